// fp8_quantize.cu -- W4A8's activations: rows of x to E4M3 with one fp32 scale per row, bit for bit the reference
// dsv4_nvfp4.gemm.w4a8.ref_quantize_fp8_act(x) (block = 0, pow2 = False; derived in nbs/04e_w4a8.ipynb):
//   s = amax / 448 (fp32 IEEE division); amax == 0 -> 1; a row holding NaN or +-Inf -> s NaN (and so its values)
//   q = e4m3_rne(x / s), |q| saturating at 448 (the reference's clamp); NaN stays NaN
// One CTA per row, two passes over it: the row's amax as the integer max of |x| bits (every NaN pattern is above +Inf,
// so the max propagates it), then the values, 16 per thread step. K % 16 == 0 (the launcher checks).
// Compile-time switches: none.
#include "nvfp4_common.cuh"

using namespace nvfp4;

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ void fp8_rows(const T* __restrict__ x, i64 K, u8* __restrict__ q, float* __restrict__ scale) {
    __shared__ u32 sh[32];
    const i64 r = blockIdx.x;
    const T* __restrict__ xr = x + r * K;
    const i64 nb = K / kBlock;
    u32 m = 0u;
    for (i64 b = threadIdx.x; b < nb; b += blockDim.x) {
        float v[16];
        load16(xr + b * kBlock, v);
#pragma unroll
        for (int i = 0; i < 16; ++i) m = max(m, abs_bits(v[i]));
    }
    const float s = fp8_row_scale(block_max_u32_once(m, sh));
    if (threadIdx.x == 0) scale[r] = s;
    u8* __restrict__ qr = q + r * K;
    for (i64 b = threadIdx.x; b < nb; b += blockDim.x) {
        float v[16];
        load16(xr + b * kBlock, v);
        *reinterpret_cast<uint4*>(qr + b * kBlock) = fp8_pack16(v, s);
    }
}

#define FP8_ROWS_ENTRY_POINT(SUF, T)                                                                           \
    extern "C" __global__ void __launch_bounds__(kThreads)                                                     \
    fp8_quantize_rows_##SUF(const T* __restrict__ x, i64 K, u8* __restrict__ q, float* __restrict__ scale) {   \
        fp8_rows<T>(x, K, q, scale);                                                                           \
    }
FP8_ROWS_ENTRY_POINT(bf16, __nv_bfloat16)
FP8_ROWS_ENTRY_POINT(f16, __half)
FP8_ROWS_ENTRY_POINT(f32, float)
