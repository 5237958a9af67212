// nvfp4_kv_compress.cu -- DSV4's KV compressor (CSA: ratio 4, overlapping windows; HCA: ratio 128) fused with RMSNorm,
// RoPE and NVFP4 quantization into a pool of compressed entries (nbs/06_kv_compress.ipynb; the reference is
// dsv4_nvfp4.kv.ref_compress_kv / ref_compress_step). One CTA per entry; nothing intermediate goes to global memory.
//
//   nvfp4_kv_compress_prefill   every complete window of each sequence of a ragged batch (sequences from position 0)
//   nvfp4_kv_prefill_state      the decode state a prefill leaves: the tail tokens (and, for CSA, the last complete
//                               window as the previous rows); empty slots kv 0, score -inf
//   nvfp4_kv_compress_decode    one token per sequence (fixed batch, position -1: inactive): the token's slot of the
//                               state; a sequence whose window closes pools it into an entry (CSA then shifts)
//
// A CTA has SPLIT groups of KV_D / 4 threads (the launcher: 4 for HCA's 128 slots, 1 for CSA): group g pools slots
// [g r / SPLIT, (g+1) r / SPLIT) of each part (CSA: of the previous and of this window), then group 0 merges the
// partials in group order and finishes the entry. The prefill and the decode split and merge identically.
//
// Math per entry (window i of r tokens; D = 512 channels, coff = 2 for CSA, else 1; the projections kv and score are
// fp32 (tokens, coff*D); sc = score + ape[pos % r] in fp32):
//   slots     HCA: the window's r tokens, channel c.  CSA: 2r slots, the previous window's r tokens with channel c,
//             then this window's r tokens with channel D + c (window 0's previous slots: empty)
//   pooling   per channel, over the slots in slot order, an online softmax in fp32:
//               empty slot (score -inf, kv 0): skipped (its weight is exactly 0)
//               m' = max(m, s) (a NaN score propagates), a = exp(m - m'), b = exp(s - m'),
//               den = den * a + b, num = num * a + b * v;  e = num / den
//   RMSNorm   y = e * (1 / sqrt(sum(e^2) / D + eps)) * w      (sum: the fixed-order block sum)
//   RoPE      adjacent pairs of the last 64 channels, angle = pos * freq[k] with pos = i * r, computed in fp64
//             (cos, sin rounded to fp32): y[2k] = a c - b s, y[2k+1] = a s + b c
//   NVFP4     gs = gs_from_amax(max |y|) (the entry's own global scale; NaN stays NaN), then the 32 16-blocks
//             exactly as nvfp4_quantize.cu (quantize_block16): codes (D/2 bytes, element 2i in the low nibble),
//             e4m3 scales (D/16 bytes), gs (fp32)
// The prefill and the decode kernels run the same device functions on the same fp32 values (decode stores sc, the
// score with ape added, in its state), so a prefill and a token-by-token decode of the same sequence write the same
// bytes.
//
// Slots of the pool: int32, -1 = skip; anything else outside [0, capacity) is skipped too and counted in *bad
// (when bad != nullptr): the pool is never written out of bounds.
//
// Compile-time constants: RATIO (4 or 128; any r >= 2 works, CSA iff RATIO == 4), KV_D = 512 (the entry width: 4
// channels per thread, so KV_D / 4 threads per CTA, a multiple of 32), ROPE (rotated channels, 64), KV_UNROLL (slots
// whose loads a thread issues before it pools them: more bytes in flight per thread; the pooling order, hence every
// bit, does not depend on it).
#include "nvfp4_common.cuh"

using namespace nvfp4;

#ifndef RATIO
#define RATIO 4
#endif
#ifndef KV_D
#define KV_D 512
#endif
#ifndef ROPE
#define ROPE 64
#endif
#ifndef SPLIT
#define SPLIT 1
#endif
#ifndef KV_UNROLL
#define KV_UNROLL 2
#endif

#define NEG_INF __int_as_float(0xff800000)

constexpr int kR = RATIO;
constexpr int kCoff = (RATIO == 4) ? 2 : 1;
constexpr int kD = KV_D;
constexpr int kLd = kCoff * kD;                 // projection width
constexpr int kGroup = kD / 4;                  // threads of one channel group: 4 consecutive channels per thread
constexpr int kSplit = SPLIT;                   // channel groups per CTA: each pools 1/kSplit of the slots (more loads in
constexpr int kThreads = kGroup * kSplit;       // flight for HCA's 128 slots), then group 0 merges the partials
constexpr int kRope = ROPE;
constexpr int kSlots = kCoff * kR;              // pooled slots per entry
constexpr int kPer = kR / SPLIT;                // slots of one part pooled by one group
constexpr int kU = (KV_UNROLL < kPer) ? KV_UNROLL : kPer;   // slots loaded ahead (a divisor of kPer)

static_assert(kR >= 2, "RATIO must be >= 2");
static_assert(kD % 128 == 0 && kThreads <= 1024, "KV_D must be a multiple of 128 (whole warps of 4 channels each), at most 4096");
static_assert(kSplit >= 1 && kR % kSplit == 0 && kThreads / 32 <= 32, "SPLIT must divide RATIO (and KV_D / 4 * SPLIT <= 1024)");
static_assert(kRope % 4 == 0 && kRope <= kD, "ROPE must be a multiple of 4 and <= KV_D");
static_assert(kU >= 1 && kPer % kU == 0, "KV_UNROLL must divide RATIO / SPLIT (or exceed it)");

struct PoolOut {
    u8* data;                 // (capacity, D/2) E2M1 codes
    u8* scale;                // (capacity, D/16) e4m3
    float* gs;                // (capacity,)
    int capacity;
    int* bad;                 // slots outside [-1, capacity) are counted here (or nullptr)
};

// Online softmax state of 4 channels.
struct Pool4 {
    float m[4], den[4], num[4];
    __device__ __forceinline__ void init() {
#pragma unroll
        for (int k = 0; k < 4; ++k) { m[k] = NEG_INF; den[k] = 0.0f; num[k] = 0.0f; }
    }
    __device__ __forceinline__ void add(const float4& s4, const float4& v4) {
        const float s[4] = {s4.x, s4.y, s4.z, s4.w}, v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (s[k] == NEG_INF) continue;                       // an empty slot: weight exactly 0
            const float mn = (s[k] > m[k] || s[k] != s[k]) ? s[k] : m[k];
            const float a = expf(__fsub_rn(m[k], mn)), b = expf(__fsub_rn(s[k], mn));
            den[k] = __fmaf_rn(den[k], a, b);
            num[k] = __fmaf_rn(num[k], a, __fmul_rn(b, v[k]));
            m[k] = mn;
        }
    }
    // Fold in another partial (the same channels, later slots): the merge of two online softmaxes.
    __device__ __forceinline__ void merge(float mb, float db, float nb, int k) {
        if (mb == NEG_INF) return;                             // no slot there
        if (m[k] == NEG_INF) { m[k] = mb; den[k] = db; num[k] = nb; return; }
        const float mn = (mb > m[k] || mb != mb) ? mb : m[k];
        const float a = expf(__fsub_rn(m[k], mn)), b = expf(__fsub_rn(mb, mn));
        den[k] = __fmaf_rn(den[k], a, __fmul_rn(db, b));
        num[k] = __fmaf_rn(num[k], a, __fmul_rn(nb, b));
        m[k] = mn;
    }
    __device__ __forceinline__ void result(float (&e)[4]) const {
#pragma unroll
        for (int k = 0; k < 4; ++k) e[k] = __fdiv_rn(num[k], den[k]);   // all slots empty: 0/0 = NaN (never happens)
    }
};

__device__ __forceinline__ float4 add4(const float4& a, const float4& b) {
    return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}
__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// Pool kPer slots of 4 channels: slot j's score is sc[j * ld] (+ ape[j * ld] when ape != nullptr), its value
// kv[j * ld]. The loads of kU slots are issued before they are pooled; the pooling order is slot order whatever kU.
__device__ __forceinline__ void pool_part(Pool4& p, const float* sc, const float* kv, const float* __restrict__ ape) {
    for (int j = 0; j < kPer; j += kU) {
        float4 s[kU], v[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            s[u] = ld4(sc + (i64)(j + u) * kLd);
            v[u] = ld4(kv + (i64)(j + u) * kLd);
            if (ape != nullptr) s[u] = add4(s[u], ld4(ape + (i64)(j + u) * kLd));
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) p.add(s[u], v[u]);
    }
}

// Group 0 folds in the partials of groups 1 .. kSplit-1, in group order, and gets the entry; the other groups get
// zeros (they take part in finish_entry's reductions with nothing). Every thread of the CTA calls it.
__device__ __forceinline__ void merge_groups(Pool4& p, float (&e)[4]) {
    __shared__ float part[kSplit > 1 ? kSplit - 1 : 1][3][kD];
    const int g = threadIdx.x / kGroup, c0 = 4 * (threadIdx.x % kGroup);
    if (kSplit > 1) {
        if (g > 0) {
#pragma unroll
            for (int k = 0; k < 4; ++k) { part[g - 1][0][c0 + k] = p.m[k]; part[g - 1][1][c0 + k] = p.den[k]; part[g - 1][2][c0 + k] = p.num[k]; }
        }
        __syncthreads();
        if (g == 0)
            for (int h = 0; h < kSplit - 1; ++h)
#pragma unroll
                for (int k = 0; k < 4; ++k) p.merge(part[h][0][c0 + k], part[h][1][c0 + k], part[h][2][c0 + k], k);
    }
    if (g == 0) p.result(e);
    else { e[0] = e[1] = e[2] = e[3] = 0.0f; }
}

// RMSNorm, RoPE at position `pos`, quantization into pool slot `slot`, and the fp32 entry to `dbg` (or nullptr).
// Every thread of the CTA calls it; group 0's threads hold the entry (channels 4 * threadIdx.x ..), the others zeros.
__device__ void finish_entry(float (&e)[4], i64 pos, const float* __restrict__ norm_w, const double* __restrict__ freqs,
                             float eps, int slot, const PoolOut& out, float* __restrict__ dbg) {
    __shared__ float red[32];
    __shared__ u32 redu[32];
    __shared__ __align__(16) float y_s[kD];
    const bool own = threadIdx.x < kGroup;
    const int c0 = 4 * (threadIdx.x % kGroup);
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) ss = __fmaf_rn(e[k], e[k], ss);
    const float tot = block_sum_once(ss, red);
    const float rinv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(tot, (float)kD), eps)));
    const float4 w4 = ld4(norm_w + c0);
    float y[4] = {__fmul_rn(__fmul_rn(e[0], rinv), w4.x), __fmul_rn(__fmul_rn(e[1], rinv), w4.y),
                  __fmul_rn(__fmul_rn(e[2], rinv), w4.z), __fmul_rn(__fmul_rn(e[3], rinv), w4.w)};
    if (c0 >= kD - kRope) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int k = (c0 + 2 * h - (kD - kRope)) / 2;
            double sd, cd;
            sincos((double)pos * freqs[k], &sd, &cd);
            const float c = (float)cd, s = (float)sd, a = y[2 * h], b = y[2 * h + 1];
            y[2 * h] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
            y[2 * h + 1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
        }
    }
    u32 am = 0u;
    if (own) {
#pragma unroll
        for (int k = 0; k < 4; ++k) { y_s[c0 + k] = y[k]; am = max(am, abs_bits(y[k])); }
    }
    const u32 amax = block_max_u32_once(am, redu);                // includes the barrier that publishes y_s
    if (own && dbg != nullptr) *reinterpret_cast<float4*>(dbg + c0) = make_float4(y[0], y[1], y[2], y[3]);
    const bool ok = slot >= 0 && slot < out.capacity;
    if (!ok) {
        if (slot != -1 && threadIdx.x == 0 && out.bad != nullptr) atomicAdd(out.bad, 1);
        return;
    }
    const float gs = gs_from_amax(__uint_as_float(amax));
    if (threadIdx.x < kD / 16) {
        const int b = threadIdx.x;
        float v[16];
#pragma unroll
        for (int k = 0; k < 4; ++k) {                          // 16-byte reads: 4-way instead of 16-way bank conflicts
            const float4 q = reinterpret_cast<const float4*>(y_s + 16 * b)[k];
            v[4 * k] = q.x; v[4 * k + 1] = q.y; v[4 * k + 2] = q.z; v[4 * k + 3] = q.w;
        }
        u32 lo, hi;
        const u32 sb = quantize_block16(v, absmax_bits16(v), gs, lo, hi);
        *reinterpret_cast<uint2*>(out.data + (i64)slot * (kD / 2) + 8 * b) = make_uint2(lo, hi);
        out.scale[(i64)slot * (kD / 16) + b] = (u8)sb;
    }
    if (threadIdx.x == 0) out.gs[slot] = gs;
}

// ---------------------------------------------------------------------------------------------
// Prefill: CTA w is entry w of the batch: sequence b = the last with cu_win[b] <= w, window i = w - cu_win[b].
extern "C" __global__ void __launch_bounds__(kThreads)
nvfp4_kv_compress_prefill(const float* __restrict__ kv,       // (tokens, coff*D) fp32, sequences back to back
                          const float* __restrict__ score,    // (tokens, coff*D) fp32, ape not added
                          const int* __restrict__ cu_seqlens, // (B + 1,) token offsets
                          const int* __restrict__ cu_win,     // (B + 1,) entry offsets: cu_win[b+1] - cu_win[b] = len_b / r
                          int B,
                          const float* __restrict__ ape,      // (r, coff*D)
                          const float* __restrict__ norm_w,   // (D,)
                          const double* __restrict__ freqs,   // (ROPE / 2,) radians per position
                          float eps,
                          const int* __restrict__ slots,      // (entries,) pool slot of each entry, -1: skip
                          u8* __restrict__ pool_data, u8* __restrict__ pool_scale, float* __restrict__ pool_gs,
                          int capacity, int* __restrict__ bad,
                          float* __restrict__ dbg) {          // (entries, D) fp32 pre-quantization entries, or nullptr
    const int w = blockIdx.x;
    int lo = 0, hi = B;                                        // the sequence: cu_win[lo] <= w < cu_win[lo + 1]
    while (hi - lo > 1) { const int mid = (lo + hi) >> 1; if (cu_win[mid] <= w) lo = mid; else hi = mid; }
    const int b = lo, i = w - cu_win[b];
    const i64 t0 = cu_seqlens[b] + (i64)i * kR;                 // the window's first token (row)
    const int c0 = 4 * (threadIdx.x % kGroup), j0 = (threadIdx.x / kGroup) * kPer;
    Pool4 p;
    p.init();
    if (kCoff == 2 && i > 0) {                                 // the previous window, channels [0, D)
        const i64 o = (t0 - kR + j0) * kLd + c0;
        pool_part(p, score + o, kv + o, ape + (i64)j0 * kLd + c0);
    }
    const int off = (kCoff - 1) * kD;                          // this window: channels [D, 2D) for CSA
    const i64 o = (t0 + j0) * kLd + off + c0;
    pool_part(p, score + o, kv + o, ape + (i64)j0 * kLd + off + c0);
    float e[4];
    merge_groups(p, e);
    const PoolOut out{pool_data, pool_scale, pool_gs, capacity, bad};
    finish_entry(e, (i64)i * kR, norm_w, freqs, eps, slots[w], out, dbg ? dbg + (i64)w * kD : nullptr);
}

// The state after a prefill (CTA b): rows of this window (CSA: rows [r, 2r)) hold the tail tokens, the rest empty;
// CSA rows [0, r) hold the last complete window (empty if there is none). Stored: kv and sc = score + ape.
extern "C" __global__ void __launch_bounds__(kGroup)
nvfp4_kv_prefill_state(const float* __restrict__ kv, const float* __restrict__ score, const int* __restrict__ cu_seqlens,
                       const float* __restrict__ ape,
                       float* __restrict__ st_kv, float* __restrict__ st_sc) {   // (B, coff*r, coff*D) fp32
    const int b = blockIdx.x;
    const i64 s0 = cu_seqlens[b], len = cu_seqlens[b + 1] - s0, nwin = len / kR, tail = len - nwin * kR;
    float* sk = st_kv + (i64)b * kSlots * kLd;
    float* ss = st_sc + (i64)b * kSlots * kLd;
    for (int q = threadIdx.x; q < kSlots * kLd / 4; q += blockDim.x) {
        const int row = (4 * q) / kLd, c = (4 * q) % kLd;
        i64 src = -1;                                          // the token that fills this state row, if any
        if (kCoff == 2 && row < kR) { if (nwin > 0) src = s0 + (nwin - 1) * kR + row; }
        else { const int k = row - (kCoff - 1) * kR; if (k < tail) src = s0 + nwin * kR + k; }
        const int j = (kCoff == 2 && row < kR) ? row : row - (kCoff - 1) * kR;   // position in its window
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f), s = make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
        if (src >= 0) { v = ld4(kv + src * kLd + c); s = add4(ld4(score + src * kLd + c), ld4(ape + (i64)j * kLd + c)); }
        *reinterpret_cast<float4*>(sk + (i64)row * kLd + c) = v;
        *reinterpret_cast<float4*>(ss + (i64)row * kLd + c) = s;
    }
}

// ---------------------------------------------------------------------------------------------
// Decode: CTA b takes sequence b's token at position pos[b] (< 0: inactive, nothing happens).
extern "C" __global__ void __launch_bounds__(kThreads)
nvfp4_kv_compress_decode(const float* __restrict__ kv,       // (B, coff*D) fp32
                         const float* __restrict__ score,    // (B, coff*D) fp32, ape not added
                         const i64* __restrict__ pos,        // (B,)
                         const float* __restrict__ ape, const float* __restrict__ norm_w,
                         const double* __restrict__ freqs, float eps,
                         const int* __restrict__ slots,      // (B,) pool slot of the entry a closing window writes
                         u8* __restrict__ pool_data, u8* __restrict__ pool_scale, float* __restrict__ pool_gs,
                         int capacity, int* __restrict__ bad,
                         float* st_kv, float* st_sc,         // (B, coff*r, coff*D) fp32 (read and written)
                         float* __restrict__ dbg) {          // (B, D) fp32 pre-quantization entries, or nullptr
    const int b = blockIdx.x;
    const i64 p = pos[b];
    if (p < 0) return;
    const int k = (int)(p % kR), row = (kCoff - 1) * kR + k;
    float* sk = st_kv + (i64)b * kSlots * kLd;
    float* ss = st_sc + (i64)b * kSlots * kLd;
    for (int c = 4 * threadIdx.x; c < kLd; c += 4 * blockDim.x) {
        *reinterpret_cast<float4*>(sk + (i64)row * kLd + c) = ld4(kv + (i64)b * kLd + c);
        *reinterpret_cast<float4*>(ss + (i64)row * kLd + c) = add4(ld4(score + (i64)b * kLd + c), ld4(ape + (i64)k * kLd + c));
    }
    if (k != kR - 1) return;                                   // uniform over the CTA
    __syncthreads();                                           // the token's slot is visible to the whole CTA
    const int c0 = 4 * (threadIdx.x % kGroup), j0 = (threadIdx.x / kGroup) * kPer;
    Pool4 pl;                                                  // the same slots per group, in the same order, as the prefill
    pl.init();
    if (kCoff == 2) pool_part(pl, ss + (i64)j0 * kLd + c0, sk + (i64)j0 * kLd + c0, nullptr);
    const int off = (kCoff - 1) * kD;
    const i64 o = (i64)((kCoff - 1) * kR + j0) * kLd + off + c0;
    pool_part(pl, ss + o, sk + o, nullptr);
    float e[4];
    merge_groups(pl, e);
    const PoolOut out{pool_data, pool_scale, pool_gs, capacity, bad};
    finish_entry(e, p - (kR - 1), norm_w, freqs, eps, slots[b], out, dbg ? dbg + (i64)b * kD : nullptr);
    __syncthreads();                                           // every read of the state is done
    for (int q = threadIdx.x; q < kR * kLd / 4; q += blockDim.x) {   // CSA: this window -> the previous rows; reset
        const int r = (4 * q) / kLd, c = (4 * q) % kLd;
        const i64 cur = (i64)((kCoff - 1) * kR + r) * kLd + c;
        if (kCoff == 2) {
            *reinterpret_cast<float4*>(sk + (i64)r * kLd + c) = ld4(sk + cur);
            *reinterpret_cast<float4*>(ss + (i64)r * kLd + c) = ld4(ss + cur);
        }
        *reinterpret_cast<float4*>(sk + cur) = make_float4(0.f, 0.f, 0.f, 0.f);
        *reinterpret_cast<float4*>(ss + cur) = make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
    }
}
