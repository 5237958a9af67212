import json, os, statistics, tempfile
import torch
from torch.profiler import ProfilerActivity, profile
from dsv4_nvfp4.bench.core import read_clean


def timeline(graph, flush, sink, n=20):
    "Per (stream, order on it) kernel: median start after the replay's first kernel and median duration (us); and the span."
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
    rows = {}
    for it in (i for i in its if i):
        t0 = min(e["ts"] for e in it); t1 = max(e["ts"] + e["dur"] for e in it)
        per = {}
        for e in it:
            s = e["args"].get("stream"); j = per.setdefault(s, 0); per[s] += 1
            rows.setdefault(f"s{s}#{j} {e['name'][:40]} grid{e['args'].get('grid')}", []).append((e["ts"] - t0, e["dur"]))
        rows.setdefault("span", []).append((0, t1 - t0))
    out = {k: dict(start=round(statistics.median(a for a, _ in v), 2), dur=round(statistics.median(b for _, b in v), 2), n=len(v))
           for k, v in rows.items()}
    return dict(sorted(out.items(), key=lambda kv: kv[1]["start"]))
