"""CPU: the W4A8 table decode (GemmConfig.table) as built: tile_weights_w4a8_table's slabs decoded by
emulate_decode_w4a8_table (the kernel's instructions, PRMT included) are w4a8_weights' bytes on MXFP4-carried experts,
dead 16-blocks of every kind included; its code words are the words of the bit-level model in
tests/test_w4a8_table_model.py; w4a8_table_ok refuses what the table cannot hold, with the reason; the sm90_w4a8
backend takes the table path exactly for such weights and launches it with table=True."""
import pytest
import torch

from dsv4_nvfp4.gemm import EpilogueArgs, Problem, get_backend, plan_for
from dsv4_nvfp4.gemm import sm90 as S90
from dsv4_nvfp4.gemm import w4a8 as W
from dsv4_nvfp4.quant import NVFP4Experts, mxfp4_experts_to_nvfp4, quantize_experts, ref_quantize_mxfp4
from test_w4a8_table_model import decode as model_decode, pack as model_pack


def gen(s): return torch.Generator().manual_seed(s)


def mx_experts(seed, E=3, N=128, K=512, zero_scales=True):
    """MXFP4-carried experts (power-of-two scales, equal across each 32-group) with rows over two decades, block
    exponents spread over five binades, and dead blocks of every kind: an all-zero row, 32-groups whose first or second
    16-block has no nonzero code, an all-zero 32-group, a -0 scale byte over live codes (the first half of its group)
    and a +0 scale over live codes (the second half)."""
    g = gen(seed)
    w = torch.randn(E, N, K, generator=g) * torch.logspace(-1, 1, N).view(1, N, 1)
    w = w * torch.exp2(-torch.randint(0, 5, (E, N, K // 32, 1), generator=g).float()).expand(E, N, K // 32, 32).reshape(E, N, K)
    w[0, 3] = 0
    w[1 % E, 7, 0:16] = 0; w[1 % E, 7, 48:64] = 0; w[2 % E, 11, 64:96] = 0
    ex, _ = mxfp4_experts_to_nvfp4([ref_quantize_mxfp4(w[e]) for e in range(E)])
    if zero_scales:
        sb = ex.scale.view(torch.uint8).clone()
        sb[0, 20, 2] = 0x80                                    # -0 over live codes: a dead first half, live second half
        sb[0, 21, 5] = 0x00                                    # +0 over live codes: a dead second half
        ex = NVFP4Experts(ex.data, sb.view(torch.float8_e4m3fn), ex.global_scale, ex.shape)
    return ex


def table_bytes(ex):
    "The table path's E4M3 bytes (E, N, K) of `ex` (padded as the backend pads), its slabs and its row exponents."
    E, N, K = ex.shape
    p = S90.pad_experts(ex)
    tiled, c = W.tile_weights_w4a8_table(p)
    out = W.emulate_decode_w4a8_table(tiled, E, p.shape[1], p.shape[2]).view(torch.uint8)
    assert (out[:, N:] == 0).all() and (out[..., K:] == 0).all()  # the padding: +0 weights
    return out[:, :N, :K], tiled, c[:, :N]


@pytest.mark.parametrize("seed,shape", [(0, (3, 128, 512)), (1, (2, 64, 256)), (2, (3, 96, 320)), (3, (1, 200, 160))])
def test_table_decode_is_w4a8_weights(seed, shape):
    ex = mx_experts(seed, *shape)
    assert W.w4a8_table_ok(ex) == (True, "")
    got, tiled, c = table_bytes(ex)
    w8, cw, rep = W.w4a8_weights(ex)
    assert rep["rounded"] == rep["flushed"] == 0                    # MXFP4 carried: exact
    assert torch.equal(c, cw) and torch.equal(got, w8.view(torch.uint8))
    # the F2FP slabs of the same weights: the same bytes, the same row exponents, slabs of the same shape
    tf, cf = W.tile_weights_w4a8(S90.pad_experts(ex))
    assert tf.shape == tiled.shape and torch.equal(cf[:, :shape[1]], c)
    assert (w8.view(torch.uint8)[0, 3] == 0).all()                   # the all-zero row
    assert (w8.view(torch.uint8)[0, 20, 32:48] & 0x7F == 0).all()    # the -0 scale: zeros (signed), the other half live
    assert (w8.float()[0, 20, 48:64] != 0).any()


def test_a_dead_first_half_takes_the_live_halfs_k():
    # one row, one 32-group: a first 16-block with no nonzero code, a second with scale 2^-3 and codes up to 6; another
    # 32-group at scale 1 sets the row exponent (c = -6), so the second block's k is -3 - (-6) = 3, not 0
    codes = torch.zeros(1, 64, 128, dtype=torch.uint8)
    sb = torch.zeros(1, 64, 8, dtype=torch.uint8)
    codes[0, 0, 16:32] = torch.arange(16, dtype=torch.uint8)          # every code, both signs
    sb[0, 0, 0:2] = 0x20                                             # 2^-3 (the first half dead: no nonzero code)
    codes[0, 0, 64:96] = 7; sb[0, 0, 4:6] = 0x38                     # 6 x 1: the row's largest product
    data = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    ex = NVFP4Experts(data, sb.view(torch.float8_e4m3fn), torch.ones(1), (1, 64, 128))
    assert W.w4a8_table_ok(ex) == (True, "")
    got, tiled, c = table_bytes(ex)
    assert int(c[0, 0]) == -6 and torch.equal(got, W.w4a8_weights(ex)[0].view(torch.uint8))
    # the slab's scale word 0 of quad 0 holds k + 8 = 11 for row 0 (byte 0), 8 for the all-dead row 8 (byte 2)
    assert tiled.view(-1)[4096:4100].tolist() == [11, 0, 8, 0]


def test_code_words_are_the_models():
    # every thread's 8 code words of one slab are tests/test_w4a8_table_model.py's pack() of its registers j and j + 2,
    # and the model's decode of them is the emulation's bytes
    ex = mx_experts(5, 1, 64, 128, zero_scales=False)
    w = ex.data.view(torch.uint8)
    codes = torch.stack([w & 0xF, w >> 4], -1).view(64, 128)
    sf = ex.scale.float().view(64, 8)
    dead = (sf == 0) | (codes.view(64, 8, 16) & 7).eq(0).all(-1)
    codes = torch.where(dead.repeat_interleave(16, 1), codes & 8, codes)
    tiled, c = W.tile_weights_w4a8_table(ex)
    b = tiled.view(-1)[:4096].view(2, 128, 4, 4).to(torch.int64)
    words = (b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24).permute(1, 0, 2).reshape(128, 4, 2)
    row, col = W._frag_coords_fp8()
    dec = W.emulate_decode_w4a8_table(tiled, 1, 64, 128).view(torch.uint8)[0]
    for t in range(0, 128, 7):
        for q in range(4):
            for j in range(2):
                a_codes = codes[row[t, q, j], col[t, q, j]].tolist()
                b_codes = codes[row[t, q, j + 2], col[t, q, j + 2]].tolist()
                assert int(words[t, q, j]) == model_pack(a_codes, b_codes), (t, q, j)
                k = int(tiled.view(-1)[4096 + 16 * (t // 4) + 4 * q + 2 * j]) - 8
                ra, rb = model_decode(int(words[t, q, j]), k, k)
                assert [ra >> 8 * i & 0xFF for i in range(4)] == dec[row[t, q, j], col[t, q, j]].tolist()
                assert [rb >> 8 * i & 0xFF for i in range(4)] == dec[row[t, q, j + 2], col[t, q, j + 2]].tolist()


def test_prmt_model():
    # the emulation's PRMT is the bit-level model's, selector bit 3 (sign copy) and the unread upper half included
    g = gen(7)
    a, b, s = (torch.randint(0, 2 ** 32, (500,), generator=g, dtype=torch.int64) for _ in range(3))
    from test_w4a8_table_model import prmt
    assert [prmt(int(x), int(y), int(z)) for x, y, z in zip(a, b, s)] == W._prmt(a, b, s).tolist()


def _with_scale(ex, edit):
    sb = ex.scale.view(torch.uint8).clone()
    edit(sb)
    return NVFP4Experts(ex.data, sb.view(torch.float8_e4m3fn), ex.global_scale, ex.shape)


def _live(ex, e, n, group):
    "Whether both 16-blocks of 32-group `group` of row n of expert e hold a nonzero code."
    w = ex.data[e, n, 16 * group: 16 * group + 16]
    c = torch.stack([w & 7, (w >> 4) & 7], -1).view(2, 16)
    return bool(c.ne(0).any(-1).all())


def test_table_ok_refuses_with_the_reason():
    ex = mx_experts(0, 2, 64, 256, zero_scales=False)
    n = next(n for n in range(64) if _live(ex, 1, n, 3) and int(ex.scale.view(torch.uint8)[1, n, 6]) > 0x18)
    def mantissa(sb): sb[1, n, 6:8] = sb[1, n, 6:8] | 2                # 1.25 x the power of two: both halves
    def unequal(sb): sb[1, n, 7] -= 0x08                              # the second half at half the first's scale
    for edit, word, count in ((mantissa, "not a power of two", 2), (unequal, "unlike the other half of its 32-group", 2)):
        bad = _with_scale(ex, edit)
        ok, why = W.w4a8_table_ok(bad)
        assert not ok and word in why and why.startswith(f"{count} live 16-blocks"), why
        assert f"expert 1, row {n}, K 96..111" in why, why
        with pytest.raises(ValueError, match=word):
            W.tile_weights_w4a8_table(bad)
    # k below -5: a block 2^-6 against a row whose largest product is 6 x 256 (c = 2): k = -8
    codes = torch.full((1, 64, 128), 7, dtype=torch.uint8)
    sb = torch.full((1, 64, 8), 0x78, dtype=torch.uint8)               # 256
    sb[0, 9, 2:4] = 0x08                                               # 2^-6
    data = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    low = NVFP4Experts(data, sb.view(torch.float8_e4m3fn), torch.ones(1), (1, 64, 128))
    ok, why = W.w4a8_table_ok(low)
    assert not ok and why == ("2 live 16-blocks with k = log2(scale) - c outside [-5, 6] "
                              "(the first: expert 0, row 9, K 32..47, scale 0.015625, k = -8)"), why
    with pytest.raises(ValueError, match=r"outside \[-5, 6\]"):
        W.tile_weights_w4a8_table(low)
    # k above 6: a row whose largest code is 0.5 under 256 (c = -1, k = 9): the table's 4 and 6 entries would overflow
    high = NVFP4Experts(torch.full((1, 64, 64), 0x11, dtype=torch.uint8), torch.full((1, 64, 8), 0x78, dtype=torch.uint8).view(torch.float8_e4m3fn),
                        torch.ones(1), (1, 64, 128))
    ok, why = W.w4a8_table_ok(high)
    assert not ok and "512 live 16-blocks with k" in why and "k = 9" in why, why
    # negative and NaN scales are errors, as tile_weights_w4a8 has them
    for b in (0xB0, 0x7F):
        bad = _with_scale(ex, lambda sb: sb.__setitem__((0, 1, 1), b))
        with pytest.raises(ValueError, match="finite and >= 0"): W.w4a8_table_ok(bad)
        with pytest.raises(ValueError, match="finite and >= 0"): W.tile_weights_w4a8_table(bad)
    with pytest.raises(ValueError, match="K % 128"):
        W.tile_weights_w4a8_table(mx_experts(1, 1, 64, 96))
    # general NVFP4 weights (E4M3 scales with mantissa bits) are not table weights
    assert not W.w4a8_table_ok(quantize_experts(torch.randn(2, 64, 128, generator=gen(3))))[0]


def test_backend_picks_the_table_for_mxfp4_carried_weights(monkeypatch):
    b = get_backend("sm90_w4a8")
    mx = mx_experts(4, 2, 96, 320)
    nv = quantize_experts(torch.randn(2, 96, 320, generator=gen(4)))
    wt, wf = b.prepare(mx, None), b.prepare(nv, None)
    assert wt.table and not wf.table and wt.to("cpu").table
    assert wt.w_w4a8.shape == wf.w_w4a8.shape == (2 * 2 * 3 * 18, 256)
    dec = W.emulate_decode_w4a8_table(wt.w_w4a8, 2, 128, 384)
    assert torch.equal(dec[:, :96, :320].view(torch.uint8), W.w4a8_weights(mx)[0].view(torch.uint8))
    assert torch.equal(torch.log2(-wt.w_rows[:, :96]).int(), W.w4a8_weights(mx)[1])   # table experts: -2^c
    assert (wt.w_rows < 0).all() and (wf.w_rows > 0).all()
    dec = W.emulate_decode_w4a8(wf.w_w4a8, torch.log2(wf.w_rows).int(), 2, 128, 384)
    assert torch.equal(dec[:, :96, :320].view(torch.uint8), W.w4a8_weights(nv)[0].view(torch.uint8))
    # the launch: the plan is made from the problem alone (table False), run() adds the weights' decode
    pytest.importorskip("cutlass")
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    seen = []
    monkeypatch.setattr(S90K, "run_sm90", lambda cfg, w, *a, **k: seen.append((cfg, w)))
    for epi in ("bf16", "swiglu_bf16"):
        plan = plan_for(b, Problem(40, 2, 96, 320, "fp8", epi, epi == "bf16"))
        assert not plan.cfg.table
        a = W.ref_quantize_fp8_act(torch.randn(40, 320, generator=gen(5)))
        offs = torch.tensor([10, 40], dtype=torch.int32)
        epa = EpilogueArgs(gs_a=a.scale.view(-1)) if epi == "bf16" else EpilogueArgs(row_scales=torch.ones(40, 2))
        for w in (wt, wf):
            b.run(plan, a, w, offs, None, epa)
            cfg, tiled = seen.pop()
            assert cfg == plan.cfg._replace(table=w.table) and tiled is w.w_w4a8


def test_kernel_refuses_table_without_fp8():
    pytest.importorskip("cutlass")
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    ok, why = S90K.GroupedGemmSm90.can_implement(S90.CONFIGS[64]._replace(table=True), 8, smem_limit=S90.HOPPER_SMEM_PER_BLOCK)
    assert not ok and "fp8=True" in why
    assert S90K.GroupedGemmSm90.can_implement(S90.CONFIGS[64]._replace(table=True, fp8=True, overlap=False, epilogue=S90.Epilogue.BF16_ROW_GS),
                                              8, smem_limit=S90.HOPPER_SMEM_PER_BLOCK) == (True, "")


def test_the_decode_is_chosen_per_expert():
    """A layer of MXFP4-carried experts with one general NVFP4 expert among them (DeepSeek-V4's routed experts and its
    re-quantized shared expert): w4a8_table_experts marks each expert alone, tile_weights_w4a8_mixed lays each out for
    its own decode (each expert's slabs decode to its w4a8_weights bytes), the row table is negated exactly for the table
    experts, and the backend's weights say a table launch is needed. All general: no table expert, all positive rows."""
    mx = mx_experts(6, 3, 64, 256)
    nv = quantize_experts(torch.randn(1, 64, 256, generator=gen(7)))
    cat = lambda *xs: torch.cat(xs)
    ex = NVFP4Experts(cat(mx.data[:2], nv.data, mx.data[2:]), cat(mx.scale[:2], nv.scale, mx.scale[2:]),
                      cat(mx.global_scale[:2], nv.global_scale, mx.global_scale[2:]), (4, 64, 256))
    table = W.w4a8_table_experts(ex)
    assert table.tolist() == [True, True, False, True]
    assert not W.w4a8_table_ok(ex)[0] and all(W.w4a8_table_ok(one)[0] for one in (mx,))
    tiled, c, t2 = W.tile_weights_w4a8_mixed(ex)
    assert torch.equal(t2, table) and torch.equal(c, W.w4a8_weights(ex)[1])
    want = W.w4a8_weights(ex)[0].view(torch.uint8)
    per = tiled.view(4, -1, 256)
    for e in range(4):
        dec = (W.emulate_decode_w4a8_table(per[e], 1, 64, 256) if table[e] else
               W.emulate_decode_w4a8(per[e], c[e:e + 1], 1, 64, 256))
        assert torch.equal(dec[0].view(torch.uint8), want[e]), e
    rows = W.w4a8_row_scales(c, table=table)
    assert torch.equal(rows.abs(), W.w4a8_row_scales(c)) and torch.equal(rows[:, 0] < 0, table)
    with pytest.raises(ValueError, match="table must be"): W.w4a8_row_scales(c, table=table[:3])
    b = get_backend("sm90_w4a8")
    w = b.prepare(ex, None)
    tp, cp, _ = W.tile_weights_w4a8_mixed(S90.pad_experts(ex))                # the backend pads N to 128
    assert w.table and torch.equal(w.w_w4a8, tp) and torch.equal(w.w_rows, W.w4a8_row_scales(cp, table=table))
    w = b.prepare(NVFP4Experts(nv.data.repeat(2, 1, 1), nv.scale.repeat(2, 1, 1), nv.global_scale.repeat(2), (2, 64, 256)), None)
    assert not w.table and (w.w_rows > 0).all()


def test_synthetic_mxfp4_layer_is_deepseek_v4s_form():
    "DSV4MoE.synthetic(mxfp4=True): every routed expert of W13 and W2 is a table expert, the shared expert (last) is not."
    from dsv4_nvfp4.moe import DSV4MoE, MoEConfig
    lay = DSV4MoE.synthetic(MoEConfig(256, 128, 8, 2, 1.5), seed=3, act="w4a8", mxfp4=True)
    for w in (lay.w13, lay.w2):
        assert W.w4a8_table_experts(w).tolist() == [True] * 8 + [False]
    assert not W.w4a8_table_experts(DSV4MoE.synthetic(MoEConfig(256, 128, 8, 2, 1.5), seed=3).w13).any()
