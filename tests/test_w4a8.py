"""The W4A8 numerics (dsv4_nvfp4.gemm.w4a8): E2M1 codes in E4M3 bytes, FP8 activations, NVFP4 weights rounded once to
E4M3 (exact for MXFP4), and the float64 reference GEMM. CPU only."""
import pytest
import torch

from dsv4_nvfp4.formats import e2m1_decode, e4m3_value_from_bits
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
