// ep_plan.cu -- the send plan of the expert-parallel layer's fixed-shape forward (nbs/08a_expert_parallel.ipynb,
// `CapturedEP`), in one launch instead of some thirty small torch ops:
//
//   ep_plan   every routed (token, slot) s of this rank's T_max tokens gets its row in the send buffer, and every send
//             row its (expert id, weight bits) and its token:
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
//   ep_pack_nvfp4   the NVFP4 payload of every send row r straight from its token: codes and block scales of
//             x[tok[r]] under the row's destination expert's a1, a1[clamp(meta[r].id, 0, E - 1)] (a padding row: any
//             scale), bit for bit what quantize_nvfp4_cuda gives the gathered rows with that per-row global scale (the
//             same quantize_block16); one CTA per row, one 16-block per thread per step. It replaces the row gather, the
//             scale gather and the quantize launch (and the gathered rows' round trip through HBM).
//
//   ep_recv_sort   a receiver's rows sorted by local expert, stably (what torch.argsort(key, stable=True) gives):
//               key(row)  = id - e0 if that is in [0, per_rank), else per_rank (not a local expert: sorts last)
//               order[p]  = the row at sorted position p;  back[row] = its position
//               offs[e]   = the end of local expert e's rows (e < per_rank): the inclusive scan of the counts
//               rs[p]     = (a1[clamp(id, 0, E - 1)], w) of the row at p (fp32 pairs)
//             the same counting sort as ep_plan with per_rank + 1 keys (at most EP_SORT_MAXK: the launcher checks, and
//             the kernel traps on more).
//
// One CTA of EP_THREADS = 512 threads (16 warps): warp w owns a contiguous run of slots and counts them per key in 32-slot tiles
// (__match_any_sync groups a tile's equal keys), a scan over the warps gives each (warp, key) its base, and a second
// pass over the same tiles places every slot; the padding rows are written last, each row exactly once. A warp issues
// the loads of EP_BATCH tiles before it uses any of them: one CTA is latency-bound, and a load per tile left the
// kernels one L2 round trip per tile and pass (16 warps x 24-31 tiles at 2048 tokens per rank). Keys: at most
// EP_MAXB = 64 (chunks x ranks); the launcher checks. No host read: CUDA-graph capturable.

#include "nvfp4_common.cuh"
using namespace nvfp4;


#ifndef EP_MAXB
#define EP_MAXB 64
#endif
#define EP_THREADS 512
#define EP_WARPS (EP_THREADS / 32)
#define EP_BATCH 8                            // tiles whose loads a warp issues together

extern "C" __global__ void __launch_bounds__(EP_THREADS)
ep_plan(const int* __restrict__ ids,          // int32 (T_max * k): expert id of each slot
        const float* __restrict__ w,          // fp32 (T_max * k): routing weight of each slot
        const long long* __restrict__ n_ptr,  // int64 (): real tokens (<= T_max)
        const long long* __restrict__ seg,    // int64 (W,): segment of each destination within a chunk
        int* __restrict__ spos,               // int32 (T_max * k) out: each slot's row for the combine (R + far: none)
        int* __restrict__ meta,               // int32 (R, 2) out: (expert id, weight bits) of each send row
        long long* __restrict__ tok,          // int64 (R,) out: token of each send row
        unsigned long long* __restrict__ dropped,   // int64 (): += real slots past the capacity
        int Tk, int k, int per_rank, int W, int C, int Tc, int cap, int R, int T_max, int by_expert,
        int rank,                             // this rank
        int far)                              // added to spos but for this rank's own slots
{
    __shared__ int cnt[EP_WARPS][EP_MAXB];          // per warp, per key: slots (phase 1); then the next free place (phase 3)
    __shared__ int total[EP_MAXB];
    __shared__ int sseg[EP_MAXB];                   // seg, read once (W <= EP_MAXB: the keys include every destination)
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int B = C * W;                      // keys; B itself means "not sent"
    const long long n = *n_ptr;
    for (int i = tid; i < EP_WARPS * EP_MAXB; i += EP_THREADS) (&cnt[0][0])[i] = 0;
    for (int i = tid; i < W; i += EP_THREADS) sseg[i] = (int)seg[i];
    __syncthreads();

    const int per_w = ((Tk + EP_THREADS - 1) / EP_THREADS) * 32;  // slots per warp, whole tiles
    const int beg = wid * per_w, end = min(Tk, beg + per_w);
    auto key_of = [&](int s, int id, int& dest, int& chunk) -> int {
        if (s >= end) return B + 1;                                 // past the warp's run: no slot
        const int t = s / k;
        int d = id / per_rank;                                      // (a bad id clamps, as the torch ops do)
        dest = d < 0 ? 0 : (d > W - 1 ? W - 1 : d);
        if (by_expert) {
            int l = id - dest * per_rank;
            l = l < 0 ? 0 : (l > per_rank - 1 ? per_rank - 1 : l);
            chunk = (int)(((long long)l * C) / per_rank);
        } else {
            chunk = t / Tc;
        }
        return t < n ? chunk * W + dest : B;
    };
    // phase 1: count each warp's slots per key
    for (int t0 = beg; t0 < beg + per_w; t0 += 32 * EP_BATCH) {
        int idv[EP_BATCH];
#pragma unroll
        for (int j = 0; j < EP_BATCH; ++j) { const int s = t0 + 32 * j + lane; idv[j] = s < end ? ids[s] : 0; }
#pragma unroll
        for (int j = 0; j < EP_BATCH; ++j) {
            int dest = 0, chunk = 0;
            const int key = key_of(t0 + 32 * j + lane, idv[j], dest, chunk);
            const unsigned m = __match_any_sync(0xffffffffu, key);
            if (key < B && lane == __ffs(m) - 1) cnt[wid][key] += __popc(m);
            __syncwarp();                                           // (the next tile's leader may be another lane)
        }
    }
    __syncthreads();
    // phase 2: exclusive scan over the warps, per key
    for (int b = tid; b < B; b += EP_THREADS) {
        int run = 0;
        for (int v = 0; v < EP_WARPS; ++v) { const int c = cnt[v][b]; cnt[v][b] = run; run += c; }
        total[b] = run;
    }
    __syncthreads();
    // phase 3: place every slot, in slot order within its key
    unsigned long long lost = 0;
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
            const int key = key_of(s, idv[j], dest, chunk);
            const unsigned m = __match_any_sync(0xffffffffu, key);
            int within = 0;
            if (key < B) within = cnt[wid][key] + __popc(m & ((1u << lane) - 1u));
            __syncwarp();
            if (key < B && lane == __ffs(m) - 1) cnt[wid][key] += __popc(m);
            __syncwarp();
            if (s < end) {
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
    // the padding rows: each key's segment past its slots
    for (int i = tid; i < B * cap; i += EP_THREADS) {
        const int b = i / cap, j = i - b * cap;
        if (j < total[b]) continue;
        const int chunk = b / W, dest = b - chunk * W;
        const int row = (chunk * W + sseg[dest]) * cap + j;
        meta[2 * row] = -1;
        meta[2 * row + 1] = 0;
        tok[row] = T_max - 1;
    }
}

// ---------------------------------------------------------------------------------------------
#define EP_PACK_THREADS 256

extern "C" __global__ void __launch_bounds__(EP_PACK_THREADS)
ep_pack_nvfp4(const __nv_bfloat16* __restrict__ x,   // bf16 (T_max, K): the tokens
              const long long* __restrict__ tok,     // int64 (R,): each send row's token
              const int* __restrict__ meta,          // int32 (R, 2): each send row's (expert id, weight bits)
              const float* __restrict__ a1,          // fp32 (E,): each expert's activation global scale
              int E, long long R, long long K,
              u8* __restrict__ codes,                // uint8 (R, K/2) out
              u8* __restrict__ sf)                   // uint8 (R, K/16) out: e4m3 block scales, row-major
{
    const long long r = blockIdx.x;
    if (r >= R) return;
    int id = meta[2 * r];
    id = id < 0 ? 0 : (id > E - 1 ? E - 1 : id);
    const float g = a1[id];
    const long long kb = K >> 4;
    const __nv_bfloat16* __restrict__ src = x + tok[r] * K;
    for (long long b = threadIdx.x; b < kb; b += EP_PACK_THREADS) {
        const uint4* q = reinterpret_cast<const uint4*>(src + b * 16);
        uint4 w[2];
        w[0] = q[0]; w[1] = q[1];
        float v[16];
        const u32 am = unpack16_amax<__nv_bfloat16>(w, v);
        u32 lo, hi;
        const u32 sb = quantize_block16(v, am, g, lo, hi);
        *reinterpret_cast<uint2*>(codes + (r * kb + b) * 8) = make_uint2(lo, hi);
        sf[r * kb + b] = (u8)sb;
    }
}

// ---------------------------------------------------------------------------------------------
#ifndef EP_SORT_MAXK
#define EP_SORT_MAXK 400
#endif
static_assert(EP_SORT_MAXK * (EP_WARPS + 1) * 4 <= 48 * 1024, "ep_recv_sort: its counters must fit 48 KB of static shared memory");

extern "C" __global__ void __launch_bounds__(EP_THREADS)
ep_recv_sort(const int* __restrict__ ids, long long ids_stride,   // int32: each received row's expert id
             const float* __restrict__ w, long long w_stride,     // fp32: its routing weight
             int n, int e0, int per_rank,
             const float* __restrict__ a1, int E,                 // fp32 (E,): each expert's activation global scale
             int* __restrict__ order,                             // int32 (n,) out
             int* __restrict__ back,                              // int32 (n,) out
             int* __restrict__ offs,                              // int32 (per_rank,) out
             float* __restrict__ rs)                              // fp32 (n, 2) out
{
    __shared__ int cnt[EP_WARPS][EP_SORT_MAXK];    // per warp, per key: rows (phase 1); then the next free place (phase 3)
    __shared__ int base[EP_SORT_MAXK];             // each key's first sorted position
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const int B = per_rank + 1;                    // keys; per_rank: not a local expert
    if (B > EP_SORT_MAXK) __trap();                // (the launcher checks first)
    for (int i = tid; i < EP_WARPS * B; i += EP_THREADS) cnt[i / B][i % B] = 0;
    __syncthreads();
    const int per_w = ((n + EP_THREADS - 1) / EP_THREADS) * 32;
    const int beg = wid * per_w, end = min(n, beg + per_w);
    auto key_of = [&](int s, int id) -> int {
        if (s >= end) return B;                                     // past the warp's run: no row
        const int l = id - e0;
        return (l >= 0 && l < per_rank) ? l : per_rank;
    };
    for (int t0 = beg; t0 < beg + per_w; t0 += 32 * EP_BATCH) {
        int idv[EP_BATCH];
#pragma unroll
        for (int j = 0; j < EP_BATCH; ++j) { const int s = t0 + 32 * j + lane; idv[j] = s < end ? ids[(long long)s * ids_stride] : 0; }
#pragma unroll
        for (int j = 0; j < EP_BATCH; ++j) {
            const int key = key_of(t0 + 32 * j + lane, idv[j]);
            const unsigned m = __match_any_sync(0xffffffffu, key);
            if (key < B && lane == __ffs(m) - 1) cnt[wid][key] += __popc(m);
            __syncwarp();
        }
    }
    __syncthreads();
    for (int b = tid; b < B; b += EP_THREADS) {                    // per key: exclusive scan over the warps
        int run = 0;
        for (int v = 0; v < EP_WARPS; ++v) { const int c = cnt[v][b]; cnt[v][b] = run; run += c; }
        base[b] = run;                                              // (the key's total, for now)
    }
    __syncthreads();
    if (tid < 32) {                                                 // exclusive scan over the keys: one warp
        int carry = 0;
        for (int b0 = 0; b0 < B; b0 += 32) {
            const int b = b0 + lane, v = b < B ? base[b] : 0;
            int inc = v;
            for (int o = 1; o < 32; o <<= 1) { const int u = __shfl_up_sync(0xffffffffu, inc, o); if (lane >= o) inc += u; }
            if (b < B) base[b] = carry + inc - v;
            if (b < per_rank) offs[b] = carry + inc;
            carry += __shfl_sync(0xffffffffu, inc, 31);
        }
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
            const int key = key_of(s, idv[j]);
            const unsigned m = __match_any_sync(0xffffffffu, key);
            int p = 0;
            if (key < B) p = base[key] + cnt[wid][key] + __popc(m & ((1u << lane) - 1u));
            __syncwarp();
            if (key < B && lane == __ffs(m) - 1) cnt[wid][key] += __popc(m);
            __syncwarp();
            if (s < end) {
                order[p] = s;
                back[s] = p;
                reinterpret_cast<float2*>(rs)[p] = make_float2(av[j], wv[j]);
            }
        }
    }
}
