// nvfp4_gather.cu -- gather rows of an NVFP4 matrix by index and dequantize them to bf16 (the
// top-k KV path of CSA), or dequantize a dense row range (HCA), into a caller-given buffer.
// Any arch >= sm_80 (compiled for sm_90a and sm_100a).
//
// Math: out[o, :] = bf16_rne((e2m1 * float(s)) * gs) of source row src(o), exactly as
// nvfp4_dequantize.cu / dsv4_nvfp4.quant.dequantize_nvfp4; a zero row where src(o) is invalid.
//   indexed mode (idx != nullptr): src(o) = idx[o] (int32)
//     idx[o] == -1                  -> zero row (padding), not counted
//     idx[o] <  -1 or >= n_src_rows -> zero row, and (+1) atomically added to *bad_count when
//                                     bad_count != nullptr (the checked mode). Source memory is
//                                     never read for an out-of-range index, checked or not.
//   dense mode (idx == nullptr): src(o) = row_start + o; the launcher checks
//     0 <= row_start and row_start + n_out_rows <= n_src_rows on the host (plain ints, no sync).
//
// Layouts: codes (n_src_rows, K/2) uint8; sf (n_src_rows, K/16) e4m3 plain, or 32_4_4 swizzled
// (round_up(n_src_rows,128), round_up(K/16,4)) when sf_swizzled != 0; gs fp32 read as
// gs[src * gs_stride] (0: per tensor, 1: per source row); out (n_out_rows, K) bf16 with row stride
// out_stride elements (a multiple of 8, >= K), 16-byte aligned. K % 16 == 0.
//
// Entry point: nvfp4_gather_dequant_bf16. Mapping: one thread per (output row, 16-element block),
// 256 threads per CTA, grid = ceil(n_out_rows * K/16 / 256), n_out_rows * K/16 < 2^32; t / (K/16)
// uses the host-computed magic (div_m, div_l).
//
// Decode: the codes go through the hardware E4M3 conversion, not the per-element E2M1 decode of
// nvfp4_common.cuh (about 9 integer instructions per element, which made this kernel issue-bound on the
// integer pipe: ncu on an H200, 65536 rows, math-pipe throttle 32%, issue active 76%, 82% of a same-size
// copy). An E2M1 code s|e1 e0|m0 placed as the E4M3 byte s|0 0 e1 e0|m0 0 0 is the code's value times
// 2^-6 exactly (the subnormal code 0.5 becomes the E4M3 subnormal 2^-7); the float of that, times
// 64 * scale, is code * scale exactly (at most 2 x 4 significant bits), and the one rounded product with
// gs follows, as in the reference.
//
// Compile-time constants: none is set from outside (the launcher passes no defines); kThreads below is fixed.
#include "nvfp4_common.cuh"

using namespace nvfp4;

constexpr int kThreads = 256;

__device__ __forceinline__ void store16_bf16(__nv_bfloat16* __restrict__ p, const float (&v)[16]) {
    u32 w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        w[i] = *reinterpret_cast<const u32*>(&b);
    }
    uint4* q = reinterpret_cast<uint4*>(p);
    q[0] = make_uint4(w[0], w[1], w[2], w[3]);
    q[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// 8 codes of a 32-bit word (element 2j in the low nibble of byte j) -> v[0..7] = code * s64 * g,
// where s64 = 64 * scale (exact) and each element is rounded once (the product with g).
__device__ __forceinline__ void decode8(u32 w, float s64, float g, float* v) {
    float2 f[4];
    e2m1x8_to_float_pairs(w, f);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[2 * j] = __fmul_rn(__fmul_rn(f[j].x, s64), g);
        v[2 * j + 1] = __fmul_rn(__fmul_rn(f[j].y, s64), g);
    }
}

extern "C" __global__ void __launch_bounds__(kThreads)
nvfp4_gather_dequant_bf16(const u8* __restrict__ codes, const u8* __restrict__ sf,
                          const float* __restrict__ gs, i64 gs_stride, int sf_swizzled,
                          i64 n_src_rows, i64 K,
                          const int* __restrict__ idx, i64 row_start, i64 n_out_rows,
                          __nv_bfloat16* __restrict__ out, i64 out_stride,
                          int* __restrict__ bad_count, u32 div_m, u32 div_l) {
    const i64 kb = K >> 4;
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    if ((i64)t >= n_out_rows * kb) return;
    const u32 o32 = fast_div(t, div_m, div_l);   // t / kb
    const i64 o = o32, c = (i64)t - o * kb;
    i64 src;
    if (idx != nullptr) {
        src = (i64)idx[o];
    } else {
        src = row_start + o;
    }
    float v[16];
    if (src >= 0 && src < n_src_rows) {
        const uint2 q = *reinterpret_cast<const uint2*>(codes + src * (K >> 1) + c * 8);
        const u32 sb = sf[sf_swizzled ? sf_swizzled_offset(src, c, round_up(kb, kSfTileCols)) : src * kb + c];
        const float s64 = __fmul_rn(e4m3_to_float(sb), 64.0f);   // exact: a power-of-two scaling of <= 448
        const float g = gs[src * gs_stride];
        decode8(q.x, s64, g, v);
        decode8(q.y, s64, g, v + 8);
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = 0.0f;
        // NOTE: one count per bad output row (from the thread of block 0), not per block.
        if (idx != nullptr && src != -1 && c == 0 && bad_count != nullptr) atomicAdd(bad_count, 1);
    }
    store16_bf16(out + o * out_stride + c * kBlock, v);
}
