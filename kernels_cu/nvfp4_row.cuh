// nvfp4_row.cuh -- one-CTA-per-row NVFP4 quantization with the row held in registers:
// plain (per-row amax -> gs), RMSNorm, and mHC pre-mix + RMSNorm. Included by
// nvfp4_quantize.cu (plain mode) and nvfp4_rmsnorm_quantize.cu (the fused modes).
//
// Mapping: CTA r owns row r; thread t owns the 16-element blocks c = t + k*blockDim.x,
// k < NB, and keeps their 16*NB fp32 values in registers, so X is read from HBM exactly once
// and the amax / quantize passes work from registers.
// Launcher contract: blockDim.x is a multiple of 32, blockDim.x <= RowMaxThreads<NB>::value, and
// NB * blockDim.x >= N/16 (every block of the row is owned). N % 16 == 0.
// Swizzled scales: grid = round_up(M, 128); CTAs r >= M only zero their padding row, and every
// CTA zeroes its padding columns c in [N/16, round_up(N/16, 4)); the kernel writes every byte
// of the padded buffer, so callers need not zero it.
//
// Exact fp32 operation order (the Python references ref_rmsnorm_quantize_nvfp4 and
// ref_mhc_rmsnorm_quantize_nvfp4 follow it):
//   mHC:     h[i] = a[0]*x[0,i];  h[i] = h[i] + a[j]*x[j,i] for j = 1 .. n_hc-1   (separate mul, add)
//   RMSNorm: ss  = sum_i h[i]*h[i]   (fp32, fused multiply-add per thread, then a tree: the ONLY
//                                     step whose order the reference cannot reproduce)
//            var = ss / N;  inv_rms = 1 / sqrt(var + eps)     (IEEE div, sqrt; never rsqrtf)
//            y[i] = (h[i] * inv_rms) * w[i]                    (two fp32 roundings)
//            optionally y[i] = float(bf16_rne(y[i]))           (round_bf16 = 1: match an unfused
//                                                              bf16 RMSNorm output)
//   gs  = gs_in[r * gs_in_stride] if gs_in else gs_from_amax(max_i |y[i]|)   (NaN-propagating max)
//   then every 16-block of y is quantized exactly as nvfp4_quantize.cu does.
#pragma once
#include "nvfp4_common.cuh"

namespace nvfp4 {

enum RowMode { kRowPlain = 0, kRowRmsNorm = 1, kRowMhc = 2 };

constexpr int kMaxHc = 4;  // mHC: at most 4 hyper-connection streams (DSV4 uses 4)

// NOTE: NB * 16 fp32 values live in registers. The files instantiate NB = 1 only: a 1024-thread
// CTA then covers N <= 16384 within 64 registers/thread, and every extra NB roughly doubles the
// NVRTC compile time of the fully unrolled body (measured: NB=1 1.3 s, NB=8 9.6 s per dtype pair).
template <int NB> struct RowMaxThreads { static constexpr int value = NB == 1 ? 1024 : (NB == 2 ? 512 : 256); };

template <typename T, int NB, int MODE>
__device__ __forceinline__ void row_quantize(
    const T* __restrict__ x,            // plain/RMSNorm: (M, N); mHC: (M, n_hc, N)
    const float* __restrict__ a,        // mHC: (M, n_hc) fp32 mixing weights; else unused
    int n_hc,                           // mHC: 1..4
    i64 M, i64 N,
    const float* __restrict__ w,        // RMSNorm/mHC: (N,) fp32 weight; else unused
    float eps,
    int round_bf16,
    const float* __restrict__ gs_in,    // nullptr: compute gs per row; else gs_in[r * gs_in_stride]
    i64 gs_in_stride,
    float* __restrict__ gs_out,         // (M,) or nullptr (only written when gs is computed)
    float* __restrict__ inv_rms_out,    // (M,) or nullptr (RMSNorm/mHC)
    u8* __restrict__ codes,             // (M, N/2)
    u8* __restrict__ sf,                // (M, N/16) or swizzled (round_up(M,128), round_up(N/16,4))
    int swizzle) {
    static_assert(NB >= 1 && NB <= 8, "NB blocks of 16 per thread: 1..8");
    __shared__ float sh_f[32];
    __shared__ u32 sh_u[32];

    const i64 r = blockIdx.x;
    const i64 nb = N >> 4;
    const i64 cp = swizzle ? round_up(nb, kSfTileCols) : nb;
    if (r >= M) {  // swizzle padding rows
        for (i64 c = threadIdx.x; c < cp; c += blockDim.x) sf[sf_swizzled_offset(r, c, cp)] = 0;
        return;
    }

    float h[NB][16];
    u32 bam[NB];   // per-block |.|-max bits of the values that get quantized (reused by pass 3)
    u32 mx = 0u;
    float ss = 0.0f;

    float am[kMaxHc];
    if (MODE == kRowMhc) {
#pragma unroll
        for (int j = 0; j < kMaxHc; ++j) am[j] = (j < n_hc) ? a[r * n_hc + j] : 0.0f;
    }

    // Pass 1: load (and mix) the row into registers; sum of squares or amax.
#pragma unroll
    for (int k = 0; k < NB; ++k) {
        const i64 c = threadIdx.x + (i64)k * blockDim.x;
        if (c < nb) {
            if (MODE == kRowMhc) {
                const T* xr = x + r * n_hc * N + c * kBlock;
                load16(xr, h[k]);
#pragma unroll
                for (int i = 0; i < 16; ++i) h[k][i] = __fmul_rn(am[0], h[k][i]);
#pragma unroll
                for (int j = 1; j < kMaxHc; ++j) {
                    if (j < n_hc) {
                        float t[16];
                        load16(xr + j * N, t);
#pragma unroll
                        for (int i = 0; i < 16; ++i) h[k][i] = __fadd_rn(h[k][i], __fmul_rn(am[j], t[i]));
                    }
                }
            } else if (MODE == kRowPlain) {
                // |.|-max on the raw 16-byte words (SIMD 16x2 max for bf16/fp16): same bits as
                // absmax_bits16 on the converted values, fewer instructions.
                bam[k] = load16_amax(x + r * N + c * kBlock, h[k]);
            } else {
                load16(x + r * N + c * kBlock, h[k]);
            }
            if (MODE == kRowPlain) {
                mx = max(mx, bam[k]);
            } else {
#pragma unroll
                for (int i = 0; i < 16; ++i) ss = __fmaf_rn(h[k][i], h[k][i], ss);
            }
        }
    }

    // Pass 2 (RMSNorm/mHC): y = (h * inv_rms) * w in registers, amax of y.
    if (MODE != kRowPlain) {
        ss = block_sum_once(ss, sh_f);
        const float var = __fdiv_rn(ss, (float)N);
        const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
        if (threadIdx.x == 0 && inv_rms_out != nullptr) inv_rms_out[r] = inv;
#pragma unroll
        for (int k = 0; k < NB; ++k) {
            const i64 c = threadIdx.x + (i64)k * blockDim.x;
            if (c < nb) {
                const float4* w4 = reinterpret_cast<const float4*>(w + c * kBlock);
#pragma unroll
                for (int i4 = 0; i4 < 4; ++i4) {
                    const float4 wq = w4[i4];
                    const float wv[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        float y = __fmul_rn(__fmul_rn(h[k][4 * i4 + i], inv), wv[i]);
                        if (round_bf16) y = __bfloat162float(__float2bfloat16_rn(y));
                        h[k][4 * i4 + i] = y;
                    }
                }
                bam[k] = absmax_bits16(h[k]);
                mx = max(mx, bam[k]);
            }
        }
    }

    float g;
    if (gs_in != nullptr) {
        g = gs_in[r * gs_in_stride];
    } else {
        mx = block_max_u32_once(mx, sh_u);
        g = gs_from_amax(__uint_as_float(mx));
        if (threadIdx.x == 0 && gs_out != nullptr) gs_out[r] = g;
    }

    // Pass 3: quantize the blocks held in registers.
#pragma unroll
    for (int k = 0; k < NB; ++k) {
        const i64 c = threadIdx.x + (i64)k * blockDim.x;
        if (c < nb) {
            u32 lo, hi;
            const u32 sb = quantize_block16(h[k], bam[k], g, lo, hi);
            *reinterpret_cast<uint2*>(codes + r * (N >> 1) + c * 8) = make_uint2(lo, hi);
            sf[swizzle ? sf_swizzled_offset(r, c, cp) : r * nb + c] = (u8)sb;
        }
    }
    if (swizzle) {
        for (i64 c = nb + threadIdx.x; c < cp; c += blockDim.x) sf[sf_swizzled_offset(r, c, cp)] = 0;
    }
}

}  // namespace nvfp4
