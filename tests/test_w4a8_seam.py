"""W4A8 through the GEMM seam on the CPU (the reference backend): FP8 activations accepted by the grouped GEMM and the
fused L1, the expert MLP with act="w4a8" against its float64 spec, the checks that refuse what W4A8 does not do, and
the sm90 backend's refusal until its plan takes W4A8."""
import pytest
import torch

from dsv4_nvfp4 import swiglu as S
from dsv4_nvfp4.gemm import Problem, check_activations, grouped_gemm_nvfp4, prepare_weights, wo_a_nvfp4
from dsv4_nvfp4.gemm import w4a8 as W
from dsv4_nvfp4.gemm import reference as GR
from dsv4_nvfp4.gemm.reference import deinterleave_l1, ref_swiglu, ref_swiglu_out
from dsv4_nvfp4.quant import FP8Activations, quantize_experts
from dsv4_nvfp4.routing import random_topk, route_topk


def gen(s): return torch.Generator().manual_seed(s)


def _bf16(x64): return GR._f64_to_bf16(x64)               # float64 -> bf16 rounded once, as the reference backend stores it


def test_grouped_gemm_takes_fp8_rows_on_the_reference_backend():
    E, N, K = 3, 64, 96
    ex = quantize_experts(torch.randn(E, N, K, generator=gen(1)) * torch.logspace(-2, 1, N).view(1, N, 1))
    w = prepare_weights(ex, device="cpu")
    offs = torch.tensor([4, 4, 11], dtype=torch.int32)
    a = W.ref_quantize_fp8_act(torch.randn(11, K, generator=gen(2)) * 3)
    w8, c, _ = W.w4a8_weights(ex)
    want = W.ref_grouped_gemm_w4a8(a, w8, c, ex.global_scale, offs)
    got64 = grouped_gemm_nvfp4(a, w, offs, out=torch.empty(11, N, dtype=torch.float64))
    assert torch.equal(got64, want)
    assert torch.equal(grouped_gemm_nvfp4(a, w, offs), _bf16(want))
    # the W4A8 weights are not the W4A16 ones where an E4M3 block scale has mantissa bits (one rounding of code x s)
    w16 = grouped_gemm_nvfp4(a.dequantize().to(torch.bfloat16), w, offs, out=torch.empty(11, N, dtype=torch.float64))
    rel = ((got64 - w16).norm() / w16.norm()).item()
    assert 0 < rel < 0.1


def test_fused_l1_takes_fp8_rows():
    E, H, I = 3, 64, 32
    w13 = S.interleave_experts(quantize_experts(torch.randn(E, I, H, generator=gen(3))),
                               quantize_experts(torch.randn(E, I, H, generator=gen(4))), unify=True)
    offs = torch.tensor([2, 7, 9], dtype=torch.int32)
    a = W.ref_quantize_fp8_act(torch.randn(9, H, generator=gen(5)))
    p = torch.rand(9, generator=gen(6))
    h = S.grouped_gemm_swiglu_nvfp4(a, prepare_weights(w13, device="cpu"), offs, swiglu_limit=7.0, route_weight=p)
    w8, c, _ = W.w4a8_weights(w13)
    g, u = deinterleave_l1(W.ref_grouped_gemm_w4a8(a, w8, c, w13.global_scale, offs), dim=-1)
    assert torch.equal(h, ref_swiglu_out(ref_swiglu(g, u, 7.0) * p.double()[:, None], "swiglu_bf16", offs))   # fp32 h, then bf16


def test_seam_refuses_what_w4a8_does_not_do():
    ex = quantize_experts(torch.randn(2, 32, 64, generator=gen(7)))
    w = prepare_weights(ex, device="cpu")
    offs = torch.tensor([1, 3], dtype=torch.int32)
    x = torch.randn(3, 64, generator=gen(8))
    with pytest.raises(ValueError, match="one FP8 scale per row"):
        grouped_gemm_nvfp4(W.ref_quantize_fp8_act(x, block=32), w, offs)
    a = W.ref_quantize_fp8_act(x)
    with pytest.raises(TypeError, match="float32"):
        grouped_gemm_nvfp4(FP8Activations(a.data, a.scale.double()), w, offs)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        grouped_gemm_nvfp4(FP8Activations(a.data.view(torch.uint8), a.scale), w, offs)
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_gemm_nvfp4(W.ref_quantize_fp8_act(x[:, :48]), w, offs)
    with pytest.raises(ValueError, match="2-D rows"):
        check_activations(a, 64, "t", dims=3)
    with pytest.raises(ValueError, match="bf16 and swiglu_bf16 epilogues"):
        S.grouped_gemm_swiglu_nvfp4(a, prepare_weights(quantize_experts(torch.randn(2, 32, 64)), device="cpu"), offs,
                                    out_dtype="nvfp4", out_scale=torch.ones(2))
    with pytest.raises(TypeError, match="FP8Activations"):
        grouped_gemm_nvfp4(a.data, w, offs)                                     # raw E4M3 without its scales
    assert check_activations(a, 64, "t")[0] == "fp8" and torch.equal(check_activations(a, 64, "t")[2], a.scale.view(-1))


def test_w4a8_is_its_own_backend_on_hopper():
    from dsv4_nvfp4.gemm import backend_names, get_backend
    ok, why = get_backend("sm90").can_implement(Problem(64, 4, 256, 512, "fp8", "bf16", True))
    assert not ok and "sm90_w4a8" in why                                   # the bf16 loop's backend names the W4A8 one
    b = get_backend("sm90_w4a8")
    assert "sm90_w4a8" in backend_names() and not b.supports("cpu")
    for p, word in ((Problem(64, 4, 256, 512, "bf16"), "FP8 rows"), (Problem(64, 4, 256, 512, "nvfp4"), "FP8 rows"),
                    (Problem(64, 4, 256, 512, "fp8", "wo_a"), "epilogues"), (Problem(64, 4, 256, 512, "fp8", "swiglu_nvfp4"), "epilogues")):
        ok, why = b.can_implement(p)
        assert not ok and word in why, (p, why)
    from dsv4_nvfp4.gemm import plan_for
    for rows, E, per_row in ((1, 8, False), (4096, 8, True), (24000, 257, True)):   # through the seam's checked path
        assert b.can_implement(Problem(rows, E, 512, 1024, "fp8", "bf16", per_row)) == (True, "")
        pl = plan_for(b, Problem(rows, E, 512, 1024, "fp8", "bf16", per_row))          # W4A8, the row-scale epilogue
        assert pl.cfg.fp8 and pl.cfg.epilogue.name == "BF16_ROW_GS"
        pl = plan_for(b, Problem(rows, E, 512, 1024, "fp8", "swiglu_bf16", False, 7.0))
        assert pl.cfg.fp8 and pl.cfg.epilogue.name == "SWIGLU_BF16" and pl.cfg.swiglu_limit == 7.0
    # its layout on the CPU: N padded to 128, the slabs decode to w4a8_weights byte for byte, the padding to zeros
    ex = quantize_experts(torch.randn(2, 64, 200, generator=gen(9)))
    w = b.prepare(ex, None)
    assert type(w).__name__ == "Sm90W4A8Weights" and w.shape == (2, 64, 200) and tuple(w.w_rows.shape) == (2, 128)
    dec = W.emulate_decode_w4a8(w.w_w4a8, torch.log2(w.w_rows).int(), 2, 128, 256)
    assert torch.equal(dec[:, :64, :200].view(torch.uint8), W.w4a8_weights(ex)[0].view(torch.uint8))
    assert dec[:, 64:].float().abs().sum() == 0 and dec[..., 200:].float().abs().sum() == 0


def _mlp_case(seed=20, E=5, H=96, I=48, T=9, k=2):
    w13 = S.interleave_experts(quantize_experts(torch.randn(E, I, H, generator=gen(seed))),
                               quantize_experts(torch.randn(E, I, H, generator=gen(seed + 1))), unify=True)
    w2 = quantize_experts(torch.randn(E, H, I, generator=gen(seed + 2)))
    ids = random_topk(T, E, k, generator=gen(seed + 3)); ids[ids == 3] = 0                # expert 3: no rows
    rt = route_topk(ids, E)
    x = torch.randn(T, H, generator=gen(seed + 4))[rt.token] * 3
    p = torch.rand(rt.perm.numel(), generator=gen(seed + 5))
    return w13, w2, rt, x, p


def test_expert_mlp_w4a8_is_its_spec():
    w13, w2, rt, x, p = _mlp_case()
    a = W.quantize_fp8_act(x.to(torch.bfloat16))
    y = S.expert_mlp_nvfp4(a, prepare_weights(w13, device="cpu"), prepare_weights(w2, device="cpu"), rt.expert_offsets,
                           act="w4a8", route_weight=p)
    want, h = S.ref_expert_mlp(a, w13, w2, rt.expert_offsets, act="w4a8", route_weight=p, return_h=True)
    assert torch.equal(y, _bf16(want))
    # the spec by hand: L2 reads the bf16 h quantized per row to E4M3
    h8 = W.ref_quantize_fp8_act(ref_swiglu_out(h, "swiglu_bf16", rt.expert_offsets))
    w8, c, _ = W.w4a8_weights(w2)
    assert torch.equal(want, W.ref_grouped_gemm_w4a8(h8, w8, c, w2.global_scale, rt.expert_offsets))
    # the workspace path writes the same, into its buffers
    R = x.shape[0]
    ws = S.mlp_workspace(R, prepare_weights(w13, device="cpu"), prepare_weights(w2, device="cpu"), act="w4a8", device="cpu")
    y2 = S.expert_mlp_nvfp4(a, prepare_weights(w13, device="cpu"), prepare_weights(w2, device="cpu"), rt.expert_offsets,
                            act="w4a8", route_weight=p, workspace=ws)
    assert torch.equal(y2, y) and torch.equal(ws.h_fp8.data.view(torch.uint8), h8.data.view(torch.uint8))


def test_expert_mlp_w4a8_bad_input():
    w13, w2, rt, x, p = _mlp_case()
    w13p, w2p = prepare_weights(w13, device="cpu"), prepare_weights(w2, device="cpu")
    with pytest.raises(TypeError, match="FP8Activations"):
        S.expert_mlp_nvfp4(x.to(torch.bfloat16), w13p, w2p, rt.expert_offsets, act="w4a8")
    with pytest.raises(TypeError, match="bf16 activations"):
        S.expert_mlp_nvfp4(W.quantize_fp8_act(x), w13p, w2p, rt.expert_offsets)
    with pytest.raises(ValueError, match="a2_scales is for act='w4a4'"):
        S.expert_mlp_nvfp4(W.quantize_fp8_act(x), w13p, w2p, rt.expert_offsets, act="w4a8", a2_scales=torch.ones(5))
    with pytest.raises(ValueError, match="not for act='w4a8'"):
        S.expert_mlp_nvfp4(W.quantize_fp8_act(x), w13p, w2p, rt.expert_offsets, act="w4a8",
                           workspace=S.mlp_workspace(x.shape[0], w13p, w2p, device="cpu"))


def test_quantize_fp8_act_on_the_cpu_writes_its_out_buffers():
    x = torch.randn(5, 32, generator=gen(30)).to(torch.bfloat16)
    d, s = torch.empty(5, 32, dtype=torch.float8_e4m3fn), torch.empty(5, 1)
    q = W.quantize_fp8_act(x, out_data=d, out_scale=s)
    r = W.ref_quantize_fp8_act(x)
    assert q.data is d and q.scale is s and torch.equal(d.view(torch.uint8), r.data.view(torch.uint8)) and torch.equal(s, r.scale)
    with pytest.raises(ValueError, match="multiple of 16"):
        W.quantize_fp8_act(x[:, :20])
    with pytest.raises(ValueError, match="2-D"):
        W.quantize_fp8_act(x.view(5, 2, 16))
    with pytest.raises(TypeError, match="tensor"):
        W.quantize_fp8_act(x.tolist())
    with pytest.raises(ValueError):
        W.quantize_fp8_act(x, out_scale=torch.empty(5))


def test_moe_layer_w4a8_on_the_cpu():
    from dsv4_nvfp4.moe import DSV4MoE, MoEConfig, ref_moe, ref_moe_bf16
    cfg = MoEConfig(hidden=128, inter=64, num_experts=6, top_k=2)
    x = torch.randn(7, 128, generator=gen(40)).to(torch.bfloat16)
    lay = DSV4MoE.synthetic(cfg, seed=3, act="w4a8")
    want = ref_moe(x, lay)
    assert "act='w4a8'" in repr(lay) and torch.equal(lay(x), want.to(torch.bfloat16))
    # the rows the reference quantized are x's rows, each with its own E4M3 scale: W4A8 sits between W4A16 and W4A4
    bf = ref_moe_bf16(x, lay)
    cos = lambda y: torch.nn.functional.cosine_similarity(y.flatten(), bf.flatten(), 0).item()
    c16 = cos(ref_moe(x, DSV4MoE.synthetic(cfg, seed=3)))
    c4 = cos(ref_moe(x, DSV4MoE.synthetic(cfg, seed=3, act="w4a4", calib_tokens=16)))
    assert c4 < cos(want) <= c16 + 1e-4
    wide = DSV4MoE.synthetic(MoEConfig(hidden=1024, inter=64, num_experts=4, top_k=2), seed=1, act="w4a8", keep_bf16=False)
    _, h, (x8, h8), _ = wide.buffers(4, "cpu")                      # the device path's buffers: bf16 h, E4M3 x and h
    assert h.dtype == torch.bfloat16 and x8.data.dtype == torch.float8_e4m3fn and x8.data.shape == (12, 1024)
    assert h8.data.shape == (12, 64) and h8.scale.shape == (12, 1)
    with pytest.raises(ValueError, match="are for act='w4a4'"):
        DSV4MoE(cfg, lay.w13, lay.w2, lay.gate_weight, lay.gate_bias, act="w4a8", a1_scales=torch.ones(7))
