// nvfp4_decode_gemm.cu -- the grouped GEMM of a decode step (a few rows per expert), streaming the sm90 backend's own
// weight slabs (dsv4_nvfp4.gemm.sm90.tile_weights_sm90: no second copy of the weights) through plain 16-byte loads and
// mma.sync, with no TMA, mbarrier ring or warp specialization to set up. Any arch >= sm_80; compiled for sm_90a and
// sm_100a.
//
// Semantics (normative: dsv4_nvfp4.gemm.reference.ref_grouped_gemm_nvfp4, the Epilogue.BF16 / BF16_ROW_GS kinds):
//   C[r, n] = bf16( (sum_k W_e[n, k] * A[r, k]) * (2^7 * gs_w[e]) * gs_a )   for the rows r of expert e,
// where the rows of expert e are [offsets[e - 1], offsets[e]) (offsets[-1] = 0), W_e's decode is the sm90 mainloop's
// (e2m1 * s * 2^-7, exact in bf16, the same fragment registers), A is bf16, gs_a is one scalar or one per row.
//
// Slab layout (sm90.py): slab (e, m, kt) = 4608 bytes at ((e * MT + m) * KT + kt) * 4608, m a 64-row tile, kt a
// 128-wide K tile; thread t (0-127) of the 64 rows' warpgroup reads 16 bytes at 16 t (K blocks 0-3 of its fragment),
// 2048 + 16 t (blocks 4-7) and 4096 + 16 (t / 4) (its quad's scale word). Warp q of that warpgroup holds rows
// 16 q .. 16 q + 15 in mma.sync m16n8k16's A layout (WGMMA's register A fragment is the same per warp).
//
// Work split: grid (MT, A): CTA (m, a) takes the 64-row tile m of the a-th expert that has rows (A = min(E, R) slots;
// the slots past the last such expert exit). Its 4 warps are the tile's 4 row groups; each streams every K tile of
// its 16 rows through a ring of kStages stages in shared memory (cp.async, kStages - 1 tiles in flight), private to
// the thread (each thread reads back only what it copied: no barrier), with the activation fragments loaded a tile
// ahead, for 8 rows at a time (one n8 MMA tile; more rows take more passes over the weights). Each output is summed by
// one warp in K order: the bits do not depend on timing (no atomics, no split), graph-safe.
//
// Numerics: bf16 products summed in fp32 by the tensor core (m16n8k16), 8 K blocks per tile; not the sm90 WGMMA's
// summation order, so the float64 tolerance of the GEMM tests applies, not bit-identity with the sm90 kernel.
//
// Compile-time switches: none.
#include "nvfp4_common.cuh"

using namespace nvfp4;

constexpr int kSlab = 4608;            // bytes per (64 rows, 128 K) slab
constexpr int kKTile = 128;
constexpr int kWarps = 4;              // 16-row groups per 64-row tile
constexpr int kThreads = 32 * kWarps;
#ifndef DG_STAGES
#define DG_STAGES 5
#endif
constexpr int kStages = DG_STAGES;     // ring depth: per stage 3 x 16 bytes of weights per thread, 8 rows of A
constexpr int kXStride = 2 * kKTile + 16;   // bytes per A row in a stage: 256 + 16 (ldmatrix rows on distinct banks)
constexpr u32 kCodeMask = 0x81C081C0u; // sm90.BF16_CODE_MASK
constexpr float kDecodeScale = 128.0f; // sm90.DECODE_SCALE

__device__ __forceinline__ void cp16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}
// the same, zero-filling the 16 bytes instead (no global read) when !valid
__device__ __forceinline__ void cp16z(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"((u32)__cvta_generic_to_shared(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((u32)__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

__device__ __forceinline__ u32 rotl(u32 w, int s) { return __funnelshift_l(w, w, s); }

__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 4 A registers of K block kb from its code word w and the quad's scale word sc (sm90.DECODE_ROTATIONS
// ((0,), (12,), (2, 6), (2, 8)): register j = mask & XOR of rotl(w, s); times {S_g, S_g} (j even) or {S_g+8, S_g+8}).
__device__ __forceinline__ void decode_kb(u32 w, u32 sc, int kb, u32 (&a)[4]) {
    const u32 s2 = (kb & 1) ? (((sc & 0xFF00FF00u) >> 4) + 0x70007000u) : ((sc & 0x00FF00FFu) * 16u + 0x70007000u);
    const u32 slo = __byte_perm(s2, 0, 0x1010), shi = __byte_perm(s2, 0, 0x3232);
    const u32 r2 = rotl(w, 2);
    a[0] = bf16x2_mul(w & kCodeMask, slo);
    a[1] = bf16x2_mul(rotl(w, 12) & kCodeMask, shi);
    a[2] = bf16x2_mul((r2 ^ rotl(w, 6)) & kCodeMask, slo);
    a[3] = bf16x2_mul((r2 ^ rotl(w, 8)) & kCodeMask, shi);
}

// The rows of the a-th expert (in expert order) that has rows: *e, *start, *cnt (clamped to [0, R]); false past the last.
__device__ __forceinline__ bool nth_active_expert(const int* __restrict__ off, int E, int R, int a, int lane,
                                                  int* e_out, int* start, int* cnt) {
    int acc = 0;
    for (int base = 0; base < E; base += 256) {
        int hi[8], lo[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {       // every load first: one round trip for up to 256 experts
            const int e = base + 32 * i + lane;
            hi[i] = e < E ? __ldg(off + e) : 0;
            lo[i] = (e < E && e > 0) ? __ldg(off + e - 1) : 0;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int l = min(max(lo[i], 0), R), h = min(max(hi[i], l), R);
            const u32 m = __ballot_sync(0xffffffffu, h > l);
            const int n = __popc(m);
            if (a < acc + n) {
                const int src = __fns(m, 0, a - acc + 1);
                *e_out = base + 32 * i + src;
                *start = __shfl_sync(0xffffffffu, l, src);
                *cnt = __shfl_sync(0xffffffffu, h - l, src);
                return true;
            }
            acc += n;
        }
    }
    return false;
}

extern "C" __global__ void __launch_bounds__(kThreads)
nvfp4_decode_gemm_bf16(const u8* __restrict__ slabs,          // the sm90 slabs: (E, MT, KT) x 4608 bytes
                       const __nv_bfloat16* __restrict__ a,   // (R, K) bf16 activations, rows grouped by expert
                       __nv_bfloat16* __restrict__ c,         // (R, N) bf16 out
                       const int* __restrict__ off,           // (E,) int32 inclusive ends of each expert's rows
                       const float* __restrict__ gs_w,        // (E,) fp32
                       const float* __restrict__ gs_a,        // (1,) or (R,) fp32
                       int per_row, int E, int R, int N, int K, int MT, int KT) {
    __shared__ uint4 ring[kStages][3][kThreads];               // this thread's code words (2) and quad scale word
    __shared__ __align__(16) u8 xs[kStages][8 * kXStride];     // the pass's 8 A rows of the stage's K tile (zeros past)
    const int t = threadIdx.x, lane = t & 31, q = t >> 5;
    const int m = blockIdx.x;
    int e, start, cnt;
    if (!nth_active_expert(off, E, R, blockIdx.y, lane, &e, &start, &cnt)) return;   // every warp gets the same answer

    const u8* w = slabs + ((i64)e * MT + m) * KT * kSlab;              // + k * kSlab: K tile k's slab
    const int oc = 16 * t, os = 4096 + 16 * (t / 4);
    const int g = lane >> 2, cc = lane & 3;
    const int xr_ = t >> 4, xc = 8 * (t & 15);                         // the A chunk thread t copies: row, first column
    // ldmatrix row addresses: lanes 8j .. 8j + 7 give rows 0-7 of matrix j = (K block 2i + j / 2, half j % 2)
    const int lrow = lane & 7, lcol = 8 * (lane >> 3);
    const float gw = __fmul_rn(gs_w[e], kDecodeScale);

    for (int p0 = 0; p0 < cnt; p0 += 8) {
        const bool xrow = p0 + xr_ < cnt;
        const __nv_bfloat16* xsrc = a + (i64)(start + (xrow ? p0 + xr_ : 0)) * K + xc;
        auto issue = [&](int k, int s) {
            const u8* p = w + (i64)k * kSlab;
            cp16(&ring[s][0][t], p + oc); cp16(&ring[s][1][t], p + oc + 2048); cp16(&ring[s][2][t], p + os);
            const bool v = xrow && k * kKTile + xc < K;                // K is a multiple of 16: a chunk is wholly in or out
            cp16z(&xs[s][xr_ * kXStride + 2 * xc], v ? xsrc + k * kKTile : a, v);
        };
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < kStages - 1; ++i) { if (i < KT) issue(i, i); cp_commit(); }
        int st = 0, sn = kStages - 1;                                  // the stage of tile k and of tile k + kStages - 1
        for (int k = 0; k < KT; ++k) {
            cp_wait<kStages - 2>();                                    // tile k has landed (this thread's copies) ...
            __syncthreads();                                           // ... and every thread's; tile k - 1 is consumed
            if (k + kStages - 1 < KT) issue(k + kStages - 1, sn);      // into tile k - 1's stage
            cp_commit();
            const uint4 c0 = ring[st][0][t], c1 = ring[st][1][t], sc = ring[st][2][t];
            const u8* xb = &xs[st][lrow * kXStride + 2 * lcol];
            st = st + 1 == kStages ? 0 : st + 1; sn = sn + 1 == kStages ? 0 : sn + 1;
            const u32 cw[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
            const u32 sw[4] = {sc.x, sc.y, sc.z, sc.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 b[4];
                ldsm_x4(b, xb + 2 * 32 * i);                           // K blocks 2i, 2i + 1: {b0, b1} each
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int kb = 2 * i + j;
                    u32 af[4];
                    decode_kb(cw[kb], sw[kb / 2], kb, af);
                    mma_bf16(acc, af, b[2 * j], b[2 * j + 1]);
                }
            }
        }
        // acc i: (weight row g + 8 (i >> 1), token 2 cc + (i & 1)) of this warp's 16 x 8 tile
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int n = m * 64 + 16 * q + g + 8 * (i >> 1);
            const int tk = p0 + 2 * cc + (i & 1);
            if (tk < cnt && n < N) {
                const int row = start + tk;
                const float ga = gs_a[per_row ? row : 0];
                c[(i64)row * N + n] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(acc[i], gw), ga));
            }
        }
        __syncthreads();                                               // the next pass refills every stage
    }
}
