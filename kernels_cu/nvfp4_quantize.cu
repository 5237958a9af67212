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
//                                  in registers (X read once from HBM); K <= 16384 (NB blocks of 16 per
//                                  thread); larger K uses nvfp4_amax_rows_<dt> + nvfp4_quantize_<dt>
// Per-tensor fused mode is 4 launches on one stream (fill, amax, gs, quantize): no host sync, no
// workspace (the gs output buffer doubles as the amax accumulator), CUDA-graph capturable. It reads
// x twice (amax, then quantize): inherent for a tensor-wide scale larger than L2.
//
// Signatures and launch shapes (the launcher: dsv4_nvfp4.quantize_cuda, nbs/03a_quantize_cuda.ipynb):
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
//                                                                     block max(32, round_up(ceil(K/16 / NB), 32)),
//                                                                     NB = 4 (bf16/fp16), 2 (fp32)
//
// Compile-time constants: none is set from outside (the launchers pass no defines): kThreads, kAmaxUnroll and
// NVFP4_ROWGS_NB / _NB32 below are fixed; the flat kernels' register caps (kFlatMinBlocks*) follow __CUDA_ARCH__
// (sm_90 tuning); tests/test_runtime.py compiles both archs.
#include "nvfp4_common.cuh"
#include "nvfp4_row.cuh"

using namespace nvfp4;

constexpr int kThreads = 256;  // flat kernels: threads per CTA
constexpr int kAmaxUnroll = 4; // amax: 16-byte loads in flight per thread per iteration
// Fused per-row kernel: NB 16-blocks per thread (row_quantize's template argument), NVFP4_ROWGS_NB for
// bf16/fp16 and NVFP4_ROWGS_NB32 for fp32 (its registers hold fp32 anyway). The launcher (quantize_nvfp4_cuda,
// per-row branch) uses block = max(32, round_up(ceil(K/16 / NB), 32)) with the same NB (tests/test_runtime.py
// checks the two agree). NB = 4 won on an H200 (bf16 (M, 4096), 1 GB; NB 1/2/4/8: 3.17/3.42/3.75/3.52 TB/s).
#define NVFP4_ROWGS_NB 4     // bf16 / fp16
#define NVFP4_ROWGS_NB32 2   // fp32
// The flat kernels' register caps are tuned on sm_90 (H100/H200); other archs allocate differently (sm_100a would
// spill) and keep the compiler's choice.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ != 900
constexpr int kFlatMinBlocks = 1, kFlatMinBlocksF16 = 1, kFlatMinBlocksF32 = 1;
#else
// bf16: <= 32 registers, 2048 threads per SM (the body needs 33 otherwise); fp16/fp32: <= 40 (6 CTAs)
constexpr int kFlatMinBlocks = 8, kFlatMinBlocksF16 = 6, kFlatMinBlocksF32 = 6;
#endif

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
template <typename T> constexpr int kVec16 = (int)sizeof(T);   // 16-byte vectors per 16-element block

// One 16-block at flat index t: load (returns false for a swizzle padding block, whose scale it zeroes).
template <typename T>
__device__ __forceinline__ bool flat_load(const T* __restrict__ x, u32 M, u32 kb, u32 C, int swizzle, u32 t,
                                          u32 div_m, u32 div_l, u8* __restrict__ sf, i64& blk, i64& so, u32& r,
                                          uint4 (&w)[kVec16<T>]) {
    if (!swizzle) {
        blk = t; so = t;
        r = 0u;
    } else {
        r = fast_div(t, div_m, div_l);
        const u32 c = t - r * C;
        so = sf_swizzled_offset(r, c, C);
        if (r >= M || c >= kb) { sf[so] = 0; return false; }
        blk = (i64)r * kb + c;
    }
    const uint4* q = reinterpret_cast<const uint4*>(x + blk * kBlock);
#pragma unroll
    for (int i = 0; i < kVec16<T>; ++i) w[i] = q[i];
    return true;
}

// Flat quantize: grid-stride over the 16-element blocks t < R x C = (M, K/16) plain or
// (round_up(M,128), round_up(K/16,4)) swizzled, one block per thread per iteration (any grid is correct;
// the launcher gives one thread per block: measured faster than 2 blocks per thread with both loads in
// flight, which needs ~60 registers and halves the resident threads). Block t of the
// plain layout is x[t*16 ..], codes[t*8 ..], sf[t]: no division; the row r = t / C (host magic
// (div_m, div_l)) is only computed for a per-row gs or the swizzled layout. Swizzle padding blocks
// (r >= M or c >= K/16) only write a zero scale. R * C < 2^32 (launcher check).
// NOTE: a warp reads 32 consecutive blocks = 1-2 KB contiguous; each thread's first 16-byte load
// brings its whole 32-byte sector into L1, so the second load hits L1 (DRAM traffic is exact).
template <typename T>
__device__ __forceinline__ void quantize_flat(const T* __restrict__ x, i64 M, i64 K,
                                              const float* __restrict__ gs, i64 gs_stride,
                                              u8* __restrict__ codes, u8* __restrict__ sf, int swizzle,
                                              u32 div_m, u32 div_l) {
    const u32 kb = (u32)(K >> 4);
    const u32 R = (u32)(swizzle ? round_up(M, kSfTileRows) : M);
    const u32 C = swizzle ? (u32)round_up(kb, kSfTileCols) : kb;
    const u32 n = R * C;
    const u32 stride = gridDim.x * blockDim.x;
    const bool per_row = gs_stride != 0;
    const float g0 = gs[0];
    for (u32 t = blockIdx.x * blockDim.x + threadIdx.x; t < n;) {
        uint4 w0[kVec16<T>];
        i64 blk0, so0;
        u32 r0;
        if (flat_load(x, (u32)M, kb, C, swizzle, t, div_m, div_l, sf, blk0, so0, r0, w0)) {
            float v0[16];
            const u32 am0 = unpack16_amax<T>(w0, v0);
            const float g = per_row ? gs[(i64)(swizzle ? r0 : fast_div(t, div_m, div_l)) * gs_stride] : g0;
            u32 lo, hi;
            const u32 sb = quantize_block16(v0, am0, g, lo, hi);
            *reinterpret_cast<uint2*>(codes + blk0 * 8) = make_uint2(lo, hi);
            sf[so0] = (u8)sb;
        }
        if (stride >= n - t) break;   // (never wraps around 2^32)
        t += stride;
    }
}

// ---------------------------------------------------------------------------------------------
#define NVFP4_QUANTIZE_ENTRY_POINTS(SUF, T, QMINB)                                                             \
    extern "C" __global__ void __launch_bounds__(kThreads)                                              \
    nvfp4_amax_tensor_##SUF(const T* __restrict__ x, i64 n, u32* __restrict__ amax_bits) {              \
        amax_tensor<T>(x, n, amax_bits);                                                                \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kThreads)                                              \
    nvfp4_amax_rows_##SUF(const T* __restrict__ x, i64 M, i64 K, float* __restrict__ gs_out) {          \
        amax_rows<T>(x, M, K, gs_out);                                                                  \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(kThreads, QMINB)                                              \
    nvfp4_quantize_##SUF(const T* __restrict__ x, i64 M, i64 K, const float* __restrict__ gs,           \
                         i64 gs_stride, u8* __restrict__ codes, u8* __restrict__ sf, int swizzle,       \
                         u32 div_m, u32 div_l) {                                                        \
        quantize_flat<T>(x, M, K, gs, gs_stride, codes, sf, swizzle, div_m, div_l);                     \
    }

#define NVFP4_ROWGS_ENTRY_POINT(SUF, T, BOUNDS, NB)                                                     \
    extern "C" __global__ void BOUNDS                                                                   \
    nvfp4_quantize_rowgs_##SUF(const T* __restrict__ x, i64 M, i64 K, float* __restrict__ gs_out,       \
                               u8* __restrict__ codes, u8* __restrict__ sf, int swizzle) {              \
        if constexpr (sizeof(T) == 2 && NB > 1)                                                         \
            row_quantize_raw<T, NB, kRowPlain, false>(x, M, K, nullptr, 0.0f, 0, nullptr, 0, gs_out,        \
                                                      nullptr, codes, sf, swizzle);                     \
        else                                                                                            \
            row_quantize<T, NB, kRowPlain>(x, nullptr, 0, M, K, nullptr, 0.0f, 0, nullptr, 0, gs_out,    \
                                          nullptr, codes, sf, swizzle);                                 \
    }

NVFP4_QUANTIZE_ENTRY_POINTS(bf16, __nv_bfloat16, kFlatMinBlocks)
NVFP4_QUANTIZE_ENTRY_POINTS(f16, __half, kFlatMinBlocksF16)
NVFP4_QUANTIZE_ENTRY_POINTS(f32, float, kFlatMinBlocksF32)
NVFP4_ROWGS_ENTRY_POINT(bf16, __nv_bfloat16, __launch_bounds__(RowMaxThreads<NVFP4_ROWGS_NB>::value), NVFP4_ROWGS_NB)
NVFP4_ROWGS_ENTRY_POINT(f16, __half, __launch_bounds__(RowMaxThreads<NVFP4_ROWGS_NB>::value), NVFP4_ROWGS_NB)
NVFP4_ROWGS_ENTRY_POINT(f32, float, __launch_bounds__(RowMaxThreads<NVFP4_ROWGS_NB32>::value), NVFP4_ROWGS_NB32)
