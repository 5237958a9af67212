"""Session 43 experiment: the captured DSV4-Flash W4A16 layer at T = 1 with the shared expert scheduled differently.
Each variant is the layer's own decode step (forward_device's shared-apart branch) with one thing changed; all must give
the baseline's bits. Timed alternating (graph replay, L2 flushed clean, median of 200, 3 rounds), plus a per-stream
timeline from the profiler's trace (kernels identified by stream and order, not by position in a mixed sort)."""
import json, os, statistics, sys, tempfile
import torch
from torch.profiler import ProfilerActivity, profile
from dsv4_nvfp4.moe import FLASH, DSV4MoE
from dsv4_nvfp4.routing import route_permute_fused, combine_tokens
from dsv4_nvfp4.swiglu import grouped_gemm_swiglu_nvfp4
from dsv4_nvfp4.gemm import grouped_gemm_nvfp4, cached_ones
from dsv4_nvfp4.bench.core import read_clean

OUT = sys.argv[1]
dev = torch.device("cuda")
layer = DSV4MoE.synthetic(FLASH, seed=0, device=dev, keep_bf16=False).to(dev)
c, T = layer.cfg, 1
flush = torch.zeros(32 << 20, dtype=torch.int64, device=dev); sink = torch.empty((), dtype=torch.int64, device=dev)
hp = torch.cuda.Stream(dev, priority=-1)     # torch: lower is higher; the default streams are 0


def fwd(x, n, out, bufs, order, sfree, side):
    buf = bufs[0]
    (w13s, w2s), routed = layer.apart(dev)[1], layer.apart(dev)[0]
    hs, ys, offs_s, rs_s = bufs[4]
    main = torch.cuda.current_stream(dev)
    cached_ones((1, 1), dev)
    def shared():
        with torch.cuda.stream(side):
            offs_s.copy_(n.clamp(0, T))
            h1 = grouped_gemm_swiglu_nvfp4(x, w13s, offs_s, out=hs[:T], swiglu_limit=c.swiglu_limit, row_scales=rs_s[:T],
                                           scales_given=True, sms_free=sfree)
            grouped_gemm_nvfp4(h1, w2s, offs_s, out=ys[:T], sms_free=sfree)
    route = lambda: route_permute_fused(x, layer.gate_weight, buf, layer.gate_bias, routed_scaling_factor=c.routed_scaling_factor,
                                        tid2eid=layer.tid2eid, input_ids=None, a1_scales=None, n_tokens=n)
    if order == "fork_first":                 # today's order
        side.wait_stream(main); shared(); xr, rs = route()
    elif order == "route_then_fork":          # the shared expert depends on the route: runs beside the routed GEMMs
        xr, rs = route(); side.wait_stream(main); shared()
    elif order == "route_hi":                 # today's order, the route on a high-priority stream
        side.wait_stream(main); shared(); hp.wait_stream(main)
        with torch.cuda.stream(hp): xr, rs = route()
        main.wait_stream(hp)
    elif order == "route_node_first":         # today's dependencies, the route's node recorded first
        ev = torch.cuda.Event(); ev.record(main); xr, rs = route(); side.wait_event(ev); shared()
    E = c.num_experts
    rows = layer.run_experts(xr, rs, buf.offsets[:E], bufs, weights=routed, l2_pdl=True)
    main.wait_stream(side)
    return combine_tokens(rows, buf, out, n, shared=ys)


class Cap:
    def __init__(self, order, sfree=0):
        self.bufs = layer.buffers(T, dev)
        self.x = torch.zeros(T, c.hidden, dtype=torch.bfloat16, device=dev)
        self.n = torch.full((), T, dtype=torch.long, device=dev)
        self.out = torch.empty(T, c.hidden, dtype=torch.bfloat16, device=dev)
        self.side = torch.cuda.Stream(dev)
        run = lambda: fwd(self.x, self.n, self.out, self.bufs, order, sfree, self.side)
        s = torch.cuda.Stream(dev); s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(2): run()
        torch.cuda.current_stream(dev).wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph): run()
    def __call__(self, x):
        self.x.copy_(x); self.graph.replay(); return self.out


class Base:                                    # the layer's own capture (shared_apart as the package has it, or off)
    def __init__(self, apart=True):
        layer.shared_apart = apart
        self.cap = layer.capture(T); self.graph = self.cap.graph
        layer.shared_apart = True
    def __call__(self, x): return self.cap(x)


variants = {"base": Base(), "no_apart": Base(False), "fork_first": Cap("fork_first"),
            "route_then_fork": Cap("route_then_fork"), "route_node_first": Cap("route_node_first"),
            "fork_first_free64": Cap("fork_first", 64), "fork_first_free96": Cap("fork_first", 96),
            "route_node_first_free64": Cap("route_node_first", 64), "route_hi": Cap("route_hi")}
res = dict(gpu=torch.cuda.get_device_name(dev), same={}, us={}, timeline={})
g = torch.Generator(device=dev).manual_seed(1)
for i in range(4):
    x = (torch.randn(T, c.hidden, device=dev, generator=g) * 0.5).to(torch.bfloat16)
    ref = variants["base"](x).clone()
    for k, v in variants.items():
        res["same"].setdefault(k, True)
        res["same"][k] &= bool(torch.equal(v(x), ref))
print("same bits:", res["same"], flush=True)


def time_graph(graph, n=200):
    ts = []
    for _ in range(n):
        read_clean(flush, sink)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); ts.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ts) * 1e3


for r in range(3):
    for k, v in variants.items():
        res["us"].setdefault(k, []).append(round(time_graph(v.graph), 2))
    print("round", r, {k: v[-1] for k, v in res["us"].items()}, flush=True)


def timeline(graph, n=20):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            read_clean(flush, sink); graph.replay()
        torch.cuda.synchronize()
    f = tempfile.mktemp(suffix=".json"); prof.export_chrome_trace(f)
    ev = [e for e in json.load(open(f))["traceEvents"] if e.get("cat") == "kernel"]
    os.remove(f)
    ev.sort(key=lambda e: e["ts"])
    its, cur = [], None
    for e in ev:
        if "reduce" in e["name"].lower() and e["dur"] > 40: cur = []; its.append(cur); continue
        if cur is not None: cur.append(e)
    its = [i for i in its if i]
    rows = {}
    for it in its:
        t0 = min(e["ts"] for e in it); t1 = max(e["ts"] + e["dur"] for e in it)
        per = {}
        for e in it:
            s = e["args"].get("stream"); j = per.setdefault(s, 0); per[s] += 1
            key = f"s{s}#{j} {e['name'][:40]} grid{e['args'].get('grid')}"
            rows.setdefault(key, []).append((e["ts"] - t0, e["dur"]))
        rows.setdefault("span", []).append((0, t1 - t0))
    out = {k: dict(start=round(statistics.median(a for a, _ in v), 2), dur=round(statistics.median(b for _, b in v), 2), n=len(v))
           for k, v in rows.items()}
    return dict(sorted(out.items(), key=lambda kv: kv[1]["start"]))


for k in ("base", "no_apart", "route_then_fork", "route_node_first", "fork_first_free64", "route_hi"):
    res["timeline"][k] = timeline(variants[k].graph)
    print("==", k)
    for kk, vv in res["timeline"][k].items(): print(f"   {vv['start']:7.2f} +{vv['dur']:6.2f}  {kk}")
json.dump(res, open(OUT, "w"), indent=1)
print("best:", {k: min(v) for k, v in res["us"].items()})
