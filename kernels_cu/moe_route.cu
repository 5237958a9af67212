// moe_route.cu -- the DSV4 MoE layer's small kernels around the two grouped GEMMs (nbs/04_routing.ipynb):
//
//   moe_router_logits  logits = x . w_gate^T in fp32                            (T, E)
//   moe_route          sqrt(softplus) scores, top-k of score + bias (or the hash table, or a given routing), the
//                      normalized and scaled weights, and the expert-major row of every (token, slot): per-chunk counts, then the
//                      last CTA to finish scans them into expert_offsets and per-chunk bases
//   moe_permute        x -> expert-major rows (bf16, or for W4A4 quantized to NVFP4 with the expert's static global
//                      scale and written decoded: code * block scale, exact in bf16), the GEMM's per-row (gs_a, p),
//                      and inv (T, k + 1): the row of every (token, slot)
//   moe_permute_fp8    W4A8: moe_permute's rows in E4M3 with one scale per row (fp8_quantize_rows_bf16's bits)
//   moe_combine        out[t] = sum over slots j = 0 .. k of rows[inv[t, j]] in fp32 in slot order, then bf16
//   moe_route_small    a decode step (<= 4 tokens): moe_router_logits + moe_route + moe_permute in one launch, the same
//                      device functions in the same order (the same bits); its logits CTAs also store each logit's
//                      score and selection key, so the last CTA's top-k only selects; moe_route_small_wide: the same
//                      with twice the warps, for W4A4 rows (their quantization is the tail's longest step)
//
// Local experts (an expert-parallel slice): with a table g2l (NE,) mapping each routed expert to its group on this
// layer (-1: held elsewhere) and the shared expert's group sg (-1: held elsewhere), only the (token, slot)s of the
// layer's own G groups get rows (expert-major by group, offsets (G,)); the others get row -1 and the combine skips
// them. Without g2l the groups are the experts: G = NE + 1, sg = NE.
//
// Every launch has a fixed shape: a token count T_cap and, optionally, a device scalar n (<= T_cap) of real tokens;
// tokens t >= n are not routed (no rows, no output). Nothing synchronizes with the host, so the chain is CUDA-graph
// capturable and replays with new inputs and new routing.
//
// Determinism: every sum has a fixed order (the logits' butterfly, the weights' j = 0..k-1, the combine's slots) and
// the rows of an expert are in token order (rank = tokens of the chunk before t that chose e, from a bitmask; then
// per-chunk bases from one scan), so the permutation, the offsets and the output are identical run to run. It is the
// same permutation as `route_topk`'s stable sort (tests compare them).
//
// Compile-time constants (the launcher passes them as defines):
//   HID   hidden size, a multiple of 1024 (moe_router_logits, moe_permute, moe_combine)
//   TOPK  routed experts per token (moe_route, moe_permute, moe_combine)
//   NE    routed experts E (moe_route); NE + 1 (the shared expert) <= 1024
#include "nvfp4_common.cuh"

using namespace nvfp4;
typedef __nv_bfloat16 bf16;
typedef unsigned long long u64;

#ifndef HID
#define HID 4096
#endif
#ifndef TOPK
#define TOPK 6
#endif
#ifndef NE
#define NE 256
#endif

constexpr int kRouteThreads = 256;  // 8 warps; a CTA routes a chunk of <= 64 tokens (one 64-bit mask word per expert)
constexpr int kNE1 = NE + 1;        // routed experts + the shared one (expert id NE)
constexpr int kNPL = (NE + 31) / 32;  // experts held per lane in the top-k

static_assert(HID % 1024 == 0, "HID must be a multiple of 1024");
static_assert(NE >= 1 && kNE1 <= 1024, "1 <= NE and NE + 1 <= 1024");
static_assert(TOPK >= 1 && TOPK < 32 && TOPK <= NE, "1 <= TOPK <= min(31, NE)");

__device__ __forceinline__ int n_real(const i64* n_ptr, int T) {
    if (n_ptr == nullptr) return T;
    const i64 n = *n_ptr;
    return n < 0 ? 0 : (n > T ? T : (int)n);
}

__device__ __forceinline__ void bf16x8_to_float(uint4 q, float (&v)[8]) {
    bf16x2_to_float2(q.x, v[0], v[1]); bf16x2_to_float2(q.y, v[2], v[3]);
    bf16x2_to_float2(q.z, v[4], v[5]); bf16x2_to_float2(q.w, v[6], v[7]);
}

// DSV4's score: sqrt(softplus(l)) with torch's softplus (threshold 20: l > 20 -> l), IEEE sqrt.
__device__ __forceinline__ float dsv4_score(float l) {
    const float sp = l > 20.0f ? l : log1pf(expf(l));
    return __fsqrt_rn(sp);
}

// ---------------------------------------------------------------------------------------------
// Router logits for small T: CTA (b, y) owns experts kG*b .. kG*b + kG - 1 and tokens tiles y, y + grid.y, ... and keeps
// the experts' weights in registers (read from HBM once per CTA); its 4 warps split K in 16-byte chunks (chunk c = i*128 + warp*32 + lane), each token's partial dot is a
// warp butterfly, the 4 partials are added in warp order. bf16 products are exact in fp32, so this is an fp32 dot
// product in a fixed order (a cuBLAS fp32 GEMM sums in another order: same precision, different last bits).
constexpr int kLogitWarps = 4, kG = 2, kTokTile = 64;
constexpr int kChunksPerLane = HID / 8 / (kLogitWarps * 32);

// With `pre` (moe_route_small and _wide) each logit's DSV4 score and selection key (score + bias) are stored beside it,
// so the last CTA's top-k reads them instead of computing 256 scores in one warp: the same functions, the same bits.
// kWarps: the CTA's warps; a wider CTA (moe_route_small_wide's) computes with its first kLogitWarps.
template <int kWarps = kLogitWarps>
__device__ __forceinline__ void router_logits_cta(const bf16* __restrict__ x, const bf16* __restrict__ w, int T, int E,
                                                  float* __restrict__ logits, float (*part)[kG][kTokTile],
                                                  const float* __restrict__ bias = nullptr, float2* __restrict__ pre = nullptr) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, e0 = blockIdx.x * kG;
    const bool dot = kWarps == kLogitWarps || warp < kLogitWarps;
    float bz[kG];                                // the bias of this CTA's experts, loaded beside the gate rows
#pragma unroll
    for (int g = 0; g < kG; ++g) bz[g] = (pre != nullptr && bias != nullptr && e0 + g < E) ? bias[e0 + g] : 0.0f;
    uint4 wr[kG][kChunksPerLane];
#pragma unroll
    for (int g = 0; g < kG; ++g)
#pragma unroll
        for (int i = 0; i < kChunksPerLane; ++i)
            wr[g][i] = (dot && e0 + g < E) ? reinterpret_cast<const uint4*>(w + (i64)(e0 + g) * HID)[i * 128 + warp * 32 + lane]
                                    : make_uint4(0u, 0u, 0u, 0u);
    for (int t0 = blockIdx.y * kTokTile; t0 < T; t0 += gridDim.y * kTokTile) {   // grid.y splits the tokens
        const int nt = min(kTokTile, T - t0);
        for (int tt = 0; dot && tt < nt; ++tt) {
            const uint4* xr = reinterpret_cast<const uint4*>(x + (i64)(t0 + tt) * HID);
            float acc[kG];
#pragma unroll
            for (int g = 0; g < kG; ++g) acc[g] = 0.0f;
#pragma unroll
            for (int i = 0; i < kChunksPerLane; ++i) {
                float xv[8];
                bf16x8_to_float(xr[i * 128 + warp * 32 + lane], xv);
#pragma unroll
                for (int g = 0; g < kG; ++g) {
                    float wv[8];
                    bf16x8_to_float(wr[g][i], wv);
#pragma unroll
                    for (int k = 0; k < 8; ++k) acc[g] = __fmaf_rn(xv[k], wv[k], acc[g]);
                }
            }
#pragma unroll
            for (int g = 0; g < kG; ++g) {
                const float s = warp_sum(acc[g]);
                if (lane == 0) part[warp][g][tt] = s;
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < kG * nt; i += blockDim.x) {
            const int g = i / nt, tt = i - g * nt;
            if (e0 + g < E) {
                float s = part[0][g][tt];
#pragma unroll
                for (int q = 1; q < kLogitWarps; ++q) s = __fadd_rn(s, part[q][g][tt]);
                logits[(i64)(t0 + tt) * E + e0 + g] = s;
                if (pre != nullptr) {
                    const float sc = dsv4_score(s);
                    float bg = bz[0];                    // bz[g] without a local-memory index
#pragma unroll
                    for (int q = 1; q < kG; ++q) if (g == q) bg = bz[q];
                    pre[(i64)(t0 + tt) * E + e0 + g] = make_float2(bias != nullptr ? __fadd_rn(sc, bg) : sc, sc);
                }
            }
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(kLogitWarps * 32)
moe_router_logits(const bf16* __restrict__ x,       // (T, HID)
                  const bf16* __restrict__ w,       // (E, HID)
                  int T, int E,
                  float* __restrict__ logits) {     // (T, E)
    __shared__ float part[kLogitWarps][kG][kTokTile];
    router_logits_cta(x, w, T, E, logits, part);
}

// ---------------------------------------------------------------------------------------------
// Top-k with a total order: the key's bits made monotone as an unsigned integer (NaN lowest), the expert id
// complemented below it, so the 64-bit max picks the largest key and, among equal keys, the lower expert id, and
// every lane of the butterfly gets the same winner.
__device__ __forceinline__ u64 order_key(float v, int e) {
    const u32 b = __float_as_uint(v);
    const u32 o = (v != v) ? 0u : ((b & 0x80000000u) ? ~b : (b | 0x80000000u));
    return ((u64)o << 32) | (u64)(0xffffffffu - (u32)e);
}
// The warp's largest 64-bit key, in every lane: the largest high word (one warp reduction), then the largest low
// word among the lanes holding it (a second): the order of u64 max, in two REDUX instead of ten shuffles.
__device__ __forceinline__ u64 warp_max_u64(u64 v) {
    const u32 hi = (u32)(v >> 32);
    const u32 mhi = __reduce_max_sync(0xffffffffu, hi);
    const u32 mlo = __reduce_max_sync(0xffffffffu, hi == mhi ? (u32)v : 0u);
    return ((u64)mhi << 32) | (u64)mlo;
}

// One warp routes token t (chunk-local index lt): top-k of score + bias (or the hash table, or the given routing),
// the normalized scaled weights into topk_w / topk_ids, and bit lt of the mask of every group it visits (shared memory).
// The logits are read through L2 (__ldcg): in moe_route_small other CTAs of the same launch wrote them.
__device__ __forceinline__ void route_token(int t, int lt, int lane,
                                            const float* __restrict__ logits, const float* __restrict__ bias,
                                            const int* __restrict__ tid2eid, const i64* __restrict__ input_ids, i64 vocab,
                                            const int* __restrict__ given_ids, const float* __restrict__ given_w,
                                            float scale, const int* __restrict__ g2l, int sg,
                                            float* __restrict__ topk_w, int* __restrict__ topk_ids, u64* mask,
                                            int* __restrict__ bad, const float2* __restrict__ pre = nullptr) {
    const float* lrow = logits + (i64)t * NE;
    int id = -1;            // lane j < TOPK: the id of slot j
    float sv = 0.0f;        // and its unbiased score
    if (tid2eid == nullptr && given_ids == nullptr) {
        float key[kNPL], s[kNPL];
#pragma unroll
        for (int i = 0; i < kNPL; ++i) {
            const int e = lane + 32 * i;
            if (pre != nullptr) {                // (key, score) from the logits CTAs (L2: written by this launch)
                const float2 p = e < NE ? __ldcg(pre + (i64)t * NE + e) : make_float2(0.0f, 0.0f);
                key[i] = p.x; s[i] = p.y;
            } else {
                s[i] = e < NE ? dsv4_score(__ldcg(lrow + e)) : 0.0f;
                key[i] = e < NE ? (bias ? __fadd_rn(s[i], bias[e]) : s[i]) : 0.0f;
            }
        }
        u32 taken = 0u;
        u64 ok[kNPL];
#pragma unroll
        for (int i = 0; i < kNPL; ++i) {
            if (lane + 32 * i >= NE) taken |= 1u << i;
            ok[i] = order_key(key[i], lane + 32 * i);
        }
        for (int j = 0; j < TOPK; ++j) {
            u64 best = 0ull; float bs = 0.0f;
#pragma unroll
            for (int i = 0; i < kNPL; ++i)
                if (!((taken >> i) & 1u) && ok[i] > best) { best = ok[i]; bs = s[i]; }
            const u64 win = warp_max_u64(best);
            const int e = (int)(0xffffffffu - (u32)win);
            const float se = __shfl_sync(0xffffffffu, bs, e & 31);
            if ((e & 31) == lane) taken |= 1u << (e >> 5);
            if (lane == j) { id = e; sv = se; }
        }
    } else {
        // Hash or given ids: a token id outside [0, vocab), an expert id outside [0, NE) or a repeated expert
        // makes the whole token bad: counted, routed to experts 0..TOPK-1 with NaN weights (its output is NaN).
        bool ok = true;
        i64 tok = 0;
        if (given_ids == nullptr) { tok = input_ids[t]; ok = tok >= 0 && tok < vocab; }
        if (lane < TOPK && ok) id = given_ids ? given_ids[(i64)t * TOPK + lane] : tid2eid[tok * TOPK + lane];
        const bool in = lane >= TOPK || (id >= 0 && id < NE);
        const u32 same = __match_any_sync(0xffffffffu, lane < TOPK ? id : -1 - lane);
        ok = __all_sync(0xffffffffu, ok && in && (lane >= TOPK || __popc(same) == 1));
        if (!ok && lane == 0 && bad != nullptr) atomicAdd(bad, 1);
        if (lane < TOPK) {
            if (!ok) { id = lane; sv = __int_as_float(0x7fffffff); }
            else sv = given_ids ? given_w[(i64)t * TOPK + lane] : dsv4_score(__ldcg(lrow + id));
        }
    }
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < TOPK; ++j) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, sv, j));
    if (lane < TOPK) {
        topk_w[(i64)t * TOPK + lane] = given_ids ? sv : __fmul_rn(__fdiv_rn(sv, sum), scale);
        topk_ids[(i64)t * TOPK + lane] = id;
    }
    if (lane <= TOPK) {
        const int g = lane < TOPK ? (g2l ? g2l[id] : id) : sg;
        if (g >= 0) atomicOr(&mask[g], 1ull << lt);
    }
}

// The group of slot j of token t (its own write of topk_ids, or one made visible by a barrier), -1: not here.
__device__ __forceinline__ int slot_group(int t, int j, const int* __restrict__ topk_ids, const int* __restrict__ g2l, int sg) {
    if (j == TOPK) return sg;
    const int e = topk_ids[(i64)t * TOPK + j];
    return g2l ? g2l[e] : e;
}

// tot[0 .. ng) (shared) -> exclusive starts in place, offsets = inclusive ends. Every thread of the CTA calls it.
template <int kThreads>
__device__ __forceinline__ void scan_groups(int* tot, int* wsum, int ng, int* __restrict__ offsets) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    constexpr int kPer = (kNE1 + kThreads - 1) / kThreads;     // consecutive entries per thread, then a block scan
    int v[kPer], run = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
        const int e = threadIdx.x * kPer + i;
        v[i] = e < ng ? tot[e] : 0;
        run += v[i];
    }
    int inc = run;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += y;
    }
    if (lane == 31) wsum[warp] = inc;
    __syncthreads();
    int before = inc - run;
    for (int q = 0; q < warp; ++q) before += wsum[q];
    __syncthreads();                               // everyone has read tot: overwrite it with the exclusive starts
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
        const int e = threadIdx.x * kPer + i;
        if (e < ng) { tot[e] = before; offsets[e] = before + v[i]; }
        before += v[i];
    }
    __syncthreads();
}

// The threadfence reduction pattern: every CTA publishes its global writes and takes a ticket; true (for the whole
// CTA) in the last one to arrive, which then sees every other CTA's writes. Every thread of the CTA calls it.
__device__ __forceinline__ bool arrive_last(u32* ticket) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
    return true;
}

extern "C" __global__ void __launch_bounds__(kRouteThreads)
moe_route(const float* __restrict__ logits,      // (T, E) fp32
          const float* __restrict__ bias,        // (E,) or nullptr
          const int* __restrict__ tid2eid,       // (vocab, TOPK) or nullptr: hash routing
          const i64* __restrict__ input_ids,     // (T,) with tid2eid
          i64 vocab,
          const int* __restrict__ given_ids,     // (T, TOPK) or nullptr: a given routing (ids and weights as given)
          const float* __restrict__ given_w,     // (T, TOPK) with given_ids
          const i64* __restrict__ n_ptr,         // real tokens (device scalar) or nullptr (= T)
          int T, float scale,                    // routed_scaling_factor
          int chunk,                             // tokens per CTA (<= 64, a multiple of 8)
          const int* __restrict__ g2l,           // (NE,): group of each routed expert on this layer, -1 elsewhere; nullptr: identity
          int ng, int sg,                        // groups G (<= NE + 1) and the shared expert's group (-1: not here)
          float* __restrict__ topk_w,            // (T, TOPK) fp32
          int* __restrict__ topk_ids,            // (T, TOPK) int32
          int* __restrict__ rank,                // (T, TOPK + 1): row of (t, j) within its group's rows of this chunk, -1: not here
          int* __restrict__ chunk_counts,        // (n_chunks, G)
          int* __restrict__ chunk_base,          // (n_chunks, G): first row of group g for this chunk
          int* __restrict__ offsets,             // (G,) cumulative end offsets
          u32* __restrict__ ticket,              // one counter, 0 between launches (the last CTA resets it)
          int* __restrict__ bad) {               // counts tokens with a bad input_id / given or table ids (or nullptr)
    __shared__ u64 mask[kNE1];
    __shared__ int tot[kNE1];
    __shared__ int wsum[kRouteThreads / 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = n_real(n_ptr, T);
    for (int e = threadIdx.x; e < kNE1; e += blockDim.x) mask[e] = 0ull;
    __syncthreads();

    const int tpw = chunk / (kRouteThreads / 32), c0 = blockIdx.x * chunk;
#pragma unroll 1
    for (int q = 0; q < tpw; ++q) {
        const int lt = warp + q * (kRouteThreads / 32), t = c0 + lt;
        if (t >= n) break;
        route_token(t, lt, lane, logits, bias, tid2eid, input_ids, vocab, given_ids, given_w, scale, g2l, sg, topk_w, topk_ids, mask, bad);
    }
    __syncthreads();
#pragma unroll 1
    for (int q = 0; q < tpw; ++q) {
        const int lt = warp + q * (kRouteThreads / 32), t = c0 + lt;
        if (t >= n) break;
        if (lane <= TOPK) {      // this lane wrote topk_ids[t, lane] above (its own write: visible to it)
            const int g = slot_group(t, lane, topk_ids, g2l, sg);
            rank[(i64)t * (TOPK + 1) + lane] = g >= 0 ? __popcll(mask[g] & ((1ull << lt) - 1ull)) : -1;
        }
    }
    for (int e = threadIdx.x; e < ng; e += blockDim.x) chunk_counts[(i64)blockIdx.x * ng + e] = __popcll(mask[e]);

    // The last CTA to get here scans the counts.
    if (!arrive_last(ticket)) return;
    const int nch = gridDim.x;
    for (int e = threadIdx.x; e < ng; e += blockDim.x) {
        int s = 0;
        for (int c = 0; c < nch; ++c) s += __ldcg(chunk_counts + (i64)c * ng + e);
        tot[e] = s;
    }
    __syncthreads();
    scan_groups<kRouteThreads>(tot, wsum, ng, offsets);
    for (int e = threadIdx.x; e < ng; e += blockDim.x) {
        int b = tot[e];
        for (int c = 0; c < nch; ++c) {
            chunk_base[(i64)c * ng + e] = b;
            b += __ldcg(chunk_counts + (i64)c * ng + e);
        }
    }
    if (threadIdx.x == 0) *ticket = 0u;
}

// ---------------------------------------------------------------------------------------------
// Permute: token t's row to its TOPK + 1 expert-major rows pos[j] (those of this layer's groups; -1: skipped), the
// whole CTA striding over the row. W4A4 (a1 != nullptr): each 16-block is quantized with slot j's group's static
// global scale gsa[j] exactly as nvfp4_quantize.cu does, and written decoded (code * block scale: at most 6
// significant bits, exact in bf16); the GEMM applies the scale per row (row_scales).
template <int kThreads>   // the CTA's block size: the bf16 copy issues all of a thread's loads before its first store
__device__ __forceinline__ void permute_token(const bf16* __restrict__ src, const int* pos, const float* gsa, bool w4a4,
                                              bf16* __restrict__ xr) {
    if (!w4a4) {
        constexpr int kC = (HID / 8 + kThreads - 1) / kThreads;    // 16-byte chunks per thread
        const uint4* s4 = reinterpret_cast<const uint4*>(src);
        uint4 v[kC];
#pragma unroll
        for (int i = 0; i < kC; ++i) {
            const int c = threadIdx.x + i * kThreads;
            if (c < HID / 8) v[i] = s4[c];
        }
#pragma unroll
        for (int i = 0; i < kC; ++i) {
            const int c = threadIdx.x + i * kThreads;
            if (c >= HID / 8) continue;
#pragma unroll
            for (int j = 0; j <= TOPK; ++j) if (pos[j] >= 0) reinterpret_cast<uint4*>(xr + (i64)pos[j] * HID)[c] = v[i];
        }
        return;
    }
    for (int b = threadIdx.x; b < HID / 16; b += blockDim.x) {
        float v[16];
        const u32 amax = load16_amax<bf16>(src + b * 16, v);
#pragma unroll 1
        for (int j = 0; j <= TOPK; ++j) {
            if (pos[j] < 0) continue;
            u32 lo, hi;
            const u32 sb = quantize_block16(v, amax, gsa[j], lo, hi);
            const float s = e4m3_to_float(sb);
            u32 o[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const u32 w = k < 4 ? lo : hi, sh = 8 * (k & 3);
                const float a = __fmul_rn(e2m1_to_float((w >> sh) & 15u), s);
                const float c = __fmul_rn(e2m1_to_float((w >> (sh + 4)) & 15u), s);
                const __nv_bfloat162 h2 = __floats2bfloat162_rn(a, c);
                o[k] = *reinterpret_cast<const u32*>(&h2);
            }
            uint4* dst = reinterpret_cast<uint4*>(xr + (i64)pos[j] * HID + b * 16);
            dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
            dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
        }
    }
}

// Slot j of token t has row p (-1: not here): inv, and the L1's per-row (gs_a, p).
__device__ __forceinline__ void place_slot(int t, int j, int g, int p, const float* __restrict__ topk_w,
                                           const float* __restrict__ a1, int* pos, float* gsa,
                                           float* __restrict__ row_scales, int* __restrict__ inv) {
    const float s = a1 && g >= 0 ? a1[g] : 1.0f;
    pos[j] = p; gsa[j] = s;
    inv[(i64)t * (TOPK + 1) + j] = p;
    if (p >= 0) {
        row_scales[(i64)p * 2] = s;
        row_scales[(i64)p * 2 + 1] = j < TOPK ? topk_w[(i64)t * TOPK + j] : 1.0f;
    }
}

// The k + 1 slots of token t after moe_route (thread j places slot j): its row from the chunk's base and the token's
// rank, then as place_slot. The callers' barrier makes pos and gsa visible.
__device__ __forceinline__ void place_token_slots(int t, const int* __restrict__ topk_ids, const float* __restrict__ topk_w,
                                                  const int* __restrict__ rank, const int* __restrict__ chunk_base,
                                                  const int* __restrict__ g2l, int ng, int sg, int chunk,
                                                  const float* __restrict__ a1, int* pos, float* gsa,
                                                  float* __restrict__ row_scales, int* __restrict__ inv) {
    if (threadIdx.x <= TOPK) {
        const int j = threadIdx.x, g = slot_group(t, j, topk_ids, g2l, sg);
        const int p = g >= 0 ? chunk_base[(i64)(t / chunk) * ng + g] + rank[(i64)t * (TOPK + 1) + j] : -1;
        place_slot(t, j, g, p, topk_w, a1, pos, gsa, row_scales, inv);
    }
}

constexpr int kPermThreads = 256;

extern "C" __global__ void __launch_bounds__(kPermThreads)
moe_permute(const bf16* __restrict__ x,          // (T, HID)
            const i64* __restrict__ n_ptr, int T,
            const int* __restrict__ topk_ids,    // (T, TOPK)
            const float* __restrict__ topk_w,    // (T, TOPK)
            const int* __restrict__ rank,        // (T, TOPK + 1)
            const int* __restrict__ chunk_base,  // (n_chunks, G)
            const int* __restrict__ g2l,         // as moe_route's
            int ng, int sg,
            int chunk,                           // moe_route's tokens per CTA
            const float* __restrict__ a1,        // (G,) static global scales of x (W4A4) or nullptr (W4A16)
            bf16* __restrict__ xr,               // (R, HID) expert-major rows
            float* __restrict__ row_scales,      // (R, 2): (gs_a, p) per row
            int* __restrict__ inv) {             // (T, TOPK + 1): the row of (t, j), -1 when its expert is not here
    __shared__ int pos[TOPK + 1];
    __shared__ float gsa[TOPK + 1];
    const int t = blockIdx.x;                    // one CTA per token
    if (t >= n_real(n_ptr, T)) return;
    place_token_slots(t, topk_ids, topk_w, rank, chunk_base, g2l, ng, sg, chunk, a1, pos, gsa, row_scales, inv);
    __syncthreads();
    permute_token<kPermThreads>(x + (i64)t * HID, pos, gsa, a1 != nullptr, xr);
}

// W4A8: the same rows in E4M3 with one scale per row, bit for bit fp8_quantize_rows_bf16 (fp8_quantize.cu) of the rows
// moe_permute writes (each an exact copy of x[t]): s = amax(x[t]) / 448 (1 for a zero row, NaN for a row holding NaN or
// Inf), q = e4m3_satfinite(x / s). Every slot of token t gets the same bytes; xs[p] = s and row_scales[p] = (s, weight)
// (the L1 applies s per row). One read of x[t] for its amax, one for its values; each row written once, in E4M3.
extern "C" __global__ void __launch_bounds__(kPermThreads)
moe_permute_fp8(const bf16* __restrict__ x,          // (T, HID)
                const i64* __restrict__ n_ptr, int T,
                const int* __restrict__ topk_ids,    // (T, TOPK)
                const float* __restrict__ topk_w,    // (T, TOPK)
                const int* __restrict__ rank,        // (T, TOPK + 1)
                const int* __restrict__ chunk_base,  // (n_chunks, G)
                const int* __restrict__ g2l,         // as moe_route's
                int ng, int sg,
                int chunk,                           // moe_route's tokens per CTA
                u8* __restrict__ xq,                 // (R, HID) E4M3 expert-major rows
                float* __restrict__ xs,              // (R,): each row's scale
                float* __restrict__ row_scales,      // (R, 2): (s, p) per row
                int* __restrict__ inv) {             // (T, TOPK + 1)
    __shared__ int pos[TOPK + 1];
    __shared__ float gsa[TOPK + 1];
    __shared__ u32 sh[32];
    const int t = blockIdx.x;                    // one CTA per token
    if (t >= n_real(n_ptr, T)) return;
    place_token_slots(t, topk_ids, topk_w, rank, chunk_base, g2l, ng, sg, chunk, nullptr, pos, gsa, row_scales, inv);
    const bf16* __restrict__ src = x + (i64)t * HID;
    u32 m = 0u;
    for (int b = threadIdx.x; b < HID / 16; b += kPermThreads) {
        float v[16];
        load16(src + b * 16, v);
#pragma unroll
        for (int i = 0; i < 16; ++i) m = max(m, abs_bits(v[i]));
    }
    const float s = fp8_row_scale(block_max_u32_once(m, sh));   // its barrier also makes pos visible
    if (threadIdx.x <= TOPK && pos[threadIdx.x] >= 0) {    // the thread that placed slot j: after its own writes
        row_scales[(i64)pos[threadIdx.x] * 2] = s;
        xs[pos[threadIdx.x]] = s;
    }
    for (int b = threadIdx.x; b < HID / 16; b += kPermThreads) {
        float v[16];
        load16(src + b * 16, v);
        const uint4 q4 = fp8_pack16(v, s);
#pragma unroll
        for (int j = 0; j <= TOPK; ++j)
            if (pos[j] >= 0) *reinterpret_cast<uint4*>(xq + (i64)pos[j] * HID + b * 16) = q4;
    }
}

// ---------------------------------------------------------------------------------------------
// Decode (T <= kSmallMaxT tokens): logits, route, scan and permute in ONE launch (three fewer kernel boundaries on
// the latency-bound path). Every CTA computes the logits of its kG experts (as moe_router_logits); the last CTA to
// finish (ticket) routes the tokens (warp w: token w), scans the groups (one chunk) and writes the rows (as
// moe_route + moe_permute). Same arithmetic in the same order as the three kernels: the same bits.
// moe_route_small's CTA is the logits' kLogitWarps warps; moe_route_small_wide's, for W4A4 rows (each 16-block quantized
// once per slot, 7 times the work of a copy), kWideWarps, the extra ones idle until the last CTA's tail.
constexpr int kSmallMaxT = kLogitWarps, kWideWarps = 8;  // 8 warps: the logits' registers (HID 7168) fit under 256 threads

// route_small's parameters, once for the device function and its two entry points (forwarded in this order):
//   x (T, HID); w_gate (NE, HID); n_ptr, T (T <= kSmallMaxT); bias (NE,) or nullptr; tid2eid, input_ids, vocab (hash
//   routing) or nullptr; scale; g2l, ng, sg (the groups, as moe_route's); a1 (G,) W4A4 or nullptr; logits (T, NE);
//   pre (T, NE): (score + bias, score) of every logit; topk_w, topk_ids (T, TOPK); offsets (G,); xr, row_scales, inv (as
//   moe_permute's); ticket; bad
#define MOE_ROUTE_SMALL_PARAMS const bf16* __restrict__ x, const bf16* __restrict__ w_gate, const i64* __restrict__ n_ptr, \
    int T, const float* __restrict__ bias, const int* __restrict__ tid2eid, const i64* __restrict__ input_ids, i64 vocab, \
    float scale, const int* __restrict__ g2l, int ng, int sg, const float* __restrict__ a1, float* __restrict__ logits, \
    float2* __restrict__ pre, float* __restrict__ topk_w, int* __restrict__ topk_ids, int* __restrict__ offsets, \
    bf16* __restrict__ xr, float* __restrict__ row_scales, int* __restrict__ inv, u32* __restrict__ ticket, int* __restrict__ bad
#define MOE_ROUTE_SMALL_ARGS x, w_gate, n_ptr, T, bias, tid2eid, input_ids, vocab, scale, g2l, ng, sg, a1, logits, pre, topk_w, \
    topk_ids, offsets, xr, row_scales, inv, ticket, bad

template <int kWarps>
__device__ __forceinline__ void route_small(MOE_ROUTE_SMALL_PARAMS) {
    __shared__ float part[kLogitWarps][kG][kTokTile];
    __shared__ u64 mask[kNE1];
    __shared__ int tot[kNE1];
    __shared__ int wsum[kWarps];
    __shared__ int pos[kSmallMaxT][TOPK + 1];
    __shared__ float gsa[kSmallMaxT][TOPK + 1];
    if (T > kSmallMaxT || blockDim.x != kWarps * 32) __trap();   // the launcher never does this
    router_logits_cta<kWarps>(x, w_gate, T, NE, logits, part, tid2eid == nullptr ? bias : nullptr, tid2eid == nullptr ? pre : nullptr);
    if (!arrive_last(ticket)) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = n_real(n_ptr, T);
    for (int e = threadIdx.x; e < kNE1; e += blockDim.x) mask[e] = 0ull;
    __syncthreads();
    if (warp < n)
        route_token(warp, warp, lane, logits, bias, tid2eid, input_ids, vocab, nullptr, nullptr, scale, g2l, sg, topk_w, topk_ids, mask, bad,
                    tid2eid == nullptr ? pre : nullptr);
    __syncthreads();                             // masks and topk_ids visible to the CTA
    for (int e = threadIdx.x; e < ng; e += blockDim.x) tot[e] = __popcll(mask[e]);
    __syncthreads();
    scan_groups<kWarps * 32>(tot, wsum, ng, offsets);
    for (int i = threadIdx.x; i < n * (TOPK + 1); i += blockDim.x) {
        const int t = i / (TOPK + 1), j = i - t * (TOPK + 1), g = slot_group(t, j, topk_ids, g2l, sg);
        const int p = g >= 0 ? tot[g] + __popcll(mask[g] & ((1ull << t) - 1ull)) : -1;
        place_slot(t, j, g, p, topk_w, a1, pos[t], gsa[t], row_scales, inv);
    }
    __syncthreads();
    for (int t = 0; t < n; ++t) permute_token<kWarps * 32>(x + (i64)t * HID, pos[t], gsa[t], a1 != nullptr, xr);
    if (threadIdx.x == 0) *ticket = 0u;
}

#define MOE_ROUTE_SMALL_KERNEL(NAME, WARPS) \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(MOE_ROUTE_SMALL_PARAMS) { route_small<WARPS>(MOE_ROUTE_SMALL_ARGS); }
MOE_ROUTE_SMALL_KERNEL(moe_route_small, kLogitWarps)
MOE_ROUTE_SMALL_KERNEL(moe_route_small_wide, kWideWarps)

// ---------------------------------------------------------------------------------------------
// Combine: out[t] = bf16( (((rows[inv[t,0]] + rows[inv[t,1]]) + ...) + rows[inv[t,TOPK]]) ) in fp32, slot order (the
// shared expert last): bit-identical to the same sum in torch fp32 (the GPU tests). Slots with no row here (inv -1, a local
// layer) are skipped; a token with none gets zeros.
// CTA (t, y) sums the 16-byte chunks y * blockDim + i, stepping by blockDim * gridDim.y: any grid.y (the launcher splits
// a row over hidden / 1024 CTAs at few tokens) gives the same bits.
extern "C" __global__ void __launch_bounds__(256)
moe_combine(const bf16* __restrict__ rows,      // (R, HID), routing weights already applied
            const int* __restrict__ inv,        // (T, TOPK + 1)
            const i64* __restrict__ n_ptr, int T,
            bf16* __restrict__ out) {           // (T, HID)
    __shared__ int pos[TOPK + 1];
    const int t = blockIdx.x;
    if (t >= n_real(n_ptr, T)) return;
    if (threadIdx.x <= TOPK) pos[threadIdx.x] = inv[(i64)t * (TOPK + 1) + threadIdx.x];
    __syncthreads();
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < HID / 8; c += blockDim.x * gridDim.y) {
        uint4 q[TOPK + 1];                             // every load in flight before the first add
#pragma unroll
        for (int j = 0; j <= TOPK; ++j)
            q[j] = pos[j] >= 0 ? reinterpret_cast<const uint4*>(rows + (i64)pos[j] * HID)[c] : make_uint4(0u, 0u, 0u, 0u);
        float acc[8];
        bool any = false;
#pragma unroll
        for (int j = 0; j <= TOPK; ++j) {
            if (pos[j] < 0) continue;                  // uniform over the CTA
            float v[8];
            bf16x8_to_float(q[j], v);
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[k] = any ? __fadd_rn(acc[k], v[k]) : v[k];
            any = true;
        }
        if (!any) {
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[k] = 0.0f;
        }
        u32 o[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const __nv_bfloat162 h2 = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
            o[k] = *reinterpret_cast<const u32*>(&h2);
        }
        reinterpret_cast<uint4*>(out + (i64)t * HID)[c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
}
