"""Session 43 experiment: the shared expert's weight slabs prefetched into L2 while the router runs (the router reads
2 MB; HBM is otherwise idle then), in the single-stream decode step. Same bits required."""
import json, statistics, sys
import torch
from dsv4_nvfp4 import moe as M, runtime as rt
from dsv4_nvfp4.moe import FLASH, DSV4MoE, MoEConfig
from dsv4_nvfp4.routing import route_permute_fused, combine_tokens
from dsv4_nvfp4.bench.core import read_clean
sys.path.insert(0, "_draft/run")
from apart_ab_tl import timeline
OUT = sys.argv[1]
dev = torch.device("cuda")
flush = torch.zeros(32 << 20, dtype=torch.int64, device=dev); sink = torch.empty((), dtype=torch.int64, device=dev)


def slab(w, e):
    per = w.w_sm90.shape[0] // w.shape[0]
    s = w.w_sm90[e * per:(e + 1) * per]
    return s, s.numel()


def fwd(layer, T, x, n, out, bufs, mode, side):
    c, E = layer.cfg, layer.cfg.num_experts
    buf = bufs[0]
    w13p, w2p = layer.prepared(dev)
    main = torch.cuda.current_stream(dev)
    if mode != "plain":
        (a, na), (b, nb) = slab(w13p, E), slab(w2p, E)
        if mode.endswith("l1"): nb = 0
        args = (rt.ptr(a), rt.i64(na), rt.ptr(b), rt.i64(nb))
        if mode.startswith("side"):
            side.wait_stream(main)
            with torch.cuda.stream(side): rt.launch("exp_l2_prefetch.cu", "exp_l2_prefetch", (132, 1, 1), (32, 1, 1), args)
        else: rt.launch("exp_l2_prefetch.cu", "exp_l2_prefetch", (132, 1, 1), (32, 1, 1), args)
    xr, rs = route_permute_fused(x, layer.gate_weight, buf, layer.gate_bias, routed_scaling_factor=c.routed_scaling_factor,
                                 tid2eid=layer.tid2eid, input_ids=None, a1_scales=None, n_tokens=n)
    if mode.startswith("side"): main.wait_stream(side)
    rows = layer.run_experts(xr, rs, buf.offsets, bufs, l2_pdl=True)
    return combine_tokens(rows, buf, out, n)


class Cap:
    def __init__(self, layer, T, mode):
        c = layer.cfg
        self.bufs = layer.buffers(T, dev)
        self.x = torch.zeros(T, c.hidden, dtype=torch.bfloat16, device=dev)
        self.n = torch.full((), T, dtype=torch.long, device=dev)
        self.out = torch.empty(T, c.hidden, dtype=torch.bfloat16, device=dev)
        self.side = torch.cuda.Stream(dev)
        run = lambda: fwd(layer, T, self.x, self.n, self.out, self.bufs, mode, self.side)
        s = torch.cuda.Stream(dev); s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(2): run()
        torch.cuda.current_stream(dev).wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph): run()
    def __call__(self, x):
        self.x[:x.shape[0]].copy_(x); self.graph.replay(); return self.out


def time_graph(graph, n=200):
    ts = []
    for _ in range(n):
        read_clean(flush, sink)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); ts.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ts) * 1e3


res = dict(gpu=torch.cuda.get_device_name(dev), rows=[], timeline={})
modes = ("plain", "main", "side", "main_l1", "side_l1")
for name, cfg, Ts in (("Flash", FLASH, (1, 2, 4)), ("Pro EP48", MoEConfig(7168, 3072, 48, 6, 2.5), (1, 2))):
    layer = DSV4MoE.synthetic(cfg, seed=0, device=dev, keep_bf16=False).to(dev)
    for T in Ts:
        caps = {"package": layer.capture(T)}
        for m in modes: caps[m] = Cap(layer, T, m)
        same = {k: True for k in caps}
        for i in range(3):
            x = (torch.randn(T, cfg.hidden, device=dev) * 0.5).to(torch.bfloat16)
            ref = caps["package"](x)[:T].clone()
            for kk, v in caps.items(): same[kk] &= bool(torch.equal(v(x)[:T], ref))
        us = {kk: [] for kk in caps}
        order = list(caps)
        for r in range(4):
            for kk in (order if r % 2 == 0 else order[::-1]): us[kk].append(round(time_graph(caps[kk].graph), 2))
        best = {kk: min(v) for kk, v in us.items()}
        row = dict(problem=name, T=T, same_bits=same, us=us, best=best, over_plain={k: round(v / best["plain"], 3) for k, v in best.items()})
        res["rows"].append(row); print(row, flush=True)
        if T == 1:
            for kk in ("plain", "side", "main"):
                res["timeline"][f"{name} {kk}"] = tl = timeline(caps[kk].graph, flush, sink)
                print("==", name, kk)
                for a, b in tl.items(): print(f"   {b['start']:7.2f} +{b['dur']:6.2f}  {a}")
        del caps; torch.cuda.empty_cache()
    del layer; torch.cuda.empty_cache()
json.dump(res, open(OUT, "w"), indent=1)
