"""GPU tests of the sm_90a W4A8 grouped GEMM (GroupedGemmSm90 with GemmConfig.fp8: gemm.w4a8's slabs decoded in
registers to E4M3, E4M3 activations with one fp32 scale per row, FP8 WGMMA) against the float64 reference of the same
quantized operands (`ref_grouped_gemm_w4a8`). Tolerance: the GEMM issue's (relative Frobenius <= 2e-3, >= 99% of the
outputs within one bf16 ulp): the products are exact, only the fp32 sums and the bf16 output round."""
import pytest
import torch

from dsv4_nvfp4 import quant as Q
from dsv4_nvfp4.gemm import sm90 as S90
from dsv4_nvfp4.gemm import w4a8 as W
from _gpu_helpers import assert_gemm_close, hopper

pytestmark = pytest.mark.gpu
if torch.cuda.is_available() and not hopper():
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="the sm_90a kernel needs a Hopper GPU")]


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
    cfg = S90.CONFIGS[tt]._replace(fp8=True, epilogue=S90.Epilogue.BF16_ROW_GS)
    out = torch.full((R, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    S90K.run_sm90(cfg, tiled.cuda(), a.data.cuda(), out, offs.cuda(), ex.global_scale.cuda(), a.scale.cuda(),
                  sf_c=W.w4a8_row_scales(c2).cuda())
    torch.cuda.synchronize()
    want = W.ref_grouped_gemm_w4a8(a, w8, c, ex.global_scale, offs)
    assert_gemm_close(out.cpu(), want, f"W4A8 tok_tile {tt}")
