"""Run under `torchrun --nproc-per-node W` (W >= 2): the soak test of the captured expert-parallel forward (`CapturedEP`).
Per transport and shared-expert placement (NCCL's kernels or the copy engines, the shared expert whole or split) and
payload, `--replays` graph replays, each with new tokens and a new given routing (ragged sizes, T = 1, an empty rank,
full buffers, skewed routing), every output compared bit for bit with the one-GPU layer on the same routing. Before
every replay the capture's persistent buffers (the send and receive rows, the returned and shared rows, the output)
are filled with NaN (codes and scales with 0xFF, an E4M3 NaN scale), so a step that reads a buffer before the step
that writes it is ordered before it shows as a mismatch on any replay, not only on the first call after a warm-up.

The replays run in queues of 8 back to back, as a decode loop runs them (the references first; no host sync between the
replays of a queue). It can fail, and shows it: `--broken` captures one more forward (NCCL's kernels, the shared
expert after the return: the schedule on which a read that overtakes the dispatch shows soonest, and one the default
variant list soaks unbroken; with --kept it is not a kept schedule) with the main stream's wait for the dispatch
removed (`torch.cuda.Stream.wait_event` a no-op during that capture: the experts may read the rows before they
arrive) and requires mismatches there; the run fails if the broken forward stays exact. Mismatches only on the copy
engines could be a rank poisoning its window while a slower peer still reads it: rerun with a barrier before each
poison to tell (not done here).

Prints one line per variant (replays, mismatching replays and tokens, drops) and `SOAK OK` on rank 0 when every kept
variant is exact (and the broken one is caught). Arguments: --replays N (10000), --acts w4a16,w4a4, --max-tokens T (256),
--broken, --kept (the schedules the layer picks, per payload), --variants."""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout, installed or not
from dsv4_nvfp4 import moe as M
from dsv4_nvfp4.ep import capture as EPc
from dsv4_nvfp4.ep import transport as EPt
from dsv4_nvfp4.ep.capture import CapturedEP
from dsv4_nvfp4.ep.layer import EPMoE
from ep_gpu_check import forced, nccl_init, teardown                                          # (tests/, this script's folder)

CFG = M.MoEConfig(hidden=2048, inter=1024, num_experts=16, top_k=6, routed_scaling_factor=1.5)
POISON = {torch.bfloat16: float("nan"), torch.uint8: 0xFF}


def say(line: str):
    "One line in one write: the ranks share the terminal, and print's two writes (text, newline) interleave."
    sys.stdout.write(line + "\n"); sys.stdout.flush()


def poison(c: CapturedEP):
    """Fill what a replay must overwrite: the row buffers with NaN (bf16) or 0xFF (codes, scales: an E4M3 NaN scale),
    the rows' metadata with -1 (expert -1, weight bits NaN). Not the plan's slot indices (-1 would index out of bounds)
    nor the experts' internal buffers."""
    for name in ("back", "send", "recv", "recv_scale", "send_scale", "out", "recv_meta", "send_meta", "plan_meta"):
        t = getattr(c, name, None)
        if t is None: continue
        if t.dtype in POISON: t.fill_(POISON[t.dtype])
        elif t.dtype == torch.int32: t.fill_(-1)


def case(i: int, W: int, max_tokens: int, dev):
    "Replay i's tokens per rank and routing, the same on every rank: (Ts, x_all, weights, ids)."
    g = torch.Generator().manual_seed(1000 + i)
    kind = i % 5
    if kind == 0: Ts = [int(v) for v in torch.randint(0, max_tokens + 1, (W,), generator=g)]      # ragged
    elif kind == 1: Ts = [1] * W                                                                   # T = 1
    elif kind == 2: Ts = [int(v) for v in torch.randint(1, max_tokens + 1, (W,), generator=g)]; Ts[i % W] = 0   # an empty rank
    else: Ts = [max_tokens] * W                                                                    # full buffers
    n = sum(Ts)
    x = (torch.randn(n, CFG.hidden, generator=g) * 0.5).to(torch.bfloat16)
    w = torch.rand(n, CFG.top_k, generator=g) + 0.1
    if kind == 4:                                                                                  # skewed: most on rank 0
        per = CFG.num_experts // W
        m = min(4, per)
        ids = torch.stack([torch.cat([torch.randperm(per, generator=g)[:m], per + torch.randperm(CFG.num_experts - per, generator=g)[:CFG.top_k - m]])
                           for _ in range(n)]) if n else torch.zeros(0, CFG.top_k, dtype=torch.long)
    else:
        ids = torch.rand(n, CFG.num_experts, generator=g).topk(CFG.top_k, dim=1).indices
    return Ts, x.to(dev), w.to(dev), ids.to(device=dev, dtype=torch.int32)


def soak(lay, c: CapturedEP, replays: int, W: int, r: int, dev, queue: int = 8) -> tuple[int, int]:
    """Replays with new inputs, each compared bit for bit with the one-GPU layer: (mismatching replays, mismatching
    tokens) on this rank. The references of `queue` replays are computed first; then those replays run back to back
    (each one's buffers poisoned and its output copied, no host sync between them), as a decode loop runs them."""
    bad_replays = bad_tokens = 0
    for i0 in range(0, replays, queue):
        todo = []
        for i in range(i0, min(i0 + queue, replays)):
            Ts, x_all, w, ids = case(i, W, c.max_tokens, dev)
            a, T = sum(Ts[:r]), Ts[r]
            want = lay.forward_routed(x_all, w, ids)[a:a + T] if x_all.shape[0] else x_all[:0]
            todo.append((x_all[a:a + T], w[a:a + T], ids[a:a + T], want))
        got = []
        for x, w, ids, _ in todo:
            poison(c)
            got.append(c(x, w, ids).clone())
        for g_, (_, _, _, want) in zip(got, todo):
            diff = (g_.view(torch.int16) != want.view(torch.int16)).any(1)
            if diff.any():
                bad_replays += 1
                bad_tokens += int(diff.sum())
    return bad_replays, bad_tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=10000)
    ap.add_argument("--acts", default="w4a16,w4a4")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--broken", action="store_true")
    ap.add_argument("--payloads", default="bf16,nvfp4", help="W4A4's payloads to soak (W4A16 sends bf16 only)")
    ap.add_argument("--kept", action="store_true", help="only the schedules `capture_schedule` picks for each payload "
                    "(at 1, SCHEDULE_CE_MIN_T and SCHEDULE_LARGE_T tokens per rank), instead of the five variants")
    ap.add_argument("--variants", default="", help="';'-separated substrings: only the variants whose name holds one "
                    "(e.g. 'copy engines, shared 0%%'); empty: all. For splitting a 10,000-replay soak over several runs")
    args = ap.parse_args()
    W, r, dev = nccl_init()
    if W < 2 or CFG.num_experts % W: raise SystemExit(f"ep_soak: needs 2 or more ranks dividing {CFG.num_experts} experts, got {W}")
    CE = EPt.copy_engines_supported()
    fails, made, lines = [], [], []
    for act in args.acts.split(","):
        lay = M.DSV4MoE.synthetic(CFG, seed=7, act=act, device=dev).to(dev)
        for payload in [p for p in args.payloads.split(",") if p in ("bf16", "nvfp4")] if act == "w4a4" else ("bf16",):
            ep = EPMoE(lay, payload=payload).to(dev)
            variants = [("kernels", (False, 0.0)), ("kernels, shared split", (False, 0.5)), ("kernels, shared after", (False, 1.0))]
            if CE: variants += [("copy engines", (True, 0.0)), ("copy engines, shared split", (True, 0.75))]
            if args.kept:                                       # the schedules the layer runs, at each threshold of the rule
                ts = (1, EPc.SCHEDULE_CE_MIN_T, EPc.SCHEDULE_LARGE_T)
                kept = dict.fromkeys(tuple(EPc.capture_schedule(payload, t, W, CE)) for t in ts)
                variants = [(f"kept: {'copy engines' if ce else 'kernels'}, shared {after:.0%} after", (ce, after)) for ce, after in kept]
            if args.variants: variants = [v for v in variants if any(k in v[0] for k in args.variants.split(";"))]
            for name, how in variants:
                with forced(*how): c = CapturedEP(ep, args.max_tokens, given=True)
                made.append(c)
                t0 = time.time()
                br, bt = soak(lay, c, args.replays, W, r, dev)
                lines.append(f"{act} {payload} {name}: {args.replays} replays, {br} mismatching ({bt} tokens), "
                             f"{c.dropped} slots dropped, {time.time() - t0:.0f} s")
                say(f"rank {r}: {lines[-1]}")                                 # (as each finishes: a cut run keeps them)
                if br or c.dropped: fails.append(lines[-1])
            if args.broken:                                     # the dispatch not awaited: must be caught
                with forced(False, 1.0, broken=True): c = CapturedEP(ep, args.max_tokens, given=True)
                made.append(c)
                n = min(args.replays, 200)
                br, bt = soak(lay, c, n, W, r, dev)
                caught = torch.tensor([br], device=dev)
                dist.all_reduce(caught)
                lines.append(f"{act} {payload} BROKEN wait (kernels, shared after the return): {n} replays, "
                             f"{int(caught.item())} mismatching over the ranks ({bt} tokens here)")
                say(f"rank {r}: {lines[-1]}")
                if caught.item() == 0: fails.append("the broken event wait was not caught: " + lines[-1])
    bad = torch.tensor([len(fails)], device=dev)
    dist.all_reduce(bad)
    dist.barrier()
    if r == 0: print("SOAK OK" if bad.item() == 0 else f"SOAK FAILED ({int(bad.item())} failures over the ranks)", flush=True)
    teardown(made, r)
    return 0 if bad.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
