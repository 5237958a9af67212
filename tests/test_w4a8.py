"""The W4A8 numerics (dsv4_nvfp4.gemm.w4a8): E2M1 codes in E4M3 bytes, FP8 activations, NVFP4 weights rounded once to
E4M3 (exact for MXFP4), and the float64 reference GEMM. CPU only."""
import pytest
import torch

from dsv4_nvfp4.formats import e2m1_decode, e4m3_value_from_bits
from dsv4_nvfp4.gemm import sm90 as S90
from dsv4_nvfp4.gemm import w4a8 as W
from dsv4_nvfp4.quant import (NVFP4Experts, mxfp4_experts_to_nvfp4, quantize_experts, ref_quantize_mxfp4)


def test_e2m1_codes_are_e4m3_bytes_times_2_pow_6():
    codes = torch.arange(16, dtype=torch.uint8)
    b = W.e2m1_as_e4m3(codes)
    for c in range(16):                      # against the formats table's independent E4M3 decoder
        assert e4m3_value_from_bits(int(b.view(torch.uint8)[c])) * 64 == float(e2m1_decode(torch.tensor([c], dtype=torch.uint8)))
    with pytest.raises(TypeError): W.e2m1_as_e4m3(codes.int())
    with pytest.raises(ValueError, match="0..15"): W.e2m1_as_e4m3(torch.tensor([16], dtype=torch.uint8))


@pytest.mark.parametrize("block", [0, 128])
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_activations(block, pow2):
    g = torch.Generator().manual_seed(block + pow2)
    x = torch.randn(5, 512, generator=g) * torch.logspace(-3, 3, 5).view(5, 1)
    q = W.ref_quantize_fp8_act(x, block, pow2)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    assert q.scale.shape == ((5, 1) if not block else (5, 512 // block))
    xb = x.view(5, -1, block or 512)
    amax = q.data.float().view(5, -1, block or 512).abs().amax(-1)
    if pow2:
        assert (torch.log2(q.scale) % 1 == 0).all() and (amax <= 448).all() and (amax > 224).all()
    else:
        assert (amax == 448).all()
    rel = (q.dequantize() - x.double()).abs() / x.double().abs().clamp(min=1e-30)
    big = x.abs() >= xb.abs().amax(-1).repeat_interleave(block or 512, 1) * 2 ** -6   # normal E4M3 range: 4 significant bits
    assert rel[big].max() <= 2 ** -4 + 1e-9


def test_fp8_bad_input_nan_and_saturation():
    x = torch.randn(4, 256)
    x[2, 100] = float("nan"); x[3, 5] = float("inf")
    for block in (0, 128):
        d = W.ref_quantize_fp8_act(x, block).dequantize()
        assert not d[:2].isnan().any()
        assert d[2, (100 // block * block) if block else 0:].isnan().any() and d[3].isnan().any()
    q = W.ref_quantize_fp8_act(torch.tensor([[1e4, -1e4, 3.0]]), scale=torch.tensor(0.5))
    assert q.data.float().tolist() == [[448.0, -448.0, 6.0]]          # saturated, never Inf
    for bad in (0.0, -2.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite and > 0"): W.ref_quantize_fp8_act(x, scale=torch.tensor(bad))
    with pytest.raises(ValueError, match="divide K"): W.ref_quantize_fp8_act(x, block=100)
    with pytest.raises(ValueError, match=r"\(R, K\)"): W.ref_quantize_fp8_act(x[0])
    with pytest.raises(ValueError, match="given scale must be"): W.ref_quantize_fp8_act(x, scale=torch.ones(3))
    assert torch.equal(W.ref_quantize_fp8_act(torch.zeros(2, 32)).scale, torch.ones(2, 1))


def products(we: NVFP4Experts) -> torch.Tensor:
    "float64 (E, N, K): e2m1 code x block scale of every weight (the global scale left out), exact."
    codes = torch.stack([we.data & 15, we.data >> 4], -1).flatten(-2)
    return e2m1_decode(codes).double() * we.scale.double().repeat_interleave(16, -1)


def test_w4a8_weights_one_rounding_and_mxfp4_exact():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 32, 256, generator=g) * torch.rand(3, 32, 1, generator=g)
    we = quantize_experts(w)
    w8, c, rep = W.w4a8_weights(we)
    assert w8.dtype == torch.float8_e4m3fn and c.dtype == torch.int32 and c.shape == (3, 32)
    assert w8.float().abs().amax() <= 448
    exact = products(we)
    got = w8.double() * torch.exp2(c.double())[..., None]
    live = exact != 0
    rel = ((got - exact).abs() / exact.abs())[live]
    assert 0 < rep["rounded"] == int((got != exact)[live].sum()) and rel.max() <= 2 ** -4 + 1e-12
    nv, _ = mxfp4_experts_to_nvfp4([ref_quantize_mxfp4(w[e]) for e in range(3)])
    w8x, cx, repx = W.w4a8_weights(nv)
    assert repx["rounded"] == repx["flushed"] == 0
    assert torch.equal(w8x.double() * torch.exp2(cx.double())[..., None], products(nv))
    assert (w8x.float().abs().amax(-1) > 224).all()                 # each row's largest product uses the top binade


def test_reference_gemm_matches_a_direct_sum():
    g = torch.Generator().manual_seed(4)
    E, N, K = 3, 16, 128
    we = quantize_experts(torch.randn(E, N, K, generator=g))
    w8, c, _ = W.w4a8_weights(we)
    offs = torch.tensor([5, 5, 12], dtype=torch.int32)                # an empty expert
    a = W.ref_quantize_fp8_act(torch.randn(12, K, generator=g), block=64)
    y = W.ref_grouped_gemm_w4a8(a, w8, c, we.global_scale, offs)
    x = a.data.double() * a.scale.double().repeat_interleave(64, 1)
    for r in range(12):
        e = 0 if r < 5 else 2
        wr = w8[e].double() * torch.exp2(c[e].double())[:, None] * float(we.global_scale[e])
        assert torch.allclose(y[r], wr @ x[r], rtol=1e-12, atol=0)


# ---- the W4A8 register decode: slabs, fragment coordinates, the bit program and its CPU model

def _experts(codes, scale_bytes, gs=None):
    "NVFP4Experts from codes uint8 (E, N, K) 0..15 and E4M3 scale bytes uint8 (E, N, K/16)."
    E = codes.shape[0]
    data = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return NVFP4Experts(data, scale_bytes.view(torch.float8_e4m3fn), torch.ones(E) if gs is None else gs, codes.shape)


def test_fp8_fragment_covers_the_slab_once_and_each_register_sits_in_one_block():
    row, col = W._frag_coords_fp8()
    idx = (row * 128 + col).flatten()
    assert torch.equal(idx.sort().values, torch.arange(64 * 128))
    assert ((col // 16).amin(-1) == (col // 16).amax(-1)).all()          # a register's 4 bytes: one 16-block, one scale
    assert (row.amin(-1) == row.amax(-1)).all() and ((col[..., 1:] - col[..., :-1]) == 1).all()   # one row, consecutive K
    # thread t, register r: rows 16 w + l/4 (+8 for odd r), the PTX ISA's m64nNk32 A layout for 8-bit types
    assert row[37, 2, 1, 0] == 16 * 1 + 5 // 4 + 8 and col[37, 2, 1, 0] == 64 + 4 * (5 % 4) and col[37, 2, 3, 0] == 64 + 16 + 4


def test_w4a8_decode_program_inverts():
    g = torch.Generator().manual_seed(3)
    T = torch.randint(0, 2 ** 32, (1000, 2), generator=g, dtype=torch.int64) & W.W4A8_CODE_MASK
    w = S90.encode_words(T, W.W4A8_CODE_MASK, W.W4A8_DECODE_ROTATIONS)
    assert torch.equal(S90.decode_words(w, W.W4A8_CODE_MASK, W.W4A8_DECODE_ROTATIONS), T)
    assert not torch.equal(S90.decode_words(w, W.W4A8_CODE_MASK, ((0,), (2, 12))), T)   # another program reads other codes


@pytest.mark.parametrize("kind", ["heavy", "mxfp4"])
def test_w4a8_decode_model_is_w4a8_weights_byte_for_byte(kind):
    from dsv4_nvfp4.moe import _heavy
    g = torch.Generator().manual_seed(11)
    span = (-4, 2) if kind == "heavy" else (-2, 2)                      # MXFP4 carried to NVFP4: 18 binades per tensor
    w = torch.stack([_heavy((128, 512), g, 512 ** -0.5, "cpu") for _ in range(2)]) * torch.logspace(*span, 128).view(1, 128, 1)
    w[0, 3] = 0; w[1, 5, 16:48] = 0                                     # an all-zero row and two all-zero blocks
    ex = quantize_experts(w) if kind == "heavy" else mxfp4_experts_to_nvfp4([ref_quantize_mxfp4(w[e]) for e in range(2)])[0]
    w8, c, rep = W.w4a8_weights(ex)
    tiled, c2 = W.tile_weights_w4a8(ex)
    assert tiled.shape == (2 * 2 * 4 * 18, 256) and tiled.dtype == torch.uint8
    assert torch.equal(c2, c) and (c.min() < -9 or kind == "mxfp4")     # rows whose 2^(6-c) would overflow f16 as a factor
    got = W.emulate_decode_w4a8(tiled, c2, 2, 128, 512)
    assert torch.equal(got.view(torch.uint8), w8.view(torch.uint8))
    assert (rep["rounded"] > 0) == (kind == "heavy")


def test_w4a8_dead_blocks_are_cleared_not_misread():
    # block 0: scale 448 but every code zero; block 1: nonzero codes under a zero scale; block 2..: ordinary
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (1, 64, 128), generator=g, dtype=torch.uint8)
    sb = torch.full((1, 64, 8), 0x30, dtype=torch.uint8)                # E4M3 1.0
    codes[0, 0, :16] = 0; sb[0, 0, 0] = 0x7E                             # 448 over zeros
    sb[0, 1, 1] = 0                                                      # zero scale over nonzero codes
    sb[0, 2, :] = 0x01; codes[0, 2] = 1                                  # the smallest scale (2^-9) and codes 0.5: c = -18
    ex = _experts(codes, sb)
    w8, c, _ = W.w4a8_weights(ex)
    tiled, c2 = W.tile_weights_w4a8(ex)
    got = W.emulate_decode_w4a8(tiled, c2, 1, 64, 128)
    assert torch.equal(got.view(torch.uint8), w8.view(torch.uint8)) and c[0, 2] == -18
    assert (got.float()[0, 1, 16:32] == 0).all() and torch.isfinite(got.float()).all()


def test_tile_weights_w4a8_refuses():
    codes = torch.zeros(1, 64, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="N % 64"): W.tile_weights_w4a8(_experts(codes[:, :32], torch.full((1, 32, 8), 0x30, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="K % 128"): W.tile_weights_w4a8(_experts(codes[..., :64], torch.full((1, 64, 4), 0x30, dtype=torch.uint8)))
    for bad in (0x7F, 0xB0):                                             # NaN, -1.0
        sb = torch.full((1, 64, 8), 0x30, dtype=torch.uint8); sb[0, 7, 3] = bad
        with pytest.raises(ValueError, match="finite and >= 0"): W.tile_weights_w4a8(_experts(codes, sb))


def test_emulate_decode_w4a8_refuses_mismatched_inputs():
    codes = torch.randint(0, 16, (1, 64, 128), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    tiled, c = W.tile_weights_w4a8(_experts(codes, torch.full((1, 64, 8), 0x7E, dtype=torch.uint8)))   # scale 448: c = 3
    with pytest.raises(ValueError, match="not those of"): W.emulate_decode_w4a8(tiled, c, 1, 128, 128)
    with pytest.raises(ValueError, match="not those of"): W.emulate_decode_w4a8(tiled, c[:, :32], 1, 64, 128)
    with pytest.raises(ValueError, match="finite range"): W.emulate_decode_w4a8(tiled, c - 30, 1, 64, 128)   # 2^(6-c) too large


def test_w4a8_negative_zero_scale_is_a_dead_block():
    # a -0 scale byte (0x80) passes the >= 0 check; left as is, its s_eff (-0 bits plus the exponent add) would be a
    # negative power of two and turn the block's codes into nonzero weights: the tiling clears it like a +0 scale
    codes = torch.randint(1, 8, (1, 64, 128), generator=torch.Generator().manual_seed(9), dtype=torch.uint8)
    sb = torch.full((1, 64, 8), 0x30, dtype=torch.uint8); sb[0, 4, 2] = 0x80
    ex = _experts(codes, sb)
    w8, c, _ = W.w4a8_weights(ex)
    tiled, c2 = W.tile_weights_w4a8(ex)
    got = W.emulate_decode_w4a8(tiled, c2, 1, 64, 128)
    assert (got.float()[0, 4, 32:48] == 0).all() and torch.equal(got.float(), w8.float())


def test_w4a8_encoder_refuses_a_program_that_does_not_invert():
    with pytest.raises(ValueError, match="not invertible"): S90.encode_words(torch.zeros(1, 2, dtype=torch.int64), W.W4A8_CODE_MASK, ((0,), (0, 2)))


def test_w4a8_row_scales():
    c = torch.tensor([[-18, 0, 3], [1, -2, 0]], dtype=torch.int32)
    t = W.w4a8_row_scales(c, 64)
    assert t.shape == (2, 64) and t.dtype == torch.float32
    assert torch.equal(t[:, :3], torch.exp2(c.float())) and (t[:, 3:] == 1).all()
    assert torch.equal((t.view(torch.int32) >> 23) - 127, torch.cat([c, torch.zeros(2, 61, dtype=torch.int32)], 1))   # what the kernel reads back
    with pytest.raises(ValueError, match="multiple of 64"): W.w4a8_row_scales(c, 32)


def _accumulation_case(seed=8, E=3, N=256, K=512, rows=(5, 0, 21)):
    # the GPU test's kind of operands: weight rows over 4 decades, tokens over 4
    g = torch.Generator().manual_seed(seed)
    ex = quantize_experts(torch.randn(E, N, K, generator=g) * torch.logspace(-3, 1, N).view(1, N, 1))
    w8, c, _ = W.w4a8_weights(ex)
    offs = torch.tensor(rows).cumsum(0).to(torch.int32)
    a = W.ref_quantize_fp8_act(torch.randn(int(offs[-1]), K, generator=g) * torch.logspace(-2, 2, int(offs[-1])).view(-1, 1))
    return a, w8, c, ex.global_scale, offs


def test_w4a8_error_bound_holds_for_a_12_bit_tensor_core_and_catches_bugs():
    a, w8, c, gs, offs = _accumulation_case()
    want = W.ref_grouped_gemm_w4a8(a, w8, c, gs, offs)
    mag = W.ref_w4a8_magnitude(a, w8, c, gs, offs)
    bound = W.w4a8_error_bound(want, mag)
    assert bool((mag >= want.abs() - 1e-12 * mag).all())                        # |sum| <= sum of |terms|
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    m12, m16 = (W.fp8_wgmma_model(a, w8, c, gs, offs, bits) for bits in (12, 16))
    assert bool(((m12 - want).abs() <= bound).all()) and bool(((m16 - want).abs() <= bound).all())
    within = lambda m: ((m - want).abs() <= ulp).double().mean().item()
    assert within(m12) < 0.95 < 0.99 < within(m16)                               # the 1-ulp count tells the widths apart
    dropped = w8.clone(); dropped[..., 128:256] = 0                              # one K tile lost
    assert ((W.fp8_wgmma_model(a, dropped, c, gs, offs, 16) - want).abs() > bound).double().mean() > 0.5
    wrong = w8.clone().view(torch.uint8); wrong[2, 100, 300] ^= 0x20             # one weight of expert 2, row 100, changed
    bad = (W.fp8_wgmma_model(a, wrong.view(torch.float8_e4m3fn), c, gs, offs, 16) - want).abs() > bound
    assert bad[5:, 100].any() and not bad[:, :100].any() and not bad[:5].any()   # seen in its column, nowhere else
