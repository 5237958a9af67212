// nvfp4_kv_compress.cu -- DSV4's KV compressor (CSA: ratio 4, overlapping windows; HCA: ratio 128) fused with RMSNorm,
// RoPE and NVFP4 quantization into a pool of compressed entries (nbs/06_kv_compress.ipynb; the reference is
// dsv4_nvfp4.kv.ref_compress_kv / ref_compress_step). One CTA per entry; nothing intermediate goes to global memory.
//
//   nvfp4_kv_compress_prefill   every complete window of each sequence of a ragged batch (sequences from position 0)
//   nvfp4_kv_prefill_state      the decode state a prefill leaves: per group of slots, the online softmax of the tail
//                               tokens (for CSA after the last complete window's), as the decode would have built it
//   nvfp4_kv_compress_decode    one token per sequence (fixed batch, position -1: inactive): the token joins its
//                               group's online softmax in the state; a sequence whose window closes merges the groups
//                               into an entry (O(D) per step whatever the ratio: the raw slots are not kept)
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
// The prefill and the decode kernels run the same device functions on the same fp32 values in the same order (the
// decode keeps each group's online softmax where the prefill keeps it in registers), so a prefill and a token-by-token
// decode of the same sequence write the same bytes.
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

// The RoPE inputs of this thread's channels c0 .. c0 + 3 (two pairs), loaded at a kernel's start: they do not depend
// on the data, so their latency hides under the pooling's. Below the RoPE channels: unused.
struct RopeIn { double f[2]; };
__device__ __forceinline__ RopeIn rope_in(const double* __restrict__ freqs, int c0) {
    RopeIn r{{0.0, 0.0}};
    if (c0 >= kD - kRope)
#pragma unroll
        for (int h = 0; h < 2; ++h) r.f[h] = freqs[(c0 + 2 * h - (kD - kRope)) / 2];
    return r;
}
// The rotation of those pairs at position `pos`: cos and sin in double, then to fp32 (made before the merge, so the
// double-precision sincos overlaps the CTA's barriers).
struct Rot { float c[2], s[2]; };
__device__ __forceinline__ Rot rope_rot(const RopeIn& in, i64 pos, int c0) {
    Rot r{{1.0f, 1.0f}, {0.0f, 0.0f}};
    if (c0 >= kD - kRope)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            double sd, cd;
            sincos((double)pos * in.f[h], &sd, &cd);
            r.c[h] = (float)cd; r.s[h] = (float)sd;
        }
    return r;
}

// RMSNorm (weights w4 of channels c0 .. c0 + 3), RoPE by `rot`, quantization into pool slot `slot`, and the fp32 entry
// to `dbg` (or nullptr). Every thread of the CTA calls it; group 0's threads hold the entry (channels 4 * threadIdx.x
// ..), the others zeros.
__device__ void finish_entry(float (&e)[4], const Rot& rot, float4 w4,
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
    float y[4] = {__fmul_rn(__fmul_rn(e[0], rinv), w4.x), __fmul_rn(__fmul_rn(e[1], rinv), w4.y),
                  __fmul_rn(__fmul_rn(e[2], rinv), w4.z), __fmul_rn(__fmul_rn(e[3], rinv), w4.w)};
    if (c0 >= kD - kRope) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float c = rot.c[h], s = rot.s[h], a = y[2 * h], b = y[2 * h + 1];
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
    // the finish's inputs after the pooling, not beside it: live through the pooling they raise the prefill's registers
    // (HCA's 512-thread CTA can lose its second slot on an SM) for a latency the prefill's many CTAs hide anyway
    const float4 w4 = ld4(norm_w + c0);
    const Rot rot = rope_rot(rope_in(freqs, c0), (i64)i * kR, c0);
    float e[4];
    merge_groups(p, e);
    const PoolOut out{pool_data, pool_scale, pool_gs, capacity, bad};
    finish_entry(e, rot, w4, eps, slots[w], out, dbg ? dbg + (i64)w * kD : nullptr);
}

// The decode state of sequence b: fp32 (coff, SPLIT, 3, D), part x group x (m, den, num) x channel: for each group g
// of an entry's slots, the online softmax of the group's slots seen so far, in slot order. Part 0 is the entry in
// progress (CSA: the previous window's group-g slots with channels [0, D), then this window's with [D, 2D)); CSA's
// part 1 is the next entry's first half (this window's group-g slots, channels [0, D)). A decode step adds its token
// to its group's chains and, when the window closes, merges the groups and finishes the entry: the same adds and the
// same merge, in the same order, as the prefill's CTA for that entry, so both write the same bytes; the state is
// 3 coff SPLIT D floats whatever the ratio (HCA: 24 KB a sequence, against the 512 KB of its 128 raw slots).
__device__ __forceinline__ float* chain_ptr(float* st, int b, int part, int g) {
    return st + ((((i64)b * kCoff + part) * kSplit + g) * 3) * kD;
}
__device__ __forceinline__ void load_chain(Pool4& p, const float* ch, int c0) {
    const float4 m = ld4(ch + c0), d = ld4(ch + kD + c0), n = ld4(ch + 2 * kD + c0);
    p.m[0] = m.x; p.m[1] = m.y; p.m[2] = m.z; p.m[3] = m.w;
    p.den[0] = d.x; p.den[1] = d.y; p.den[2] = d.z; p.den[3] = d.w;
    p.num[0] = n.x; p.num[1] = n.y; p.num[2] = n.z; p.num[3] = n.w;
}
__device__ __forceinline__ void store_chain(const Pool4& p, float* ch, int c0) {
    *reinterpret_cast<float4*>(ch + c0) = make_float4(p.m[0], p.m[1], p.m[2], p.m[3]);
    *reinterpret_cast<float4*>(ch + kD + c0) = make_float4(p.den[0], p.den[1], p.den[2], p.den[3]);
    *reinterpret_cast<float4*>(ch + 2 * kD + c0) = make_float4(p.num[0], p.num[1], p.num[2], p.num[3]);
}

// The state after a prefill (CTA b, group g): part 0 pools CSA's last complete window (its group-g slots, channels
// [0, D); none if there is no complete window) and then the tail tokens of group g's slots (channels [D, 2D) for CSA,
// [0, D) for HCA); CSA's part 1 pools the same tail tokens with channels [0, D).
extern "C" __global__ void __launch_bounds__(kThreads)
nvfp4_kv_prefill_state(const float* __restrict__ kv, const float* __restrict__ score, const int* __restrict__ cu_seqlens,
                       const float* __restrict__ ape,
                       float* __restrict__ st) {                   // (B, coff, SPLIT, 3, D) fp32
    const int b = blockIdx.x;
    const i64 s0 = cu_seqlens[b], len = cu_seqlens[b + 1] - s0, nwin = len / kR, tail = len - nwin * kR;
    const int g = threadIdx.x / kGroup, c0 = 4 * (threadIdx.x % kGroup), j0 = g * kPer;
    const int off = (kCoff - 1) * kD;
    Pool4 p, q;
    p.init();
    q.init();
    if (kCoff == 2 && nwin > 0) {
        const i64 o = (s0 + (nwin - 1) * kR + j0) * kLd + c0;
        pool_part(p, score + o, kv + o, ape + (i64)j0 * kLd + c0);
    }
    const i64 t0 = s0 + nwin * kR;                               // the tail's first token
    for (int j = j0; j < j0 + kPer && j < tail; ++j) {
        const i64 o = (t0 + j) * kLd;
        const float* a = ape + (i64)j * kLd;
        p.add(add4(ld4(score + o + off + c0), ld4(a + off + c0)), ld4(kv + o + off + c0));
        if (kCoff == 2) q.add(add4(ld4(score + o + c0), ld4(a + c0)), ld4(kv + o + c0));
    }
    store_chain(p, chain_ptr(st, b, 0, g), c0);
    if (kCoff == 2) store_chain(q, chain_ptr(st, b, 1, g), c0);
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
                         float* st,                          // (B, coff, SPLIT, 3, D) fp32 (read and written)
                         float* __restrict__ dbg) {          // (B, D) fp32 pre-quantization entries, or nullptr
    const int b = blockIdx.x;
    const int g = threadIdx.x / kGroup, c0 = 4 * (threadIdx.x % kGroup);
    float* P = chain_ptr(st, b, 0, g);
    float* Q = chain_ptr(st, b, kCoff - 1, g);                 // CSA's part 1 (HCA: unused)
    Pool4 p, q;
    load_chain(p, P, c0);                                      // the chains do not depend on the position: their loads
    if (kCoff == 2) load_chain(q, Q, c0);                      // go out with pos's, and so do the finish's inputs
    const float4 w4 = ld4(norm_w + c0);
    const RopeIn ri = rope_in(freqs, c0);
    const int slot = slots[b];                                 // read now, not at the finish: one DRAM trip fewer
    const i64 ps = pos[b];
    if (ps < 0) return;
    const int k = (int)(ps % kR);
    const bool mine = (k / kPer) == g, close = k == kR - 1;    // close: uniform over the CTA
    float4 s1, a1, x1, s0, a0, x0;                             // this token's loads (CSA: both parts), issued first ...
    const int off = (kCoff - 1) * kD;
    if (mine) {
        const float* x = kv + (i64)b * kLd;
        const float* s = score + (i64)b * kLd;
        const float* a = ape + (i64)k * kLd;
        s1 = ld4(s + off + c0); a1 = ld4(a + off + c0); x1 = ld4(x + off + c0);
        if (kCoff == 2) { s0 = ld4(s + c0); a0 = ld4(a + c0); x0 = ld4(x + c0); }
    }
    const Rot rot = close ? rope_rot(ri, ps - (kR - 1), c0) : Rot{};   // ... so the double sincos overlaps them
    if (mine) {                                                // the token joins its group's chains
        p.add(add4(s1, a1), x1);
        if (kCoff == 2) q.add(add4(s0, a0), x0);
        if (!close) {
            store_chain(p, P, c0);
            if (kCoff == 2) store_chain(q, Q, c0);
        }
    }
    if (!close) return;
    float e[4];
    merge_groups(p, e);                                        // every group's chain is complete: merged in group order
    const PoolOut out{pool_data, pool_scale, pool_gs, capacity, bad};
    finish_entry(e, rot, w4, eps, slot, out, dbg ? dbg + (i64)b * kD : nullptr);
    Pool4 z;                                                   // the next entry: part 0 continues from part 1 (CSA) or
    z.init();                                                  // starts empty; part 1 starts empty
    store_chain(kCoff == 2 ? q : z, P, c0);
    if (kCoff == 2) store_chain(z, Q, c0);
}
