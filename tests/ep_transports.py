"""The two transports side by side at small sizes (a GPU tool, not a test), under torchrun: `bench ep`'s layer
(`bench_ep_layer`) as `CapturedEP` at `bench_capacity`, with the shared expert beside the dispatch, on NCCL's kernels
and on the copy engines (forced, as tests/ep_gpu_check.py forces them), both payloads, timed by the bench's timer;
and the one-GPU layer captured over the W T tokens: ms per variant, and whether each output equals the one-GPU
layer's (with the one GPU's own routing: at larger T its router may route a token differently, as `bench ep`
reports). Rank 0 prints one JSON row per size, keyed as the records in
nbs/measured/bench_ep_*.json are (`graph_cap`: NCCL's kernels at the bench's capacity, `graph_cap_ce`: the copy
engines), and with OUT.json writes them as one record's `res`.

With `--shared-after F,F,...` it times instead the copy engines with the last F of the shared expert beside the return,
one key per F (`graph_cap_shP_ce`, P = 100 F), to place the split where the first part covers the dispatch and the
rest covers the return.

    torchrun --nproc-per-node 2 tests/ep_transports.py [--out OUT.json] [--shared-after F,...] [T ...]
        (default T: 1 4 32 128 512)"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]                  # the checkout (installed or not), and tests/
from dsv4_nvfp4.bench.ep import _timed, bench_capacity, bench_ep_layer
from dsv4_nvfp4.ep.capture import CapturedEP
from dsv4_nvfp4.ep.layer import EPMoE
from dsv4_nvfp4.moe import FLASH
from ep_gpu_check import forced, nccl_init


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tokens", type=int, nargs="*", default=[1, 4, 32, 128, 512], help="tokens per rank")
    ap.add_argument("--out", default=None, help="rank 0 writes the rows here as one record's `res`")
    ap.add_argument("--shared-after", default=None, help="F,F,...: the copy engines with each split instead")
    a = ap.parse_args()
    variants = ([(True, float(f), f"graph_cap_sh{round(100 * float(f))}_ce") for f in a.shared_after.split(",")] if a.shared_after
                else [(False, 0.0, "graph_cap"), (True, 0.0, "graph_cap_ce")])
    W, r, dev = nccl_init()
    lay = bench_ep_layer(FLASH, dev)
    eps = {p: EPMoE(lay, payload=p).to(dev) for p in ("bf16", "nvfp4")}
    rows = []
    for T in a.tokens:
        g = torch.Generator(device=dev).manual_seed(1000 + T)
        x_all = (torch.randn(W * T, FLASH.hidden, generator=g, device=dev) * 0.5).to(torch.bfloat16)
        x = x_all[r * T:(r + 1) * T].contiguous()
        one = lay.capture(W * T); one(x_all)
        t1 = _timed(lambda: one(x_all), 20); want = one(x_all).clone(); one = None
        row = dict(tokens_per_rank=T, world=W, t_one_graph_ms=round(t1, 4), bit_exact_one_graph=True)
        for p, ep in eps.items():
            for ce, sh, key in variants:
                with forced(ce, sh): c = CapturedEP(ep, T, capacity=bench_capacity(T, FLASH, W))
                y = c(x).clone()
                row[f"t_ep_{p}_{key}_ms"] = round(_timed(lambda: c(x), 20), 4)
                row[f"bit_exact_{p}_{key}"] = bool(torch.equal(y, want[r * T:(r + 1) * T]))   # (the one GPU's own routing)
                c.close(); c = None
        rows.append(row)
        if r == 0: print(json.dumps(row), flush=True)
    if r == 0 and a.out:
        json.dump(dict(rows=rows, gpu=torch.cuda.get_device_name(dev), world=W, router="balanced"), open(a.out, "w"), indent=1)
    dist.barrier(); dist.destroy_process_group()


if __name__ == "__main__":
    main()
