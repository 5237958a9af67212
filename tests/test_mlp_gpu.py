"""GPU: the NVFP4 pieces of the expert MLP. The L1 epilogue's NVFP4 output (Epilogue.SWIGLU_NVFP4) bit for bit against
`ref_quantize_nvfp4` of the kernel's own fp32 h (the `dump` variant stores it); the whole `expert_mlp_nvfp4` against the
float64 `ref_expert_mlp`, ragged groups and empty experts, one token, the DSV4 sizes, NaN rows, and CUDA-graph replay
with new routing."""
import pytest
import torch

from dsv4_nvfp4 import gemm as GC
from dsv4_nvfp4.gemm import reference as GR
from dsv4_nvfp4.gemm import sm90 as S90
from dsv4_nvfp4 import swiglu as S
from dsv4_nvfp4.quant import NVFP4Tensor, quantize_experts, ref_quantize_nvfp4
from dsv4_nvfp4.routing import group_sizes, random_topk, route_topk

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
_LAYERS = {}


def layer(E, H, I, seed):
    "(w13, w2 NVFP4Experts on the CPU, and both prepared on the GPU), cached: quantizing a Pro-sized layer takes a while."
    key = (E, H, I, seed)
    if key not in _LAYERS:
        g = torch.Generator().manual_seed(seed)
        w13 = S.interleave_experts(quantize_experts(torch.randn(E, I, H, generator=g)),
                                   quantize_experts(torch.randn(E, I, H, generator=g) * 2), unify=True)
        w2 = quantize_experts(torch.randn(E, H, I, generator=g))
        _LAYERS[key] = (w13, w2, GC.prepare_weights(w13, device=DEV), GC.prepare_weights(w2, device=DEV))
    return _LAYERS[key]


def routed(T, E, k, seed, empty=1):
    "Top-k routing of T tokens with expert `empty` never chosen (an empty group)."
    g = torch.Generator().manual_seed(seed)
    ids = random_topk(T, E, k, generator=g)
    if E > 1: ids[ids == empty] = 0 if empty else 1
    return route_topk(ids, E)


def inputs(rt, H, w4a4, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    T = int(rt.token.max()) + 1 if rt.token.numel() else 0
    xf = torch.randn(max(T, 1), H, generator=g)[rt.token] * scale
    x = ref_quantize_nvfp4(xf, per_row=True) if w4a4 else xf.to(torch.bfloat16)
    p = torch.rand(rt.perm.numel(), generator=g) + 0.5
    return x, p


def to_dev(x):
    return x.to(DEV) if isinstance(x, (torch.Tensor, NVFP4Tensor)) else x


def a2_scales(x, w13, w2, offs, p):
    "Static per-expert scales of h, calibrated on the float64 h of these very rows (what a calibration pass would do)."
    _, h = S.ref_expert_mlp(x, w13, w2, offs, act="w4a16" if not isinstance(x, NVFP4Tensor) else "w4a4",
                            route_weight=p, a2_scales=torch.ones(offs.numel()), return_h=True)
    return S.calibrate_input_scales(h, offs)


def rows_gs(gs_e, offs):
    return gs_e.repeat_interleave(group_sizes(offs))


_L1_CONFIGS = [S90.CONFIGS[t] for t in sorted(S90.CONFIGS)] + [S90.WIDE_CONFIG, *S90.DECODE_WIDE.values()]


@pytest.mark.parametrize("cfg", _L1_CONFIGS, ids=[f"tt{c.tok_tile}x{c.wgs}" for c in _L1_CONFIGS])
@pytest.mark.parametrize("w4a4", [False, True])
def test_l1_nvfp4_out_is_the_reference_quantizer_bit_for_bit(cfg, w4a4):
    "Every configuration a plan can pick, four consumer warpgroups included (their h exchange of block maxima is per warpgroup)."
    tok_tile = cfg.tok_tile
    E, H, I, T = 8, 2048, 1024, 40
    w13, w2, w13p, _ = layer(E, H, I, seed=1)
    rt = routed(T, E, 3, seed=tok_tile)
    x, p = inputs(rt, H, w4a4, seed=2)
    gs_e = a2_scales(x, w13, w2, rt.expert_offsets, p)
    R = rt.perm.numel()
    dump = torch.full((R, I), float("nan"), device=DEV)
    h = S.grouped_gemm_swiglu_nvfp4(to_dev(x), w13p, rt.expert_offsets.to(DEV), route_weight=p.to(DEV), out_dtype="nvfp4",
                                    out_scale=gs_e.to(DEV), dump=dump,
                                    config=cfg, check=True)
    hf = dump.cpu()
    assert torch.isfinite(hf).all(), "every row of h was dumped"
    want = ref_quantize_nvfp4(hf, rows_gs(gs_e, rt.expert_offsets))
    assert torch.equal(h.global_scale.cpu(), want.global_scale)
    assert torch.equal(h.scale.cpu().view(torch.uint8), want.scale.view(torch.uint8)), "block scales differ"
    assert torch.equal(h.data.cpu(), want.data), "codes differ"
    # and the fp32 h itself is the SwiGLU of the float64 reference to fp32 accuracy of the GEMM
    g_, u_ = S.deinterleave_l1(GR.ref_grouped_gemm_nvfp4(x, w13, rt.expert_offsets), dim=-1)
    ref = S.ref_swiglu(g_, u_) * p.double()[:, None]
    assert ((hf.double() - ref).norm() / ref.norm()).item() <= 1e-3


@pytest.mark.parametrize("H,I,E", [(4096, 2048, 16), (7168, 3072, 4), (2048, 3072, 6), (3072, 2048, 6)])
@pytest.mark.parametrize("act", ["w4a16", "w4a4"])
def test_expert_mlp_against_float64(H, I, E, act):
    w13, w2, w13p, w2p = layer(E, H, I, seed=H + I)
    rt = routed(24, E, min(6, E - 1), seed=I)
    x, p = inputs(rt, H, act == "w4a4", seed=3)
    a2 = a2_scales(x, w13, w2, rt.expert_offsets, p) if act == "w4a4" else None
    y = S.expert_mlp_nvfp4(to_dev(x), w13p, w2p, rt.expert_offsets.to(DEV), act=act, route_weight=p.to(DEV),
                           a2_scales=None if a2 is None else a2.to(DEV), check=True)
    want = S.ref_expert_mlp(x, w13, w2, rt.expert_offsets, act=act, route_weight=p, a2_scales=a2)
    assert y.shape == (rt.perm.numel(), H) and torch.isfinite(y).all()
    assert ((y.cpu().double() - want).norm() / want.norm()).item() <= 5e-3


@pytest.mark.parametrize("act", ["w4a16", "w4a4"])
def test_expert_mlp_one_token_and_a_nan_row(act):
    E, H, I = 8, 2048, 1024
    w13, w2, w13p, w2p = layer(E, H, I, seed=1)
    rt = route_topk(torch.tensor([[5]]), E)                                       # one token, top-1
    x, p = inputs(rt, H, act == "w4a4", seed=4)
    a2 = a2_scales(x, w13, w2, rt.expert_offsets, p) if act == "w4a4" else None
    kw = dict(act=act, route_weight=p, a2_scales=a2)
    y = S.expert_mlp_nvfp4(to_dev(x), w13p, w2p, rt.expert_offsets.to(DEV),
                           **{k: to_dev(v) for k, v in kw.items()})
    want = S.ref_expert_mlp(x, w13, w2, rt.expert_offsets, **kw)
    assert ((y.cpu().double() - want).norm() / want.norm()).item() <= 5e-3
    # a NaN in one row's input: that row of y is NaN, every other row is exactly what it is without the NaN
    rt = routed(9, E, 2, seed=7)
    x, p = inputs(rt, H, False, seed=8)
    bad = int(rt.inv[4, 0])
    xn = x.clone(); xn[bad, 7] = float("nan")
    if act == "w4a4":                                    # a NaN cannot be quantized: inject it into h via the gate instead
        x4 = ref_quantize_nvfp4(x.float(), per_row=True)
        gs = x4.global_scale.clone(); gs[bad] = float("nan")
        x, xn = x4, NVFP4Tensor(x4.data, x4.scale, gs, x4.shape)
    a2 = torch.full((E,), 0.01) if act == "w4a4" else None
    run = lambda xx: S.expert_mlp_nvfp4(to_dev(xx), w13p, w2p, rt.expert_offsets.to(DEV), act=act, route_weight=p.to(DEV),
                                        a2_scales=None if a2 is None else a2.to(DEV)).cpu()
    clean, dirty = run(x), run(xn)
    assert dirty[bad].isnan().all()
    keep = [r for r in range(dirty.shape[0]) if r != bad]
    assert torch.equal(dirty[keep], clean[keep])


@pytest.mark.parametrize("act", ["w4a16", "w4a4"])
def test_expert_mlp_graph_replay_with_new_routing(act):
    E, H, I, R = 8, 2048, 1024, 48
    w13, w2, w13p, w2p = layer(E, H, I, seed=1)
    g = torch.Generator().manual_seed(12)
    xf = torch.randn(R, H, generator=g) * 0.05
    x = to_dev(ref_quantize_nvfp4(xf, per_row=True) if act == "w4a4" else xf.to(torch.bfloat16))
    p = (torch.rand(R, generator=g) + 0.5).to(DEV)
    a2 = torch.full((E,), 2e-4, device=DEV) if act == "w4a4" else None
    offs = torch.tensor([6, 6, 20, 21, 30, 40, 40, 48], dtype=torch.int32, device=DEV)
    ws = S.mlp_workspace(R, w13p, w2p, act)
    out = torch.empty(R, H, dtype=torch.bfloat16, device=DEV)
    call = lambda: S.expert_mlp_nvfp4(x, w13p, w2p, offs, act=act, route_weight=p, a2_scales=a2, out=out,
                                      workspace=ws)
    call(); torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for new in ([0, 8, 8, 30, 31, 31, 47, 48], [48] * 8, [1, 2, 3, 4, 5, 6, 7, 48]):
        offs.copy_(torch.tensor(new, dtype=torch.int32)); out.fill_(float("nan")); graph.replay(); torch.cuda.synchronize()
        replayed = out.clone()
        eager = S.expert_mlp_nvfp4(x, w13p, w2p, offs, act=act, route_weight=p, a2_scales=a2)
        assert torch.equal(replayed, eager), new
