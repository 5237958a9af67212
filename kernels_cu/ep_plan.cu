// ep_plan.cu -- the send plan, the NVFP4 payload and the receiver's sort of the expert-parallel layer's fixed-shape
// forward (nbs/08a_ep_transport.ipynb, `CapturedEP`), in a few launches instead of some fifty small torch ops:
//
//   ep_plan_count + ep_plan_place   every routed (token, slot) s of this rank's T_max tokens gets its row in the send
//             buffer, and every send row its (expert id, weight bits) and its token:
//               key(s)    = chunk(s) * W + dest(s) for a real token (token < n), else "not sent";
//                           dest(s) = clamp(id / per_rank, 0, W - 1); chunk(s) = token / Tc, or with by_expert the
//                           chunk of the slot's expert among its rank's: clamp(id - dest * per_rank, 0, per_rank - 1) * C / per_rank
//               within(s) = the slots before s (in slot order) with the same key: a stable counting sort
//               spos(s)   = (chunk * W + seg[dest]) * cap + within   when within < cap, else R (dropped, or not sent),
//                           plus `far` unless the slot is sent and dest == rank: the row the final combine reads
//                           (on the GPU far = R: a rank's own rows are read where its experts wrote them, the others
//                           R rows further, a dropped slot at 2R, the NaN row; far = 0 gives the send rows)
//               meta[r]   = (id, weight bits) of the slot at row r, (-1, 0) for a padding row
//               tok[r]    = the token of the slot at row r, T_max - 1 for a padding row (any valid row: never used)
//               *dropped += the real slots past the capacity
//             exactly what the torch ops of `CapturedEP._plan` and `_meta` compute (the tests compare them); meta and tok
//             are indexed by the send row, without `far`.
//
//   ep_pack_nvfp4   the NVFP4 payload of every sent slot straight from its token: codes and block scales of x[t]
//             under the slot's destination expert's a1, a1[clamp(meta[row].id, 0, E - 1)], into the slot's send row
//             (from spos: row = spos < R ? spos : spos - far; not sent when that is R), bit for bit what
//             quantize_nvfp4_cuda gives the gathered rows with that per-row global scale (the same quantize_block16).
//             One CTA per token: the row is read once for its k slots (a CTA per send row read it k times). The
//             padding rows of the send buffer are not written (their metadata names no expert: no receiver reads them).
//
//   ep_sort_count + ep_sort_place   a receiver's rows sorted by local expert, stably (what
//             torch.argsort(key, stable=True) gives):
//               key(row)  = id - e0 if that is in [0, per_rank), else per_rank (not a local expert: sorts last)
//               order[p]  = the row at sorted position p;  back[row] = its position
//               offs[e]   = the end of local expert e's rows (e < per_rank): the inclusive scan of the counts
//               rs[p]     = (a1[clamp(id, 0, E - 1)], w) of the row at p (fp32 pairs)
//             the same counting sort with per_rank + 1 keys (at most EP_SORT_MAXK: the launcher checks, the kernels trap).
//
// Both sorts run over G <= EP_GMAX CTAs of EP_THREADS = 512 threads, each on a contiguous range of `per_cta` slots (a
// multiple of EP_THREADS; the launcher picks it). The count kernel counts its range per key (shared atomics: counts
// only), writes them to a workspace, and the CTA that finishes last (a ticket, which atomicInc wraps back to zero)
// turns them into each (key, CTA)'s first position: the exclusive scan over the CTAs, plus (sort) the keys before it,
// or (plan) each key's total. The place kernel starts each key at its CTA's position, counts its warps' slots per
// key, scans over the warps, and places every slot in slot order: a warp's 32-slot tile groups equal keys with
// __match_any_sync, and each warp issues the loads of EP_BATCH tiles before it uses any. One CTA did the whole sort
// before: it was bound by its own work per tile (37 / 142 us for the plan at 2048 / 8192 tokens per rank on an H200).
// Where the slots fit one CTA (the launcher's grid of one), ep_plan_one and ep_sort_one run the count and the place in
// one launch: the one CTA is the count's last, so its positions are in the workspace when its barrier passes.
// Workspace: int32, EP_WORK_INTS = 32 + EP_SORT_MAXK (EP_GMAX + 1) entries, zero the first time (the ticket); a place
// kernel traps on a position outside its outputs (a corrupted workspace) rather than write there.
// Keys: at most EP_MAXB = 64 (chunks x ranks) for the plan; the launchers check. No host read: CUDA-graph capturable.

#include "nvfp4_common.cuh"
using namespace nvfp4;


#ifndef EP_MAXB
#define EP_MAXB 64
#endif
#ifndef EP_SORT_MAXK
#define EP_SORT_MAXK 400
#endif
#define EP_THREADS 512
#define EP_WARPS (EP_THREADS / 32)
#define EP_BATCH 8                            // tiles whose loads a warp issues together
#define EP_GMAX 32                            // CTAs of a sort at most: one lane per CTA in the last CTA's scan
#define EP_WSTRIDE (EP_GMAX + 1)              // workspace row of one key: its CTAs, then (plan) its total
#define EP_WORK_INTS (32 + EP_SORT_MAXK * EP_WSTRIDE)
static_assert(EP_SORT_MAXK * (EP_WARPS + 1) * 4                                      // the place's and the count's counters
              + (EP_SORT_MAXK + EP_WARPS - 1) / EP_WARPS * EP_WARPS * 4 + 4 <= 48 * 1024, // count_finish's totals, ticket flag
              "ep_sort_place and ep_sort_one (the count's counters too): must fit 48 KB of static shared memory");

struct PlanKeys {
    int k, per_rank, W, C, Tc, by_expert;
    long long n;
    // the key of slot s with expert id `id` (B = C W: not sent), and its destination and chunk
    __device__ __forceinline__ int operator()(int s, int id, int& dest, int& chunk) const {
        const int t = s / k;
        const int d = id / per_rank;                                // (a bad id clamps, as the torch ops do)
        dest = d < 0 ? 0 : (d > W - 1 ? W - 1 : d);
        if (by_expert) {
            int l = id - dest * per_rank;
            l = l < 0 ? 0 : (l > per_rank - 1 ? per_rank - 1 : l);
            chunk = (int)(((long long)l * C) / per_rank);
        } else {
            chunk = t / Tc;
        }
        return t < n ? chunk * W + dest : C * W;
    }
};

__device__ __forceinline__ int sort_key(int id, int e0, int per_rank) {
    const int l = id - e0;
    return (l >= 0 && l < per_rank) ? l : per_rank;
}

// The count kernels' end: this CTA's counts `c` (shared, B keys) into the workspace; the last CTA to finish turns the
// workspace into each (key, CTA)'s first position. KPW: keys per warp in that scan (B <= KPW EP_WARPS).
// sort: position = the keys before (all CTAs) + this key in the CTAs before; offs[e] = the end of key e (e < B - 1).
// plan: position = this key in the CTAs before; entry EP_GMAX = the key's total.
template <int KPW, bool SORT>
__device__ __forceinline__ void count_finish(const int* c, int B, int* __restrict__ work, int* __restrict__ offs) {
    __shared__ int s_last;
    __shared__ int s_tot[KPW * EP_WARPS];
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, G = gridDim.x, g = blockIdx.x;
    int* __restrict__ cnt = work + 32;
    for (int b = tid; b < B; b += EP_THREADS) cnt[b * EP_WSTRIDE + g] = c[b];
    __threadfence();
    __syncthreads();
    // the ticket counts 0 .. G - 1 and wraps to 0 at the last CTA (atomicInc): the next launch finds it at zero
    if (tid == 0) s_last = atomicInc(reinterpret_cast<unsigned*>(work), (unsigned)(G - 1)) == (unsigned)(G - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    int v[KPW], ex[KPW];
#pragma unroll
    for (int i = 0; i < KPW; ++i) {                                 // every key's counts, one lane per CTA: one batch
        const int b = wid + i * EP_WARPS;
        v[i] = (b < B && lane < G) ? __ldcg(cnt + b * EP_WSTRIDE + lane) : 0;
    }
#pragma unroll
    for (int i = 0; i < KPW; ++i) {                                 // exclusive scan over the CTAs, per key
        int inc = v[i];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) { const int u = __shfl_up_sync(0xffffffffu, inc, o); if (lane >= o) inc += u; }
        ex[i] = inc - v[i];
        const int b = wid + i * EP_WARPS;
        if (b < B && lane == 31) s_tot[b] = inc;
    }
    __syncthreads();
    if (SORT) {
        if (tid < 32) {                                             // exclusive scan over the keys: one warp
            int carry = 0;
            for (int b0 = 0; b0 < B; b0 += 32) {
                const int b = b0 + lane, t = b < B ? s_tot[b] : 0;
                int inc = t;
                for (int o = 1; o < 32; o <<= 1) { const int u = __shfl_up_sync(0xffffffffu, inc, o); if (lane >= o) inc += u; }
                if (b < B) s_tot[b] = carry + inc - t;
                if (b < B - 1) offs[b] = carry + inc;
                carry += __shfl_sync(0xffffffffu, inc, 31);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < KPW; ++i) {
        const int b = wid + i * EP_WARPS;
        if (b >= B) continue;
        if (lane < G) cnt[b * EP_WSTRIDE + lane] = ex[i] + (SORT ? s_tot[b] : 0);
        if (!SORT && lane == 0) cnt[b * EP_WSTRIDE + EP_GMAX] = s_tot[b];
    }
}

__device__ __forceinline__ void
plan_count(const int* __restrict__ ids,          // int32 (T_max * k): expert id of each slot
           const long long* __restrict__ n_ptr,  // int64 (): real tokens (<= T_max)
           int Tk, int k, int per_rank, int W, int C, int Tc, int by_expert,
           int per_cta,                          // slots per CTA (a multiple of EP_THREADS)
           int* __restrict__ work)               // int32 (EP_WORK_INTS,): the workspace
{
    __shared__ int c[EP_MAXB];
    const int tid = threadIdx.x, B = C * W;
    const PlanKeys key_of{k, per_rank, W, C, Tc, by_expert, *n_ptr};
    if (B > EP_MAXB || gridDim.x > EP_GMAX) __trap();               // (the launcher checks first)
    for (int i = tid; i < EP_MAXB; i += EP_THREADS) c[i] = 0;
    __syncthreads();
    const int beg = blockIdx.x * per_cta, end = min(Tk, beg + per_cta);
    for (int s = beg + tid; s < end; s += EP_THREADS) {
        int dest, chunk;
        const int key = key_of(s, ids[s], dest, chunk);
        if (key < B) atomicAdd(&c[key], 1);
    }
    __syncthreads();
    count_finish<(EP_MAXB + EP_WARPS - 1) / EP_WARPS, false>(c, B, work, nullptr);
}

__device__ __forceinline__ void
plan_place(const int* __restrict__ ids,          // int32 (T_max * k): expert id of each slot
           const float* __restrict__ w,          // fp32 (T_max * k): routing weight of each slot
           const long long* __restrict__ n_ptr,  // int64 (): real tokens (<= T_max)
           const long long* __restrict__ seg,    // int64 (W,): segment of each destination within a chunk
           const int* __restrict__ work,         // int32: ep_plan_count's positions
           int* __restrict__ spos,               // int32 (T_max * k) out: each slot's row for the combine (R + far: none)
           int* __restrict__ meta,               // int32 (R, 2) out: (expert id, weight bits) of each send row
           long long* __restrict__ tok,          // int64 (R,) out: token of each send row
           unsigned long long* __restrict__ dropped,   // int64 (): += real slots past the capacity
           int Tk, int k, int per_rank, int W, int C, int Tc, int cap, int R, int T_max, int by_expert,
           int rank,                             // this rank
           int far,                              // added to spos but for this rank's own slots
           int per_cta)                          // slots per CTA, as ep_plan_count's
{
    __shared__ int cnt[EP_WARPS][EP_MAXB];          // per warp, per key: slots; then the next free place
    __shared__ int total[EP_MAXB];
    __shared__ int sseg[EP_MAXB];                   // seg, read once (W <= EP_MAXB: the keys include every destination)
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, g = blockIdx.x, G = gridDim.x;
    const int B = C * W;
    const PlanKeys key_of{k, per_rank, W, C, Tc, by_expert, *n_ptr};
    const int* __restrict__ pos = work + 32;
    for (int i = tid; i < EP_WARPS * EP_MAXB; i += EP_THREADS) (&cnt[0][0])[i] = 0;
    for (int i = tid; i < W; i += EP_THREADS) sseg[i] = (int)seg[i];
    for (int b = tid; b < B; b += EP_THREADS) total[b] = pos[b * EP_WSTRIDE + EP_GMAX];
    const int per_w = per_cta / EP_WARPS;                           // slots per warp, whole tiles
    const int beg = g * per_cta + wid * per_w, end = min(Tk, min(g * per_cta + per_cta, beg + per_w));
    __syncthreads();
    for (int s = beg + lane; s < end; s += 32) {                    // this CTA's warps' counts per key
        int dest, chunk;
        const int key = key_of(s, ids[s], dest, chunk);
        if (key < B) atomicAdd(&cnt[wid][key], 1);
    }
    __syncthreads();
    for (int b = tid; b < B; b += EP_THREADS) {                    // exclusive scan over the warps, from the CTA's start
        int run = pos[b * EP_WSTRIDE + g];
        for (int v = 0; v < EP_WARPS; ++v) { const int c = cnt[v][b]; cnt[v][b] = run; run += c; }
    }
    __syncthreads();
    unsigned long long lost = 0;                                    // place every slot, in slot order within its key
    for (int t0 = beg; t0 < beg + per_w; t0 += 32 * EP_BATCH) {
        int idv[EP_BATCH];
        float wv[EP_BATCH];
#pragma unroll
        for (int j = 0; j < EP_BATCH; ++j) {
            const int s = t0 + 32 * j + lane;
            idv[j] = s < end ? ids[s] : 0;
            wv[j] = s < end ? w[s] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < EP_BATCH; ++j) {
            const int s = t0 + 32 * j + lane;
            int dest = 0, chunk = 0;
            const int key = s < end ? key_of(s, idv[j], dest, chunk) : B + 1;
            const unsigned m = __match_any_sync(0xffffffffu, key);
            int within = 0;
            if (key < B) within = cnt[wid][key] + __popc(m & ((1u << lane) - 1u));
            __syncwarp();
            if (key < B && lane == __ffs(m) - 1) cnt[wid][key] += __popc(m);
            __syncwarp();
            if (s < end) {
                if (within < 0) __trap();                           // (a corrupted workspace: never write outside)
                const bool ok = key < B && within < cap;
                const int row = ok ? (chunk * W + sseg[dest]) * cap + within : R;
                spos[s] = row + (ok && dest == rank ? 0 : far);
                if (ok) {
                    meta[2 * row] = idv[j];
                    meta[2 * row + 1] = __float_as_int(wv[j]);
                    tok[row] = s / k;
                } else if (key < B) {
                    ++lost;
                }
            }
        }
    }
    for (int o = 16; o; o >>= 1) lost += __shfl_xor_sync(0xffffffffu, lost, o);
    if (lane == 0 && lost) atomicAdd(dropped, lost);
    // the padding rows: each key's segment past its slots, over the whole grid
    for (int i = g * EP_THREADS + tid; i < B * cap; i += G * EP_THREADS) {
        const int b = i / cap, j = i - b * cap;
        if (j < total[b]) continue;
        const int chunk = b / W, dest = b - chunk * W;
        const int row = (chunk * W + sseg[dest]) * cap + j;
        meta[2 * row] = -1;
        meta[2 * row + 1] = 0;
        tok[row] = T_max - 1;
    }
}

extern "C" __global__ void __launch_bounds__(EP_THREADS)
ep_plan_count(const int* __restrict__ ids, const long long* __restrict__ n_ptr,
              int Tk, int k, int per_rank, int W, int C, int Tc, int by_expert, int per_cta, int* __restrict__ work)
{
    plan_count(ids, n_ptr, Tk, k, per_rank, W, C, Tc, by_expert, per_cta, work);
}

extern "C" __global__ void __launch_bounds__(EP_THREADS)
ep_plan_place(const int* __restrict__ ids, const float* __restrict__ w, const long long* __restrict__ n_ptr,
              const long long* __restrict__ seg, const int* __restrict__ work, int* __restrict__ spos, int* __restrict__ meta,
              long long* __restrict__ tok, unsigned long long* __restrict__ dropped,
              int Tk, int k, int per_rank, int W, int C, int Tc, int cap, int R, int T_max, int by_expert, int rank, int far,
              int per_cta)
{
    plan_place(ids, w, n_ptr, seg, work, spos, meta, tok, dropped, Tk, k, per_rank, W, C, Tc, cap, R, T_max, by_expert,
               rank, far, per_cta);
}

// One CTA (the launcher's grid when the slots fit one): the count and the place in one launch, ep_plan_place's
// arguments. The CTA is the count's last: its positions are in the workspace when the barrier passes.
extern "C" __global__ void __launch_bounds__(EP_THREADS)
ep_plan_one(const int* __restrict__ ids, const float* __restrict__ w, const long long* __restrict__ n_ptr,
            const long long* __restrict__ seg, int* __restrict__ work, int* __restrict__ spos, int* __restrict__ meta,
            long long* __restrict__ tok, unsigned long long* __restrict__ dropped,
            int Tk, int k, int per_rank, int W, int C, int Tc, int cap, int R, int T_max, int by_expert, int rank, int far,
            int per_cta)
{
    if (gridDim.x != 1) __trap();                                   // (the launcher picks it for one CTA only)
    plan_count(ids, n_ptr, Tk, k, per_rank, W, C, Tc, by_expert, per_cta, work);
    __syncthreads();
    plan_place(ids, w, n_ptr, seg, work, spos, meta, tok, dropped, Tk, k, per_rank, W, C, Tc, cap, R, T_max, by_expert,
               rank, far, per_cta);
}

// ---------------------------------------------------------------------------------------------
#define EP_PACK_THREADS 256
#define EP_PACK_MAXK 32                               // slots per token at most (the launcher checks)

extern "C" __global__ void __launch_bounds__(EP_PACK_THREADS)
ep_pack_nvfp4(const __nv_bfloat16* __restrict__ x,   // bf16 (T_max, K): the tokens
              const int* __restrict__ spos,          // int32 (T_max k,): each slot's row (ep_plan_place's)
              const int* __restrict__ meta,          // int32 (R, 2): each send row's (expert id, weight bits)
              const float* __restrict__ a1,          // fp32 (E,): each expert's activation global scale
              int E, int k, long long R, long long far, long long K,
              u8* __restrict__ codes,                // uint8 (R, K/2) out: the sent rows
              u8* __restrict__ sf)                   // uint8 (R, K/16) out: e4m3 block scales, row-major
{
    __shared__ long long s_row[EP_PACK_MAXK];
    __shared__ float s_g[EP_PACK_MAXK];
    __shared__ int s_any;
    const long long t = blockIdx.x;
    const int tid = threadIdx.x;
    if (k > EP_PACK_MAXK) __trap();                  // (the launcher checks first)
    if (tid == 0) s_any = 0;
    __syncthreads();
    if (tid < k) {
        const long long v = spos[t * k + tid];
        const long long row = v >= R ? v - far : v;  // (the combine's row: far past the send row but for own slots)
        const bool sent = row >= 0 && row < R;
        float g = 0.f;
        if (sent) {
            int id = meta[2 * row];
            id = id < 0 ? 0 : (id > E - 1 ? E - 1 : id);
            g = a1[id];
            s_any = 1;
        }
        s_row[tid] = sent ? row : -1;
        s_g[tid] = g;
    }
    __syncthreads();
    if (!s_any) return;                              // a padding token, or every slot dropped
    const long long kb = K >> 4;
    const __nv_bfloat16* __restrict__ src = x + t * K;
    for (long long b = tid; b < kb; b += EP_PACK_THREADS) {
        const uint4* q = reinterpret_cast<const uint4*>(src + b * 16);
        uint4 wq[2];
        wq[0] = q[0]; wq[1] = q[1];
        float v[16];
        const u32 am = unpack16_amax<__nv_bfloat16>(wq, v);
        for (int j = 0; j < k; ++j) {
            const long long row = s_row[j];
            if (row < 0) continue;
            u32 lo, hi;
            const u32 sb = quantize_block16(v, am, s_g[j], lo, hi);
            *reinterpret_cast<uint2*>(codes + (row * kb + b) * 8) = make_uint2(lo, hi);
            sf[row * kb + b] = (u8)sb;
        }
    }
}

// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void
sort_count(const int* __restrict__ ids, long long ids_stride,   // int32: each received row's expert id
           int n, int e0, int per_rank,
           int per_cta,                                         // rows per CTA (a multiple of EP_THREADS)
           int* __restrict__ work,                              // int32 (EP_WORK_INTS,): the workspace
           int* __restrict__ offs)                              // int32 (per_rank,) out
{
    __shared__ int c[EP_SORT_MAXK];
    const int tid = threadIdx.x, B = per_rank + 1;
    if (B > EP_SORT_MAXK || gridDim.x > EP_GMAX) __trap();         // (the launcher checks first)
    for (int i = tid; i < B; i += EP_THREADS) c[i] = 0;
    __syncthreads();
    const int beg = blockIdx.x * per_cta, end = min(n, beg + per_cta);
    for (int s = beg + tid; s < end; s += EP_THREADS) atomicAdd(&c[sort_key(ids[(long long)s * ids_stride], e0, per_rank)], 1);
    __syncthreads();
    count_finish<(EP_SORT_MAXK + EP_WARPS - 1) / EP_WARPS, true>(c, B, work, offs);
}

__device__ __forceinline__ void
sort_place(const int* __restrict__ ids, long long ids_stride,   // int32: each received row's expert id
           const float* __restrict__ w, long long w_stride,     // fp32: its routing weight
           int n, int e0, int per_rank,
           const float* __restrict__ a1, int E,                 // fp32 (E,): each expert's activation global scale
           const int* __restrict__ work,                        // int32: ep_sort_count's positions
           int per_cta,                                         // rows per CTA, as ep_sort_count's
           int* __restrict__ order,                             // int32 (n,) out
           int* __restrict__ back,                              // int32 (n,) out
           float* __restrict__ rs)                              // fp32 (n, 2) out
{
    __shared__ int cnt[EP_WARPS][EP_SORT_MAXK];    // per warp, per key: rows; then the next free place
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, g = blockIdx.x;
    const int B = per_rank + 1;                    // keys; per_rank: not a local expert
    const int* __restrict__ pos = work + 32;
    for (int i = tid; i < EP_WARPS * B; i += EP_THREADS) cnt[i / B][i % B] = 0;
    const int per_w = per_cta / EP_WARPS;
    const int beg = g * per_cta + wid * per_w, end = min(n, min(g * per_cta + per_cta, beg + per_w));
    __syncthreads();
    for (int s = beg + lane; s < end; s += 32) atomicAdd(&cnt[wid][sort_key(ids[(long long)s * ids_stride], e0, per_rank)], 1);
    __syncthreads();
    for (int b = tid; b < B; b += EP_THREADS) {                    // per key: exclusive scan over the warps, from the CTA's start
        int run = pos[b * EP_WSTRIDE + g];
        for (int v = 0; v < EP_WARPS; ++v) { const int c = cnt[v][b]; cnt[v][b] = run; run += c; }
    }
    __syncthreads();
    for (int t0 = beg; t0 < beg + per_w; t0 += 32 * EP_BATCH) {
        int idv[EP_BATCH];
        float wv[EP_BATCH], av[EP_BATCH];
#pragma unroll
        for (int j = 0; j < EP_BATCH; ++j) {
            const int s = t0 + 32 * j + lane;
            idv[j] = s < end ? ids[(long long)s * ids_stride] : 0;
            wv[j] = s < end ? w[(long long)s * w_stride] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < EP_BATCH; ++j) {
            const int id = idv[j] < 0 ? 0 : (idv[j] > E - 1 ? E - 1 : idv[j]);
            av[j] = t0 + 32 * j + lane < end ? a1[id] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < EP_BATCH; ++j) {
            const int s = t0 + 32 * j + lane;
            const int key = s < end ? sort_key(idv[j], e0, per_rank) : B;
            const unsigned m = __match_any_sync(0xffffffffu, key);
            int p = 0;
            if (key < B) p = cnt[wid][key] + __popc(m & ((1u << lane) - 1u));
            __syncwarp();
            if (key < B && lane == __ffs(m) - 1) cnt[wid][key] += __popc(m);
            __syncwarp();
            if (s < end) {
                if (p < 0 || p >= n) __trap();                      // (a corrupted workspace: never write outside)
                order[p] = s;
                back[s] = p;
                reinterpret_cast<float2*>(rs)[p] = make_float2(av[j], wv[j]);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(EP_THREADS)
ep_sort_count(const int* __restrict__ ids, long long ids_stride, int n, int e0, int per_rank, int per_cta,
              int* __restrict__ work, int* __restrict__ offs)
{
    sort_count(ids, ids_stride, n, e0, per_rank, per_cta, work, offs);
}

extern "C" __global__ void __launch_bounds__(EP_THREADS)
ep_sort_place(const int* __restrict__ ids, long long ids_stride, const float* __restrict__ w, long long w_stride,
              int n, int e0, int per_rank, const float* __restrict__ a1, int E, const int* __restrict__ work, int per_cta,
              int* __restrict__ order, int* __restrict__ back, float* __restrict__ rs)
{
    sort_place(ids, ids_stride, w, w_stride, n, e0, per_rank, a1, E, work, per_cta, order, back, rs);
}

// One CTA: the count and the place in one launch (ep_sort_place's arguments, then offs), as ep_plan_one.
extern "C" __global__ void __launch_bounds__(EP_THREADS)
ep_sort_one(const int* __restrict__ ids, long long ids_stride, const float* __restrict__ w, long long w_stride,
            int n, int e0, int per_rank, const float* __restrict__ a1, int E, int* __restrict__ work, int per_cta,
            int* __restrict__ order, int* __restrict__ back, float* __restrict__ rs, int* __restrict__ offs)
{
    if (gridDim.x != 1) __trap();
    sort_count(ids, ids_stride, n, e0, per_rank, per_cta, work, offs);
    __syncthreads();
    sort_place(ids, ids_stride, w, w_stride, n, e0, per_rank, a1, E, work, per_cta, order, back, rs);
}
