"""Timeline of the captured DSV4-Flash MoE layer (a GPU tool, not a test): torch.profiler (CUPTI) over 30 replays of the
CUDA graph, the L2 flushed before each; per kernel, the median duration and the median gap after the kernel before
it, and the median span from the first kernel's start to the last one's end. W4A16 and W4A4; with --w4a8, the layer
in DeepSeek-V4's weight form (MXFP4-carried routed experts) on W4A8 and on W4A16 (the prefill timelines of 04e).

    python tests/moe_timeline.py OUT.json [--w4a8] [T ...]        (default T = 1)"""
import json, statistics, sys

import torch
from torch.profiler import ProfilerActivity, profile


def timeline(cap, flush, n=30):
    "Per-kernel median durations and gaps of `cap.graph` replays, and the median span (us)."
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            flush.sum(); cap.graph.replay()
        torch.cuda.synchronize()
    # copies and memsets are the harness's: torch.sum's multi-block reduction (the flush) clears its semaphores with a
    # memset just before the reduction, which would otherwise close each iteration and pad its span (about 3 us at T = 1)
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "emcpy" not in e.name and "emset" not in e.name),
                key=lambda e: e.time_range.start)
    its, cur = [], None
    for e in ev:                                    # an iteration starts after each flush (the long reduction)
        if e.time_range.elapsed_us() > 40 and "reduce" in e.name.lower():
            cur = []; its.append(cur); continue
        if cur is not None: cur.append(e)
    its = [i for i in its if i]
    k = statistics.mode(len(i) for i in its); its = [i for i in its if len(i) == k]
    rows = [dict(name=its[0][j].name[:90], dur_us=round(statistics.median(i[j].time_range.elapsed_us() for i in its), 2),
                 gap_us=None if j == 0 else round(statistics.median(i[j].time_range.start - i[j - 1].time_range.end for i in its), 2))
            for j in range(k)]
    span = statistics.median(i[-1].time_range.end - i[0].time_range.start for i in its)
    return dict(kernels=rows, span_us=round(span, 2), replays=len(its))


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
                print(f"   gap {k['gap_us'] if k['gap_us'] is not None else '-':>6}  dur {k['dur_us']:8.2f}  {k['name']}", flush=True)
            del cap; torch.cuda.empty_cache()
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
