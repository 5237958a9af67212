"""Run under `torchrun --nproc-per-node 2` (any number of GPUs, 1 included): EPMoE on NCCL against the one-GPU layer, bit
for bit, eager and captured in a CUDA graph (`CapturedEP`): on the schedule `capture_schedule` picks, and on each
transport (NCCL's kernels; the copy engines where supported, checked to launch no NCCL kernel) with the shared expert
whole or split, forced by replacing `capture_schedule` for the capture. Arguments: the activation kinds to check (w4a16,
w4a4; default both), so that one run can stay short (each kind compiles its own GEMMs: minutes on a fresh machine)."""
import contextlib
import gc
import os
import sys
import threading
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout, installed or not
from dsv4_nvfp4 import moe as M
from dsv4_nvfp4.ep import capture as EPc
from dsv4_nvfp4.ep import layer as EPl
from dsv4_nvfp4.ep import transport as EPt
from dsv4_nvfp4.ep.capture import CapturedEP, CaptureSchedule
from dsv4_nvfp4.ep.layer import EPMoE

CFG = M.MoEConfig(hidden=2048, inter=1024, num_experts=16, top_k=6, routed_scaling_factor=1.5)
MAX_T = 320                                     # the captured forwards' tokens per rank


@contextlib.contextmanager
def forced(copy_engines: bool, shared_after: float, plan_keys: int | None = None, broken: bool = False):
    """Captures made inside run this schedule (and, with `plan_keys`, the torch send plan where W > plan_keys). `broken`
    (tests/ep_soak.py's self-check): a stream's wait on an event (the forward's one such wait: the main stream's on the
    dispatch) does nothing, while `wait_stream` (which torch builds on `wait_event`) still waits."""
    keep, keys = EPc.capture_schedule, EPc.EP_PLAN_MAX_KEYS
    wait, join = torch.cuda.Stream.wait_event, torch.cuda.Stream.wait_stream
    EPc.capture_schedule = lambda payload, T, W, ok: CaptureSchedule(copy_engines and ok and W > 1, shared_after)
    if plan_keys is not None: EPc.EP_PLAN_MAX_KEYS = plan_keys
    if broken:
        torch.cuda.Stream.wait_stream = lambda self, stream: wait(self, stream.record_event())
        torch.cuda.Stream.wait_event = lambda self, event=None: None
    try: yield
    finally:
        EPc.capture_schedule, EPc.EP_PLAN_MAX_KEYS = keep, keys
        torch.cuda.Stream.wait_event, torch.cuda.Stream.wait_stream = wait, join


def nccl_init():
    """Under torchrun: NVLink multicast off, this process's GPU (LOCAL_RANK) current, the NCCL process group made:
    (world size, rank, device)."""
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    return dist.get_world_size(), dist.get_rank(), torch.device("cuda", torch.cuda.current_device())


def teardown(made: list, r: int):
    """Close every capture, then destroy the process group: the graphs and the registered windows go before the
    communicators they use (a teardown with graphs alive hung); a teardown that hangs exits the process at once."""
    for c in made: c.close()
    made.clear()
    gc.collect(); torch.cuda.synchronize()
    done = threading.Event()
    threading.Thread(target=lambda: done.wait(120) or (print(f"rank {r}: FAIL teardown (destroy_process_group) hung", flush=True),
                                                        os._exit(3)), daemon=True).start()
    dist.barrier()
    dist.destroy_process_group()
    done.set()


def main(acts=("w4a16", "w4a4")):
    if not acts or any(a not in ("w4a16", "w4a4") for a in acts): raise SystemExit(f"ep_gpu_check: kinds are w4a16 and w4a4, got {acts}")
    W, r, dev = nccl_init()
    fails, made = [], []
    CE = W > 1 and EPt.copy_engines_supported()
    if r == 0: print(f"world {W}, copy engines {'supported' if CE else 'not supported: NCCL kernels only'}", flush=True)
    def capture_(*a_, how=None, **k_):                                  # a capture, closed (collective) at the end
        with (forced(*how) if how else contextlib.nullcontext()): made.append(CapturedEP(ep, *a_, **k_))
        return made[-1]
    def shared_rows_ok(c, T_):                                          # the shared expert's parts, routed once at capture:
        k = CFG.top_k                                                   # after a call of T_ tokens, the part [a, b)'s permute
        for part in c.shared_parts or ():                               # put token t's shared row at t for its real tokens
            if part is None: continue
            a_, b_, bufs_ = part
            n_ = min(max(T_ - a_, 0), b_ - a_)
            inv_ = bufs_[0].inv.view(-1, k + 1)[:n_, k]
            if not (torch.equal(inv_, torch.arange(n_, dtype=inv_.dtype, device=dev)) and int(bufs_[0].offsets[0]) == n_):
                return False
        return True

    def plan_same(c, T_, seed):                                         # the fused send plan (one kernel) against the torch ops
        g_ = torch.Generator(device=dev).manual_seed(seed)
        ids_ = torch.randint(0, CFG.num_experts, (c.max_tokens, CFG.top_k), generator=g_, device=dev, dtype=torch.int32)
        w_ = torch.rand(c.max_tokens, CFG.top_k, generator=g_, device=dev)
        n_, d0 = torch.tensor(T_, device=dev), c.dropped_.clone()
        spos, src = c._plan(ids_, n_)
        meta, tok = c._meta(w_, ids_, src)
        d1 = c.dropped_.clone()
        fs, fm, ft = EPt.ep_send_plan(ids_, w_, n_, c.seg, torch.empty_like(c.plan_spos), torch.empty_like(c.plan_meta),
                                      torch.empty_like(c.plan_tok), c.dropped_, per_rank=ep.per_rank, world=W,
                                      capacity=c.capacity, rank=r, far=c.far)
        d2 = c.dropped_.clone()
        c.dropped_.copy_(d0)
        return torch.equal(spos.int(), fs) and torch.equal(meta, fm) and torch.equal(tok, ft) and torch.equal(d1 - d0, d2 - d1)
    def plan_agrees(ep_, seg_, Tm, cap, T_, ids_, w_, far, work=None):   # the plan kernels against the torch plan, on a
        k, Wn = CFG.top_k, ep_.world                                    # layout of Wn capacity-row segments (seg_)
        ns = types.SimpleNamespace(ep=ep_, capacity=cap, rows=Wn * cap, slot_token=torch.arange(Tm * k, device=dev) // k,
                                   dropped_=torch.zeros((), dtype=torch.long, device=dev), seg=seg_,
                                   buckets=torch.arange(Wn + 1, device=dev)[:, None], far=far,
                                   none=torch.tensor([[-1, 0]], dtype=torch.int32, device=dev), max_tokens=Tm)
        n_ = torch.tensor(T_, device=dev)
        spos, src = CapturedEP._plan(ns, ids_, n_)
        meta, tok = CapturedEP._meta(ns, w_, ids_, src)
        d1 = ns.dropped_.clone(); ns.dropped_.zero_()
        z = lambda *s_, dt=torch.int32: torch.full(s_, -7, dtype=dt, device=dev)
        fs, fm, ft = EPt.ep_send_plan(ids_, w_, n_, seg_, z(Tm * k), z(Wn * cap, 2), z(Wn * cap, dt=torch.long), ns.dropped_,
                                      per_rank=ep_.per_rank, world=Wn, capacity=cap, rank=ep_.rank, far=far, work=work)
        return torch.equal(spos.int(), fs) and torch.equal(meta, fm) and torch.equal(tok, ft) and torch.equal(d1, ns.dropped_)
    def plan_same_large(c, Tm, cap, T_, seed):                          # the same at bench sizes (many batches of tiles per
        g_ = torch.Generator(device=dev).manual_seed(seed)              # warp), with the capture's layout and a given capacity
        ids_ = torch.randint(-1, CFG.num_experts + 1, (Tm, CFG.top_k), generator=g_, device=dev, dtype=torch.int32)   # bad ids clamp
        w_ = torch.rand(Tm, CFG.top_k, generator=g_, device=dev)
        return plan_agrees(c.ep, c.seg, Tm, cap, T_, ids_, w_, W * cap if c.far else 0)
    def sort_agrees(n_, E, experts, a1, g_, work=None):                 # the receiver's sort kernels against the torch ops
        m_ = torch.stack([torch.randint(-1, E, (n_,), generator=g_, device=dev, dtype=torch.int32),   # on n_ random rows,
                          torch.rand(n_, generator=g_, device=dev).view(torch.int32)], 1)            # strided (a meta view)
        er_, wr_ = m_[:, 0], m_[:, 1].view(torch.float32)
        order, back, offs, rs = EPt.recv_sort(er_, wr_, experts, a1, work=work)
        o0, f0, a0 = EPt.recv_sort_torch(er_, experts, a1)
        return (torch.equal(order.long(), o0) and torch.equal(offs, f0) and torch.equal(back.long()[o0], torch.arange(n_, device=dev))
                and torch.equal(rs, torch.stack([a0[o0], wr_[o0]], 1)))
    def sort_same_large(n_, seed):                                      # the receiver's sort at bench sizes, strided rows
        return sort_agrees(n_, CFG.num_experts, ep.experts, ep.a1_all, torch.Generator(device=dev).manual_seed(seed))
    def kernels_at_real_key_counts():                                   # the sorts' kernels at the layers' real key counts
        ws, k = EPt.ep_workspace(dev), CFG.top_k                        # (Flash E/W + 1 = 129, Pro at W = 1: 385), many
        g_ = torch.Generator(device=dev).manual_seed(5)                 # CTAs (up to EP_GMAX), one workspace reused
        for per in (31, 32, 33, 128, 384, 399):
            e0, E = 5, 5 + per + 1
            a1 = torch.rand(E, generator=g_, device=dev)
            for n_ in (1, 1000, 1025, 4097, 32768, 65536):          # (up to 1024: one CTA, one launch)
                if not sort_agrees(n_, E, range(e0, e0 + per), a1, g_, work=ws):
                    fails.append(f"ep_sort kernels != recv_sort_torch (E/W = {per}, n = {n_})")
        for Wf, per_rank in ((17, 3), (33, 2), (64, 4)):                # the plan at many destinations (a made-up world)
            for Tm_, cap_, T_ in ((2048, 2048 * k // Wf + 64, 2000), (8192, 200, 8192), (5, 4, 3), (170, 80, 169)):
                ep_ = types.SimpleNamespace(per_rank=per_rank, world=Wf, rank=Wf // 3, cfg=types.SimpleNamespace(top_k=k))
                seg_ = torch.randperm(Wf, generator=g_, device=dev)
                ids_ = torch.randint(-1, Wf * per_rank + 1, (Tm_, k), generator=g_, device=dev, dtype=torch.int32)
                w_ = torch.rand(Tm_, k, generator=g_, device=dev)
                if not plan_agrees(ep_, seg_, Tm_, cap_, T_, ids_, w_, Wf * cap_, work=ws):
                    fails.append(f"ep_plan kernels != the torch plan (W = {Wf}, Tm = {Tm_}, capacity = {cap_}, T = {T_})")
    kernels_at_real_key_counts()
    for act in acts:
        lay = M.DSV4MoE.synthetic(CFG, seed=7, act=act, device=dev).to(dev)     # the same layer on every rank
        for payload in ("bf16", "nvfp4") if act == "w4a4" else ("bf16",):
            ep = EPMoE(lay, payload=payload).to(dev)
            if payload == "nvfp4":                                      # the payload kernel and the receiver's sort kernel
                g_ = torch.Generator(device=dev).manual_seed(11)       # against the torch ops they replace
                xs_ = (torch.randn(50, CFG.hidden, generator=g_, device=dev) * 0.5).to(torch.bfloat16)
                R_ = 320                                                # 50 tokens x 6 slots: each slot sent to its own
                row_ = torch.randperm(R_, generator=g_, device=dev)[:300].int()   # row, some not sent (dropped), some
                fate_ = torch.randint(0, 3, (300,), generator=g_, device=dev)      # own (spos = row), the rest far
                fate_[:6] = 0                                           # (token 0: no slot sent, the kernel's early exit)
                spos_ = torch.where(fate_ == 0, 2 * R_, torch.where(fate_ == 1, row_, row_ + R_)).int()
                ms_ = torch.stack([torch.randint(-1, CFG.num_experts, (R_,), generator=g_, device=dev, dtype=torch.int32),
                                   torch.rand(R_, generator=g_, device=dev).view(torch.int32)], 1)
                c_, s_ = EPt.pack_nvfp4(xs_, spos_, ms_, ep.a1_all, R_, torch.full((R_, CFG.hidden // 2), 0xAB, dtype=torch.uint8, device=dev),
                                        torch.full((R_, CFG.hidden // 16), 0xAB, dtype=torch.uint8, device=dev))
                sent_ = fate_ != 0
                tok_ = torch.full((R_,), -1, dtype=torch.long, device=dev)
                tok_[row_[sent_].long()] = torch.arange(300, device=dev)[sent_] // CFG.top_k
                got_ = tok_ >= 0                                        # the send rows some slot was packed into
                c0, s0 = ep.quantize_rows(xs_.index_select(0, tok_[got_]), ms_[got_])
                if not (torch.equal(c_[got_], c0) and torch.equal(s_[got_], s0) and bool((c_[~got_] == 0xAB).all())
                        and bool((s_[~got_] == 0xAB).all())):
                    fails.append(f"{act}: ep_pack_nvfp4 != gather + quantize (or a row no slot was sent to was written)")
                tok_ = torch.randint(0, 50, (300,), generator=g_, device=dev)   # the receiver's rows: any tokens' payload
                ms_ = ms_[:300]
                c_, s_ = ep.quantize_rows(xs_.index_select(0, tok_), ms_)
                for n_ in (300, 1, 37):                                 # the sorted decoded rows, their (a1, weight), the
                    d_, sc_, m_ = c_[:n_], s_[:n_], ms_[:n_]            # experts' ends, the inverse order; and the experts' rows
                    args_ = (d_, sc_, m_[:, 1].view(torch.float32), m_[:, 0])
                    k1, y1 = ep.sort_decode(*args_), ep.rows_nvfp4(*args_)
                    keep, EPl.EP_SORT_MAXK = EPl.EP_SORT_MAXK, 0                # the torch ops
                    try: k0, y0 = ep.sort_decode(*args_), ep.rows_nvfp4(*args_)
                    finally: EPl.EP_SORT_MAXK = keep
                    loc = (m_[:, 0] >= ep.experts.start) & (m_[:, 0] < ep.experts.stop)   # (other rows: undefined)
                    if not (all(torch.equal(a_, b_.to(a_.dtype)) for a_, b_ in zip(k1, k0)) and torch.equal(y1[loc], y0[loc])):
                        fails.append(f"{act}: the sort kernels + gather_dequant != the torch ops (n={n_})")
                for n_ in (62000, 15520, 4097):                        # bench sizes: many batches of tiles per warp
                    if not sort_same_large(n_, n_): fails.append(f"{act}: the sort kernels != recv_sort_torch (n={n_})")
            rule = capture_(MAX_T, given=True)                                  # the schedule's own choice at 320 tokens
            want_ce = CE and MAX_T >= EPc.SCHEDULE_CE_MIN_T
            if rule.schedule != (want_ce, 0.0): fails.append(f"{act} {payload}: schedule {rule.schedule}, expected ({want_ce}, 0.0)")
            caps = {"rule": rule,                                                # each transport, the shared expert whole or split
                    "kernels": capture_(MAX_T, given=True, how=(False, 0.0)), "kernels, split": capture_(MAX_T, given=True, how=(False, 0.75)),
                    "torch plan": capture_(MAX_T, given=True, how=(CE, 0.5, 0))}
            if CE: caps.update({"copy engines": capture_(MAX_T, given=True, how=(True, 0.0)), "copy engines, split": capture_(MAX_T, given=True, how=(True, 0.5))})
            if caps["torch plan"].fused_plan or not rule.fused_plan: fails.append(f"{act} {payload}: the fused plan chosen wrongly")
            for nm, c_ in caps.items():
                if nm != "torch plan" and c_.schedule.copy_engines != (nm.startswith("copy") or (nm == "rule" and want_ce)):
                    fails.append(f"{act} {payload} {nm}: transport not taken as asked")
                for T_ in (MAX_T, 37, 1, 0):
                    if not plan_same(c_, T_, T_ + 1): fails.append(f"{act} {payload} fused send plan != torch ops ({nm}, T={T_})")
                if nm in ("kernels", "copy engines"):                          # both layouts, bench sizes: every slot fits, or
                    for Tm_, cap_, T_ in ((8192, 8192 * CFG.top_k // W + 64, 8000), (2048, 1000, 2048)):   # many are dropped
                        if not plan_same_large(c_, Tm_, cap_, T_, Tm_ + cap_):
                            fails.append(f"{act} {payload} fused send plan != torch ops ({nm}, Tm={Tm_}, capacity={cap_}, T={T_})")
            for Ts in ([37, 300], [1, 0], [0, 1], [256, 256]):                # ragged, T = 1, an empty rank
                Ts = (Ts * W)[:W]
                g = torch.Generator(device=dev).manual_seed(sum(Ts))
                x_all = (torch.randn(sum(Ts), CFG.hidden, generator=g, device=dev) * 0.5).to(torch.bfloat16)
                a = sum(Ts[:r]); x = x_all[a:a + Ts[r]]
                want = lay(x_all)[a:a + Ts[r]]
                if not torch.equal(ep(x), want): fails.append(f"{act} {payload} T={Ts}")
                # fixed shapes (one CUDA graph): with the routing given, bit for bit at any T <= max_tokens
                if x_all.shape[0]:
                    w, ids = lay.route(x_all)
                    want_r = lay.forward_routed(x_all, w, ids)[a:a + Ts[r]]
                    for nm, c_ in caps.items():
                        if not torch.equal(c_(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want_r): fails.append(f"{act} {payload} captured, {nm}, T={Ts}")
                        if not shared_rows_ok(c_, Ts[r]): fails.append(f"{act} {payload} captured, {nm}, T={Ts}: a shared part's rows are not its tokens")
                # skewed: four of every token's six experts on rank 0, two elsewhere
                if x_all.shape[0] and W > 1:
                    w, _ = lay.route(x_all)
                    per, gen = CFG.num_experts // W, torch.Generator().manual_seed(sum(Ts))
                    ids = torch.stack([torch.cat([torch.randperm(per, generator=gen)[:4], per + torch.randperm(CFG.num_experts - per, generator=gen)[:2]])
                                       for _ in range(x_all.shape[0])]).to(device=dev, dtype=torch.int32)
                    want = lay.forward_routed(x_all, w, ids)[a:a + Ts[r]]
                    if not torch.equal(ep.forward_routed(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want): fails.append(f"{act} {payload} skewed T={Ts}")
                    for nm, c_ in caps.items():
                        if not torch.equal(c_(x, w[a:a + Ts[r]], ids[a:a + Ts[r]]), want): fails.append(f"{act} {payload} captured, {nm}, skewed T={Ts}")
            # the router inside the graph, on a full buffer (the same logits GEMM shape as the eager forward's)
            full = MAX_T
            g = torch.Generator(device=dev).manual_seed(5)
            x_all = (torch.randn(W * full, CFG.hidden, generator=g, device=dev) * 0.5).to(torch.bfloat16)
            x = x_all[r * full:(r + 1) * full]
            routed = capture_(full)
            if not torch.equal(routed(x), ep(x)): fails.append(f"{act} {payload} captured router != eager EP")
            for how in ((False, 0.4), (CE, 1.0)):                       # the shared expert split, or all of it after
                c_ = capture_(full, how=how)
                if not torch.equal(c_(x), ep(x)): fails.append(f"{act} {payload} captured router, schedule {how} != eager EP")
            tiny = capture_(3, how=(CE, 0.5))                            # the fused router path (<= 4 tokens), split
            if not torch.equal(tiny(x[:3]), ep(x[:3])): fails.append(f"{act} {payload} captured router, 3 tokens, shared split != eager EP")
            if CE:                                                       # the copy engines move the rows: no NCCL kernel runs
                from torch.profiler import profile, ProfilerActivity
                ce = capture_(full, how=(True, 0.5))
                ce(x); torch.cuda.synchronize(); dist.barrier()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    y_ = ce(x); torch.cuda.synchronize()
                names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
                nccl = sorted({n for n in names if "nccl" in n.lower()})
                if nccl or not any("PtoP" in n for n in names): fails.append(f"{act} {payload} copy engines, graph: NCCL kernels {nccl[:3]}, no peer copy")
                if not torch.equal(y_, ep(x)): fails.append(f"{act} {payload} copy engines, graph != eager EP")
            # a capacity that the skewed routing overflows: NaN exactly for the tokens that lost a slot, counted
            if W > 1:
                smalls = {"kernels": capture_(MAX_T, capacity=64, given=True, how=(False, 0.0))}
                if CE: smalls["copy engines"] = capture_(MAX_T, capacity=64, given=True, how=(True, 0.5))
                for nm, c_ in smalls.items():
                    for T_ in (MAX_T, 100):                                 # random routing past the capacity: drops counted alike
                        if not plan_same(c_, T_, 7 + T_): fails.append(f"{act} {payload} fused send plan != torch ops ({nm}, capacity 64, T={T_})")
                per, gen = CFG.num_experts // W, torch.Generator().manual_seed(9)
                ids = torch.stack([torch.cat([torch.randperm(per, generator=gen)[:4], per + torch.randperm(CFG.num_experts - per, generator=gen)[:2]])
                                   for _ in range(W * 40)]).to(device=dev, dtype=torch.int32)
                w = torch.rand(W * 40, CFG.top_k, device=dev) + 0.1
                want = lay.forward_routed(x_all[:W * 40], w, ids)[r * 40:(r + 1) * 40]
                dest = ids[r * 40:(r + 1) * 40].long() // per                   # this rank's slots, in token order per destination
                pos = torch.stack([(dest.reshape(-1) == d).cumsum(0).view_as(dest) - 1 for d in range(W)]).gather(0, dest[None])[0]
                lost = (pos >= 64).any(1)
                for nm, c_ in smalls.items():
                    y = c_(x_all[r * 40:(r + 1) * 40], w[r * 40:(r + 1) * 40], ids[r * 40:(r + 1) * 40])
                    if not (torch.isnan(y).all(1).equal(lost) and torch.equal(y[~lost], want[~lost]) and c_.dropped == int((pos >= 64).sum())):
                        fails.append(f"{act} {payload} capacity overflow, {nm}")
    bad = torch.tensor([len(fails)], device=dev)
    dist.all_reduce(bad)
    if fails: print(f"rank {r}: FAIL " + "; ".join(fails), flush=True)
    dist.barrier()
    if r == 0: print("ALL OK" if bad.item() == 0 else f"{int(bad.item())} failures", flush=True)
    teardown(made, r)
    return 0 if bad.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main(tuple(sys.argv[1:]) or ("w4a16", "w4a4")))
