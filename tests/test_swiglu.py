"""The SwiGLU expert MLP references (CPU): the gate/up interleave, the clamped SwiGLU, the static L2 input scales and
the float64 expert MLP against an independent per-token computation."""
import math

import pytest
import torch

from dsv4_nvfp4 import swiglu as S
from dsv4_nvfp4.formats import e2m1_decode, unpack_fp4
from dsv4_nvfp4.quant import NVFP4Experts, quantize_experts, ref_quantize_nvfp4, stack_experts
from dsv4_nvfp4.routing import group_sizes, random_topk, route_topk


def gen(s): return torch.Generator().manual_seed(s)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("I", [16, 48, 2048])
def test_interleave_is_an_exact_row_permutation(dt, I):
    a, b = torch.randn(2, I, 24, generator=gen(I)).to(dt), torch.randn(2, I, 24, generator=gen(I + 1)).to(dt)
    w = S.interleave_l1(a, b)
    assert w.shape == (2, 2 * I, 24)
    raw = lambda t: t.contiguous().view(torch.uint8)
    assert torch.equal(raw(w[:, 8:16]), raw(b[:, :8])) and torch.equal(raw(w[:, 16:24]), raw(a[:, 8:16]))
    g, u = S.deinterleave_l1(w)
    assert torch.equal(raw(g), raw(a)) and torch.equal(raw(u), raw(b))
    gc, uc = S.deinterleave_l1(w.transpose(-1, -2), dim=-1)          # the L1 output form: interleaved columns
    assert torch.equal(raw(gc.transpose(-1, -2)), raw(a))


def test_interleave_bad_input():
    with pytest.raises(ValueError, match="multiple of the interleave group"):
        S.interleave_l1(torch.zeros(12, 4), torch.zeros(12, 4))
    with pytest.raises(ValueError, match="must match"):
        S.interleave_l1(torch.zeros(16, 4), torch.zeros(16, 8))
    with pytest.raises(ValueError, match="multiple of 16"):
        S.deinterleave_l1(torch.zeros(24, 4))


def test_interleave_experts_needs_one_global_scale():
    w1, w3 = torch.randn(3, 32, 64, generator=gen(1)), torch.randn(3, 32, 64, generator=gen(2)) * 4
    with pytest.raises(ValueError, match="unify=True"):
        S.interleave_experts(quantize_experts(w1), quantize_experts(w3))
    w13 = S.interleave_experts(quantize_experts(w1), quantize_experts(w3), unify=True)
    gs = torch.maximum(quantize_experts(w1).global_scale, quantize_experts(w3).global_scale)
    assert torch.equal(w13.global_scale, gs)
    want = stack_experts([ref_quantize_nvfp4(S.interleave_l1(quantize_experts(w1).expert(e).dequantize(),
                                                             quantize_experts(w3).expert(e).dequantize()), gs[e]) for e in range(3)])
    assert torch.equal(w13.data, want.data)
    with pytest.raises(ValueError, match="multiple of 16"):
        S.interleave_experts(quantize_experts(torch.randn(1, 8, 32)), quantize_experts(torch.randn(1, 8, 32)))


def test_swiglu_values_limit_and_non_finite():
    g = torch.tensor([-20.0, -1.0, 0.0, 3.0, 10.0, 25.0])
    u = torch.tensor([1.0, -30.0, 5.0, 2.0, -4.0, 12.0])
    want = [gi * (1 / (1 + math.exp(-gi))) * max(-10, min(10, ui)) for gi, ui in zip([-20, -1, 0, 3, 10, 10], u.tolist())]
    got = S.ref_swiglu(g, u, 10.0)
    assert got.dtype == torch.float64 and torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0)
    nolim = S.ref_swiglu(g, u, None)
    assert nolim[-1].item() == pytest.approx(25 / (1 + math.exp(-25)) * 12, rel=1e-14)
    assert torch.equal(S.ref_swiglu(g, u, 0), nolim)
    bad = S.ref_swiglu(torch.tensor([math.inf, 1.0, math.nan, 1.0]), torch.tensor([1.0, -math.inf, 1.0, 2.0]))
    assert bad[:3].isnan().all() and not bad[3].isnan()
    for lim in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="swiglu_limit"):
            S.ref_swiglu(g, u, lim)


def test_calibrate_input_scales():
    h = torch.randn(10, 32, generator=gen(3))
    h[4, 7] = 2688.0                                                      # expert 1's amax: gs exactly 1
    offs = torch.tensor([3, 7, 7, 10], dtype=torch.int32)
    gs = S.calibrate_input_scales(h, offs)
    assert gs.dtype == torch.float32 and gs[1].item() == 1.0 and gs[2].item() == 1.0   # expert 2 has no rows
    assert gs[0].item() == pytest.approx(h[:3].abs().max().item() / 2688, rel=1e-6)
    with pytest.raises(ValueError, match="end at the row count"):
        S.calibrate_input_scales(h, torch.tensor([3, 7, 7, 9], dtype=torch.int32))


def _f64(c, s, gs):
    v = e2m1_decode(unpack_fp4(c)).double().reshape(*s.shape, 16) * s.double()[..., None]
    return v.reshape(*c.shape[:-1], -1) * gs.double()[:, None, None]


@pytest.mark.parametrize("act", ["w4a16", "w4a4"])
def test_expert_mlp_equals_per_token_computation(act):
    E, H, I, T, k = 5, 96, 48, 9, 2
    w1, w3, w2 = (torch.randn(E, I, H, generator=gen(10)), torch.randn(E, I, H, generator=gen(11)), torch.randn(E, H, I, generator=gen(12)))
    w13 = S.interleave_experts(quantize_experts(w1), quantize_experts(w3), unify=True)
    q2 = quantize_experts(w2)
    ids = random_topk(T, E, k, generator=gen(13)); ids[ids == 3] = 0                  # expert 3: no rows
    rt = route_topk(ids, E)
    xf = torch.randn(T, H, generator=gen(14))[rt.token] * 3
    x = ref_quantize_nvfp4(xf, per_row=True) if act == "w4a4" else xf.to(torch.bfloat16)
    p = torch.rand(rt.perm.numel(), generator=gen(15))
    (c1, c3), (s1, s3) = S.deinterleave_l1(w13.data), S.deinterleave_l1(w13.scale)
    d1, d3, d2 = _f64(c1, s1, w13.global_scale), _f64(c3, s3, w13.global_scale), _f64(q2.data, q2.scale, q2.global_scale)
    if act == "w4a4":     # exact float64 decode of the activations: (e2m1 * s) * gs_a per row
        xd = (e2m1_decode(unpack_fp4(x.data)).double().reshape(*x.scale.shape, 16) * x.scale.double()[..., None]).reshape(x.shape[0], -1)
        xd = xd * x.global_scale.double()[:, None]
    else:
        xd = x.double()
    e_of_row = torch.repeat_interleave(torch.arange(E), group_sizes(rt.expert_offsets))
    h = torch.stack([torch.nn.functional.silu((d1[e] @ xd[r]).clamp(max=10)) * (d3[e] @ xd[r]).clamp(-10, 10) * p[r].double()
                     for r, e in enumerate(e_of_row.tolist())])
    a2 = S.calibrate_input_scales(h, rt.expert_offsets) if act == "w4a4" else None
    y, h_ref = S.ref_expert_mlp(x, w13, q2, rt.expert_offsets, act=act, route_weight=p, a2_scales=a2, return_h=True)
    assert torch.allclose(h_ref, h, rtol=1e-10, atol=1e-12), "h"
    if act == "w4a16":
        hin = h_ref.float().to(torch.bfloat16).double()                     # as the kernel stores h (from h_ref)
    else:
        rows_gs = a2.repeat_interleave(group_sizes(rt.expert_offsets))      # the expert's static scale on each row
        hq = ref_quantize_nvfp4(h_ref.float(), rows_gs)                     # (from h_ref: no tie flips from round-off)
        hin = (e2m1_decode(unpack_fp4(hq.data)).double().reshape(*hq.scale.shape, 16) * hq.scale.double()[..., None])
        hin = hin.reshape(hq.shape[0], -1) * rows_gs.double()[:, None]
    want = torch.stack([d2[e] @ hin[r] for r, e in enumerate(e_of_row.tolist())])
    assert torch.allclose(y, want, rtol=1e-9, atol=1e-9), f"y ({act})"


def test_expert_mlp_bad_input():
    w13 = S.interleave_experts(quantize_experts(torch.randn(2, 16, 32)), quantize_experts(torch.randn(2, 16, 32)), unify=True)
    w2 = quantize_experts(torch.randn(2, 32, 16))
    x = torch.randn(3, 32).to(torch.bfloat16)
    offs = torch.tensor([1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="a2_scales"):
        S.ref_expert_mlp(ref_quantize_nvfp4(x.float()), w13, w2, offs, act="w4a4")
    with pytest.raises(ValueError, match="one scale per expert"):
        S.ref_expert_mlp(ref_quantize_nvfp4(x.float()), w13, w2, offs, act="w4a4", a2_scales=[1.0])
    with pytest.raises(ValueError, match=r"\(E, 2I, H\)"):
        S.ref_expert_mlp(x, quantize_experts(torch.randn(2, 16, 32)), w2, offs)
    with pytest.raises(TypeError, match="bf16"):
        S.ref_expert_mlp(ref_quantize_nvfp4(x.float()), w13, w2, offs)
    with pytest.raises(ValueError, match="non-decreasing"):
        S.ref_expert_mlp(x, w13, w2, torch.tensor([3, 1], dtype=torch.int32))
