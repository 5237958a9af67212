"""GPU tests of the sm_90a W4A8 grouped GEMM (GroupedGemmSm90 with GemmConfig.fp8: gemm.w4a8's slabs decoded in
registers to E4M3, E4M3 activations with one fp32 scale per row, FP8 WGMMA) against the float64 reference of the same
quantized operands (`ref_grouped_gemm_w4a8`). The products are exact; the FP8 tensor core sums each 128-K tile with a
truncating accumulator of about 14-16 bits (not fp32), which the kernel then adds into fp32. So every output must lie
within `w4a8_error_bound` (half a bf16 ulp plus 2^-12 of the terms' magnitude: 04e derives it and shows it catches a
dropped K tile or one wrong weight) and the relative Frobenius error within the GEMM issue's 2e-3; the share within
one bf16 ulp, the bf16 loop's criterion, is printed for the record."""
import pytest
import torch

from dsv4_nvfp4 import quant as Q
from dsv4_nvfp4.gemm import sm90 as S90
from dsv4_nvfp4.gemm import w4a8 as W
from _gpu_helpers import hopper, mixed_w4a8_experts

pytestmark = pytest.mark.gpu
if torch.cuda.is_available() and not hopper():
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="the sm_90a kernel needs a Hopper GPU")]


def assert_w4a8_close(got, want, bound, what, fro_max):
    "Every output within `bound`, the relative Frobenius error within fro_max; the 1-ulp share printed (pytest -rA)."
    assert bool(torch.isfinite(got).all()), what
    d = (got - want).abs()
    fro = (d.norm() / want.norm()).item()
    within = (d <= torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)).double().mean().item()
    worst = (d / bound).max().item()
    print(f"{what}: Frobenius {fro:.2e}, within 1 bf16 ulp {100 * within:.2f}%, worst output {worst:.2f} of the bound")
    assert worst <= 1 and fro <= fro_max, f"{what}: worst output {worst:.2f} of the bound, Frobenius {fro:.2e}"


def l1_want_and_bound(a, w8, c, gs, offs, p, limit=10.0):
    """The fused W4A8 L1's float64 h = swiglu(gate, up) p on the same quantized operands, and each output's allowance:
    the tile-sum allowance of the gate and up sums carried through h = silu(min(g, L)) clamp(u, +-L) p (|silu'| <= 1.1;
    the clamps only shrink it), plus half a bf16 ulp of h."""
    from dsv4_nvfp4 import swiglu as SW
    ops = (a, w8, c, gs, offs)
    gate, up = SW.deinterleave_l1(W.ref_grouped_gemm_w4a8(*ops), dim=-1)
    mg, mu = SW.deinterleave_l1(W.ref_w4a8_magnitude(*ops), dim=-1)
    want = SW.ref_swiglu(gate, up, limit) * p.double()[:, None]
    dg, du = mg * 2.0 ** -W.W4A8_ACC_BITS, mu * 2.0 ** -W.W4A8_ACC_BITS
    sg = gate.clamp(max=limit)
    bound = want.abs() * 2.0 ** -8 + p.double()[:, None] * (1.1 * up.abs().clamp(max=limit) * dg
                                                           + (sg * torch.sigmoid(sg)).abs() * du + 1.1 * dg * du)
    return want, bound


@pytest.mark.parametrize("tt", sorted(S90.CONFIGS))
def test_w4a8_gemm_against_float64(tt):
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    g = torch.Generator().manual_seed(tt)
    E, N, K = 3, 256, 512
    w = torch.randn(E, N, K, generator=g) * torch.logspace(-3, 1, N).view(1, N, 1)
    ex = Q.quantize_experts(w)
    w8, c, _ = W.w4a8_weights(ex)
    tiled, c2 = W.tile_weights_w4a8(ex)
    counts = torch.tensor([max(tt - 3, 1), 0, 2 * tt + 5])
    offs = counts.cumsum(0).to(torch.int32)
    R = int(offs[-1])
    a = W.ref_quantize_fp8_act(torch.randn(R, K, generator=g) * torch.logspace(-2, 2, R).view(R, 1))
    cfg = S90.CONFIGS[tt]._replace(fp8=True, overlap=False, epilogue=S90.Epilogue.BF16_ROW_GS)
    out = torch.full((R, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    S90K.run_sm90(cfg, tiled.cuda(), a.data.cuda(), out, offs.cuda(), ex.global_scale.cuda(), a.scale.cuda(),
                  sf_c=W.w4a8_row_scales(c2).cuda())
    torch.cuda.synchronize()
    want = W.ref_grouped_gemm_w4a8(a, w8, c, ex.global_scale, offs)
    bound = W.w4a8_error_bound(want, W.ref_w4a8_magnitude(a, w8, c, ex.global_scale, offs))
    assert_w4a8_close(out.cpu().double(), want, bound, f"W4A8 tok_tile {tt}", 2e-3)


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_activation_kernel_is_the_reference_bit_for_bit(dt):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(67, 4096, generator=g) * torch.logspace(-6, 4, 67).view(67, 1)).to(dt)
    x[3, 100] = float("nan"); x[8, 9] = float("-inf"); x[12] = 0; x[20, 5] = -0.0
    got, want = W.quantize_fp8_act_cuda(x.cuda()), W.ref_quantize_fp8_act(x)
    assert got.data.dtype == torch.float8_e4m3fn and got.scale.shape == (67, 1) and got.block == 0
    gb, wb = got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8)
    nan = lambda b: (b & 0x7F) == 0x7F
    assert torch.equal(nan(gb), nan(wb)) and torch.equal(gb[~nan(gb)], wb[~nan(wb)])
    gs = got.scale.cpu()
    assert torch.equal(torch.isnan(gs), torch.isnan(want.scale)) and torch.equal(gs.nan_to_num(), want.scale.nan_to_num())
    assert torch.isnan(gs[[3, 8]]).all() and gs[12] == 1


def test_fp8_activation_kernel_out_buffers_and_bad_input():
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    d = torch.empty(5, 256, dtype=torch.float8_e4m3fn, device="cuda"); s = torch.empty(5, 1, device="cuda")
    q = W.quantize_fp8_act_cuda(x, out_data=d, out_scale=s)
    assert q.data.data_ptr() == d.data_ptr() and q.scale.data_ptr() == s.data_ptr()
    with pytest.raises(ValueError, match="multiple of 16"): W.quantize_fp8_act_cuda(x[:, :250].contiguous())
    with pytest.raises((TypeError, ValueError)): W.quantize_fp8_act_cuda(x.int())
    with pytest.raises((TypeError, ValueError)): W.quantize_fp8_act_cuda(x.view(5, 2, 128))
    with pytest.raises((TypeError, ValueError)): W.quantize_fp8_act_cuda(x, out_scale=torch.empty(5, device="cuda"))


@pytest.mark.parametrize("tt", sorted(S90.CONFIGS))
def test_w4a8_fused_l1_swiglu_against_float64(tt):
    # the SWIGLU_BF16 epilogue under W4A8: gate and up rows (interleaved by 8) each carry their own 2^c
    from dsv4_nvfp4 import swiglu as SW
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    from dsv4_nvfp4.routing import random_topk, route_topk
    g = torch.Generator().manual_seed(100 + tt)
    E, H, I, T = 8, 1024, 512, 40
    w13 = SW.interleave_experts(Q.quantize_experts(torch.randn(E, I, H, generator=g)),
                                Q.quantize_experts(torch.randn(E, I, H, generator=g) * 2), unify=True)
    w8, c, _ = W.w4a8_weights(w13)
    tiled, c2 = W.tile_weights_w4a8(w13)
    ids = random_topk(T, E, 3, generator=g); ids[ids == 1] = 0
    rt = route_topk(ids, E)
    R = rt.perm.numel()
    a = W.ref_quantize_fp8_act(torch.randn(T, H, generator=g)[rt.token] * 0.05)
    p = torch.rand(R, generator=g) + 0.5
    cfg = S90.CONFIGS[tt]._replace(fp8=True, overlap=False, epilogue=S90.Epilogue.SWIGLU_BF16)
    out = torch.full((R, I), float("nan"), dtype=torch.bfloat16, device="cuda")
    S90K.run_sm90(cfg, tiled.cuda(), a.data.cuda(), out, rt.expert_offsets.cuda(), w13.global_scale.cuda(),
                  torch.stack([a.scale[:, 0], p], 1).cuda(), sf_c=W.w4a8_row_scales(c2).cuda())
    torch.cuda.synchronize()
    want, bound = l1_want_and_bound(a, w8, c, w13.global_scale, rt.expert_offsets, p)
    assert_w4a8_close(out.cpu().double(), want, bound, f"W4A8 fused L1 tok_tile {tt}", 3e-3)


@pytest.mark.parametrize("N,K", [(64, 384), (192, 400)])
def test_w4a8_backend_through_the_seam(N, K):
    "prepare_weights(backend='sm90_w4a8') and grouped_gemm_nvfp4 on FP8 rows: N and K padded inside, empty experts."
    from dsv4_nvfp4.gemm import grouped_gemm_nvfp4, prepare_weights
    g = torch.Generator().manual_seed(N)
    E = 4
    ex = Q.quantize_experts(torch.randn(E, N, K, generator=g) * torch.logspace(-2, 1, N).view(1, N, 1))
    w = prepare_weights(ex, device="cuda", backend="sm90_w4a8")
    offs = torch.tensor([5, 5, 75, 78], dtype=torch.int32)
    a = W.quantize_fp8_act((torch.randn(78, K, generator=g) * 2).to(torch.bfloat16).cuda())
    out = grouped_gemm_nvfp4(a, w, offs.cuda(), check=True)
    torch.cuda.synchronize()
    ac = Q.FP8Activations(a.data.cpu(), a.scale.cpu())
    w8, c, _ = W.w4a8_weights(ex)
    want = W.ref_grouped_gemm_w4a8(ac, w8, c, ex.global_scale, offs)
    bound = W.w4a8_error_bound(want, W.ref_w4a8_magnitude(ac, w8, c, ex.global_scale, offs))
    assert_w4a8_close(out.cpu().double(), want, bound, f"sm90_w4a8 N={N} K={K}", 2e-3)
    # one row (its scale is then a single value: the plan is the per-row kind all the same), written into out=
    one = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    o1 = torch.full((1, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    a1 = Q.FP8Activations(a.data[40:41].contiguous(), a.scale[40:41].contiguous())
    assert grouped_gemm_nvfp4(a1, w, one.cuda(), out=o1) is o1
    want1 = W.ref_grouped_gemm_w4a8(Q.FP8Activations(ac.data[40:41], ac.scale[40:41]), w8, c, ex.global_scale, one)
    assert ((o1.cpu().double() - want1).abs() <= bound[40:41]).all()


def test_expert_mlp_w4a8_on_the_gpu():
    """act='w4a8' end to end on Hopper (x and h in E4M3 per row), checked stage by stage on the operands each stage was
    given: the L1's bf16 h within the fused L1's allowance of its float64 value (x as the GPU quantized it), h's E4M3
    rows the reference quantizer of that h bit for bit, and every output within `w4a8_error_bound` of the float64 L2 of
    those rows; a NaN row stays in its row. The error against ref_expert_mlp, which quantizes its own float64 h, is
    printed, not asserted: where the tensor core's truncated tile sums move an h value across an E4M3 rounding
    boundary, the two paths round it to neighbouring E4M3 values, a step of 2^-3 relative, so that comparison measures
    FP8 h's sensitivity, not the kernels."""
    from dsv4_nvfp4 import swiglu as SW
    from dsv4_nvfp4.gemm import prepare_weights
    from dsv4_nvfp4.routing import random_topk, route_topk
    g = torch.Generator().manual_seed(3)
    E, H, I, T = 6, 2048, 1024, 24
    w13 = SW.interleave_experts(Q.quantize_experts(torch.randn(E, I, H, generator=g)),
                                Q.quantize_experts(torch.randn(E, I, H, generator=g) * 2), unify=True)
    w2 = Q.quantize_experts(torch.randn(E, H, I, generator=g))
    w13p, w2p = (prepare_weights(w, device="cuda", backend="sm90_w4a8") for w in (w13, w2))
    rt = route_topk(random_topk(T, E, 3, generator=g), E)
    R = rt.perm.numel()
    x = (torch.randn(T, H, generator=g)[rt.token] * 0.05).to(torch.bfloat16)
    p = torch.rand(R, generator=g) + 0.5
    offs = rt.expert_offsets
    run = lambda xx, ws=None: SW.expert_mlp_nvfp4(W.quantize_fp8_act(xx.cuda()), w13p, w2p, offs.cuda(), act="w4a8",
                                                  route_weight=p.cuda(), workspace=ws, check=True).cpu()
    ws = SW.mlp_workspace(R, w13p, w2p, act="w4a8")
    y = run(x, ws)
    xq = W.quantize_fp8_act(x.cuda())
    xq = Q.FP8Activations(xq.data.cpu(), xq.scale.cpu())
    h, hq = ws.h.cpu(), Q.FP8Activations(ws.h_fp8.data.cpu(), ws.h_fp8.scale.cpu())
    w8, c, _ = W.w4a8_weights(w13)
    want_h, bound_h = l1_want_and_bound(xq, w8, c, w13.global_scale, offs, p)
    assert_w4a8_close(h.double(), want_h, bound_h, "W4A8 MLP, the L1's h", 3e-3)
    rq = W.ref_quantize_fp8_act(h)
    assert torch.equal(hq.data.view(torch.uint8), rq.data.view(torch.uint8)) and torch.equal(hq.scale, rq.scale)
    w8, c, _ = W.w4a8_weights(w2)
    want = W.ref_grouped_gemm_w4a8(hq, w8, c, w2.global_scale, offs)
    bound = W.w4a8_error_bound(want, W.ref_w4a8_magnitude(hq, w8, c, w2.global_scale, offs))
    assert_w4a8_close(y.double(), want, bound, "W4A8 MLP, the L2 on the GPU's h", 2e-3)
    full = SW.ref_expert_mlp(W.ref_quantize_fp8_act(x), w13, w2, offs, act="w4a8", route_weight=p)
    print(f"W4A8 MLP vs ref_expert_mlp (its own h): relative {((y.double() - full).norm() / full.norm()).item():.2e}")
    xn = x.clone(); xn[4, 7] = float("nan")
    yn = run(xn)
    assert yn[4].isnan().all() and torch.equal(yn[torch.arange(yn.shape[0]) != 4], y[torch.arange(y.shape[0]) != 4])


@pytest.mark.parametrize("tt", [64, 32, 16, 8])
def test_four_warpgroups_are_the_same_bits(tt):
    """wgs = 4 (five warpgroups; the producer's setmaxnreg gives its registers to the consumers) computes every output
    exactly as the one- or two-warpgroup configuration of the same tok_tile (same K order, same tile sums): the W4A8 loop
    (BF16_ROW_GS and SWIGLU_BF16) and the bf16 loop, on ragged experts with an empty one; W4A8 also within its bound."""
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    g = torch.Generator().manual_seed(40 + tt)
    E, N, K = 3, 512, 640
    ex = Q.quantize_experts(torch.randn(E, N, K, generator=g) * torch.logspace(-3, 1, N).view(1, N, 1))
    w8, c, _ = W.w4a8_weights(ex)
    tiled, c2 = W.tile_weights_w4a8(ex)
    w16 = S90.tile_weights_sm90(S90.pad_experts(ex).data, S90.pad_experts(ex).scale).cuda()
    offs = torch.tensor([max(tt - 3, 1), 0, 2 * tt + 5]).cumsum(0).to(torch.int32)
    R = int(offs[-1])
    x = torch.randn(R, K, generator=g) * torch.logspace(-2, 2, R).view(R, 1)
    a = W.ref_quantize_fp8_act(x)
    p = torch.rand(R, generator=g) + 0.5
    four = S90.WIDE_CONFIG if tt == 64 else S90.DECODE_WIDE[tt]        # the configurations the plan picks
    assert S90K.GroupedGemmSm90.can_implement(four._replace(fp8=True, overlap=False, epilogue=S90.Epilogue.BF16_ROW_GS), E, K)[0]
    assert not S90K.GroupedGemmSm90.can_implement(S90.GemmConfig(128, 4, 4), E, K)[0]
    outs = {}
    for cfg in (S90.CONFIGS[tt], four):
        for epi, fp8 in [(S90.Epilogue.BF16_ROW_GS, True), (S90.Epilogue.SWIGLU_BF16, True), (S90.Epilogue.BF16_ROW_GS, False)]:
            cf = cfg._replace(fp8=fp8, overlap=cfg.overlap and not fp8, epilogue=epi)
            n = N // 2 if epi.swiglu else N
            out = torch.full((R, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            if fp8:
                sc = torch.stack([a.scale[:, 0], p], 1) if epi.swiglu else a.scale
                S90K.run_sm90(cf, tiled.cuda(), a.data.cuda(), out, offs.cuda(), ex.global_scale.cuda(), sc.cuda(),
                              sf_c=W.w4a8_row_scales(c2).cuda())
            else:
                S90K.run_sm90(cf, w16, x.to(torch.bfloat16).cuda(), out, offs.cuda(), ex.global_scale.cuda(),
                              torch.ones(R, 1, device="cuda"))
            torch.cuda.synchronize()
            outs[(cfg.wgs, epi, fp8)] = out.cpu()
    for epi, fp8 in [(S90.Epilogue.BF16_ROW_GS, True), (S90.Epilogue.SWIGLU_BF16, True), (S90.Epilogue.BF16_ROW_GS, False)]:
        two, got = outs[(S90.CONFIGS[tt].wgs, epi, fp8)], outs[(4, epi, fp8)]
        assert torch.isfinite(got).all() and torch.equal(got, two), (tt, epi.name, fp8)
    want = W.ref_grouped_gemm_w4a8(a, w8, c, ex.global_scale, offs)
    bound = W.w4a8_error_bound(want, W.ref_w4a8_magnitude(a, w8, c, ex.global_scale, offs))
    assert_w4a8_close(outs[(4, S90.Epilogue.BF16_ROW_GS, True)].double(), want, bound, f"W4A8 tok_tile {tt} x 4 warpgroups", 2e-3)


@pytest.mark.parametrize("tt", [64, 128])
def test_w4a8_table_path_is_the_same_bits(tt):
    """GemmConfig.table on MXFP4-carried experts (power-of-two block scales, the weights the table decode takes): the
    table slabs (tile_weights_w4a8_table) through the PRMT loop give every output bit for bit as the F2FP loop on
    tile_weights_w4a8's slabs of the same weights (both feed the tensor core w4a8_weights' bytes: the CPU emulations
    say so), on ragged experts with an empty one; both epilogues; and within the bound of the float64 reference.
    Through the backend too: prepare_weights(backend='sm90_w4a8') takes the table path for these weights."""
    from dsv4_nvfp4.gemm import grouped_gemm_nvfp4, prepare_weights
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    g = torch.Generator().manual_seed(60 + tt)
    E, N, K = 4, 256, 512
    w = torch.randn(E, N, K, generator=g) * torch.logspace(-1, 1, N).view(1, N, 1)
    w[1, 5] = 0; w[2, 9, 32:48] = 0                                      # an all-zero row, a dead first half
    ex, _ = Q.mxfp4_experts_to_nvfp4([Q.ref_quantize_mxfp4(w[e]) for e in range(E)])
    assert W.w4a8_table_ok(ex) == (True, "")
    w8, c, _ = W.w4a8_weights(ex)
    tiled_t, ct = W.tile_weights_w4a8_table(ex)
    tiled_f, cf = W.tile_weights_w4a8(ex)
    assert torch.equal(ct, cf)
    rows = W.w4a8_row_scales(ct).cuda()
    offs = torch.tensor([tt + 7, 0, 3, 2 * tt + 1]).cumsum(0).to(torch.int32)
    R = int(offs[-1])
    a = W.ref_quantize_fp8_act(torch.randn(R, K, generator=g) * torch.logspace(-2, 2, R).view(R, 1))
    p = torch.rand(R, generator=g) + 0.5
    for epi in (S90.Epilogue.BF16_ROW_GS, S90.Epilogue.SWIGLU_BF16):
        outs = []
        for table, tiled in ((True, tiled_t), (False, tiled_f)):
            cfg = S90.CONFIGS[tt]._replace(fp8=True, overlap=False, table=table, epilogue=epi)
            out = torch.full((R, N // 2 if epi.swiglu else N), float("nan"), dtype=torch.bfloat16, device="cuda")
            sc = torch.stack([a.scale[:, 0], p], 1) if epi.swiglu else a.scale
            r = -rows if table else rows                              # a table kernel runs the table loop for -2^c rows
            S90K.run_sm90(cfg, tiled.cuda(), a.data.cuda(), out, offs.cuda(), ex.global_scale.cuda(), sc.cuda(), sf_c=r)
            torch.cuda.synchronize()
            outs.append(out.cpu())
        assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1]), (tt, epi.name)
        if not epi.swiglu:
            want = W.ref_grouped_gemm_w4a8(a, w8, c, ex.global_scale, offs)
            bound = W.w4a8_error_bound(want, W.ref_w4a8_magnitude(a, w8, c, ex.global_scale, offs))
            assert_w4a8_close(outs[0].double(), want, bound, f"W4A8 table path tok_tile {tt}", 2e-3)
    wp = prepare_weights(ex, device="cuda", backend="sm90_w4a8")
    assert wp.table
    out = grouped_gemm_nvfp4(Q.FP8Activations(a.data.cuda(), a.scale.cuda()), wp, offs.cuda(), check=True)
    torch.cuda.synchronize()
    want = W.ref_grouped_gemm_w4a8(a, w8, c, ex.global_scale, offs)
    assert_w4a8_close(out.cpu().double(), want, W.w4a8_error_bound(want, W.ref_w4a8_magnitude(a, w8, c, ex.global_scale, offs)),
                      f"sm90_w4a8 table weights, {R} rows", 2e-3)


_MIXED = [S90.CONFIGS[tt] for tt in sorted(S90.CONFIGS)] + [S90.WIDE_CONFIG] + [S90.DECODE_WIDE[tt] for tt in sorted(S90.DECODE_WIDE)]


@pytest.mark.parametrize("cfg", _MIXED, ids=[f"tt{c.tok_tile}x{c.wgs}" for c in _MIXED])
def test_w4a8_mixed_experts_are_the_same_bits(cfg):
    """Each expert by its own decode in one launch (GemmConfig.table, every configuration a plan can pick): MXFP4-carried
    experts in table slabs around a general NVFP4 expert in F2FP slabs (tile_weights_w4a8_mixed, the sign of the row
    table choosing the loop per unit) give every output bit for bit as the F2FP loop on all of them, both epilogues,
    ragged rows with an empty expert; and prepare_weights' weights take the same path through grouped_gemm_nvfp4."""
    from dsv4_nvfp4.gemm import grouped_gemm_nvfp4, prepare_weights
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    g = torch.Generator().manual_seed(90 + cfg.tok_tile + cfg.wgs)
    E, N, K = 4, 256, 512
    ex = mixed_w4a8_experts(E, N, K, g)
    tiled_m, cm, table = W.tile_weights_w4a8_mixed(ex)
    assert table.tolist() == [True, True, False, True]
    tiled_f, cf = W.tile_weights_w4a8(ex)
    assert torch.equal(cm, cf)
    tt = cfg.tok_tile
    offs = torch.tensor([tt + 5, 2 * tt + 3, 0, 3 * tt + 1]).cumsum(0).to(torch.int32)
    R = int(offs[-1])
    a = W.ref_quantize_fp8_act(torch.randn(R, K, generator=g) * torch.logspace(-2, 2, R).view(R, 1))
    p = torch.rand(R, generator=g) + 0.5
    for epi in (S90.Epilogue.BF16_ROW_GS, S90.Epilogue.SWIGLU_BF16):
        outs = []
        for mixed in (True, False):
            c = cfg._replace(fp8=True, overlap=False, table=mixed, epilogue=epi)
            out = torch.full((R, N // 2 if epi.swiglu else N), float("nan"), dtype=torch.bfloat16, device="cuda")
            sc = torch.stack([a.scale[:, 0], p], 1) if epi.swiglu else a.scale
            rows = W.w4a8_row_scales(cm, table=table if mixed else None).cuda()
            S90K.run_sm90(c, (tiled_m if mixed else tiled_f).cuda(), a.data.cuda(), out, offs.cuda(), ex.global_scale.cuda(),
                          sc.cuda(), sf_c=rows)
            torch.cuda.synchronize()
            outs.append(out.cpu())
        assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1]), (cfg, epi.name)
    wp = prepare_weights(ex, device="cuda", backend="sm90_w4a8")
    assert wp.table
    out = grouped_gemm_nvfp4(Q.FP8Activations(a.data.cuda(), a.scale.cuda()), wp, offs.cuda(), check=True)
    w8, c8, _ = W.w4a8_weights(ex)
    want = W.ref_grouped_gemm_w4a8(a, w8, c8, ex.global_scale, offs)
    assert_w4a8_close(out.cpu().double(), want, W.w4a8_error_bound(want, W.ref_w4a8_magnitude(a, w8, c8, ex.global_scale, offs)),
                      f"sm90_w4a8 mixed weights, {R} rows", 2e-3)


@pytest.mark.parametrize("K", [2048, 7168])
@pytest.mark.parametrize("tt", [64, 128])
def test_overlapped_w4a8_loop_against_float64(tt, K):
    """The overlapped W4A8 loop (GemmConfig.overlap with fp8, two consumer warpgroups): the tile accumulator sums 4 K
    tiles (512 K) on the tensor core before its fp32 add, where the plain loop adds every 128, so its outputs are not
    the plain loop's bits; each must lie within w4a8_error_bound of the float64 reference (04e's model of the tensor
    core's truncating sum: worst 0.39-0.57 of the bound at 512 K, as at 128, on its operands) and the Frobenius error within 2e-3 (3e-3 for the fused L1, as its own test); on
    MXFP4-carried experts (the table loop) around a general NVFP4 one (the F2FP loop), ragged rows with an empty expert,
    K = 2048 and 7168 (4 and 14 promotions), both epilogues (BF16_ROW_GS the staged one, `staged_store`: at K = 2048
    its C has 192 of the slabs' 256 rows, so the second warpgroup of the last m tile is outside N), the same bits twice, and
    the same bits from a grid of two CTAs (sms_free: every CTA runs many units, so the ring state passes from unit to
    unit); a K that is not a multiple of 512 is refused, and so is an output the staged epilogue cannot store 16 bytes
    at a time."""
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    g = torch.Generator().manual_seed(130 + tt + K)
    E, N = 4, 256
    Nc = 192 if K == 2048 else N                                        # BF16_ROW_GS's columns of C
    ex = mixed_w4a8_experts(E, N, K, g)
    tiled, cm, table = W.tile_weights_w4a8_mixed(ex)
    assert table.tolist() == [True, True, False, True]
    rows = W.w4a8_row_scales(cm, table=table).cuda()
    w8, c8, _ = W.w4a8_weights(ex)
    offs = torch.tensor([tt + 5, 0, 2 * tt + 3, 3 * tt + 1]).cumsum(0).to(torch.int32)   # expert 2 (F2FP) has rows
    R = int(offs[-1])
    a = W.ref_quantize_fp8_act(torch.randn(R, K, generator=g) * torch.logspace(-2, 2, R).view(R, 1))
    p = torch.rand(R, generator=g) + 0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg0 = S90.CONFIGS[tt]._replace(fp8=True, table=True, overlap=True)
    assert cfg0.wgs == 2
    for epi in (S90.Epilogue.BF16_ROW_GS, S90.Epilogue.SWIGLU_BF16):
        cfg = cfg0._replace(epilogue=epi)
        sc = (torch.stack([a.scale[:, 0], p], 1) if epi.swiglu else a.scale).cuda()
        outs = []
        for free in (0, 0, sms - 1):                                   # twice on the whole grid, once on two CTAs
            out = torch.full((R, N // 2 if epi.swiglu else Nc), float("nan"), dtype=torch.bfloat16, device="cuda")
            S90K.run_sm90(cfg, tiled.cuda(), a.data.cuda(), out, offs.cuda(), ex.global_scale.cuda(), sc, sf_c=rows,
                          sms_free=free)
            torch.cuda.synchronize()
            outs.append(out.cpu())
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (tt, K, epi.name)
        if epi.swiglu:
            want, bound = l1_want_and_bound(a, w8, c8, ex.global_scale, offs, p)
        else:
            want = W.ref_grouped_gemm_w4a8(a, w8, c8, ex.global_scale, offs)[:, :Nc]
            bound = W.w4a8_error_bound(want, W.ref_w4a8_magnitude(a, w8, c8, ex.global_scale, offs)[:, :Nc])
        assert_w4a8_close(outs[0].double(), want, bound, f"overlapped W4A8 loop tok_tile {tt} {epi.name}",
                          3e-3 if epi.swiglu else 2e-3)                 # (the fused L1's criterion, as above)
    with pytest.raises(ValueError, match="multiple of 512|K % 512"):
        a2 = torch.zeros(R, K - 128, dtype=torch.float8_e4m3fn, device="cuda")
        S90K.run_sm90(cfg0._replace(epilogue=S90.Epilogue.BF16_ROW_GS), tiled.cuda(), a2, torch.empty(R, N, dtype=torch.bfloat16, device="cuda"),
                      offs.cuda(), ex.global_scale.cuda(), a.scale.cuda(), sf_c=rows)
    assert S90.staged_store(cfg0._replace(epilogue=S90.Epilogue.BF16_ROW_GS))
    with pytest.raises(ValueError, match="16 bytes"):
        wide = torch.empty(R, N + 4, dtype=torch.bfloat16, device="cuda")[:, :N]     # row stride N + 4: not a multiple of 8
        S90K.run_sm90(cfg0._replace(epilogue=S90.Epilogue.BF16_ROW_GS), tiled.cuda(), a.data.cuda(), wide, offs.cuda(),
                      ex.global_scale.cuda(), a.scale.cuda(), sf_c=rows)


def test_w4a8_prefill_plan_takes_the_overlapped_loop():
    """From W4A8_OV_MIN_ROWS expected rows per expert and K % 512 == 0 the sm90_w4a8 plan is the overlapped W4A8 loop
    (W4A8_OV_CONFIG); through prepare_weights and grouped_gemm_nvfp4 on MXFP4-carried experts (the table slabs) its
    outputs lie within w4a8_error_bound of float64 and within 2e-3 Frobenius, with an empty expert; one row fewer per
    expert keeps the plain loop's plan."""
    from dsv4_nvfp4.gemm import Problem, get_backend, grouped_gemm_nvfp4, plan_for, prepare_weights
    g = torch.Generator().manual_seed(192)
    E, N, K = 3, 256, 1024
    w = torch.randn(E, N, K, generator=g) * torch.logspace(-1, 1, N).view(1, N, 1)
    mx, _ = Q.mxfp4_experts_to_nvfp4([Q.ref_quantize_mxfp4(w[e]) for e in range(E)])
    pw = prepare_weights(mx, device="cuda", backend="sm90_w4a8")
    assert pw.table
    R = E * W.W4A8_OV_MIN_ROWS
    b = get_backend("sm90_w4a8")
    assert plan_for(b, Problem(R, E, N, K, act="fp8")).cfg.overlap
    assert not plan_for(b, Problem(R - E, E, N, K, act="fp8")).cfg.overlap
    assert not plan_for(b, Problem(R, E, N, K - 128, act="fp8")).cfg.overlap
    offs = torch.tensor([R // 3, R // 3, R], dtype=torch.int32)             # expert 1 empty
    a = W.ref_quantize_fp8_act(torch.randn(R, K, generator=g) * torch.logspace(-2, 2, R).view(R, 1))
    out = grouped_gemm_nvfp4(Q.FP8Activations(a.data.cuda(), a.scale.cuda()), pw, offs.cuda(), check=True)
    torch.cuda.synchronize()
    w8, c, _ = W.w4a8_weights(mx)
    want = W.ref_grouped_gemm_w4a8(a, w8, c, mx.global_scale, offs)
    bound = W.w4a8_error_bound(want, W.ref_w4a8_magnitude(a, w8, c, mx.global_scale, offs))
    assert_w4a8_close(out.cpu().double(), want, bound, "sm90_w4a8 prefill plan (overlapped loop)", 2e-3)
