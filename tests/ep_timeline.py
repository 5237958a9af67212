"""Timeline of the captured expert-parallel forward (a GPU tool, not a test), under torchrun: `bench ep`'s DSV4-Flash
W4A4 layer (`bench_ep_layer`, the balanced router) as `CapturedEP` at T tokens per rank and `bench_capacity`, on the
schedule `capture_schedule` picks, profiled with torch.profiler (CUPTI) over N replays, every rank starting together.
Rank 0 writes OUT.json: per replay (the graph alone: x and the token count are copied into its inputs first, then a
marker kernel runs long enough, about 0.5 ms, for the host to have queued the graph behind it, so the replay's first
event is the graph's first kernel and its span holds no host launch time; the next replay's input copies, which the
profiler puts after this one's last kernel, are left out, so a span holds no host time between replays), every kernel,
copy and memset with its
stream, its start (us from the replay's first event) and its duration; and prints the median replay (by span) as a table, with the time each stream was busy. The
barriers between replays run on a gloo group, so they put no work on the GPUs. Every rank's replays go into OUT.json too
(`ranks`), each with its first event on the host clock the profiler's timestamps share on one machine (`start_abs_us`),
and rank 0 prints per replay how far apart the ranks' graphs started: the ranks launch their own replays, and a rank
that starts late holds up the others at the all-to-all.

    torchrun --nproc-per-node 2 tests/ep_timeline.py OUT.json [--tokens 2048] [--payload nvfp4] [--replays 8]"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout, installed or not
from dsv4_nvfp4.bench.ep import bench_capacity, bench_ep_layer
from dsv4_nvfp4.ep.capture import CapturedEP
from dsv4_nvfp4.ep.layer import EPMoE
from dsv4_nvfp4.moe import FLASH
from ep_gpu_check import nccl_init                                              # (tests/, this script's folder)


def drop_next_inputs(reps: list) -> list:
    """Each replay's events but the next iteration's input copies (c.x's `copy_`, a DtoD memcpy, and c.n's `fill_`, a
    fill kernel), which run after the replay's synchronize and before the next marker, so the segmentation by markers
    puts them at the end of every replay but the last. Raises AssertionError if a replay does not end with them."""
    for rep in reps[:-1]:
        tail = [e.name for e in rep[-2:]]
        assert len(tail) == 2 and "Memcpy DtoD" in tail[0] and "Fill" in tail[1], f"ep_timeline: unexpected tail {tail}"
        del rep[-2:]
    return reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--payload", default="nvfp4")
    ap.add_argument("--replays", type=int, default=8)
    a = ap.parse_args()
    W, r, dev = nccl_init()
    lay = bench_ep_layer(FLASH, dev)
    ep = EPMoE(lay, payload=a.payload).to(dev)
    T = a.tokens
    g = torch.Generator(device=dev).manual_seed(1000 + T)
    x = (torch.randn(W * T, FLASH.hidden, generator=g, device=dev) * 0.5).to(torch.bfloat16)[r * T:(r + 1) * T].contiguous()
    c = CapturedEP(ep, T, capacity=bench_capacity(T, FLASH, W))
    for _ in range(3): c(x)
    host = dist.new_group(backend="gloo")                   # the barriers between replays: no GPU work of their own
    torch.cuda.synchronize(); dist.barrier(group=host)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.replays):
            c.x[:T].copy_(x); c.n.fill_(T)                  # the inputs, as c(x) copies them
            dist.barrier(group=host); torch.cuda.synchronize()
            torch.cuda._sleep(1_000_000)                    # the marker: a replay is what follows it (long: see above)
            c.graph.replay()
            torch.cuda.synchronize()
    dist.barrier(group=host)
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    reps, cur = [], None
    for e in ev:
        if "spin" in e.name.lower():
            cur = []; reps.append(cur); continue
        if cur is not None: cur.append(e)
    drop_next_inputs(reps)
    out = []
    base = prof.profiler.kineto_results.trace_start_ns() / 1e3        # the host clock (us), the same for every rank here
    for rep in filter(None, reps):
        t0 = rep[0].time_range.start
        out.append(dict(span_us=round(max(e.time_range.end for e in rep) - t0, 1), start_abs_us=round(base + t0, 1),
                        events=[dict(name=e.name[:100], stream=getattr(e, "device_resource_id", None),
                                     start_us=round(e.time_range.start - t0, 1), dur_us=round(e.time_range.elapsed_us(), 1))
                                for e in rep]))
    ranks = [None] * W
    dist.all_gather_object(ranks, out, group=host)                    # every rank's replays, for their skew
    if r == 0:
        res = dict(gpu=torch.cuda.get_device_name(dev), world=W, tokens_per_rank=T, payload=a.payload,
                   schedule=dict(copy_engines=c.schedule.copy_engines, shared_after=c.schedule.shared_after),
                   capacity=c.capacity, replays=out, ranks=ranks)
        json.dump(res, open(a.out, "w"), indent=1)
        full = [o for o in out if len(o["events"]) >= max(len(p["events"]) for p in out) // 2]
        med = sorted(full, key=lambda o: o["span_us"])[len(full) // 2]
        print(f"{res['gpu']} x{W}, T/rank {T}, {a.payload}, {res['schedule']}: {len(out)} replays, spans "
              f"{sorted(o['span_us'] for o in full)} us; the median one:")
        busy = {}
        for e in med["events"]:
            print(f"  s{e['stream']!s:>3} {e['start_us']:9.1f} {e['dur_us']:8.1f}  {e['name']}")
            busy[e["stream"]] = busy.get(e["stream"], 0) + e["dur_us"]
        print("  busy per stream (us): " + ", ".join(f"s{k}: {v:.1f}" for k, v in busy.items()))
        if all(len(x) == len(out) for x in ranks):                       # each replay's graph start per rank (us after the
            for k in range(len(out)):                                    # first rank's) and its span: the ranks' skew
                t0 = min(x[k]["start_abs_us"] for x in ranks)
                print(f"  replay {k}: starts " + " / ".join(f"+{x[k]['start_abs_us'] - t0:.1f}" for x in ranks)
                      + " us, spans " + " / ".join(f"{x[k]['span_us']:.0f}" for x in ranks) + " us")
    c.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
