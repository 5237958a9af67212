"""Run under `torchrun --nproc-per-node 2` (any number of GPUs, 1 included): EPMoE on NCCL against the one-GPU layer, bit
for bit, eager and captured in a CUDA graph (`EPMoE.capture`): the all-to-alls on the copy engines (the default where
supported; checked to launch no NCCL kernel) and on NCCL's kernels. Arguments: the activation kinds to check (w4a16, w4a4;
default both), so that one run can stay short (each kind compiles its own GEMMs: minutes on a fresh machine)."""
import gc
import os
import sys
import threading

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout, installed or not
from dsv4_nvfp4 import moe as M
from dsv4_nvfp4 import ep as EPm
from dsv4_nvfp4.ep import EPMoE, copy_engines_supported
from dsv4_nvfp4 import gemm_sm90 as S90

CFG = M.MoEConfig(hidden=2048, inter=1024, num_experts=16, top_k=6, routed_scaling_factor=1.5)
MAX_T = 320                                     # the captured forwards' tokens per rank


def main(acts=("w4a16", "w4a4")):
    if not acts or any(a not in ("w4a16", "w4a4") for a in acts): raise SystemExit(f"ep_gpu_check: kinds are w4a16 and w4a4, got {acts}")
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")   # no NVLink multicast
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    W, r, dev = dist.get_world_size(), dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    fails, made = [], []
    CE = W > 1 and copy_engines_supported()
    if r == 0: print(f"world {W}, copy engines {'supported' if CE else 'not supported: NCCL kernels only'}", flush=True)
    def capture_(*a_, **k_):                                               # a capture, closed (collective) at the end
        made.append(ep.capture(*a_, **k_)); return made[-1]
    def plan_same(c, T_, seed):                                         # the fused send plan (one kernel) against the torch ops
        g_ = torch.Generator(device=dev).manual_seed(seed)
        ids_ = torch.randint(0, CFG.num_experts, (c.max_tokens, CFG.top_k), generator=g_, device=dev, dtype=torch.int32)
        w_ = torch.rand(c.max_tokens, CFG.top_k, generator=g_, device=dev)
        n_, d0 = torch.tensor(T_, device=dev), c.dropped_.clone()
        spos, src = c._plan(ids_, n_)
        meta, tok = c._meta(w_, ids_, src)
        d1 = c.dropped_.clone()
        fs, fm, ft = c._plan_fused(w_, ids_, n_)
        d2 = c.dropped_.clone()
        c.dropped_.copy_(d0)
        return c.fused_plan and torch.equal(spos.int(), fs) and torch.equal(meta, fm) and torch.equal(tok, ft) and torch.equal(d1 - d0, d2 - d1)
    for act in acts:
        lay = M.DSV4MoE.synthetic(CFG, seed=7, act=act, device=dev).to(dev)     # the same layer on every rank
        for payload in ("bf16", "nvfp4") if act == "w4a4" else ("bf16",):
            ep = EPMoE(lay, payload=payload).to(dev)
            if payload == "nvfp4":                                      # the payload kernel and the receiver's sort kernel
                g_ = torch.Generator(device=dev).manual_seed(11)       # against the torch ops they replace
                xs_ = (torch.randn(50, CFG.hidden, generator=g_, device=dev) * 0.5).to(torch.bfloat16)
                tok_ = torch.randint(0, 50, (300,), generator=g_, device=dev)
                ms_ = torch.stack([torch.randint(-1, CFG.num_experts, (300,), generator=g_, device=dev, dtype=torch.int32),
                                   torch.rand(300, generator=g_, device=dev).view(torch.int32)], 1)
                c_, s_ = EPm._pack_nvfp4(xs_, tok_, ms_, ep.a1_all, torch.empty(300, CFG.hidden // 2, dtype=torch.uint8, device=dev),
                                         torch.empty(300, CFG.hidden // 16, dtype=torch.uint8, device=dev))
                c0, s0 = ep._quantize_rows(xs_.index_select(0, tok_), ms_)
                if not (torch.equal(c_, c0) and torch.equal(s_, s0)): fails.append(f"{act}: ep_pack_nvfp4 != gather + quantize")
                for n_ in (300, 1, 37):                                 # the sorted decoded rows, their (a1, weight), the
                    d_, sc_, m_ = c_[:n_], s_[:n_], ms_[:n_]            # experts' ends, the inverse order; and the experts' rows
                    args_ = (d_, sc_, m_[:, 1].view(torch.float32), m_[:, 0])
                    k1, y1 = ep._sort_decode(*args_), ep._rows_nvfp4_parts(*args_)
                    keep, EPm.EP_SORT_MAXK = EPm.EP_SORT_MAXK, 0                # the torch ops
                    try: k0, y0 = ep._sort_decode(*args_), ep._rows_nvfp4_parts(*args_)
                    finally: EPm.EP_SORT_MAXK = keep
                    loc = (m_[:, 0] >= ep.experts.start) & (m_[:, 0] < ep.experts.stop)   # (other rows: undefined)
                    if not (all(torch.equal(a_, b_.to(a_.dtype)) for a_, b_ in zip(k1, k0)) and torch.equal(y1[loc], y0[loc])):
                        fails.append(f"{act}: ep_recv_sort + gather_dequant != the torch ops (n={n_})")
            caps = {payload: capture_(MAX_T, given=True)}                       # (2 GPUs: copy engines where supported)
            if CE and not caps[payload].ce: fails.append(f"{act} {payload}: copy engines supported, not used")
            kern = capture_(MAX_T, given=True, copy_engines=False)              # NCCL's kernels: the own segment off the wire
            chunked = capture_(MAX_T, given=True, chunks=3, comm_sms=8)         # the pipelined chunks (107, 107, 106 tokens), GEMMs
                                                                          # leaving 8 SMs; the eager calls below need larger
                                                                          # expert buffers than its own
            chunked_k = capture_(MAX_T, given=True, chunks=3, comm_sms=8, copy_engines=False)
            split = capture_(MAX_T, given=True, shared_after=0.5, comm_sms=16)  # the shared expert half beside each all-to-all
            split_chunks = capture_(MAX_T, given=True, chunks=2, shared_after=0.3)   # and with chunks
            echunks = capture_(MAX_T, given=True, chunks=2, chunk_by="experts", shared_after=0.5)   # 2 chunks of each rank's experts
            many = capture_(MAX_T, given=True, chunks=80)                  # 80 x W keys > EP_PLAN_MAX_KEYS: the torch plan
            # copy engines with the last return on NCCL's kernels: the own rows read where the experts wrote them
            tail = capture_(MAX_T, given=True, tail_kernels=True)
            tail_c = capture_(MAX_T, given=True, chunks=3, tail_kernels=True)
            tail_e = capture_(MAX_T, given=True, chunks=2, chunk_by="experts", shared_after=0.5, comm_sms=8, tail_kernels=True)
            tail_m = capture_(MAX_T, given=True, chunks=80, tail_kernels=True)  # and the torch plan
            tail_n = capture_(MAX_T, given=True, chunks=2, tail_kernels=True, tail_ctas=24)     # on a 24-CTA group
            kern_n = capture_(MAX_T, given=True, chunks=2, copy_engines=False, tail_ctas=24)    # NCCL's kernels throughout
            if tail.tail != CE or tail.far != tail.rows: fails.append(f"{act} {payload}: tail_kernels not taken as asked")
            if many.fused_plan or not caps[payload].fused_plan: fails.append(f"{act} {payload}: the fused plan chosen wrongly")
            for nm, c_ in (("one chunk", caps[payload]), ("NCCL kernels", kern), ("chunks", chunked), ("chunks, NCCL kernels", chunked_k),
                           ("expert chunks", echunks), ("tail kernels", tail), ("tail kernels, expert chunks", tail_e)):
                for T_ in (MAX_T, 37, 1, 0):
                    if not plan_same(c_, T_, T_ + 1): fails.append(f"{act} {payload} fused send plan != torch ops ({nm}, T={T_})")
            for Ts in ([37, 300], [1, 0], [0, 1], [256, 256]):                # ragged, T = 1, an empty rank
                Ts = (Ts * W)[:W]
                g = torch.Generator(device=dev).manual_seed(sum(Ts))
                x_all = (torch.randn(sum(Ts), CFG.hidden, generator=g, device=dev) * 0.5).to(torch.bfloat16)
                a = sum(Ts[:r]); x = x_all[a:a + Ts[r]]
                want = lay(x_all)[a:a + Ts[r]]
                if not torch.equal(ep(x), want): fails.append(f"{act} {payload} T={Ts}")
                ep.overlap = True                                               # the shared expert on a side stream: the same bits
                if not torch.equal(ep(x), want): fails.append(f"{act} {payload} side stream T={Ts}")
                ep.overlap = False
                ep.micro_batches = 3                                            # micro-batched all-to-alls: the same bits
                if not torch.equal(ep(x), want): fails.append(f"{act} {payload} 3 micro-batches T={Ts}")
                ep.micro_batches = 1
                # fixed shapes (`capture`, one CUDA graph): with the routing given, bit for bit at any T <= max_tokens
                if x_all.shape[0]:
                    w, ids = lay.route(x_all)
                    cap = caps[payload]
                    got = cap(x, w[a:a + Ts[r]], ids[a:a + Ts[r]])
                    want_r = lay.forward_routed(x_all, w, ids)[a:a + Ts[r]]
                    if not torch.equal(got, want_r): fails.append(f"{act} {payload} captured T={Ts}")
                    if not torch.equal(kern(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want_r): fails.append(f"{act} {payload} captured, NCCL kernels T={Ts}")
                    if not torch.equal(chunked(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want_r): fails.append(f"{act} {payload} captured in chunks T={Ts}")
                    if not torch.equal(chunked_k(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want_r): fails.append(f"{act} {payload} captured in chunks, NCCL kernels T={Ts}")
                    if not torch.equal(split(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want_r): fails.append(f"{act} {payload} captured, shared split T={Ts}")
                    if not torch.equal(split_chunks(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want_r): fails.append(f"{act} {payload} captured, shared split, chunks T={Ts}")
                    if not torch.equal(echunks(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want_r): fails.append(f"{act} {payload} captured in expert chunks T={Ts}")
                    if not torch.equal(many(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want_r): fails.append(f"{act} {payload} captured in 80 chunks (torch plan) T={Ts}")
                    for nm, c_ in (("", tail), (", 3 chunks", tail_c), (", expert chunks", tail_e), (", 80 chunks", tail_m),
                                   (", 24 CTAs", tail_n), (" (NCCL's throughout), 24 CTAs", kern_n)):
                        if not torch.equal(c_(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want_r): fails.append(f"{act} {payload} captured, tail kernels{nm} T={Ts}")
                # skewed: four of every token's six experts on rank 0, two elsewhere
                if x_all.shape[0] and W > 1:
                    w, _ = lay.route(x_all)
                    per, gen = CFG.num_experts // W, torch.Generator().manual_seed(sum(Ts))
                    ids = torch.stack([torch.cat([torch.randperm(per, generator=gen)[:4], per + torch.randperm(CFG.num_experts - per, generator=gen)[:2]])
                                       for _ in range(x_all.shape[0])]).to(device=dev, dtype=torch.int32)
                    want = lay.forward_routed(x_all, w, ids)[a:a + Ts[r]]
                    if not torch.equal(ep.forward_routed(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want): fails.append(f"{act} {payload} skewed T={Ts}")
                    if not torch.equal(caps[payload](x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want): fails.append(f"{act} {payload} captured skewed T={Ts}")
                    if not torch.equal(kern(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want): fails.append(f"{act} {payload} captured, NCCL kernels, skewed T={Ts}")
                    if not torch.equal(chunked(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want): fails.append(f"{act} {payload} captured in chunks, skewed T={Ts}")
                    if not torch.equal(split(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want): fails.append(f"{act} {payload} captured, shared split, skewed T={Ts}")
                    if not torch.equal(echunks(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want): fails.append(f"{act} {payload} captured in expert chunks, skewed T={Ts}")
                    for nm, c_ in (("", tail), (", 3 chunks", tail_c), (", expert chunks", tail_e), (", 24 CTAs", tail_n), (" (NCCL's throughout), 24 CTAs", kern_n)):
                        if not torch.equal(c_(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want): fails.append(f"{act} {payload} captured, tail kernels{nm}, skewed T={Ts}")
            # the router inside the graph, on a full buffer (the same logits GEMM shape as the eager forward's)
            full = MAX_T
            g = torch.Generator(device=dev).manual_seed(5)
            x_all = (torch.randn(W * full, CFG.hidden, generator=g, device=dev) * 0.5).to(torch.bfloat16)
            x = x_all[r * full:(r + 1) * full]
            routed = capture_(full)
            if not torch.equal(routed(x), ep(x)): fails.append(f"{act} {payload} captured router != eager EP")
            if CE:                                                       # the copy engines move the rows: no NCCL kernel runs
                from torch.profiler import profile, ProfilerActivity
                def on_gpu(fn):                                          # (fn's output, the CUDA events' names of one call)
                    fn(); torch.cuda.synchronize(); dist.barrier()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        y_ = fn(); torch.cuda.synchronize()
                    return y_, [e.name for e in prof.events() if e.device_type.name == "CUDA"]
                eager = ep.capture(full, graph=False)
                for how, fn in (("eager", lambda: eager(x)), ("graph", lambda: routed(x))):   # the fixed-shape steps, the replay
                    y_, names = on_gpu(fn)
                    nccl = sorted({n for n in names if "nccl" in n.lower()})
                    if nccl or not any("PtoP" in n for n in names): fails.append(f"{act} {payload} copy engines, {how}: NCCL kernels {nccl[:3]}, no peer copy")
                    if not torch.equal(y_, ep(x)): fails.append(f"{act} {payload} copy engines, {how} != eager EP")
                eager.close(); del eager
            for after in (1.0, 0.4):                                    # all, or the last 40% of the shared expert beside the return
                routed_after = ep.capture(full, shared_after=after, comm_sms=8)
                if not torch.equal(routed_after(x), ep(x)): fails.append(f"{act} {payload} captured router, shared after {after} != eager EP")
                routed_after.close(); del routed_after
            tiny = ep.capture(3, shared_after=0.5)                       # the fused router path (<= 4 tokens), split
            if not torch.equal(tiny(x[:3]), ep(x[:3])): fails.append(f"{act} {payload} captured router, 3 tokens, shared split != eager EP")
            tiny.close(); del tiny
            # where the SMs are left to NCCL: the shared expert's GEMMs beside the all-to-alls; the routed ones only with chunks
            if W > 1:
                seen, run = [], S90.run_sm90
                def spy(*a_, **k_):
                    seen.append(S90._SM_RESERVE[0]); return run(*a_, **k_)
                S90.run_sm90 = spy
                try:
                    # beside NCCL's kernels only: none beside the copy engines; with tail_kernels, the shared part beside the last return
                    for C_, how, want_seen in ((1, "kernels", [12, 12, 0, 0, 12, 12]), (2, "kernels", [12] * 8), (1, "ce", [0] * 6),
                                               (2, "ce", [0] * 8), (1, "tail", [0, 0, 0, 0, 12, 12]), (2, "tail", [0] * 6 + [12, 12])):
                        if how != "kernels" and not CE: continue
                        seen.clear()
                        probe = ep.capture(full, graph=False, comm_sms=12, shared_after=0.5, chunks=C_, copy_engines=how != "kernels",
                                           tail_kernels=how == "tail")                  # (its warm-up launches too)
                        seen.clear(); probe(x); torch.cuda.synchronize()
                        if seen != want_seen: fails.append(f"{act} {payload} chunks={C_}, {how}: SM reserve per GEMM launch {seen}, expected {want_seen}")
                        probe.close(); del probe
                finally:
                    S90.run_sm90 = run
            # a capacity that the skewed routing overflows: NaN exactly for the tokens that lost a slot, counted
            if W > 1:
                small = capture_(MAX_T, capacity=64, given=True)
                small_e = capture_(MAX_T, capacity=48, given=True, chunks=2, chunk_by="experts")
                small_t = capture_(MAX_T, capacity=64, given=True, tail_kernels=True)   # drops read from row R + far
                for T_ in (MAX_T, 100):                                     # random routing past the capacity: drops counted alike
                    if not plan_same(small, T_, 7 + T_): fails.append(f"{act} {payload} fused send plan != torch ops (capacity 64, T={T_})")
                    if not plan_same(small_t, T_, 8 + T_): fails.append(f"{act} {payload} fused send plan != torch ops (tail kernels, capacity 64, T={T_})")
                    if not plan_same(small_e, T_, 9 + T_): fails.append(f"{act} {payload} fused send plan != torch ops (expert chunks, capacity 48, T={T_})")
                per, gen = CFG.num_experts // W, torch.Generator().manual_seed(9)
                ids = torch.stack([torch.cat([torch.randperm(per, generator=gen)[:4], per + torch.randperm(CFG.num_experts - per, generator=gen)[:2]])
                                   for _ in range(W * 40)]).to(device=dev, dtype=torch.int32)
                w = torch.rand(W * 40, CFG.top_k, device=dev) + 0.1
                want = lay.forward_routed(x_all[:W * 40], w, ids)[r * 40:(r + 1) * 40]
                dest = ids[r * 40:(r + 1) * 40].long() // per                   # this rank's slots, in token order per destination
                pos = torch.stack([(dest.reshape(-1) == d).cumsum(0).view_as(dest) - 1 for d in range(W)]).gather(0, dest[None])[0]
                lost = (pos >= 64).any(1)
                for nm, c_ in (("", small), (", tail kernels", small_t)):
                    y = c_(x_all[r * 40:(r + 1) * 40], w[r * 40:(r + 1) * 40], ids[r * 40:(r + 1) * 40])
                    if not (torch.isnan(y).all(1).equal(lost) and torch.equal(y[~lost], want[~lost]) and c_.dropped == int((pos >= 64).sum())):
                        fails.append(f"{act} {payload} capacity overflow{nm}")
    bad = torch.tensor([len(fails)], device=dev)
    dist.all_reduce(bad)
    if fails: print(f"rank {r}: FAIL " + "; ".join(fails), flush=True)
    dist.barrier()
    if r == 0: print("ALL OK" if bad.item() == 0 else f"{int(bad.item())} failures", flush=True)
    # the graphs and the registered windows go before the communicators they use (a teardown with graphs alive hung)
    for c in made: c.close()
    del caps, kern, chunked, chunked_k, split, split_chunks, echunks, many, tail, tail_c, tail_e, tail_m, tail_n, kern_n, routed, made
    if W > 1: del small, small_e, small_t
    gc.collect(); torch.cuda.synchronize()
    done = threading.Event()                                            # a teardown that hangs fails the check, at once
    threading.Thread(target=lambda: done.wait(120) or (print(f"rank {r}: FAIL teardown (destroy_process_group) hung", flush=True),
                                                        os._exit(3)), daemon=True).start()
    dist.barrier()
    dist.destroy_process_group()
    done.set()
    return 0 if bad.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main(tuple(sys.argv[1:]) or ("w4a16", "w4a4")))
