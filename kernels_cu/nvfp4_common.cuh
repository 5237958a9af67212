// nvfp4_common.cuh -- exact NVFP4 codecs and helpers shared by the kernels_cu/nvfp4_*.cu files.
//
// Included (by the NVRTC runtime, with kernels_cu/ on the include path) by every nvfp4_*.cu file.
// Its bytes are part of each file's cache key, so editing it recompiles every kernel.
//
// Numerics (normative; derived in nbs/01_quantize.ipynb, the CPU reference is dsv4_nvfp4.quant.ref_quantize_nvfp4):
//   gs   = amax / 2688 (fp32 division; 2688 = 6 * 448); gs == 0 -> 1; gs < 2^-110 -> 2^-110; NaN stays NaN
//   per 16-element block with block amax `ba`:
//   s    = e4m3_rne( min(ba / (6 * gs), 448) )      6*gs, the division: fp32 IEEE, round to nearest even
//   r    = 1 / (float(s) * gs)                        fp32 IEEE
//   code = e2m1_rne( x * r )                          fp32 multiply; ties to the even code; |v| >= 6 -> 6;
//                                                     the code's sign bit is the sign bit of x*r (-0 -> 8)
//   s == 0 -> every code of the block is 0.
//   decode: x = (e2m1 * float(s)) * gs               fp32, two roundings in this order
//
// NOTE: every fp32 operation whose rounding is part of the spec is written with an explicit
// round-to-nearest intrinsic (__fmul_rn, __fdiv_rn, __fadd_rn, __fsqrt_rn). These are never
// contracted into FMAs and ignore -use_fast_math / -prec-div=false, so the results do not depend
// on NVRTC flags. The runtime also passes --fmad=false --prec-div=true --prec-sqrt=true --ftz=false.
// Denormals matter: x*r may be an fp32 subnormal (it encodes to +-0, keeping its sign); never
// compile these files with -ftz=true.
//
// Compile-time switches: none (one code path per helper; each .cu lists its own constants).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

typedef unsigned char u8;
typedef unsigned int u32;
typedef long long i64;

namespace nvfp4 {

constexpr int kBlock = 16;              // NVFP4 block size along K
constexpr float kE2M1Max = 6.0f;        // largest E2M1 magnitude
constexpr float kE4M3Max = 448.0f;      // largest finite float8_e4m3fn
constexpr float kGsDenom = 2688.0f;     // 6 * 448, exact in fp32
constexpr float kGsMin = 0x1p-110f;     // GS_MIN: keeps 1/(s*gs) finite for every s >= 2^-9
constexpr i64 kSfTileRows = 128;        // 32_4_4 swizzle: 128 x 4 scale tiles of 512 bytes
constexpr i64 kSfTileCols = 4;

static_assert(kE2M1Max * kE4M3Max == kGsDenom, "2688 must equal 6 * 448 exactly");
static_assert(kGsMin * 0x1p-9f >= 0x1p-126f, "GS_MIN * smallest e4m3 scale (2^-9) must stay a normal fp32");

__device__ __forceinline__ i64 round_up(i64 n, i64 m) { return (n + m - 1) / m * m; }

// ---------------------------------------------------------------------------------------------
// Global scale from amax (the reference: dsv4_nvfp4.quant.global_scale_from_amax).
// NOTE: the `g < kGsMin` comparison is false for NaN, so a NaN amax gives a NaN gs (never a
// finite value): that is how NaN input shows up in the fused amax -> gs path.
__device__ __forceinline__ float gs_from_amax(float amax) {
    const float g = __fdiv_rn(amax, kGsDenom);
    if (g == 0.0f) return 1.0f;
    return (g < kGsMin) ? kGsMin : g;
}

// |x| as the bits of a non-negative fp32. As unsigned integers these order like the values,
// and every NaN pattern (> 0x7f800000) is above +Inf: an integer max therefore propagates NaN,
// where fmaxf would drop it.
__device__ __forceinline__ u32 abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// ---------------------------------------------------------------------------------------------
// E2M1 code -> fp32 (exact). For m >= 2 the E2M1 bits e:m shifted into an fp32 with the bias
// moved from 1 to 127 give the value; m == 1 is the subnormal 0.5.
__device__ __forceinline__ float e2m1_to_float(u32 code) {
    const u32 m = code & 7u;
    const u32 mag = (m >= 2u) ? ((m << 22) + (126u << 23)) : (m ? 0x3f000000u : 0u);
    return __uint_as_float(mag | ((code & 8u) << 28));
}

// ---------------------------------------------------------------------------------------------
// E4M3 (float8_e4m3fn). Encode is only ever applied to q in [0, 448] or NaN (the caller clamps).
// NOTE: on sm_89+ this is one cvt.rn.satfinite.e4m3x2.f32: round to nearest even, finite values
// saturate to +-448, NaN -> 0x7f. Input here is already clamped to <= 448.
__device__ __forceinline__ u32 e4m3_encode(float q) {
    return (u32)__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
}

// E4M3 byte -> fp32 (exact). 0x7f / 0xff are NaN.
// NOTE: hardware cvt.rn.f16x2.e4m3x2 (sm_89+), then f16 -> f32: both exact for every e4m3 value
// (f16 holds 2^-9 .. 448 exactly; NaN stays NaN). 2 instructions instead of ~15 with branches.
__device__ __forceinline__ float e4m3_to_float(u32 b) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
    return __half2float(__half(h));
}

// 8 E2M1 codes of a 32-bit word (element 2i in the low nibble of byte i) -> f[j] = (code 2j, code 2j+1) * 2^-6,
// exact. Each code's sign goes to bit 7 and its three magnitude bits to bits 4..2 of an E4M3 byte (exponent e1 e0,
// mantissa m0 0 0), which is worth code * 2^-6; one cvt per pair turns two such bytes into f16, exact, then f32.
// The gather (times 64 * scale, then the global scale) and the attention kernel (times 64 * scale, to bf16) share it.
__device__ __forceinline__ void e2m1x8_to_float_pairs(u32 w, float2 (&f)[4]) {
    const u32 lo = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);               // elements 0, 2, 4, 6
    const u32 hi = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);                      // elements 1, 3, 5, 7
    const u32 p[2] = {__byte_perm(lo, hi, 0x5140u), __byte_perm(lo, hi, 0x7362u)};     // 0 1 2 3 | 4 5 6 7
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(p[j >> 1] >> (16 * (j & 1))), __NV_E4M3);
        f[j] = __half22float2(__half2(h));
    }
}

// ---------------------------------------------------------------------------------------------
// 32_4_4 swizzle: byte offset of scale (r, c) of a matrix whose padded column count is `cp`
// (= round_up(cols, 4)); the buffer is (round_up(rows,128), cp) bytes.
__device__ __forceinline__ i64 sf_swizzled_offset(i64 r, i64 c, i64 cp) {
    return ((r >> 7) * (cp >> 2) + (c >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (c & 3);
}

// ---------------------------------------------------------------------------------------------
// Division of a 32-bit index by a runtime divisor d via a host-computed magic number
// (Granlund-Montgomery): with l = ceil(log2 d), m = floor(2^32 (2^l - d) / d) + 1,
// n / d = (n + umulhi(n, m)) >> l for every 32-bit n (the sum in 64 bits). The launcher passes
// (m, l) (dsv4_nvfp4.quantize_cuda computes them). Replaces a ~70-instruction 64-bit division per thread.
__device__ __forceinline__ u32 fast_div(u32 n, u32 m, u32 l) {
    return (u32)(((unsigned long long)n + __umulhi(n, m)) >> l);
}

// |x|-max over 16-byte vectors as the bits of a non-negative fp32 (integer max, NaN-propagating).
// bf16/fp16 use the per-halfword SIMD max __vmaxu2 on sign-cleared halves (their bit order is the
// value order, and NaN patterns sit above Inf); to_f32_bits converts the halfword max to fp32 bits.
template <typename T> struct AbsMaxVec;
template <> struct AbsMaxVec<__nv_bfloat16> {
    static __device__ __forceinline__ u32 fold(u32 acc, uint4 v) {
        const u32 m = 0x7fff7fffu;
        return __vmaxu2(acc, __vmaxu2(__vmaxu2(v.x & m, v.y & m), __vmaxu2(v.z & m, v.w & m)));
    }
    static __device__ __forceinline__ u32 to_f32_bits(u32 acc) { return max(acc & 0xffffu, acc >> 16) << 16; }
};
template <> struct AbsMaxVec<__half> {
    static __device__ __forceinline__ u32 fold(u32 acc, uint4 v) { return AbsMaxVec<__nv_bfloat16>::fold(acc, v); }
    static __device__ __forceinline__ u32 to_f32_bits(u32 acc) {
        const unsigned short h = (unsigned short)max(acc & 0xffffu, acc >> 16);
        return abs_bits(__half2float(__ushort_as_half(h)));  // fp16 NaN -> fp32 NaN (> Inf bits)
    }
};
template <> struct AbsMaxVec<float> {
    static __device__ __forceinline__ u32 fold(u32 acc, uint4 v) {
        const u32 m = 0x7fffffffu;
        return max(acc, max(max(v.x & m, v.y & m), max(v.z & m, v.w & m)));
    }
    static __device__ __forceinline__ u32 to_f32_bits(u32 acc) { return acc; }
};

// ---------------------------------------------------------------------------------------------
// 16 consecutive elements -> fp32 (exact for every input type). `p` must be 16-byte aligned.
__device__ __forceinline__ void bf16x2_to_float2(u32 w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void f16x2_to_float2(u32 w, float& lo, float& hi) {
    __half2 h = *reinterpret_cast<__half2*>(&w);
    float2 f = __half22float2(h);
    lo = f.x; hi = f.y;
}

template <typename T> struct Load16;

template <> struct Load16<__nv_bfloat16> {
    static __device__ __forceinline__ void run(const __nv_bfloat16* __restrict__ p, float (&v)[16]) {
        const uint4* q = reinterpret_cast<const uint4*>(p);
        const uint4 a = q[0], b = q[1];
        bf16x2_to_float2(a.x, v[0], v[1]);   bf16x2_to_float2(a.y, v[2], v[3]);
        bf16x2_to_float2(a.z, v[4], v[5]);   bf16x2_to_float2(a.w, v[6], v[7]);
        bf16x2_to_float2(b.x, v[8], v[9]);   bf16x2_to_float2(b.y, v[10], v[11]);
        bf16x2_to_float2(b.z, v[12], v[13]); bf16x2_to_float2(b.w, v[14], v[15]);
    }
};
template <> struct Load16<__half> {
    static __device__ __forceinline__ void run(const __half* __restrict__ p, float (&v)[16]) {
        const uint4* q = reinterpret_cast<const uint4*>(p);
        const uint4 a = q[0], b = q[1];
        f16x2_to_float2(a.x, v[0], v[1]);   f16x2_to_float2(a.y, v[2], v[3]);
        f16x2_to_float2(a.z, v[4], v[5]);   f16x2_to_float2(a.w, v[6], v[7]);
        f16x2_to_float2(b.x, v[8], v[9]);   f16x2_to_float2(b.y, v[10], v[11]);
        f16x2_to_float2(b.z, v[12], v[13]); f16x2_to_float2(b.w, v[14], v[15]);
    }
};
template <> struct Load16<float> {
    static __device__ __forceinline__ void run(const float* __restrict__ p, float (&v)[16]) {
        const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 f = q[i];
            v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
        }
    }
};

template <typename T>
__device__ __forceinline__ void load16(const T* __restrict__ p, float (&v)[16]) { Load16<T>::run(p, v); }

// Raw words (16 elements) -> fp32, exact.
template <typename T> struct Unpack16;
template <> struct Unpack16<__nv_bfloat16> {
    static __device__ __forceinline__ void run(const u32* u, float (&v)[16]) {
#pragma unroll
        for (int i = 0; i < 8; ++i) bf16x2_to_float2(u[i], v[2 * i], v[2 * i + 1]);
    }
};
template <> struct Unpack16<__half> {
    static __device__ __forceinline__ void run(const u32* u, float (&v)[16]) {
#pragma unroll
        for (int i = 0; i < 8; ++i) f16x2_to_float2(u[i], v[2 * i], v[2 * i + 1]);
    }
};
template <> struct Unpack16<float> {
    static __device__ __forceinline__ void run(const u32* u, float (&v)[16]) {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __uint_as_float(u[i]);
    }
};

// 16 elements -> fp32 plus their |.|-max bits, the max taken on the raw 16-byte words (cheaper than
// on the 16 floats for bf16/fp16).
template <typename T>
__device__ __forceinline__ u32 load16_amax(const T* __restrict__ p, float (&v)[16]) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    constexpr int kVec = 16 * (int)sizeof(T) / 16;
    uint4 w[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) w[i] = q[i];
    u32 acc = 0u;
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc = AbsMaxVec<T>::fold(acc, w[i]);
    Unpack16<T>::run(reinterpret_cast<const u32*>(w), v);
    return AbsMaxVec<T>::to_f32_bits(acc);
}

// The same from 16-byte vectors already loaded (kVec = sizeof(T) of them).
template <typename T>
__device__ __forceinline__ u32 unpack16_amax(const uint4 (&w)[(int)sizeof(T)], float (&v)[16]) {
    u32 acc = 0u;
#pragma unroll
    for (int i = 0; i < (int)sizeof(T); ++i) acc = AbsMaxVec<T>::fold(acc, w[i]);
    Unpack16<T>::run(reinterpret_cast<const u32*>(w), v);
    return AbsMaxVec<T>::to_f32_bits(acc);
}

__device__ __forceinline__ u32 absmax_bits16(const float (&v)[16]) {
    u32 m = 0u;
#pragma unroll
    for (int i = 0; i < 16; ++i) m = max(m, abs_bits(v[i]));
    return m;
}

// ---------------------------------------------------------------------------------------------
// Quantize one block of 16 fp32 values whose |.|-max bits are `amax_bits`, with global scale gs.
// Returns the e4m3 scale byte; `lo`/`hi` get the 16 packed codes (element 2i low nibble, i.e.
// element k at bits 4k of the 64-bit little-endian word lo | hi << 32).
// E2M1 encode: round to nearest, ties to the even code, on the exact fp32 value x*r; |.| >= 6 and Inf saturate
// to 6; the code's sign bit is the sign bit of x*r (so -0 and tiny negatives give code 8); NaN gives magnitude 7
// (the reference rejects NaN). Magnitudes by code: 0:0 1:0.5 2:1 3:1.5 4:2 5:3 6:4 7:6 (midpoints 0.25 0.75
// 1.25 1.75 2.5 3.5 5).
// NOTE: two values at a time, ~9 instructions per element; the per-element forms it replaced (two exact
// roundings, ~15 instructions; 7 comparisons, about twice that) are gone: the quantize kernels are close to
// issue-bound at full HBM bandwidth.
// E2M1 magnitudes of two values, as c_a | c_b << 16 (3 bits each). With a = min(|v|, 6) (fminf: NaN -> 6,
// so NaN -> magnitude 7), each of the three fp32 additions rounds `a` once (RNE) on a
// uniform grid, and the E2M1 code is the smallest of the three grid indices:
//   t1 = a + 2^22        ulp 0.5: low bits = RNE(2a)      (= the code for a <= 2)
//   t2 = a + (2^23 + 2)  ulp 1:   low bits = RNE(a) + 2   (= the code for 2 <= a <= 4)
//   t3 = a + (2^24 + 8)  ulp 2:   low bits = RNE(a/2) + 4 (= the code for 4 <= a <= 6; 6 -> 7)
// The constant offsets are even numbers of ulps, so ties still go to the even index = the even code;
// on each range the valid index is <= the other two (2a >= a+2 >= a/2+4 for a >= 4, etc.), so
// code = min(t1, t2, t3) on the low halfwords (a <= 6 keeps them < 2^16): two fp32 values share one
// 16x2 SIMD min (VIMNMX.U16x2). Checked bit-exact against the reference on the GPU (tests/test_kernels_gpu.py).
__device__ __forceinline__ u32 e2m1_mag2(float va, float vb) {
    const float aa = fminf(fabsf(va), 6.0f), ab = fminf(fabsf(vb), 6.0f);
    const u32 p1 = __byte_perm(__float_as_uint(__fadd_rn(aa, 4194304.0f)), __float_as_uint(__fadd_rn(ab, 4194304.0f)), 0x5410);
    const u32 p2 = __byte_perm(__float_as_uint(__fadd_rn(aa, 8388610.0f)), __float_as_uint(__fadd_rn(ab, 8388610.0f)), 0x5410);
    const u32 p3 = __byte_perm(__float_as_uint(__fadd_rn(aa, 16777224.0f)), __float_as_uint(__fadd_rn(ab, 16777224.0f)), 0x5410);
    return __vminu2(__vminu2(p1, p2), p3);
}
// Sign bits of xa, xb at bits 3 and 19 (the E2M1 sign bit of each halfword). The code's sign is the
// sign of x*r = the sign of x (r > 0; -0 and underflowing negatives keep it); for a NaN product
// (whose sign the hardware does not define) it is the sign of x.
__device__ __forceinline__ u32 sign2(float xa, float xb) {
    // NOTE: plain shifts (for bf16 the compiler folds both into one shift of the input word).
    return ((__float_as_uint(xa) >> 28) & 0x8u) | ((__float_as_uint(xb) >> 12) & 0x80000u);
}
// Pairs (c_2j | c_2j+1 << 16) j = 0..3 -> 8 nibbles, element k at bits 4k.
__device__ __forceinline__ u32 pack8(u32 p0, u32 p1, u32 p2, u32 p3) {
    u32 x01 = p0 + (p1 << 8);          // c0 @0, c2 @8, c1 @16, c3 @24 (disjoint fields)
    u32 x23 = p2 + (p3 << 8);
    x01 = x01 + (x01 >> 12);           // low 16 bits: c0 c1 c2 c3
    x23 = x23 + (x23 >> 12);
    return __byte_perm(x01, x23, 0x5410);
}
__device__ __forceinline__ void encode16(const float (&v)[16], float r, u32& lo, u32& hi) {
    u32 p[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
        p[j] = e2m1_mag2(__fmul_rn(v[2 * j], r), __fmul_rn(v[2 * j + 1], r)) | sign2(v[2 * j], v[2 * j + 1]);
    lo = pack8(p[0], p[1], p[2], p[3]);
    hi = pack8(p[4], p[5], p[6], p[7]);
}

__device__ __forceinline__ u32 quantize_block16(const float (&v)[16], u32 amax_bits, float gs,
                                                u32& lo, u32& hi) {
    const float ba = __uint_as_float(amax_bits);
    float q = __fdiv_rn(ba, __fmul_rn(kE2M1Max, gs));
    // NOTE: not fminf: fminf(NaN, 448) = 448 would hide NaN input behind a finite scale.
    q = (q > kE4M3Max) ? kE4M3Max : q;
    const u32 sb = e4m3_encode(q);
    lo = 0u; hi = 0u;
    if ((sb & 0x7fu) != 0u) {                       // s == 0 -> all-zero codes
        const float s = e4m3_to_float(sb);
        const float r = __fdiv_rn(1.0f, __fmul_rn(s, gs));
        encode16(v, r, lo, hi);
    }
    return sb;
}

// ---------------------------------------------------------------------------------------------
// Reductions (blockDim.x must be a multiple of 32; `sh` is >= 32 words of shared memory).
// Every thread of the block must call these (they contain __syncthreads).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ u32 warp_max_u32(u32 v) { return __reduce_max_sync(0xffffffffu, v); }

__device__ __forceinline__ float block_sum(float v, float* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = (lane < nw) ? sh[lane] : 0.0f;
        v = warp_sum(v);
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    const float r = sh[0];
    __syncthreads();
    return r;
}
__device__ __forceinline__ u32 block_max_u32(u32 v, u32* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max_u32(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = (lane < nw) ? sh[lane] : 0u;
        v = warp_max_u32(v);
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    const u32 r = sh[0];
    __syncthreads();
    return r;
}

// One-shot variants with a single barrier (instead of three): every warp reduces the per-warp partials
// itself with the same butterfly that warp 0 runs above, so every thread gets the same bits as
// block_sum / block_max_u32 return. The row kernels call each once per CTA, each on its own `sh`:
// nothing writes `sh` again, so no trailing barrier is needed. Do not call twice on one `sh`.
__device__ __forceinline__ float block_sum_once(float v, float* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    return warp_sum((lane < nw) ? sh[lane] : 0.0f);
}
__device__ __forceinline__ u32 block_max_u32_once(u32 v, u32* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max_u32(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    return warp_max_u32((lane < nw) ? sh[lane] : 0u);
}

// W4A8's activations, one fp32 scale per row (fp8_quantize.cu, and moe_route.cu's moe_permute_fp8): the scale from
// the integer max of the row's |x| bits (every NaN pattern is above +Inf): amax / 448, 1 for a zero row, NaN for a row
// holding NaN or Inf; then 16 values to E4M3 under it, |q| saturating at 448, NaN staying NaN.
__device__ __forceinline__ float fp8_row_scale(u32 amax_bits) {
    return (amax_bits >= 0x7f800000u) ? __int_as_float(0x7fffffff)
         : (amax_bits == 0u ? 1.0f : __fdiv_rn(__uint_as_float(amax_bits), kE4M3Max));
}
__device__ __forceinline__ uint4 fp8_pack16(const float (&v)[16], float s) {
    u32 w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 word = 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            word |= (u32)__nv_cvt_float_to_fp8(__fdiv_rn(v[4 * j + i], s), __NV_SATFINITE, __NV_E4M3) << (8 * i);
        w[j] = word;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace nvfp4
