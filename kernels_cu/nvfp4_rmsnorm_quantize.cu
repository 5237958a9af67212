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
#include "nvfp4_common.cuh"
#include "nvfp4_row.cuh"

using namespace nvfp4;

// Blocks of 16 per thread (NB, the template argument of row_quantize / row_quantize_raw). RMSNorm: NB = 4 for
// bf16/fp16 (2 for fp32): a 4096-wide row is 2 warps, the per-row scalar work (reductions, division, sqrt,
// gs) is paid once per 64 elements per thread instead of once per 16. The launcher
// (dsv4_nvfp4.norm._fused) uses block = max(32, round_up(ceil(N/16 / NB), 32)) with the same NB: keep the
// two in step. A/B variants (DSV4_NVFP4_DEFINES): NVFP4_ROW_NB1 / NB2 / NB8 for RMSNorm, NVFP4_MHC_NB2 / NB4 /
// NB8 for mHC (default NB 1 for mHC: near the copy ceiling, NB 2/4 measured slower), NVFP4_RMS_INTMAX.
#if defined(NVFP4_ROW_NB1)
#define NVFP4_RMS_NB16 1
#elif defined(NVFP4_ROW_NB2)
#define NVFP4_RMS_NB16 2
#elif defined(NVFP4_ROW_NB8)
#define NVFP4_RMS_NB16 8
#else
#define NVFP4_RMS_NB16 4
#endif
#if defined(NVFP4_MHC_NB2)
#define NVFP4_MHC_NB16 2
#elif defined(NVFP4_MHC_NB4)
#define NVFP4_MHC_NB16 4
#elif defined(NVFP4_MHC_NB8)
#define NVFP4_MHC_NB16 8
#else
#define NVFP4_MHC_NB16 1
#endif
// bf16/fp16 RMSNorm holds y in registers from pass 2 to pass 3 (110 registers at NB = 4);
// NVFP4_RMS_RECOMPUTE (A/B) rebuilds it from the raw words instead (80 registers, measured slower).
#if defined(NVFP4_RMS_RECOMPUTE)
#define NVFP4_RMS_RECOMP true
#else
#define NVFP4_RMS_RECOMP false
#endif
#define NVFP4_NB32(nb) ((nb) > 1 ? (nb) / 2 : 1)   // fp32 input: half the blocks (its registers hold fp32 anyway)

// NOTE: NB = 1, bf16/fp16 inputs: at most 40 registers per thread (6 CTAs of 256 threads per SM instead of 4 at
// the compiler's 50; measured 0-1 spilled words across a barrier). fp32 input keeps the default (it
// spills under 40). __maxnreg__ (CUDA 12.4+) replaces __launch_bounds__ (both cannot be given).
// NB > 1: the compiler's choice under the block-size bound (the row is 16*NB fp32 registers per thread).
#if defined(NVFP4_ROW_NOCAP) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ != 900  // sm_90 tuning only
#define NVFP4_ROW_CAP40 0
#else
#define NVFP4_ROW_CAP40 1
#endif
#if NVFP4_ROW_CAP40 && NVFP4_RMS_NB16 == 1
#define NVFP4_RMS_BOUNDS_16 __maxnreg__(40)
#else
#define NVFP4_RMS_BOUNDS_16 __launch_bounds__(RowMaxThreads<NVFP4_RMS_NB16>::value)
#endif
#if NVFP4_ROW_CAP40 && NVFP4_MHC_NB16 == 1
#define NVFP4_MHC_BOUNDS_16 __maxnreg__(40)
#else
#define NVFP4_MHC_BOUNDS_16 __launch_bounds__(RowMaxThreads<NVFP4_MHC_NB16>::value)
#endif
#define NVFP4_RMS_BOUNDS_32 __launch_bounds__(RowMaxThreads<NVFP4_NB32(NVFP4_RMS_NB16)>::value)
#define NVFP4_MHC_BOUNDS_32 __launch_bounds__(RowMaxThreads<NVFP4_NB32(NVFP4_MHC_NB16)>::value)

#define NVFP4_RMSNORM_ENTRY_POINTS(SUF, T, RBOUNDS, RNB, MBOUNDS, MNB)                                                              \
    extern "C" __global__ void RBOUNDS                              \
    nvfp4_rmsnorm_quantize_##SUF(                                                                       \
        const T* __restrict__ x, i64 M, i64 N, const float* __restrict__ w, float eps, int round_bf16,  \
        const float* __restrict__ gs_in, i64 gs_in_stride, float* __restrict__ gs_out,                  \
        float* __restrict__ inv_rms_out, u8* __restrict__ codes, u8* __restrict__ sf, int swizzle) {    \
        if constexpr (sizeof(T) == 2 && RNB > 1)                                                        \
            row_quantize_raw<T, RNB, kRowRmsNorm, NVFP4_RMS_RECOMP>(x, M, N, w, eps, round_bf16, gs_in,     \
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

NVFP4_RMSNORM_ENTRY_POINTS(bf16, __nv_bfloat16, NVFP4_RMS_BOUNDS_16, NVFP4_RMS_NB16, NVFP4_MHC_BOUNDS_16, NVFP4_MHC_NB16)
NVFP4_RMSNORM_ENTRY_POINTS(f16, __half, NVFP4_RMS_BOUNDS_16, NVFP4_RMS_NB16, NVFP4_MHC_BOUNDS_16, NVFP4_MHC_NB16)
NVFP4_RMSNORM_ENTRY_POINTS(f32, float, NVFP4_RMS_BOUNDS_32, NVFP4_NB32(NVFP4_RMS_NB16), NVFP4_MHC_BOUNDS_32,
                           NVFP4_NB32(NVFP4_MHC_NB16))
