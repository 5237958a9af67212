// nvfp4_sparse_attn.cu -- DeepSeek-V4 sparse attention for one decode query per sequence, reading the NVFP4 KV pool
// directly: no bf16 copy of the selected entries is written to memory. Any arch >= sm_80 (mma.sync, ldmatrix);
// compiled for sm_90a and sm_100a.
//
// Semantics (normative: dsv4_nvfp4.attention.ref_sparse_attention, notebook 07b): for sequence b, the slots are the
// window rows 0 .. W-1 (valid while j < wlen[b]) followed by the K pool slots idx[b, 0 .. K-1] (valid when
// 0 <= idx < cap; -1 pads, anything else is counted in *bad when bad != nullptr and never read). Every head of the
// query reads the same 512-wide latent as key and value:
//   s[h, j] = (q[h] . kv_hat[j]) * (gs[j] * scale)        kv_hat: e2m1 * block scale (exact in bf16), gs: the entry's
//                                                            fp32 global scale (1 for window rows)
//   out[h]  = sum_j softmax_j(s[h, :] with the sink logit in the denominator) * gs[j] * kv_hat[j]
// A sequence with no valid slot gives zeros; a NaN in a slot reaches only its own sequence's outputs.
//
// Numerics: q and kv_hat are bf16 MMA operands (kv_hat exactly: at most 6 significant bits); scores and the softmax
// state are fp32; the global scale stays out of the operands (on the fp32 score, and on p before p * gs is rounded to
// bf16 as the second MMA's operand), the choice notebook 07b's accuracy table makes.
//
// Work split (flash-decoding): grid (nsplit, H / 16, B); CTA (split, hg, b) takes heads 16 hg .. 16 hg + 15 of
// sequence b over slots [split * chunk, min(S, (split + 1) * chunk)), S = W + K, in tiles of 32 slots decoded into
// shared memory. Its 4 warps split the 512 dims: warp w owns dims 128 w .. 128 w + 127 for both products, so the
// scores are summed from the 4 warps' partial dot products through shared memory in a fixed order (every warp gets the
// same bits, so all four keep the same softmax state). nvfp4_sparse_attn_combine merges the splits in split order:
// the result does not depend on timing (run-to-run bit-identical, graph-replay safe: no atomics on data).
//
// Two more kernels write the same partials for H a multiple of 64, a CTA per 64 heads: nvfp4_sparse_attn_partial64
// (mma.sync, 8 warps, any arch) and nvfp4_sparse_attn_wg (Hopper's warpgroup MMA, sm_90a only: it traps elsewhere).
// dsv4_nvfp4.attention.attn_kernel picks one of the three per step.
//
// Partials: o_part (B, nsplit, H, 512) fp32 (unnormalized, relative to m), ml_part (B, nsplit, H, 2) fp32 (m, l).
// chunk is a multiple of 32 (the launcher gives nvfp4_sparse_attn_wg whole 64-slot tiles; it reads no slot past the
// chunk either way); H a multiple of 16; K >= 0, W >= 0, W + K >= 1; q, win, out rows 16-byte aligned.
//
// Compile-time switches: none.
#include "nvfp4_common.cuh"

using namespace nvfp4;

constexpr int kD = 512;               // latent width (DSV4)
#define kInf __int_as_float(0x7f800000)
constexpr int kHT = 16;               // heads per CTA: one m16 tile
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kDW = kD / kWarps;      // dims per warp (128)
constexpr int kTS = 32;               // slots per tile
constexpr int kTPT = kTS / kWarps;     // tile slots per warp (8): the tasks of one thread, 16 dims of one slot each
constexpr int kRow = kD + 8;          // shared row stride in bf16: 1040 B, so 8 ldmatrix rows hit 8 distinct 16-byte bank groups

struct __align__(16) SmemAttn {
    __nv_bfloat16 kv[kTS][kRow];      // the tile's 32 latents (kv_hat), zero rows for invalid slots
    float part[kWarps][kHT][kTS + 8]; // each warp's partial scores over its 128 dims (rows padded: 2-way, not 8-way, bank conflicts)
    float gsv[kTS];                   // gs of each slot (0 for invalid slots)
    int ok[kTS];                      // slot valid
};

__device__ __forceinline__ u32 ld_u32(const __nv_bfloat16* p) { return *reinterpret_cast<const u32*>(p); }

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&b);
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], const void* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// 8 E2M1 codes of a word (element 2i in the low nibble of byte i) times the block scale, as 4 bf16x2 words (exact:
// e2m1x8_to_float_pairs gives code * 2^-6 exactly; times 64 * s is at most 6 significant bits).
__device__ __forceinline__ void decode8_bf16(u32 w, float s64, u32* o) {
    float2 f[4];
    e2m1x8_to_float_pairs(w, f);
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = pack_bf16(__fmul_rn(f[j].x, s64), __fmul_rn(f[j].y, s64));
}
// A 16-block (16 codes, its E4M3 scale byte) as 8 bf16x2 words, exact.
__device__ __forceinline__ void decode16_bf16(uint2 cw, u32 sb, u32 (&o)[8]) {
    const float s64 = __fmul_rn(e4m3_to_float(sb), 64.0f);
    decode8_bf16(cw.x, s64, o);
    decode8_bf16(cw.y, s64, o + 4);
}


// ---- the pieces the partial kernels share (store_tile / load_raw: the mma.sync ones, NW warps, NT = 32 / NW tile slots
// per thread) ----------------------------------------------------------------------------------------------------------

// The pool slot tile slot j of sequence b names: -1 for window slots and past the split's end.
__device__ __forceinline__ int pool_index(const int* __restrict__ idx, i64 b, int K, int W, int j1, int j) {
    return (j >= W && j < j1) ? idx[b * K + (j - W)] : -1;
}

// A tile's pool rows into registers: codes (16 E2M1 of block `lane`), scale byte, global scale; zeros for e outside the pool.
template <int NT>
__device__ __forceinline__ void load_raw(const int (&e)[NT], uint2 (&cw)[NT], u32 (&sb)[NT], float (&gv)[NT],
                                         const u8* __restrict__ codes, const u8* __restrict__ sf,
                                         const float* __restrict__ gs, i64 cap, int lane) {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        const int ei = e[i];
        cw[i] = make_uint2(0, 0); sb[i] = 0; gv[i] = 0.0f;
        if (ei >= 0 && (i64)ei < cap) {
            cw[i] = *reinterpret_cast<const uint2*>(codes + (i64)ei * (kD / 2) + lane * 8);
            sb[i] = sf[(i64)ei * (kD / 16) + lane];
            gv[i] = gs[ei];
        }
    }
}

// Store the tile starting at slot `base` (thread task i: slot warp + NW i, 16-dim block `lane`): window rows by cp.async,
// pool rows decoded from the registers, zero rows for the rest; gsv / ok per slot. With `count` (one CTA per
// (sequence, slot) sets it) *bad counts the indices outside [-1, cap). Returns whether cp.async copies are in flight.
template <int NW, int NT>
__device__ __forceinline__ bool store_tile(__nv_bfloat16 (*kv)[kRow], float* gsv, int* okv, int warp, int lane, int base,
                                           int j1, int W, int wl, const __nv_bfloat16* __restrict__ win, i64 b,
                                           const int (&e)[NT], const uint2 (&cw)[NT], const u32 (&sb)[NT],
                                           const float (&gv)[NT], i64 cap, int* bad, bool count) {
    bool async = false;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        const int s = warp + NW * i, j = base + s;
        __nv_bfloat16* dst = &kv[s][lane * 16];
        float gj = 0.0f;
        int ok = 0;
        if (j < j1 && j < W) {
            if (j < wl) {
                const __nv_bfloat16* src = win + (b * W + j) * kD + lane * 16;
                const u32 d = (u32)__cvta_generic_to_shared(dst);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(d), "l"(src));
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(d + 16), "l"(src + 8));
                async = true; gj = 1.0f; ok = 1;
            }
        } else if (j < j1 && e[i] >= 0 && (i64)e[i] < cap) {
            u32 w8[8];
            decode16_bf16(cw[i], sb[i], w8);
            uint4* d = reinterpret_cast<uint4*>(dst);
            d[0] = make_uint4(w8[0], w8[1], w8[2], w8[3]); d[1] = make_uint4(w8[4], w8[5], w8[6], w8[7]);
            gj = gv[i]; ok = 1;
        } else if (j < j1 && j >= W && e[i] != -1 && count && lane == 0) {
            atomicAdd(bad, 1);
        }
        if (!ok) {
            uint4* d = reinterpret_cast<uint4*>(dst);
            d[0] = make_uint4(0, 0, 0, 0); d[1] = make_uint4(0, 0, 0, 0);
        }
        if (lane == 0) { gsv[s] = gj; okv[s] = ok; }
    }
    return async;
}

// exp(x) as __expf computes it (x * log2 e rounded, then the hardware's 2^y), but with the result flushed to zero below
// 2^-126 instead of computed as a subnormal: __expf's own subnormal path costs three more instructions per call (a
// compare and two predicated multiplies). A p that small adds nothing to l (>= 1 after the row's max) and less than
// 2^-100 of the row's largest term to o; an output element whose every larger term is zero (kv_hat[d] = 0) can keep
// such a subnormal contribution with __expf and be zero here.
__device__ __forceinline__ float exp_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(__fmul_rn(x, 1.4426950216293334961f)));
    return y;
}

// The online softmax of one tile of 8 NB slots for rows g, g + 8 of a 16-head tile, from the raw scores `sv` (q . kv_hat,
// fp32, in the C-fragment layout of NB n8 tiles: sv[n][0..1] row g, sv[n][2..3] row g + 8, columns 8 n + 2 t, + 1):
// times gs * scale, -inf for invalid slots; the running max m_r and this thread's share of the denominators l_r
// updated; alpha, the factor o must be scaled by; P (exp_ftz, times each slot's gs) packed as the A fragments of the P . kv MMA
// (k steps of 16 slots).
template <int NB>
__device__ __forceinline__ void online_softmax(float (&sv)[NB][4], const float* gsv, const int* okv, float scale, int t,
                                               float (&m_r)[2], float (&l_r)[2], float (&alpha)[2], u32 (&pa)[NB / 2][4]) {
    float mx[2] = {m_r[0], m_r[1]};
    // columns 8 n + 2 t and + 1 of each n tile: their validity and global scale, one 8-byte load each, once
    int2 ok[NB];
    float2 gv[NB];
#pragma unroll
    for (int n = 0; n < NB; ++n) {
        ok[n] = *reinterpret_cast<const int2*>(okv + 8 * n + 2 * t);
        gv[n] = *reinterpret_cast<const float2*>(gsv + 8 * n + 2 * t);
    }
#pragma unroll
    for (int n = 0; n < NB; ++n) {
        const float f0 = __fmul_rn(gv[n].x, scale), f1 = __fmul_rn(gv[n].y, scale);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            sv[n][2 * h] = ok[n].x ? __fmul_rn(sv[n][2 * h], f0) : -kInf;
            sv[n][2 * h + 1] = ok[n].y ? __fmul_rn(sv[n][2 * h + 1], f1) : -kInf;
            mx[h] = fmaxf(mx[h], fmaxf(sv[n][2 * h], sv[n][2 * h + 1]));
        }
    }
    float mref[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        mref[r] = (mx[r] == -kInf) ? 0.0f : mx[r];                 // never -inf: no (-inf) - (-inf)
        alpha[r] = __expf(m_r[r] - mref[r]);                           // m_r = -inf -> 0 (o and l are 0 then)
        m_r[r] = mx[r];
        l_r[r] *= alpha[r];
    }
#pragma unroll
    for (int n = 0; n < NB; ++n) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            p[e] = exp_ftz(sv[n][e] - mref[e >> 1]);    // invalid: exp(-inf) = 0; a NaN score stays NaN
            l_r[e >> 1] += p[e];
            p[e] = __fmul_rn(p[e], (e & 1) ? gv[n].y : gv[n].x);         // the entry's global scale, on p
        }
        // C fragment of n tile n -> A fragment of k step n / 2 (slots 16 (n/2) ..): registers (n & 1) * 2 + {0, 1}
        pa[n >> 1][(n & 1) * 2 + 0] = pack_bf16(p[0], p[1]);
        pa[n >> 1][(n & 1) * 2 + 1] = pack_bf16(p[2], p[3]);
    }
}

// The scores of a 32-slot tile from the NP partials part[0 .. NP-1] summed in that order (the same bits in every warp
// that sums them), then `online_softmax`.
template <int NP>
__device__ __forceinline__ void softmax_tile(const float (*part)[kHT][kTS + 8], const float* gsv, const int* okv, float scale,
                                             int g, int t, float (&m_r)[2], float (&l_r)[2], float (&alpha)[2],
                                             u32 (&pa)[2][4]) {
    float sv[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {                   // row g + 8 h, columns 8 n + 2 t and + 1: one 8-byte read per partial
            const int row = g + 8 * h, col = 8 * n + 2 * t;
            float2 a = *reinterpret_cast<const float2*>(&part[0][row][col]);
#pragma unroll
            for (int w = 1; w < NP; ++w) {
                const float2 x = *reinterpret_cast<const float2*>(&part[w][row][col]);
                a.x = __fadd_rn(a.x, x.x); a.y = __fadd_rn(a.y, x.y);
            }
            sv[n][2 * h] = a.x; sv[n][2 * h + 1] = a.y;
        }
    }
    online_softmax<4>(sv, gsv, okv, scale, t, m_r, l_r, alpha, pa);
}

// o (16 heads x 8 N dims from dim0) += P (16 x 32 slots) . kv (32 slots x those dims)
template <int N>
__device__ __forceinline__ void pv_mma(float (&o)[N][4], const u32 (&pa)[2][4], __nv_bfloat16 (*kv)[kRow], int dim0,
                                       int mat, int mr) {
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
#pragma unroll
        for (int np = 0; np < N / 2; ++np) {        // dim tiles 2np, 2np + 1: matrices (slots 16ks + 0..7 | 8..15) x 2 tiles
            u32 r[4];
            ldsm_x4_t(r, &kv[16 * ks + (mat & 1) * 8 + mr][dim0 + 8 * (2 * np + (mat >> 1))]);
            mma_bf16(o[2 * np], pa[ks], r[0], r[1]);
            mma_bf16(o[2 * np + 1], pa[ks], r[2], r[3]);
        }
    }
}

// A split's partials for rows row0 + g, + 8 and dims dim0 .. dim0 + 8 N - 1: o relative to m, and (m, l) where `ml`
// (one thread per row quad: l summed over the quad here).
template <int N>
__device__ __forceinline__ void store_partials(const float (&o)[N][4], const float (&m_r)[2], float (&l_r)[2], i64 row0,
                                               int dim0, int g, int t, bool ml, float* __restrict__ o_part,
                                               float* __restrict__ ml_part) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
        l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
    }
#pragma unroll
    for (int n = 0; n < N; ++n) {
        const int d = dim0 + 8 * n + 2 * t;
        *reinterpret_cast<float2*>(o_part + (row0 + g) * kD + d) = make_float2(o[n][0], o[n][1]);
        *reinterpret_cast<float2*>(o_part + (row0 + g + 8) * kD + d) = make_float2(o[n][2], o[n][3]);
    }
    if (ml && t == 0) {
        *reinterpret_cast<float2*>(ml_part + (row0 + g) * 2) = make_float2(m_r[0], l_r[0]);
        *reinterpret_cast<float2*>(ml_part + (row0 + g + 8) * 2) = make_float2(m_r[1], l_r[1]);
    }
}

extern "C" __global__ void __launch_bounds__(kThreads)
nvfp4_sparse_attn_partial(const __nv_bfloat16* __restrict__ q,      // (B, H, 512) bf16
                          const __nv_bfloat16* __restrict__ win,    // (B, W, 512) bf16 window rows (unused when W == 0)
                          const int* __restrict__ wlen,             // (B,) valid window rows
                          int W,
                          const u8* __restrict__ codes,             // (cap, 256) the pool's E2M1 codes
                          const u8* __restrict__ sf,                // (cap, 32) its E4M3 block scales
                          const float* __restrict__ gs,             // (cap,) its global scales
                          i64 cap,
                          const int* __restrict__ idx,              // (B, K) pool slots, -1: none
                          int K, int H, float scale, int chunk,
                          float* __restrict__ o_part,               // (B, nsplit, H, 512)
                          float* __restrict__ ml_part,              // (B, nsplit, H, 2)
                          int* __restrict__ bad) {                  // nullable: += indices outside [-1, cap)
    __shared__ SmemAttn sm;
    const int split = blockIdx.x, hg = blockIdx.y, b = blockIdx.z, nsplit = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int S = W + K;
    const int j0 = split * chunk, j1 = min(S, j0 + chunk);
    const int wl = W > 0 ? min(max(wlen[b], 0), W) : 0;   // wlen is not read without a window
    const int h0 = hg * kHT;

    // This warp's A fragments of q: rows h0 + g and h0 + g + 8, its 128 dims in 8 k16 steps.
    u32 qa[8][4];
    {
        const __nv_bfloat16* qb = q + ((i64)b * H + h0) * kD + warp * kDW;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            qa[kk][0] = ld_u32(qb + g * kD + kk * 16 + 2 * t);
            qa[kk][1] = ld_u32(qb + (g + 8) * kD + kk * 16 + 2 * t);
            qa[kk][2] = ld_u32(qb + g * kD + kk * 16 + 8 + 2 * t);
            qa[kk][3] = ld_u32(qb + (g + 8) * kD + kk * 16 + 8 + 2 * t);
        }
    }
    float o[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_r[2] = {-kInf, -kInf};   // running max of rows g, g + 8 (-inf: nothing valid yet)
    float l_r[2] = {0.0f, 0.0f};             // this thread's share of the running denominators (its columns)
    const int mat = lane >> 3, mr = lane & 7;

    // The tile pipeline: the pool rows of the next tile are loaded into registers (codes, scale byte, global scale)
    // while this tile computes, and their indices one tile earlier still, so no load waits on another inside the loop.
    // Window rows (bf16 already) go straight to shared memory by cp.async when their tile is stored.
    // Thread task i (0..7) of a tile: slot warp + 4 i, 16-block `lane`.
    int e_cur[kTPT], e_nxt[kTPT];
    uint2 cw[kTPT];
    u32 sb[kTPT];
    float gv[kTPT];
#pragma unroll
    for (int i = 0; i < kTPT; ++i) {
        e_cur[i] = pool_index(idx, b, K, W, j1, j0 + warp + kWarps * i);
        e_nxt[i] = pool_index(idx, b, K, W, j1, j0 + kTS + warp + kWarps * i);
    }
    load_raw(e_cur, cw, sb, gv, codes, sf, gs, cap, lane);
    const bool count = bad != nullptr && hg == 0;   // once per (sequence, slot): one split owns it, head group 0 counts

    for (int base = j0; base < j1; base += kTS) {
        if (store_tile<kWarps>(sm.kv, sm.gsv, sm.ok, warp, lane, base, j1, W, wl, win, b, e_cur, cw, sb, gv, cap, bad, count))
            asm volatile("cp.async.wait_all;\n" ::: "memory");
        __syncthreads();
        // ---- the next tile's pool rows into registers, the one after's indices: in flight while this tile computes
        if (base + kTS < j1) {
#pragma unroll
            for (int i = 0; i < kTPT; ++i) {
                e_cur[i] = e_nxt[i];
                e_nxt[i] = pool_index(idx, b, K, W, j1, base + 2 * kTS + warp + kWarps * i);
            }
            load_raw(e_cur, cw, sb, gv, codes, sf, gs, cap, lane);
        }

        // ---- partial scores: S_w (16 heads x 32 slots) over this warp's 128 dims
        float sacc[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n) sacc[n][0] = sacc[n][1] = sacc[n][2] = sacc[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
            for (int np = 0; np < 2; ++np) {        // n tiles 2np, 2np + 1: matrices (slots 8n.., dims +0..7 | +8..15)
                u32 r[4];
                ldsm_x4(r, &sm.kv[8 * (2 * np + (mat >> 1)) + mr][warp * kDW + kk * 16 + (mat & 1) * 8]);
                mma_bf16(sacc[2 * np], qa[kk], r[0], r[1]);
                mma_bf16(sacc[2 * np + 1], qa[kk], r[2], r[3]);
            }
        }
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            *reinterpret_cast<float2*>(&sm.part[warp][g][8 * n + 2 * t]) = make_float2(sacc[n][0], sacc[n][1]);
            *reinterpret_cast<float2*>(&sm.part[warp][g + 8][8 * n + 2 * t]) = make_float2(sacc[n][2], sacc[n][3]);
        }
        __syncthreads();

        // ---- the full scores (the four partials in warp order: the same bits in every warp), online softmax
        float alpha[2];
        u32 pa[2][4];
        softmax_tile<kWarps>(sm.part, sm.gsv, sm.ok, scale, g, t, m_r, l_r, alpha, pa);
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            o[n][0] *= alpha[0]; o[n][1] *= alpha[0]; o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
        }
        // ---- o (16 heads x this warp's 128 dims) += P (16 x 32 slots) . kv (32 slots x 128 dims)
        pv_mma(o, pa, sm.kv, warp * kDW, mat, mr);
        __syncthreads();                           // the tile and the partials are rewritten next
    }

    // ---- the split's partials: o relative to m, the quad's l
    store_partials(o, m_r, l_r, ((i64)b * nsplit + split) * H + h0, warp * kDW, g, t, warp == 0, o_part, ml_part);
}

// ---------------------------------------------------------------------------------------------------------------------
// nvfp4_sparse_attn_partial64: the same partials for H a multiple of 64, a CTA per 64 heads, so each tile of entries is
// decoded once for 64 heads (the 16-head kernel above decodes it once per 16). grid (nsplit, H / 64, B), 256 threads,
// dynamic shared memory sizeof(SmemAttn64) (the launcher opts in above 48 KB). Warp w takes heads 16 (w / 2) .. + 15
// of the CTA's 64 and dims 256 (w % 2) .. + 255 for both products: its o is 16 x 256 fp32 (128 registers a thread),
// q comes from shared memory by ldmatrix. The two warps of a head tile sum their partial scores through shared memory
// in dim-half order (a named barrier for the pair), so both keep the same softmax state. The slots, the validity
// rules, the scales on the fp32 scores and on p, the partials' layout and the fixed merge order are the 16-head
// kernel's; only the dims' split of the score sums differs (two halves of 256, not four quarters of 128).
constexpr int kHT64 = 64;                       // heads per CTA
constexpr int kWarps64 = 8;
constexpr int kThreads64 = 32 * kWarps64;
constexpr int kDW64 = kD / 2;                   // dims per warp (256)
constexpr int kTPT64 = kTS / kWarps64;          // tile slots per warp (4): the tasks of one thread, 16 dims of one slot each

struct __align__(16) SmemAttn64 {
    __nv_bfloat16 q[kHT64][kRow];               // the CTA's 64 query rows (1040-byte stride: ldmatrix without conflicts)
    __nv_bfloat16 kv[kTS][kRow];                // the tile's 32 latents (kv_hat), zero rows for invalid slots
    float part[kWarps64][kHT][kTS + 8];         // each warp's partial scores over its 256 dims
    float gsv[kTS];
    int ok[kTS];
};
// the launcher's dynamic shared memory (dsv4_nvfp4.attention.ATTN64_SMEM) is this size
static_assert(sizeof(SmemAttn64) == 120576, "SmemAttn64 changed: update dsv4_nvfp4.attention.ATTN64_SMEM");

extern "C" __global__ void __launch_bounds__(kThreads64, 1)
nvfp4_sparse_attn_partial64(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ win,
                            const int* __restrict__ wlen, int W, const u8* __restrict__ codes, const u8* __restrict__ sf,
                            const float* __restrict__ gs, i64 cap, const int* __restrict__ idx, int K, int H, float scale,
                            int chunk, float* __restrict__ o_part, float* __restrict__ ml_part, int* __restrict__ bad) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    SmemAttn64& sm = *reinterpret_cast<SmemAttn64*>(smem_raw);
    const int split = blockIdx.x, hb = blockIdx.y, b = blockIdx.z, nsplit = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int hg = warp >> 1, dh = warp & 1;    // head tile (16 heads) and dim half of this warp
    const int S = W + K;
    const int j0 = split * chunk, j1 = min(S, j0 + chunk);
    const int wl = W > 0 ? min(max(wlen[b], 0), W) : 0;
    const int h0 = hb * kHT64;

    // the CTA's 64 query rows into shared memory (16-byte copies; visible after the first tile's barrier)
    {
        const __nv_bfloat16* qb = q + ((i64)b * H + h0) * kD;
        for (int c = threadIdx.x; c < kHT64 * (kD / 8); c += kThreads64) {
            const int r = c / (kD / 8), col = (c % (kD / 8)) * 8;
            *reinterpret_cast<uint4*>(&sm.q[r][col]) = *reinterpret_cast<const uint4*>(qb + (i64)r * kD + col);
        }
    }
    float o[32][4];
#pragma unroll
    for (int n = 0; n < 32; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_r[2] = {-kInf, -kInf};
    float l_r[2] = {0.0f, 0.0f};
    const int mat = lane >> 3, mr = lane & 7;

    // the 16-head kernel's tile pipeline, thread task i: slot warp + 8 i, 16-block `lane`
    int e_cur[kTPT64], e_nxt[kTPT64];
    uint2 cw[kTPT64];
    u32 sb[kTPT64];
    float gv[kTPT64];
#pragma unroll
    for (int i = 0; i < kTPT64; ++i) {
        e_cur[i] = pool_index(idx, b, K, W, j1, j0 + warp + kWarps64 * i);
        e_nxt[i] = pool_index(idx, b, K, W, j1, j0 + kTS + warp + kWarps64 * i);
    }
    load_raw(e_cur, cw, sb, gv, codes, sf, gs, cap, lane);
    const bool count = bad != nullptr && hb == 0;   // once per (sequence, slot): head block 0 counts

    for (int base = j0; base < j1; base += kTS) {
        if (store_tile<kWarps64>(sm.kv, sm.gsv, sm.ok, warp, lane, base, j1, W, wl, win, b, e_cur, cw, sb, gv, cap, bad, count))
            asm volatile("cp.async.wait_all;\n" ::: "memory");
        __syncthreads();
        if (base + kTS < j1) {
#pragma unroll
            for (int i = 0; i < kTPT64; ++i) {
                e_cur[i] = e_nxt[i];
                e_nxt[i] = pool_index(idx, b, K, W, j1, base + 2 * kTS + warp + kWarps64 * i);
            }
            load_raw(e_cur, cw, sb, gv, codes, sf, gs, cap, lane);
        }

        // ---- partial scores: 16 heads x 32 slots over this warp's 256 dims; q's A fragments by ldmatrix
        float sacc[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n) sacc[n][0] = sacc[n][1] = sacc[n][2] = sacc[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < kDW64 / 16; ++kk) {
            u32 qa[4];                               // rows 16 hg + (lane & 15), dims + 8 (lane >> 4): a0..a3 in MMA order
            ldsm_x4(qa, &sm.q[kHT * hg + (lane & 15)][dh * kDW64 + kk * 16 + (lane >> 4) * 8]);
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                u32 r[4];
                ldsm_x4(r, &sm.kv[8 * (2 * np + (mat >> 1)) + mr][dh * kDW64 + kk * 16 + (mat & 1) * 8]);
                mma_bf16(sacc[2 * np], qa, r[0], r[1]);
                mma_bf16(sacc[2 * np + 1], qa, r[2], r[3]);
            }
        }
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            *reinterpret_cast<float2*>(&sm.part[warp][g][8 * n + 2 * t]) = make_float2(sacc[n][0], sacc[n][1]);
            *reinterpret_cast<float2*>(&sm.part[warp][g + 8][8 * n + 2 * t]) = make_float2(sacc[n][2], sacc[n][3]);
        }
        asm volatile("bar.sync %0, 64;\n" :: "r"(1 + hg) : "memory");   // the head tile's two warps: partials written

        // ---- the full scores (dim half 0, then 1: the same bits in both warps), online softmax
        float alpha[2];
        u32 pa[2][4];
        softmax_tile<2>(sm.part + 2 * hg, sm.gsv, sm.ok, scale, g, t, m_r, l_r, alpha, pa);
        // o *= alpha, skipped where every alpha of the warp is exactly 1 (the same bits: x * 1 = x, NaN included)
        if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
            for (int n = 0; n < 32; ++n) {
                o[n][0] *= alpha[0]; o[n][1] *= alpha[0]; o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
            }
        }
        // ---- o (16 heads x this warp's 256 dims) += P (16 x 32 slots) . kv (32 slots x 256 dims)
        pv_mma(o, pa, sm.kv, dh * kDW64, mat, mr);
        __syncthreads();                           // the tile and the partials are rewritten next
    }

    store_partials(o, m_r, l_r, ((i64)b * nsplit + split) * H + h0 + kHT * hg, dh * kDW64, g, t, dh == 0, o_part, ml_part);
}

// ---------------------------------------------------------------------------------------------------------------------
// nvfp4_sparse_attn_wg: the 64-head partials on Hopper's warpgroup MMA (sm_90a; elsewhere the kernel traps and the
// launcher never picks it). grid (nsplit, H / 64, B), 256 threads (two warpgroups), dynamic shared memory kWgSmem.
// Tiles of 64 slots, decoded into shared memory in the 128-byte-swizzled layout the MMA reads (a row of 64 dims is
// 128 bytes, its eight 16-byte chunks XOR-ed with the row's index mod 8; the 512 dims are 8 such blocks of rows), and
// double-buffered: the tile after this one is decoded while this one's score MMAs run. Warpgroup c takes dims
// 256 c .. + 255 for both products: S_c = Q[:, dims] . KV[:, dims]^T (64 heads x 64 slots, wgmma m64n64k16, q and kv
// from shared memory, both K-major). Warp w of warpgroup c holds heads 16 (w % 4) .. + 15 of S_c; of the two warps that
// hold a head tile, one (the owner: warps 0, 1, 6, 7, one on each scheduler) adds the other's half, read from shared
// memory thread by thread (the same thread of each holds the same elements), runs the online softmax of the 16-head
// kernels on the register fragments and hands P and the rescale factors back to its partner through shared memory
// (a named barrier per pair of warps); the owner keeps the pair's (m, l). Then
// O_c += P . KV[:, dims] (64 x 256, wgmma m64n256k16, P from registers as the A operand, kv read MN-major from the same
// tile). The slots, the validity rules, the scales and the partials' layout are the other kernels'; the products' sums
// run in the tensor cores' own order (not bit-identical to the mma.sync kernels; each within the reference tolerance).
constexpr int kWTS = 64;                                  // slots per tile
constexpr int kWThreads = 256;
constexpr int kWBlk = 64 * 128;                           // bytes of one 64-dim block of 64 rows (q: heads, kv: slots)
// the window, from its 1024-aligned base: q (8 blocks of 64 heads) at 0, two kv tiles, the exchange (the partners' S,
// then the owners' P and alpha: 25 of its 32 KB), gs, ok
constexpr int kWKV = 8 * kWBlk, kWPart = kWKV + 2 * 8 * kWBlk, kWGsv = kWPart + 2 * 32 * 128 * 4;
constexpr int kWOk = kWGsv + 2 * kWTS * 4, kWEnd = kWOk + 2 * kWTS * 4;
constexpr int kWgSmem = kWEnd + 1024;                     // + the alignment of the dynamic window to 1024 bytes
static_assert(kWgSmem == 231424, "the wgmma kernel's shared memory changed: update dsv4_nvfp4.attention.ATTN_WG_SMEM");

// byte offset of (row r, dims c .. c + 7) in a swizzled region of 8 blocks x 64 rows x 128 bytes
__device__ __forceinline__ u32 sw_off(int r, int c) {
    return (u32)((c >> 6) * kWBlk + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4));
}
// a wgmma shared-memory descriptor, 128-byte swizzle: start address, leading and stride byte offsets
__device__ __forceinline__ unsigned long long sw_desc(u32 addr, u32 lbo, u32 sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
           ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)      // sm_90a: the warpgroup MMA
// S (64 x 64, fp32, the C-fragment layout) (+)= Q (64 x 16, smem, K-major) . KV^T (16 x 64 slots, smem, K-major)
__device__ __forceinline__ void wgmma_qk(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(acc));
}
// O (64 x 256, fp32) += P (64 x 16 slots, registers: the A fragment) . KV (16 slots x 256 dims, smem, MN-major)
__device__ __forceinline__ void wgmma_pv(float* d, const u32 (&a)[4], unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Pin registers an in-flight warpgroup MMA reads or writes: the front end (NVVM) moves no instruction that touches
// them across the point (the accumulators before the fence and after the wait, P's fragments until the wait); ptxas
// does not see these empty statements (that it keeps the MMAs unserialized is tests/test_runtime.py's check).
template <int N> __device__ __forceinline__ void wg_pin(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
template <int N> __device__ __forceinline__ void wg_pin(u32* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i]) :: "memory");
}
#endif
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Store a 64-slot tile: thread (warp w, lane) owns slot 8 w + lane / 4 and, in each of the 8 blocks, dims + 16 (lane % 4)
// .. + 15: window rows by cp.async, pool rows decoded from the registers, zero rows for the rest.
__device__ __forceinline__ bool wg_store_tile(u32 kv, float* gsv, int* okv, int s, int sub, int base, int j1, int W,
                                              int wl, const __nv_bfloat16* __restrict__ win, i64 b, int e,
                                              const uint2 (&cw)[8], const u32 (&sb)[8], float gv, i64 cap, int* bad,
                                              bool count) {
    const int j = base + s;
    float gj = 0.0f;
    int ok = 0;
    bool async = false;
    if (j < j1 && j < W) {
        if (j < wl) {
            const __nv_bfloat16* src = win + (b * W + j) * kD + 16 * sub;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(kv + sw_off(s, 64 * i + 16 * sub)), "l"(src + 64 * i));
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(kv + sw_off(s, 64 * i + 16 * sub + 8)), "l"(src + 64 * i + 8));
            }
            async = true; gj = 1.0f; ok = 1;
        }
    } else if (j < j1 && e >= 0 && (i64)e < cap) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            u32 w8[8];
            decode16_bf16(cw[i], sb[i], w8);
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" :: "r"(kv + sw_off(s, 64 * i + 16 * sub)),
                         "r"(w8[0]), "r"(w8[1]), "r"(w8[2]), "r"(w8[3]) : "memory");
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" :: "r"(kv + sw_off(s, 64 * i + 16 * sub + 8)),
                         "r"(w8[4]), "r"(w8[5]), "r"(w8[6]), "r"(w8[7]) : "memory");
        }
        gj = gv; ok = 1;
    } else if (j < j1 && j >= W && e != -1 && count && sub == 0) {
        atomicAdd(bad, 1);
    }
    if (!ok) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" :: "r"(kv + sw_off(s, 64 * i + 16 * sub)), "r"(0u) : "memory");
            asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" :: "r"(kv + sw_off(s, 64 * i + 16 * sub + 8)), "r"(0u) : "memory");
        }
    }
    if (sub == 0) { gsv[s] = gj; okv[s] = ok; }
    return async;
}

__device__ __forceinline__ void wg_load_raw(int e, uint2 (&cw)[8], u32 (&sb)[8], float& gv, const u8* __restrict__ codes,
                                            const u8* __restrict__ sf, const float* __restrict__ gs, i64 cap, int sub) {
#pragma unroll
    for (int i = 0; i < 8; ++i) { cw[i] = make_uint2(0, 0); sb[i] = 0; }
    gv = 0.0f;
    if (e >= 0 && (i64)e < cap) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            cw[i] = *reinterpret_cast<const uint2*>(codes + (i64)e * (kD / 2) + 32 * i + 8 * sub);
            sb[i] = sf[(i64)e * (kD / 16) + 4 * i + sub];
        }
        gv = gs[e];
    }
}

extern "C" __global__ void __launch_bounds__(kWThreads, 1)
nvfp4_sparse_attn_wg(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ win,
                     const int* __restrict__ wlen, int W, const u8* __restrict__ codes, const u8* __restrict__ sf,
                     const float* __restrict__ gs, i64 cap, const int* __restrict__ idx, int K, int H, float scale,
                     int chunk, float* __restrict__ o_part, float* __restrict__ ml_part, int* __restrict__ bad) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(16) unsigned char wg_smem[];   // aligned to 1024 bytes here (the swizzle's period)
    const u32 sbase = ((u32)__cvta_generic_to_shared(wg_smem) + 1023u) & ~1023u;
    unsigned char* gbase = wg_smem + (sbase - (u32)__cvta_generic_to_shared(wg_smem));
    float* part = reinterpret_cast<float*>(gbase + kWPart);                 // the partners' S, the owners' P and alpha
    const int split = blockIdx.x, hb = blockIdx.y, nsplit = gridDim.x;
    const i64 b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int c = warp >> 2;                                   // warpgroup (dim half)
    const int hw = warp & 3;                                   // head tile (heads 16 hw ..): warps hw and hw + 4
    const bool owner = c == (hw >> 1);                         // its softmax: warps 0, 1, 6, 7 (one per scheduler)
    const int S = W + K;
    const int j0 = split * chunk, j1 = min(S, j0 + chunk);
    const int wl = W > 0 ? min(max(wlen[b], 0), W) : 0;
    const int h0 = hb * kHT64;
    const int s_own = 8 * warp + (lane >> 2), sub = lane & 3;    // the tile slot and 16-dim part this thread stores

    // the CTA's 64 query rows, swizzled (cp.async; published with the first tile)
    {
        const __nv_bfloat16* qb = q + (b * H + h0) * kD;
        for (int k = threadIdx.x; k < 64 * (kD / 8); k += kWThreads) {
            const int r = k >> 6, col = (k & 63) * 8;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(sbase + sw_off(r, col)), "l"(qb + (i64)r * kD + col));
        }
    }
    float o[32][4];
#pragma unroll
    for (int n = 0; n < 32; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_r[2] = {-kInf, -kInf};
    float l_r[2] = {0.0f, 0.0f};
    const bool count = bad != nullptr && hb == 0;

    auto pidx = [&](int j) -> int { return pool_index(idx, b, K, W, j1, j); };
    uint2 cw[8];
    u32 sb[8];
    float gv;
    int e_cur = pidx(j0 + s_own), e_nxt = pidx(j0 + kWTS + s_own);
    wg_load_raw(e_cur, cw, sb, gv, codes, sf, gs, cap, sub);
    wg_store_tile(sbase + kWKV, reinterpret_cast<float*>(gbase + kWGsv), reinterpret_cast<int*>(gbase + kWOk), s_own, sub,
                  j0, j1, W, wl, win, b, e_cur, cw, sb, gv, cap, bad, count);
    e_cur = e_nxt;
    e_nxt = pidx(j0 + 2 * kWTS + s_own);
    if (j0 + kWTS < j1) wg_load_raw(e_cur, cw, sb, gv, codes, sf, gs, cap, sub);
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    fence_async_smem();

    int it = 0;
    for (int base = j0; base < j1; base += kWTS, ++it) {
        const int cur = it & 1;
        const u32 kv = sbase + kWKV + cur * 8 * kWBlk;
        __syncthreads();                         // this tile published; the other buffer's last readers are done
        // ---- S_c = Q[:, dims] . KV[:, dims]^T, in flight while the next tile is decoded
        float sacc[8][4];
        // the descriptors of this warpgroup's first k step; the others add their (16-byte) offset to the address field
        // (no carry out of it: every shared address is below 2^18)
        const unsigned long long dq = sw_desc(sbase + 4 * c * kWBlk, 16, 1024), dk = sw_desc(kv + 4 * c * kWBlk, 16, 1024);
        wg_pin<32>(&sacc[0][0]);
        wg_fence();
#pragma unroll
        for (int kb = 0; kb < 4; ++kb)
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                const unsigned long long off = (unsigned long long)((kb * kWBlk + 32 * ks) >> 4);
                wgmma_qk(reinterpret_cast<float (&)[32]>(sacc), dq + off, dk + off, (kb | ks) != 0);
            }
        wg_commit();
        if (base + kWTS < j1) {
            const int nb = cur ^ 1;
            if (wg_store_tile(sbase + kWKV + nb * 8 * kWBlk, reinterpret_cast<float*>(gbase + kWGsv) + nb * kWTS,
                              reinterpret_cast<int*>(gbase + kWOk) + nb * kWTS, s_own, sub, base + kWTS, j1, W, wl, win,
                              b, e_cur, cw, sb, gv, cap, bad, count))
                asm volatile("cp.async.wait_all;\n" ::: "memory");
            fence_async_smem();
            e_cur = e_nxt;
            e_nxt = pidx(base + 3 * kWTS + s_own);
            if (base + 2 * kWTS < j1) wg_load_raw(e_cur, cw, sb, gv, codes, sf, gs, cap, sub);
        }
        wg_wait0();
        wg_pin<32>(&sacc[0][0]);
        // ---- the scores of head tile hw: the partner's half added to the owner's, the owner's softmax, its P and
        // alpha handed back (one softmax per head tile, not one per warpgroup; one warp of each scheduler computes it)
        float4* sx = reinterpret_cast<float4*>(part) + hw * 8 * 32;           // [4 hw][8 n][32 lanes] float4
        uint4* px = reinterpret_cast<uint4*>(part + 4 * 8 * 32 * 4) + hw * 4 * 32;   // [4 hw][4 ks][32 lanes] uint4
        float2* ax = reinterpret_cast<float2*>(part + 4 * 8 * 32 * 4 + 4 * 4 * 32 * 4) + hw * 32;   // [4 hw][32 lanes]
        if (!owner) {
#pragma unroll
            for (int n = 0; n < 8; ++n) sx[n * 32 + lane] = make_float4(sacc[n][0], sacc[n][1], sacc[n][2], sacc[n][3]);
        }
        __syncthreads();                         // the partners' scores and the next tile published
        float alpha[2];
        u32 pa[4][4];
        if (owner) {
#pragma unroll
            for (int n = 0; n < 8; ++n) {        // a + b == b + a: the bits both warpgroups summed before
                const float4 x = sx[n * 32 + lane];
                sacc[n][0] = __fadd_rn(sacc[n][0], x.x); sacc[n][1] = __fadd_rn(sacc[n][1], x.y);
                sacc[n][2] = __fadd_rn(sacc[n][2], x.z); sacc[n][3] = __fadd_rn(sacc[n][3], x.w);
            }
            online_softmax<8>(sacc, reinterpret_cast<const float*>(gbase + kWGsv) + cur * kWTS,
                              reinterpret_cast<const int*>(gbase + kWOk) + cur * kWTS, scale, t, m_r, l_r, alpha, pa);
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) px[ks * 32 + lane] = make_uint4(pa[ks][0], pa[ks][1], pa[ks][2], pa[ks][3]);
            ax[lane] = make_float2(alpha[0], alpha[1]);
        }
        asm volatile("bar.sync %0, 64;\n" :: "r"(1 + hw) : "memory");      // the pair's P and alpha published
        if (!owner) {
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                const uint4 x = px[ks * 32 + lane];
                pa[ks][0] = x.x; pa[ks][1] = x.y; pa[ks][2] = x.z; pa[ks][3] = x.w;
            }
            const float2 a = ax[lane];
            alpha[0] = a.x; alpha[1] = a.y;
        }
        if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
            for (int n = 0; n < 32; ++n) {
                o[n][0] *= alpha[0]; o[n][1] *= alpha[0]; o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
            }
        }
        // ---- O_c += P . KV[:, dims]: kv MN-major, 64-dim blocks 8192 bytes apart, 8-slot groups 1024
        const unsigned long long dv = sw_desc(kv + 4 * c * kWBlk, kWBlk, 1024);
        wg_pin<128>(&o[0][0]);
        wg_pin<16>(&pa[0][0]);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) wgmma_pv(&o[0][0], pa[ks], dv + (unsigned long long)((16 * 128 * ks) >> 4));
        wg_commit();
        wg_wait0();
        wg_pin<128>(&o[0][0]);
        wg_pin<16>(&pa[0][0]);
    }
    store_partials(o, m_r, l_r, ((i64)b * nsplit + split) * H + h0 + 16 * hw, 256 * c, g, t, owner, o_part, ml_part);
#else
    __trap();                                    // sm_90a only: the launcher never picks it elsewhere
#endif
}

// Merge the splits of one (sequence, head) in split order, add the sink to the denominator, rotate the last 64 dims back
// by the query position (pos != nullptr: pair k turned by -pos * freqs[k], in float64), and store bf16.
// grid B * H, 128 threads, 4 dims each.
extern "C" __global__ void __launch_bounds__(128)
nvfp4_sparse_attn_combine(const float* __restrict__ o_part, const float* __restrict__ ml_part, int nsplit, int H,
                          const float* __restrict__ sink,      // (H,) or nullptr
                          const int* __restrict__ pos,         // (B,) or nullptr
                          const double* __restrict__ freqs,    // (32,) pair frequencies of the last 64 dims (with pos)
                          __nv_bfloat16* __restrict__ out) {   // (B, H, 512)
    const int bh = blockIdx.x, b = bh / H, h = bh - b * H;
    const int d = 4 * threadIdx.x;
    float M = -kInf;
    bool any = false;
    for (int i = 0; i < nsplit; ++i) {
        const float2 ml = *reinterpret_cast<const float2*>(ml_part + (((i64)b * nsplit + i) * H + h) * 2);
        M = fmaxf(M, ml.x);
        any |= (ml.y != 0.0f);                     // a valid slot (or a NaN) in this split
    }
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (any) {
        float mref = (M == -kInf) ? 0.0f : M;
        const float sk = sink != nullptr ? sink[h] : -kInf;
        mref = fmaxf(mref, sk);
        float den = 0.0f;
        for (int i = 0; i < nsplit; ++i) {
            const i64 r = ((i64)b * nsplit + i) * H + h;
            const float2 ml = *reinterpret_cast<const float2*>(ml_part + r * 2);
            if (ml.y == 0.0f) continue;            // nothing valid here (its o is 0)
            const float w = __expf(ml.x - mref);
            const float4 x = *reinterpret_cast<const float4*>(o_part + r * kD + d);
            v[0] += w * x.x; v[1] += w * x.y; v[2] += w * x.z; v[3] += w * x.w;
            den += w * ml.y;
        }
        if (sink != nullptr) den += __expf(sk - mref);
        const float inv = 1.0f / den;
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] *= inv;
        if (pos != nullptr && d >= kD - 64) {
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                double sn, cs;
                sincos(-(double)pos[b] * freqs[(d - (kD - 64)) / 2 + k], &sn, &cs);
                const float x0 = v[2 * k], x1 = v[2 * k + 1], c = (float)cs, s = (float)sn;
                v[2 * k] = x0 * c - x1 * s;
                v[2 * k + 1] = x0 * s + x1 * c;
            }
        }
    }
    uint2 w;
    w.x = pack_bf16(v[0], v[1]);
    w.y = pack_bf16(v[2], v[3]);
    *reinterpret_cast<uint2*>(out + ((i64)b * H + h) * kD + d) = w;
}
