"""Timeline of the captured DSV4-Flash MoE layer (a GPU tool, not a test): torch.profiler (CUPTI) over 30 replays of the
CUDA graph, the L2 flushed before each; per kernel (keyed by its stream and its order there: `per_kernel`), the median
start, duration and gap after the kernel before it, and the median span from the first kernel's start to the last one's end. W4A16 and W4A4; with --w4a8, the layer
in DeepSeek-V4's weight form (MXFP4-carried routed experts) on W4A8 and on W4A16 (the prefill timelines of 04e).

    python tests/moe_timeline.py OUT.json [--w4a8] [T ...]        (default T = 1)"""
import json, os, statistics, sys, tempfile
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile


def per_kernel(events) -> dict:
    """Per-kernel medians over replays from `events`: dicts (name, stream, ts, dur) in us, each replay opened by the L2
    flush (a "reduce" kernel over 40 us), sorted or not. A kernel is keyed by its stream and its order on that stream, not
    by its place among all of a replay's kernels (kernels of two streams start in either order from one replay to the
    next, so a key by place would take medians over different kernels). Rows in the order of their median start: name, stream,
    start_us (after the replay's first kernel), dur_us, gap_us (from the end of the row before in that order to this
    start; None for the first); the span from the first start to the last end; the replays counted (those with the
    most common kernel count and, among them, the most common kernels per stream)."""
    its, cur = [], None
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["dur"] > 40 and "reduce" in e["name"].lower():
            cur = []; its.append(cur); continue
        if cur is not None: cur.append(e)
    its = [i for i in its if i]
    if not its: return dict(kernels=[], span_us=0.0, replays=0)
    k = statistics.mode(len(i) for i in its); its = [i for i in its if len(i) == k]
    keyed = []
    for it in its:
        t0, seen, row = it[0]["ts"], {}, {}
        for e in it:                                 # it is sorted by start: the n-th kernel of each stream in turn
            j = seen[e["stream"]] = seen.get(e["stream"], -1) + 1
            row[(e["stream"], j)] = e
        keyed.append((t0, row))
    keys = Counter(frozenset(r) for _, r in keyed).most_common(1)[0][0]
    keyed = [(t0, r) for t0, r in keyed if frozenset(r) == keys]    # the replays whose streams ran the most common kernels
    med = lambda f: round(statistics.median(f(t0, r) for t0, r in keyed), 2)
    rows = sorted((dict(name=keyed[0][1][key]["name"][:90], stream=key[0],
                        start_us=med(lambda t0, r: r[key]["ts"] - t0), dur_us=med(lambda t0, r: r[key]["dur"]), key=key)
                   for key in keys), key=lambda r: (r["start_us"], str(r["key"][0]), r["key"][1]))   # ties: a fixed order
    for a, b in zip([None] + rows[:-1], rows):
        b["gap_us"] = None if a is None else med(lambda t0, r: r[b["key"]]["ts"] - (r[a["key"]]["ts"] + r[a["key"]]["dur"]))
    for r in rows: del r["key"]
    span = med(lambda t0, r: max(e["ts"] + e["dur"] for e in r.values()) - t0)
    return dict(kernels=rows, span_us=span, replays=len(keyed))


def timeline(cap, flush, n=30):
    """`per_kernel` of `cap.graph` replays, the L2 flushed before each (torch.profiler / CUPTI, read from its trace:
    kernels only; copies and memsets, the harness's, are not kernels)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            flush.sum(); cap.graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "trace.json")
        prof.export_chrome_trace(f)
        ev = [dict(name=e["name"], stream=e["args"].get("stream"), ts=e["ts"], dur=e["dur"])
              for e in json.load(open(f))["traceEvents"] if e.get("cat") == "kernel"]
    return per_kernel(ev)


def main():
    from dsv4_nvfp4.moe import FLASH, DSV4MoE      # here, not at the top: attn_timeline imports `timeline` without the layer's deps
    args = sys.argv[2:]
    w4a8 = "--w4a8" in args
    out, Ts = sys.argv[1], [int(a) for a in args if a != "--w4a8"] or [1]
    dev = torch.device("cuda")
    if w4a8:                                                # MXFP4-carried routed experts: W4A8's table loop
        lay8 = DSV4MoE.synthetic(FLASH, seed=0, device=dev, mxfp4=True, act="w4a8", keep_bf16=False).to(dev)
        lay16 = DSV4MoE(FLASH, lay8.w13, lay8.w2, lay8.gate_weight, lay8.gate_bias, act="w4a16").to(dev)
        layers = (("w4a8", lay8), ("w4a16", lay16))
    else:
        layer = DSV4MoE.synthetic(FLASH, seed=0, device=dev, keep_bf16=False).to(dev)
        E1 = FLASH.num_experts + 1
        layer4 = DSV4MoE(FLASH, layer.w13, layer.w2, layer.gate_weight, layer.gate_bias, act="w4a4",
                         a1_scales=torch.full((E1,), 3.0 / 2688), a2_scales=torch.full((E1,), 1e-3)).to(dev)
        layer4._prepared = layer._prepared                 # the same prepared weights
        layers = (("w4a16", layer), ("w4a4", layer4))
    flush = torch.zeros(32 << 20, dtype=torch.int64, device=dev)     # 256 MB read each time: L2 flushed clean
    res = dict(gpu=torch.cuda.get_device_name(dev))
    for act, lay in layers:
        for T in Ts:
            x = (torch.randn(T, FLASH.hidden, device=dev) * 0.5).to(torch.bfloat16)
            cap = lay.capture(T); cap(x); torch.cuda.synchronize()
            r = res[f"{act} T={T}"] = timeline(cap, flush)
            print(f"== {act} T={T}: span {r['span_us']:.1f} us over {r['replays']} replays", flush=True)
            for k in r["kernels"]:
                print(f"   start {k['start_us']:8.2f}  gap {k['gap_us'] if k['gap_us'] is not None else '-':>6}  dur {k['dur_us']:8.2f}"
                      f"  stream {k['stream']}  {k['name']}", flush=True)
            del cap; torch.cuda.empty_cache()
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
