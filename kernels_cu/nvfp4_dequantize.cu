// nvfp4_dequantize.cu -- NVFP4 (M, K) -> bf16 or fp32, bit-exact with
// dsv4_nvfp4.quant.dequantize_nvfp4. Any arch >= sm_80 (compiled for sm_90a and sm_100a).
//
// Math (fp32): x = (e2m1(code) * float(s)) * gs, each product rounded (__fmul_rn; e2m1*s is
// exact anyway), then cast: bf16 round-to-nearest-even (__float2bfloat16_rn), or kept as fp32.
//
// Layouts (contiguous, row-major):
//   codes  (M, K/2) uint8 (element 2i low nibble), K % 16 == 0, 8-byte aligned
//   sf     (M, K/16) e4m3 bytes, plain, or swizzled 32_4_4 (round_up(M,128), round_up(K/16,4))
//          when sf_swizzled != 0 (the layout nvfp4_quantize.cu writes)
//   gs     fp32, read as gs[r * gs_stride] (0: per tensor, 1: per row)
//   out    (M, K) bf16 or fp32, row stride out_stride elements (>= K, a multiple of 8 so that
//          every 16-element block is a 16-byte aligned store), 16-byte aligned
//
// Entry points: nvfp4_dequantize_bf16, nvfp4_dequantize_f32.
// Mapping: one thread per 16-element block (reads 8 B codes + 1 B scale, writes 32 B or 64 B as
// 16-byte stores), 256 threads per CTA, grid = ceil(M*K/16 / 256); M*K/16 < 2^32; the row index
// t / (K/16) uses the host-computed magic (div_m, div_l) (see nvfp4_common.cuh fast_div).
#include "nvfp4_common.cuh"

using namespace nvfp4;

constexpr int kThreads = 256;

template <typename TO> struct Store16;
template <> struct Store16<__nv_bfloat16> {
    static __device__ __forceinline__ void run(__nv_bfloat16* __restrict__ p, const float (&v)[16]) {
        u32 w[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);  // .x = low half
            w[i] = *reinterpret_cast<const u32*>(&b);
        }
        uint4* q = reinterpret_cast<uint4*>(p);
        q[0] = make_uint4(w[0], w[1], w[2], w[3]);
        q[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
};
template <> struct Store16<float> {
    static __device__ __forceinline__ void run(float* __restrict__ p, const float (&v)[16]) {
        float4* q = reinterpret_cast<float4*>(p);
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    }
};

// Decode one 16-element block: packed codes (lo: elements 0-7, hi: 8-15), scale byte, gs.
__device__ __forceinline__ void decode_block16(u32 lo, u32 hi, u32 sb, float g, float (&v)[16]) {
    const float s = e4m3_to_float(sb);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(__fmul_rn(e2m1_to_float((lo >> (4 * i)) & 15u), s), g);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[8 + i] = __fmul_rn(__fmul_rn(e2m1_to_float((hi >> (4 * i)) & 15u), s), g);
}

template <typename TO>
__device__ __forceinline__ void dequantize_flat(const u8* __restrict__ codes, const u8* __restrict__ sf,
                                                const float* __restrict__ gs, i64 gs_stride, i64 M, i64 K,
                                                int sf_swizzled, TO* __restrict__ out, i64 out_stride,
                                                u32 div_m, u32 div_l) {
    const i64 kb = K >> 4;
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    if ((i64)t >= M * kb) return;
    const u32 r32 = fast_div(t, div_m, div_l);   // t / kb
    const i64 r = r32, c = (i64)t - r * kb;
    const uint2 q = *reinterpret_cast<const uint2*>(codes + r * (K >> 1) + c * 8);
    const u32 sb = sf[sf_swizzled ? sf_swizzled_offset(r, c, round_up(kb, kSfTileCols)) : r * kb + c];
    float v[16];
    decode_block16(q.x, q.y, sb, gs[r * gs_stride], v);
    Store16<TO>::run(out + r * out_stride + c * kBlock, v);
}

#define NVFP4_DEQUANT_ENTRY_POINT(SUF, TO)                                                              \
    extern "C" __global__ void __launch_bounds__(kThreads)                                              \
    nvfp4_dequantize_##SUF(const u8* __restrict__ codes, const u8* __restrict__ sf,                     \
                           const float* __restrict__ gs, i64 gs_stride, i64 M, i64 K, int sf_swizzled,  \
                           TO* __restrict__ out, i64 out_stride, u32 div_m, u32 div_l) {                \
        dequantize_flat<TO>(codes, sf, gs, gs_stride, M, K, sf_swizzled, out, out_stride,               \
                            div_m, div_l);                                                              \
    }

NVFP4_DEQUANT_ENTRY_POINT(bf16, __nv_bfloat16)
NVFP4_DEQUANT_ENTRY_POINT(f32, float)
