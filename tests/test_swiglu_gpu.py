"""GPU: the fused L1 of the expert MLP (Epilogue.SWIGLU_BF16) against the float64 reference: every configuration,
ragged groups with empty experts, routing weights, W4A16 and W4A4, the limit off, NaN rows, and the L1 -> L2
composition against ref_expert_mlp."""
import math

import pytest
import torch

from dsv4_nvfp4 import gemm as GC
from dsv4_nvfp4.gemm import reference as GR
from dsv4_nvfp4.gemm import sm90 as S90
from dsv4_nvfp4 import swiglu as S
from dsv4_nvfp4.quant import quantize_experts, ref_quantize_nvfp4
from dsv4_nvfp4.routing import random_topk, route_topk

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def layer(E, H, I, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = S.interleave_experts(quantize_experts(torch.randn(E, I, H, generator=g)),
                               quantize_experts(torch.randn(E, I, H, generator=g) * 2), unify=True)
    w2 = quantize_experts(torch.randn(E, H, I, generator=g))
    return w13, w2, GC.prepare_weights(w13, device=DEV), GC.prepare_weights(w2, device=DEV)


def routed(T, E, k, seed, empty=1):
    g = torch.Generator().manual_seed(seed)
    ids = random_topk(T, E, k, generator=g)
    ids[ids == empty] = 0
    return route_topk(ids, E)


def metrics(got, want):
    got = got.cpu().double()
    d = (got - want).abs()
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    return (d.norm() / want.norm()).item(), (d <= ulp).double().mean().item()


def ref_h(x, w13, offs, p, limit=10.0):
    g, u = S.deinterleave_l1(GR.ref_grouped_gemm_nvfp4(x, w13, offs), dim=-1)
    return S.ref_swiglu(g, u, limit) * p.double()[:, None]


@pytest.mark.parametrize("tok_tile", sorted(S90.CONFIGS))
@pytest.mark.parametrize("w4a4", [False, True])
def test_fused_l1_every_config(tok_tile, w4a4):
    E, H, I, T = 8, 2048, 1024, 40
    w13, _, w13p, _ = layer(E, H, I, seed=tok_tile)
    rt = routed(T, E, 3, seed=tok_tile + 1)
    g = torch.Generator().manual_seed(5)
    xf = torch.randn(T, H, generator=g)[rt.token] * 0.05
    x = ref_quantize_nvfp4(xf, per_row=True) if w4a4 else xf.to(torch.bfloat16)
    p = torch.rand(rt.perm.numel(), generator=g) + 0.5
    got = S.grouped_gemm_swiglu_nvfp4(x.to(DEV), w13p, rt.expert_offsets.to(DEV), route_weight=p.to(DEV),
                                      config=S90.CONFIGS[tok_tile], check=True)
    want = ref_h(x, w13, rt.expert_offsets, p)
    fro, within = metrics(got, want)
    assert got.shape == (rt.perm.numel(), I) and torch.isfinite(got).all()
    assert fro <= 3e-3 and within >= 0.99, f"tile {tok_tile} w4a4={w4a4}: Frobenius {fro:.2e}, within 1 ulp {within:.4f}"


def test_fused_l1_no_limit_one_token_and_nan_rows():
    E, H, I = 4, 2048, 1024
    w13, _, w13p, _ = layer(E, H, I, seed=3)
    rt = route_topk(torch.tensor([[2]]), E)                                         # one token, top-1
    x = (torch.randn(1, H) * 0.3).to(torch.bfloat16)
    got = S.grouped_gemm_swiglu_nvfp4(x.to(DEV), w13p, rt.expert_offsets.to(DEV), swiglu_limit=None)
    want = ref_h(x, w13, rt.expert_offsets, torch.ones(1), None)
    assert want.abs().max() > 10                                                    # the limit would have clamped
    fro, within = metrics(got, want)
    assert fro <= 3e-3 and within >= 0.99
    rt = routed(9, E, 2, seed=4)
    xs = (torch.randn(9, H) * 0.05)[rt.token].to(torch.bfloat16)
    bad = int(rt.inv[4, 0])
    xs[bad, 7] = float("nan")
    got = S.grouped_gemm_swiglu_nvfp4(xs.to(DEV), w13p, rt.expert_offsets.to(DEV)).cpu()
    assert got[bad].isnan().all()
    assert torch.isfinite(got[[r for r in range(got.shape[0]) if r != bad]]).all()


def test_fused_l1_then_l2_is_the_expert_mlp():
    E, H, I, T = 16, 4096, 2048, 24
    w13, w2, w13p, w2p = layer(E, H, I, seed=7)
    rt = routed(T, E, 6, seed=8)
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(T, H, generator=g)[rt.token] * 0.05).to(torch.bfloat16)
    p = torch.rand(rt.perm.numel(), generator=g)
    offs = rt.expert_offsets.to(DEV)
    h = S.grouped_gemm_swiglu_nvfp4(x.to(DEV), w13p, offs, route_weight=p.to(DEV))
    y = GC.grouped_gemm_nvfp4(h, w2p, offs).cpu().double()
    want = S.ref_expert_mlp(x, w13, w2, rt.expert_offsets, route_weight=p)
    assert ((y - want).norm() / want.norm()).item() <= 5e-3


def test_fused_l1_graph_replay_and_bad_input():
    E, H, I = 4, 2048, 1024
    w13, _, w13p, _ = layer(E, H, I, seed=11)
    R = 12
    x = (torch.randn(R, H) * 0.05).to(torch.bfloat16).to(DEV)
    offs = torch.tensor([3, 3, 9, 12], dtype=torch.int32, device=DEV)
    out = torch.empty(R, I, dtype=torch.bfloat16, device=DEV)
    S.grouped_gemm_swiglu_nvfp4(x, w13p, offs, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        S.grouped_gemm_swiglu_nvfp4(x, w13p, offs, out=out)
    for new in ([0, 6, 6, 12], [12, 12, 12, 12]):
        offs.copy_(torch.tensor(new, dtype=torch.int32)); out.fill_(float("nan")); graph.replay(); torch.cuda.synchronize()
        want = ref_h(x.cpu(), w13, offs.cpu(), torch.ones(R))
        fro, within = metrics(out, want)
        assert fro <= 3e-3 and within >= 0.99, new
    with pytest.raises(ValueError, match="swiglu_limit"):
        S.grouped_gemm_swiglu_nvfp4(x, w13p, offs, swiglu_limit=-2)
    with pytest.raises(ValueError, match="route_weight"):
        S.grouped_gemm_swiglu_nvfp4(x, w13p, offs, route_weight=torch.ones(5, device=DEV))
    with pytest.raises(ValueError, match="out must have shape"):
        S.grouped_gemm_swiglu_nvfp4(x, w13p, offs, out=torch.empty(R, 2 * I, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="I a multiple of 16"):
        S.grouped_gemm_swiglu_nvfp4(x, GC.prepare_weights(quantize_experts(torch.randn(4, 48, H)), device=DEV), offs)
