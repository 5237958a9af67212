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
// Constraints (checked by the launcher): N % 16 == 0; N <= 16384 (one 16-block per thread, at
// most 1024 threads per CTA: the row lives in registers); 1 <= n_hc <= 4; X, w, codes 16-byte
// aligned; all tensors contiguous.
//
// Entry points (dtype suffix bf16 / f16 / f32 for X; w, A, eps, gs always fp32):
//   nvfp4_rmsnorm_quantize_<dt>(x, M, N, w, eps, round_bf16, gs_in, gs_in_stride,
//                               gs_out, inv_rms_out, codes, sf, swizzle)
//   nvfp4_mhc_rmsnorm_quantize_<dt>(x, a, n_hc, M, N, w, eps, round_bf16, gs_in,
//                                   gs_in_stride, gs_out, inv_rms_out, codes, sf, swizzle)
// Launch: grid = M (round_up(M,128) when swizzle), block = max(32, round_up(N/16, 32)) <= 1024.
#include "nvfp4_common.cuh"
#include "nvfp4_row.cuh"

using namespace nvfp4;

// NOTE: bf16/fp16 inputs: at most 40 registers per thread (6 CTAs of 256 threads per SM instead of 4 at
// the compiler's 50; measured 0-1 spilled words across a barrier). fp32 input keeps the default (it
// spills under 40). __maxnreg__ (CUDA 12.4+) replaces __launch_bounds__ (both cannot be given).
#if defined(NVFP4_ROW_NOCAP) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ != 900  // sm_90 tuning only
#define NVFP4_ROW_BOUNDS_16 __launch_bounds__(RowMaxThreads<1>::value)
#else
#define NVFP4_ROW_BOUNDS_16 __maxnreg__(40)
#endif

#define NVFP4_RMSNORM_ENTRY_POINTS(SUF, T, BOUNDS)                                                              \
    extern "C" __global__ void BOUNDS                               \
    nvfp4_rmsnorm_quantize_##SUF(                                                                       \
        const T* __restrict__ x, i64 M, i64 N, const float* __restrict__ w, float eps, int round_bf16,  \
        const float* __restrict__ gs_in, i64 gs_in_stride, float* __restrict__ gs_out,                  \
        float* __restrict__ inv_rms_out, u8* __restrict__ codes, u8* __restrict__ sf, int swizzle) {    \
        row_quantize<T, 1, kRowRmsNorm>(x, nullptr, 0, M, N, w, eps, round_bf16, gs_in, gs_in_stride,   \
                                         gs_out, inv_rms_out, codes, sf, swizzle);                      \
    }                                                                                                   \
    extern "C" __global__ void BOUNDS                               \
    nvfp4_mhc_rmsnorm_quantize_##SUF(                                                                   \
        const T* __restrict__ x, const float* __restrict__ a, int n_hc, i64 M, i64 N,                   \
        const float* __restrict__ w, float eps, int round_bf16,                                         \
        const float* __restrict__ gs_in, i64 gs_in_stride, float* __restrict__ gs_out,                  \
        float* __restrict__ inv_rms_out, u8* __restrict__ codes, u8* __restrict__ sf, int swizzle) {    \
        row_quantize<T, 1, kRowMhc>(x, a, n_hc, M, N, w, eps, round_bf16, gs_in, gs_in_stride,          \
                                     gs_out, inv_rms_out, codes, sf, swizzle);                          \
    }

NVFP4_RMSNORM_ENTRY_POINTS(bf16, __nv_bfloat16, NVFP4_ROW_BOUNDS_16)
NVFP4_RMSNORM_ENTRY_POINTS(f16, __half, NVFP4_ROW_BOUNDS_16)
NVFP4_RMSNORM_ENTRY_POINTS(f32, float, __launch_bounds__(RowMaxThreads<1>::value))
