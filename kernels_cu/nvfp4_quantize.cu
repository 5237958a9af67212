// nvfp4_quantize.cu -- NVFP4 quantization of a bf16 / fp16 / fp32 (M, K) matrix on the GPU,
// bit-exact with dsv4_nvfp4.quant.quantize_nvfp4 (the CPU reference). Any arch >= sm_80
// (compiled for sm_90a and sm_100a).
//
// Math (fp32, IEEE round-to-nearest-even everywhere; see nvfp4_common.cuh for the codecs):
//   gs   = amax / 2688; gs == 0 -> 1; gs < 2^-110 -> 2^-110        (per tensor or per row)
//   s_b  = e4m3_rne(min(amax_b / (6*gs), 448))                       (block b = 16 elements of a row)
//   r_b  = 1 / (float(s_b) * gs)
//   q_i  = e2m1_rne(x_i * r_b)  (ties to even code, |.| >= 6 -> 6, sign bit of x_i*r_b), 0 if s_b == 0
//
// Layouts (all contiguous, row-major):
//   x      (M, K)       bf16 / fp16 / fp32, K % 16 == 0 (the launcher rejects other K: the
//                       reference zero-pads, callers pad explicitly), 16-byte aligned
//   codes  (M, K/2)     uint8, element 2i in the low nibble, 2i+1 in the high nibble
//   sf     (M, K/16)    float8_e4m3fn bytes, plain row-major, or
//          (round_up(M,128), round_up(K/16,4)) in the 32_4_4 swizzled layout (cuBLAS/tcgen05):
//          byte ((r/128)*(Cp/4) + c/4)*512 + (r%32)*16 + ((r%128)/32)*4 + c%4.
//          NOTE: the kernels write every byte of the padded swizzled buffer (padding = 0),
//          so the caller may pass torch.empty.
//   gs     fp32, read as gs[r * gs_stride]: gs_stride = 0 for one per-tensor scale, 1 per row.
//
// Entry points (extern "C", one per input dtype suffix _bf16 / _f16 / _f32):
//   nvfp4_fill_u32                 zero the amax accumulator (per-tensor fused mode, step 1)
//   nvfp4_amax_tensor_<dt>         atomicMax of |x| bits into one u32 (step 2), NaN-propagating
//   nvfp4_gs_from_amax_inplace     amax -> gs in place (step 3); the result is the gs tensor
//   nvfp4_quantize_<dt>            quantize with a given gs (step 4, or the given-gs mode)
//   nvfp4_amax_rows_<dt>           per-row amax -> gs for any K (one CTA per row)
//   nvfp4_quantize_rowgs_<dt>      fused per-row amax -> gs -> quantize, one CTA per row, the row
//                                  in registers (X read once from HBM); K <= 16384 (1024 threads x
//                                  16); larger K uses nvfp4_amax_rows_<dt> + nvfp4_quantize_<dt>
// Per-tensor fused mode is 4 launches on one stream (fill, amax, gs, quantize): no host sync, no
// workspace (the gs output buffer doubles as the amax accumulator), CUDA-graph capturable. It reads
// x twice (amax, then quantize): inherent for a tensor-wide scale larger than L2.
//
// Signatures and launch shapes (_draft/kernels.py):
//   nvfp4_fill_u32(u32* p, i64 n, u32 value)                          grid 1, block 32 (n = 1)
//   nvfp4_amax_tensor_<dt>(const T* x, i64 n_elems, u32* amax_bits)   block 256, grid min(ceil(n*sizeof(T)/16
//                                                                     / 1024), 8 * SMs)
//   nvfp4_gs_from_amax_inplace(float* buf, i64 n)                     grid 1, block 32
//   nvfp4_quantize_<dt>(const T* x, i64 M, i64 K, const float* gs, i64 gs_stride, u8* codes, u8* sf,
//                       int swizzle, u32 div_m, u32 div_l)            block 256, grid ceil(R*C/256),
//                                                                     R*C < 2^32, (div_m, div_l) = magic(C)
//   nvfp4_amax_rows_<dt>(const T* x, i64 M, i64 K, float* gs_out)     grid M, block 256
//   nvfp4_quantize_rowgs_<dt>(const T* x, i64 M, i64 K, float* gs_out, u8* codes, u8* sf, int swizzle)
//                                                                     grid M (round_up(M,128) swizzled),
//                                                                     block max(32, round_up(K/16, 32))
#include "nvfp4_common.cuh"
#include "nvfp4_row.cuh"

using namespace nvfp4;

constexpr int kThreads = 256;  // flat kernels: threads per CTA
constexpr int kAmaxUnroll = 4; // amax: 16-byte loads in flight per thread per iteration

// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kThreads)
nvfp4_fill_u32(u32* __restrict__ p, i64 n, u32 value) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = value;
}

// Grid-stride over the n*sizeof(T)/16 vectors; one atomicMax per CTA (grid ~ 8 CTAs per SM).
template <typename T>
__device__ __forceinline__ void amax_tensor(const T* __restrict__ x, i64 n, u32* __restrict__ amax_bits) {
    __shared__ u32 sh[32];
    const uint4* __restrict__ v = reinterpret_cast<const uint4*>(x);
    const i64 nv = n * (i64)sizeof(T) / 16;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 acc = 0u;
    for (; i + (kAmaxUnroll - 1) * stride < nv; i += kAmaxUnroll * stride) {
        uint4 t[kAmaxUnroll];
#pragma unroll
        for (int u = 0; u < kAmaxUnroll; ++u) t[u] = v[i + u * stride];  // all loads issued first
#pragma unroll
        for (int u = 0; u < kAmaxUnroll; ++u) acc = AbsMaxVec<T>::fold(acc, t[u]);
    }
    for (; i < nv; i += stride) acc = AbsMaxVec<T>::fold(acc, v[i]);
    const u32 m = block_max_u32(AbsMaxVec<T>::to_f32_bits(acc), sh);
    if (threadIdx.x == 0 && m != 0u) atomicMax(amax_bits, m);
}

extern "C" __global__ void __launch_bounds__(kThreads)
nvfp4_gs_from_amax_inplace(float* __restrict__ buf, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) buf[i] = gs_from_amax(buf[i]);  // buf holds |x|max as fp32 bits (0 -> gs 1)
}

// One CTA per row, any K (K % 16 == 0): gs_out[r] = gs_from_amax(max |x[r, :]|).
template <typename T>
__device__ __forceinline__ void amax_rows(const T* __restrict__ x, i64 M, i64 K, float* __restrict__ gs_out) {
    __shared__ u32 sh[32];
    const i64 r = blockIdx.x;
    if (r >= M) return;
    const uint4* __restrict__ v = reinterpret_cast<const uint4*>(x + r * K);
    const i64 nv = K * (i64)sizeof(T) / 16;
    u32 acc = 0u;
    for (i64 i = threadIdx.x; i < nv; i += blockDim.x) acc = AbsMaxVec<T>::fold(acc, v[i]);
    const u32 m = block_max_u32(AbsMaxVec<T>::to_f32_bits(acc), sh);
    if (threadIdx.x == 0) gs_out[r] = gs_from_amax(__uint_as_float(m));
}

// ---------------------------------------------------------------------------------------------
// Flat quantize: one thread per 16-element block (32 B bf16/fp16, 64 B fp32 read as 16-byte
// vectors; 8 B of codes + 1 B of scale written). Thread t -> (r, c) = (t / C, t % C) over
// R x C = (M, K/16) plain or (round_up(M,128), round_up(K/16,4)) swizzled; threads outside
// (M, K/16) only write a zero padding scale. R * C < 2^32 (launcher check); t / C uses the
// host-computed magic (div_m, div_l) for C.
// NOTE: a warp reads 32 consecutive blocks = 1-2 KB contiguous; each thread's first 16-byte load
// brings its whole 32-byte sector into L1, so the second load hits L1 (DRAM traffic is exact).
template <typename T>
__device__ __forceinline__ void quantize_flat(const T* __restrict__ x, i64 M, i64 K,
                                              const float* __restrict__ gs, i64 gs_stride,
                                              u8* __restrict__ codes, u8* __restrict__ sf, int swizzle,
                                              u32 div_m, u32 div_l) {
    const i64 kb = K >> 4;
    const u32 R = (u32)(swizzle ? round_up(M, kSfTileRows) : M);
    const u32 C = (u32)(swizzle ? round_up(kb, kSfTileCols) : kb);
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    if ((unsigned long long)t >= (unsigned long long)R * C) return;
    const u32 r32 = fast_div(t, div_m, div_l);
    const i64 r = r32, c = t - r32 * C;
    if (r >= M || c >= kb) {  // only reachable when swizzle != 0
        sf[sf_swizzled_offset(r, c, C)] = 0;
        return;
    }
    float v[16];
    const u32 amax = load16_amax(x + r * K + c * kBlock, v);
    const float g = gs[r * gs_stride];
    u32 lo, hi;
    const u32 sb = quantize_block16(v, amax, g, lo, hi);
    *reinterpret_cast<uint2*>(codes + r * (K >> 1) + c * 8) = make_uint2(lo, hi);
    sf[swizzle ? sf_swizzled_offset(r, c, C) : r * kb + c] = (u8)sb;
}

// ---------------------------------------------------------------------------------------------
#define NVFP4_QUANTIZE_ENTRY_POINTS(SUF, T)                                                             \
    extern "C" __global__ void __launch_bounds__(kThreads)                                              \
    nvfp4_amax_tensor_##SUF(const T* __restrict__ x, i64 n, u32* __restrict__ amax_bits) {              \
        amax_tensor<T>(x, n, amax_bits);                                                                \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kThreads)                                              \
    nvfp4_amax_rows_##SUF(const T* __restrict__ x, i64 M, i64 K, float* __restrict__ gs_out) {          \
        amax_rows<T>(x, M, K, gs_out);                                                                  \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kThreads)                                              \
    nvfp4_quantize_##SUF(const T* __restrict__ x, i64 M, i64 K, const float* __restrict__ gs,           \
                         i64 gs_stride, u8* __restrict__ codes, u8* __restrict__ sf, int swizzle,       \
                         u32 div_m, u32 div_l) {                                                        \
        quantize_flat<T>(x, M, K, gs, gs_stride, codes, sf, swizzle, div_m, div_l);                     \
    }

#define NVFP4_ROWGS_ENTRY_POINT(SUF, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(RowMaxThreads<1>::value)                               \
    nvfp4_quantize_rowgs_##SUF(const T* __restrict__ x, i64 M, i64 K, float* __restrict__ gs_out,       \
                               u8* __restrict__ codes, u8* __restrict__ sf, int swizzle) {              \
        row_quantize<T, 1, kRowPlain>(x, nullptr, 0, M, K, nullptr, 0.0f, 0, nullptr, 0, gs_out,        \
                                      nullptr, codes, sf, swizzle);                                     \
    }

NVFP4_QUANTIZE_ENTRY_POINTS(bf16, __nv_bfloat16)
NVFP4_QUANTIZE_ENTRY_POINTS(f16, __half)
NVFP4_QUANTIZE_ENTRY_POINTS(f32, float)
NVFP4_ROWGS_ENTRY_POINT(bf16, __nv_bfloat16)
NVFP4_ROWGS_ENTRY_POINT(f16, __half)
NVFP4_ROWGS_ENTRY_POINT(f32, float)
