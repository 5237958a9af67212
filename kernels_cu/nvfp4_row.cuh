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
//   RMSNorm: ss  = sum_i h[i]*h[i]   (fp32, fused multiply-add per thread (bf16/fp16 with NB > 1: in 4
//                                     chains, then (c0+c1)+(c2+c3)), then a butterfly tree: the ONLY
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

// NOTE: NB * 16 values live in registers. NB = 1: a 1024-thread CTA covers N <= 16384 within
// 64 registers/thread. NB > 1 (RMSNorm and the per-row quantize: 4 for bf16/fp16 through row_quantize_raw
// below, 2 for fp32): the per-row scalar work and the reductions are paid once per NB blocks per thread.
// Measured on H200, bf16 (M, 4096), 1 GB: per-row quantize NB 1/2/4/8: 3.17/3.42/3.75/3.52 TB/s; RMSNorm
// NB 1/4/8: 2.07/2.37/1.77 (NB = 8 is one warp per row at ~100-190 registers: too few warps per SM to hide
// the per-warp dependency chains).
// Every extra NB roughly doubles the NVRTC compile time of the fully unrolled body (NB=1 1.3 s, NB=8 9.6 s).
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
        // One-warp CTA (NB > 1, N <= 512 * NB): the butterfly alone, no shared memory or barrier.
        ss = (blockDim.x == 32) ? warp_sum(ss) : block_sum_once(ss, sh_f);
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
        mx = (blockDim.x == 32) ? warp_max_u32(mx) : block_max_u32_once(mx, sh_u);
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


// ---------------------------------------------------------------------------------------------
// bf16/fp16 rows, NB > 1 (plain and RMSNorm): the same math and outputs as row_quantize, but the row is
// kept as its raw 16-bit words (NB * 8 registers instead of NB * 16) and converted where used:
//   plain:   block |.|-max on the raw words (as load16_amax), the fp32 values only in pass 3.
//   RMSNorm: ss from the words; y = (h * inv_rms) * w is built in pass 2 for the amax and held for pass 3
//            (NB * 16 fp32 registers, as row_quantize), or with RECOMP built again in pass 3 (same
//            operations, same bits; half the registers but ~3 more instructions per element: measured
//            slower, 2.01 vs 2.37 TB/s at NB = 4).
// Same launcher contract as row_quantize.
// |.|-max of 16 values produced by an fp32 multiply (so any NaN among them is the canonical 0x7fffffff):
// max.NaN.f32 on |v| (one FMNMX with an |.| operand per value instead of LOP + integer max). Non-NaN: the
// same bits as absmax_bits16 (both give max |v|, -0 -> +0); NaN: 0x7fffffff, which is also what the
// integer max gives for canonical NaNs.
__device__ __forceinline__ u32 absmax_bits16_fmul(const float (&v)[16]) {
    float m[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) asm("max.NaN.f32 %0, %1, %2;" : "=f"(m[i]) : "f"(fabsf(v[2 * i])), "f"(fabsf(v[2 * i + 1])));
#pragma unroll
    for (int s = 4; s > 0; s >>= 1)
#pragma unroll
        for (int i = 0; i < s; ++i) asm("max.NaN.f32 %0, %1, %2;" : "=f"(m[i]) : "f"(m[i]), "f"(m[i + s]));
    return __float_as_uint(m[0]);
}

template <typename T>
__device__ __forceinline__ void rms_y16(const uint4 (&rw)[2], const float* __restrict__ w16, float inv,
                                        int round_bf16, float (&v)[16]) {
    Unpack16<T>::run(reinterpret_cast<const u32*>(rw), v);
    const float4* w4 = reinterpret_cast<const float4*>(w16);
#pragma unroll
    for (int i4 = 0; i4 < 4; ++i4) {
        const float4 wq = w4[i4];
        const float wv[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float y = __fmul_rn(__fmul_rn(v[4 * i4 + i], inv), wv[i]);
            if (round_bf16) y = __bfloat162float(__float2bfloat16_rn(y));
            v[4 * i4 + i] = y;
        }
    }
}

template <typename T, int NB, int MODE, bool RECOMP>
__device__ __forceinline__ void row_quantize_raw(
    const T* __restrict__ x, i64 M, i64 N, const float* __restrict__ w, float eps, int round_bf16,
    const float* __restrict__ gs_in, i64 gs_in_stride, float* __restrict__ gs_out,
    float* __restrict__ inv_rms_out, u8* __restrict__ codes, u8* __restrict__ sf, int swizzle) {
    static_assert(sizeof(T) == 2 && MODE != kRowMhc && NB >= 1 && NB <= 8, "16-bit input, plain or RMSNorm");
    __shared__ float sh_f[32];
    __shared__ u32 sh_u[32];

    const i64 r = blockIdx.x;
    const i64 nb = N >> 4;
    const i64 cp = swizzle ? round_up(nb, kSfTileCols) : nb;
    if (r >= M) {  // swizzle padding rows
        for (i64 c = threadIdx.x; c < cp; c += blockDim.x) sf[sf_swizzled_offset(r, c, cp)] = 0;
        return;
    }
    const bool warp_row = blockDim.x == 32;   // one-warp CTA: reductions are the butterflies alone

    uint4 raw[NB][2];
    u32 bam[NB];
    u32 mx = 0u;
    float ssj[4] = {0.0f, 0.0f, 0.0f, 0.0f};   // sum of squares in 4 chains (element i into chain i % 4)
#pragma unroll
    for (int k = 0; k < NB; ++k) {   // every load issued before any use
        const i64 c = threadIdx.x + (i64)k * blockDim.x;
        if (c < nb) {
            const uint4* q = reinterpret_cast<const uint4*>(x + r * N + c * kBlock);
            raw[k][0] = q[0];
            raw[k][1] = q[1];
        }
    }
    // Pass 1: block amax (plain) or sum of squares (RMSNorm).
#pragma unroll
    for (int k = 0; k < NB; ++k) {
        const i64 c = threadIdx.x + (i64)k * blockDim.x;
        if (c < nb) {
            if (MODE == kRowPlain) {
                bam[k] = AbsMaxVec<T>::to_f32_bits(AbsMaxVec<T>::fold(AbsMaxVec<T>::fold(0u, raw[k][0]), raw[k][1]));
                mx = max(mx, bam[k]);
            } else {
                float v[16];
                Unpack16<T>::run(reinterpret_cast<const u32*>(raw[k]), v);
#pragma unroll
                for (int i = 0; i < 16; ++i) ssj[i & 3] = __fmaf_rn(v[i], v[i], ssj[i & 3]);
            }
        }
    }
    float ss = __fadd_rn(__fadd_rn(ssj[0], ssj[1]), __fadd_rn(ssj[2], ssj[3]));

    // Pass 2 (RMSNorm): y, its block amax.
    float inv = 0.0f;
    float hy[RECOMP ? 1 : NB][16];
    if (MODE != kRowPlain) {
        ss = warp_row ? warp_sum(ss) : block_sum_once(ss, sh_f);
        const float var = __fdiv_rn(ss, (float)N);
        inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
        if (threadIdx.x == 0 && inv_rms_out != nullptr) inv_rms_out[r] = inv;
#pragma unroll
        for (int k = 0; k < NB; ++k) {
            const i64 c = threadIdx.x + (i64)k * blockDim.x;
            if (c < nb) {
                float* yk = hy[RECOMP ? 0 : k];
                rms_y16<T>(raw[k], w + c * kBlock, inv, round_bf16, *reinterpret_cast<float(*)[16]>(yk));
                bam[k] = absmax_bits16_fmul(*reinterpret_cast<float(*)[16]>(yk));
                mx = max(mx, bam[k]);
            }
        }
    }

    float g;
    if (gs_in != nullptr) {
        g = gs_in[r * gs_in_stride];
    } else {
        mx = warp_row ? warp_max_u32(mx) : block_max_u32_once(mx, sh_u);
        g = gs_from_amax(__uint_as_float(mx));
        if (threadIdx.x == 0 && gs_out != nullptr) gs_out[r] = g;
    }

    // Pass 3: quantize.
#pragma unroll
    for (int k = 0; k < NB; ++k) {
        const i64 c = threadIdx.x + (i64)k * blockDim.x;
        if (c < nb) {
            float v[16];
            if (MODE == kRowPlain) {
                Unpack16<T>::run(reinterpret_cast<const u32*>(raw[k]), v);
            } else if (RECOMP) {
                rms_y16<T>(raw[k], w + c * kBlock, inv, round_bf16, v);
            } else {
#pragma unroll
                for (int i = 0; i < 16; ++i) v[i] = hy[RECOMP ? 0 : k][i];
            }
            u32 lo, hi;
            const u32 sb = quantize_block16(v, bam[k], g, lo, hi);
            *reinterpret_cast<uint2*>(codes + r * (N >> 1) + c * 8) = make_uint2(lo, hi);
            sf[swizzle ? sf_swizzled_offset(r, c, cp) : r * nb + c] = (u8)sb;
        }
    }
    if (swizzle) {
        for (i64 c = nb + threadIdx.x; c < cp; c += blockDim.x) sf[sf_swizzled_offset(r, c, cp)] = 0;
    }
}

}  // namespace nvfp4
