// nvfp4_rmsnorm_quantize.cu -- fused RMSNorm + per-row amax + NVFP4 quantize, and DSV4's
// hyper-connection (mHC) pre-mix + RMSNorm + quantize, each reading X from HBM once.
// Any arch >= sm_80 (compiled for sm_90a and sm_100a).
//
// Math (exact fp32 op order; the kernel body is nvfp4_row.cuh::row_quantize):
//   mHC only:  h[m,i] = A[m,0]*X[m,0,i];  h = h + A[m,j]*X[m,j,i] for j = 1..n_hc-1
//              (each product and each sum rounded: __fmul_rn, __fadd_rn; no FMA)
//   RMSNorm:   h = X[m, :] (plain mode)
//              ss = sum_i h_i^2      (fp32; per-thread fused multiply-add, then a butterfly tree;
//                                     the order is unspecified -> tolerance vs the reference)
//              var = ss / N;  inv_rms[m] = 1 / sqrt(var + eps)     (IEEE div and sqrt)
//              y_i = (h_i * inv_rms) * w_i                          (two roundings)
//              y_i = float(bf16_rne(y_i)) when round_bf16 != 0
//   global scale: gs[m] = gs_from_amax(max_i |y_i|) per row (NaN-propagating), or a given
//              gs_in[m * gs_in_stride] (stride 0: one static activation scale, e.g. input_scale)
//   quantize:  every 16-element block of y exactly as nvfp4_quantize.cu (s, r, e2m1 codes).
// Outputs: codes (M, N/2) uint8; sf (M, N/16) e4m3 plain or 32_4_4 swizzled
// (round_up(M,128), round_up(N/16,4), padding written as 0 by the kernel); gs_out (M,) fp32 when
// computed; inv_rms_out (M,) fp32 (nullable).
//
// Constraints (checked by the launcher): N % 16 == 0; N <= 16384 (NB 16-blocks per thread, at
// most RowMaxThreads<NB> threads per CTA: the row lives in registers); 1 <= n_hc <= 4; X, w, codes 16-byte
// aligned; all tensors contiguous.
//
// Entry points (dtype suffix bf16 / f16 / f32 for X; w, A, eps, gs always fp32):
//   nvfp4_rmsnorm_quantize_<dt>(x, M, N, w, eps, round_bf16, gs_in, gs_in_stride,
//                               gs_out, inv_rms_out, codes, sf, swizzle)
//   nvfp4_mhc_rmsnorm_quantize_<dt>(x, a, n_hc, M, N, w, eps, round_bf16, gs_in,
//                                   gs_in_stride, gs_out, inv_rms_out, codes, sf, swizzle)
// Launch: grid = M (round_up(M,128) when swizzle), block = max(32, round_up(ceil(N/16 / NB), 32)), NB below
// (rmsnorm: 4 for bf16/fp16, 2 for fp32; mHC: 1).
//
// Compile-time constants: none is set from outside (the launchers pass no defines): NVFP4_RMS_NB, _NB32 and
// NVFP4_MHC_NB below are fixed; mHC's register cap (__maxnreg__(40)) follows __CUDA_ARCH__ (sm_90 tuning);
// tests/test_runtime.py compiles both archs.
#include "nvfp4_common.cuh"
#include "nvfp4_row.cuh"

using namespace nvfp4;

// Blocks of 16 per thread (NB, the template argument of row_quantize / row_quantize_raw). RMSNorm: NVFP4_RMS_NB
// = 4 for bf16/fp16 (NVFP4_RMS_NB32 = 2 for fp32): a 4096-wide row is 2 warps, the per-row scalar work (reductions,
// division, sqrt, gs) is paid once per 64 elements per thread instead of once per 16. mHC: NVFP4_MHC_NB = 1 (near
// the copy ceiling; NB 2/4 measured slower). The launcher (dsv4_nvfp4.norm._fused) uses
// block = max(32, round_up(ceil(N/16 / NB), 32)) with the same NB (tests/test_runtime.py checks the two agree).
// NB = 4 won for RMSNorm on an H200 (bf16 (M, 4096), 1 GB; NB 1/4/8: 2.07/2.37/1.77 TB/s).
#define NVFP4_RMS_NB 4     // RMSNorm, bf16 / fp16
#define NVFP4_RMS_NB32 2   // RMSNorm, fp32
#define NVFP4_MHC_NB 1     // mHC, every dtype

// NOTE: mHC (NB = 1), bf16/fp16 inputs: at most 40 registers per thread (6 CTAs of 256 threads per SM instead of 4 at
// the compiler's 50; measured 0-1 spilled words across a barrier). fp32 input keeps the default (it
// spills under 40). __maxnreg__ (CUDA 12.4+) replaces __launch_bounds__ (both cannot be given).
// NB > 1: the compiler's choice under the block-size bound (the row is 16*NB fp32 registers per thread).
// The cap is sm_90 tuning only: other archs keep the compiler's choice.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define NVFP4_MHC_BOUNDS_16 __maxnreg__(40)
#else
#define NVFP4_MHC_BOUNDS_16 __launch_bounds__(RowMaxThreads<NVFP4_MHC_NB>::value)
#endif
#define NVFP4_RMS_BOUNDS_16 __launch_bounds__(RowMaxThreads<NVFP4_RMS_NB>::value)
#define NVFP4_RMS_BOUNDS_32 __launch_bounds__(RowMaxThreads<NVFP4_RMS_NB32>::value)
#define NVFP4_MHC_BOUNDS_32 __launch_bounds__(RowMaxThreads<NVFP4_MHC_NB>::value)

#define NVFP4_RMSNORM_ENTRY_POINTS(SUF, T, RBOUNDS, RNB, MBOUNDS, MNB)                                                              \
    extern "C" __global__ void RBOUNDS                              \
    nvfp4_rmsnorm_quantize_##SUF(                                                                       \
        const T* __restrict__ x, i64 M, i64 N, const float* __restrict__ w, float eps, int round_bf16,  \
        const float* __restrict__ gs_in, i64 gs_in_stride, float* __restrict__ gs_out,                  \
        float* __restrict__ inv_rms_out, u8* __restrict__ codes, u8* __restrict__ sf, int swizzle) {    \
        if constexpr (sizeof(T) == 2 && RNB > 1)                                                        \
            row_quantize_raw<T, RNB, kRowRmsNorm, false>(x, M, N, w, eps, round_bf16, gs_in,               \
                                         gs_in_stride, gs_out, inv_rms_out, codes, sf, swizzle);        \
        else                                                                                            \
            row_quantize<T, RNB, kRowRmsNorm>(x, nullptr, 0, M, N, w, eps, round_bf16, gs_in, gs_in_stride, \
                                         gs_out, inv_rms_out, codes, sf, swizzle);                      \
    }                                                                                                   \
    extern "C" __global__ void MBOUNDS                              \
    nvfp4_mhc_rmsnorm_quantize_##SUF(                                                                   \
        const T* __restrict__ x, const float* __restrict__ a, int n_hc, i64 M, i64 N,                   \
        const float* __restrict__ w, float eps, int round_bf16,                                         \
        const float* __restrict__ gs_in, i64 gs_in_stride, float* __restrict__ gs_out,                  \
        float* __restrict__ inv_rms_out, u8* __restrict__ codes, u8* __restrict__ sf, int swizzle) {    \
        row_quantize<T, MNB, kRowMhc>(x, a, n_hc, M, N, w, eps, round_bf16, gs_in, gs_in_stride,          \
                                     gs_out, inv_rms_out, codes, sf, swizzle);                          \
    }

NVFP4_RMSNORM_ENTRY_POINTS(bf16, __nv_bfloat16, NVFP4_RMS_BOUNDS_16, NVFP4_RMS_NB, NVFP4_MHC_BOUNDS_16, NVFP4_MHC_NB)
NVFP4_RMSNORM_ENTRY_POINTS(f16, __half, NVFP4_RMS_BOUNDS_16, NVFP4_RMS_NB, NVFP4_MHC_BOUNDS_16, NVFP4_MHC_NB)
NVFP4_RMSNORM_ENTRY_POINTS(f32, float, NVFP4_RMS_BOUNDS_32, NVFP4_RMS_NB32, NVFP4_MHC_BOUNDS_32, NVFP4_MHC_NB)
