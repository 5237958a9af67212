"""The public quantize / dequantize and the GEMM's configuration choice: which path runs, what each path refuses,
and what DSV4_VERBOSE=1 prints (CPU; the GPU half of the bit-identity is in tests/test_kernels_gpu.py; the plan cache
and its DSV4_VERBOSE=1 line, once per problem, are in tests/test_gemm.py)."""
import pytest
import torch

from dsv4_nvfp4.gemm import sm90 as S90
from dsv4_nvfp4.layout import swizzle_scales
from dsv4_nvfp4.quant import ref_quantize_nvfp4
from dsv4_nvfp4.quantize_cuda import SwizzledNVFP4, dequantize_nvfp4, quantize_nvfp4


def bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("kw", [dict(), dict(per_row=True), dict(global_scale=0.03)])
def test_cpu_quantize_is_the_reference(kw):
    x = torch.randn(33, 80) * torch.logspace(-2, 2, 33)[:, None]
    got, want = quantize_nvfp4(x, **kw), ref_quantize_nvfp4(x, **kw)
    assert torch.equal(got.data, want.data) and torch.equal(bits(got.scale), bits(want.scale))
    assert torch.equal(got.global_scale, want.global_scale)
    assert torch.equal(dequantize_nvfp4(got, torch.bfloat16), want.dequantize(torch.bfloat16))


def test_cpu_swizzle_is_reference_then_swizzle():
    x = torch.randn(130, 64)
    got = quantize_nvfp4(x, swizzle=True)
    assert isinstance(got, SwizzledNVFP4)
    assert torch.equal(bits(got.scale), bits(swizzle_scales(ref_quantize_nvfp4(x).scale)))


def test_cpu_refuses_gpu_only_options():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="CUDA inputs"):
        quantize_nvfp4(x, out_data=torch.empty(4, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="CUDA inputs"):
        dequantize_nvfp4(quantize_nvfp4(x), out=torch.empty(4, 32))
    with pytest.raises(ValueError, match="2D"):
        quantize_nvfp4(torch.randn(2, 4, 32), swizzle=True)


def test_verbose_says_which_path(monkeypatch, capsys):
    x = torch.randn(4, 32)
    monkeypatch.setenv("DSV4_VERBOSE", "1")
    dequantize_nvfp4(quantize_nvfp4(x))
    err = capsys.readouterr().err
    assert "quantize_nvfp4: CPU reference" in err and "dequantize_nvfp4: CPU reference" in err
    monkeypatch.setenv("DSV4_VERBOSE", "0")
    quantize_nvfp4(x)
    assert capsys.readouterr().err == ""


def test_pick_config_refuses_what_no_config_can_run():
    pytest.importorskip("cutlass")
    with pytest.raises(ValueError, match="at most 1024 experts"):
        S90.pick_config(64, 1025)
    with pytest.raises(ValueError, match="multiple of 16"):
        S90.pick_config(64, 8, 200)
