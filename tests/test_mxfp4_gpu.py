"""GPU: DSV4's MXFP4 expert weights on the NVFP4 kernels (carried over exactly, no re-quantization)."""
import pytest
import torch

from dsv4_nvfp4 import gemm as GC
from dsv4_nvfp4 import routing as R
from dsv4_nvfp4.quant import mxfp4_experts_to_nvfp4, ref_quantize_mxfp4, ref_quantize_nvfp4
from dsv4_nvfp4.formats import E2M1_VALUES, unpack_fp4
from _gpu_helpers import assert_gemm_close as assert_close, hopper, ref_grouped as ref

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
I32 = torch.int32


if torch.cuda.is_available() and not hopper():
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="the sm_90a kernel needs a Hopper GPU")]


def mx_experts(E, N, K, seed):
    "MXFP4 experts of the OCP rule on heavy-ish weights whose magnitudes differ per expert and per column."
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * torch.logspace(-2, 1, K)[torch.randperm(K, generator=g)] * (1 + 9 * torch.rand(E, 1, 1, generator=g))
    return ref_quantize_mxfp4(w)


def test_mxfp4_weights_decode_exactly():
    # one-hot rows return DSV4's MXFP4 values themselves, bit for bit (every E2M1 x 2^e is a bf16 number)
    mx = mx_experts(2, 128, 256, seed=1)
    pw = GC.prepare_weights(mx, device=DEV)
    a = torch.eye(256, dtype=torch.bfloat16, device=DEV).repeat(2, 1)
    offs = torch.tensor([256, 512], dtype=I32, device=DEV)
    got = GC.grouped_gemm_nvfp4(a, pw, offs, check=True)
    want = torch.cat([mx.dequantize()[0].T, mx.dequantize()[1].T]).to(torch.bfloat16).to(DEV)
    assert torch.equal(got, want), f"{(got != want).sum().item()} decoded weights differ"


@pytest.mark.parametrize("K,N", [(4096, 4096), (2048, 4096), (7168, 6144)])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_mxfp4_grouped_gemm_against_float64(K, N, mode):
    E = 6
    mx = mx_experts(E, N, K, seed=K + N)
    pw = GC.prepare_weights(mx, device=DEV)
    w64 = mx.dequantize().double().to(DEV)                       # the released values, not the prepared ones
    for T, k in ((1, 1), (9, 2), (53, 3)):
        g = torch.Generator().manual_seed(T)
        rt = R.route_topk(R.random_topk(T, E, k, generator=g), E)
        offs, rows = rt.expert_offsets.to(DEV), rt.perm.numel()
        x = torch.randn(rows, K, generator=g) * 3
        if mode == "w4a16":
            a = x.to(torch.bfloat16).to(DEV)
            got, want = GC.grouped_gemm_nvfp4(a, pw, offs, check=True), ref(a.double(), w64, offs.cpu())
        else:
            q = ref_quantize_nvfp4(x)
            au = (E2M1_VALUES.double()[unpack_fp4(q.data).long()] * q.scale.double().repeat_interleave(16, -1))[:, :K]
            got = GC.grouped_gemm_nvfp4(q.to(DEV), pw, offs, check=True)
            want = ref(au.to(DEV), w64, offs.cpu()) * q.global_scale.double().item()
        assert_close(got, want, f"MXFP4 {mode} K={K} N={N} T={T}")


def test_mxfp4_and_its_nvfp4_carry_run_identically():
    # the MXFP4 path is the NVFP4 kernel on the carried-over values: identical outputs, bit for bit
    mx = mx_experts(4, 1024, 2048, seed=3)
    pa, pb = GC.prepare_weights(mx, device=DEV), GC.prepare_weights(mxfp4_experts_to_nvfp4(mx)[0], device=DEV)
    offs = torch.tensor([3, 3, 40, 47], dtype=I32, device=DEV)
    a = torch.randn(47, 2048, device=DEV).to(torch.bfloat16)
    assert torch.equal(GC.grouped_gemm_nvfp4(a, pa, offs), GC.grouped_gemm_nvfp4(a, pb, offs))
