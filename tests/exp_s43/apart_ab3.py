"""Session 43, second experiment: the shared expert's L1 alone beside the router (its h row written into the L1's h
buffer at its expert-major place, joined before the routed L1), the L2 over all E + 1 groups as a programmatic
dependent of the routed L1 as in the single stream. Against the single stream (shared_apart off) and today's apart.
n_tokens = T throughout (the shared rows are then h[kT:(k+1)T])."""
import json, statistics, sys
import torch
from torch.profiler import ProfilerActivity, profile
from dsv4_nvfp4 import moe as M
from dsv4_nvfp4.moe import FLASH, DSV4MoE, MoEConfig
from dsv4_nvfp4.routing import route_permute_fused, combine_tokens
from dsv4_nvfp4.swiglu import grouped_gemm_swiglu_nvfp4
from dsv4_nvfp4.gemm import grouped_gemm_nvfp4, cached_ones
from dsv4_nvfp4.bench.core import read_clean
sys.path.insert(0, "_draft/run")
OUT = sys.argv[1]
dev = torch.device("cuda")
flush = torch.zeros(32 << 20, dtype=torch.int64, device=dev); sink = torch.empty((), dtype=torch.int64, device=dev)


def fwd_l1(layer, T, x, n, out, bufs, side):
    c, E, k = layer.cfg, layer.cfg.num_experts, layer.cfg.top_k
    buf, h, rows_out = bufs[0], bufs[1], bufs[3]
    w13p, w2p = layer.prepared(dev)
    (w13r, _), (w13s, _) = layer.apart(dev)
    _, _, offs_s, rs_s = bufs[4]
    main = torch.cuda.current_stream(dev)
    cached_ones((1, 1), dev)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        offs_s.fill_(T)
        grouped_gemm_swiglu_nvfp4(x, w13s, offs_s, out=h[k * T:(k + 1) * T], swiglu_limit=c.swiglu_limit, row_scales=rs_s[:T],
                                  scales_given=True)
    xr, rs = route_permute_fused(x, layer.gate_weight, buf, layer.gate_bias, routed_scaling_factor=c.routed_scaling_factor,
                                 tid2eid=layer.tid2eid, input_ids=None, a1_scales=None, n_tokens=n)
    R = xr.shape[0]
    main.wait_stream(side)
    hh = grouped_gemm_swiglu_nvfp4(xr, w13r, buf.offsets[:E], out=h[:R], swiglu_limit=c.swiglu_limit, row_scales=rs, scales_given=True)
    rows = grouped_gemm_nvfp4(h[:R], w2p, buf.offsets, out=rows_out[:R], config=M._pdl_config(R, *w2p.shape))
    return combine_tokens(rows, buf, out, n)


class Cap:
    def __init__(self, layer, T):
        c = layer.cfg
        self.bufs = layer.buffers(T, dev)
        self.x = torch.zeros(T, c.hidden, dtype=torch.bfloat16, device=dev)
        self.n = torch.full((), T, dtype=torch.long, device=dev)
        self.out = torch.empty(T, c.hidden, dtype=torch.bfloat16, device=dev)
        self.side = torch.cuda.Stream(dev)
        run = lambda: fwd_l1(layer, T, self.x, self.n, self.out, self.bufs, self.side)
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


from apart_ab_tl import timeline
res = dict(gpu=torch.cuda.get_device_name(dev), rows=[], timeline={})
for name, cfg, Ts in (("Flash", FLASH, (1, 2, 4)), ("Pro EP48", MoEConfig(7168, 3072, 48, 6, 2.5), (1, 3))):
    layer = DSV4MoE.synthetic(cfg, seed=0, device=dev, keep_bf16=False).to(dev)
    for T in Ts:
        caps = {}
        for apart in (True, False):
            layer.shared_apart = apart; caps["apart" if apart else "together"] = layer.capture(T)
        layer.shared_apart = True
        caps["apart_l1"] = Cap(layer, T)
        same = {k: True for k in caps}
        for i in range(3):
            x = (torch.randn(T, cfg.hidden, device=dev) * 0.5).to(torch.bfloat16)
            ref = caps["together"](x).clone()
            for kk, v in caps.items(): same[kk] &= bool(torch.equal(v(x)[:T], ref))
        us = {kk: [] for kk in caps}
        order = list(caps)
        for r in range(4):
            for kk in (order if r % 2 == 0 else order[::-1]): us[kk].append(round(time_graph(caps[kk].graph), 2))
        row = dict(problem=name, T=T, same_bits=same, us=us, best={kk: min(v) for kk, v in us.items()})
        res["rows"].append(row); print(row, flush=True)
        if name == "Flash" and T == 1:
            for kk in caps:
                res["timeline"][kk] = tl = timeline(caps[kk].graph, flush, sink)
                print("==", kk)
                for a, b in tl.items(): print(f"   {b['start']:7.2f} +{b['dur']:6.2f}  {a}")
        del caps; torch.cuda.empty_cache()
    del layer; torch.cuda.empty_cache()
json.dump(res, open(OUT, "w"), indent=1)
