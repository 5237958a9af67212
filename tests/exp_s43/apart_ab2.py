"""Session 43: the layer's shared-apart decode step against the shared expert in the grouped GEMM (shared_apart off),
Flash and Pro EP48, T = 1-4 (SHARED_APART_MAX_T), captured, L2 flushed clean, median of 200, 4 alternating rounds, bits compared."""
import json, statistics, sys
import torch
from dsv4_nvfp4.moe import FLASH, DSV4MoE, MoEConfig
from dsv4_nvfp4.bench.core import read_clean
OUT = sys.argv[1]
dev = torch.device("cuda")
flush = torch.zeros(32 << 20, dtype=torch.int64, device=dev); sink = torch.empty((), dtype=torch.int64, device=dev)
def time_graph(graph, n=200):
    ts = []
    for _ in range(n):
        read_clean(flush, sink)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); ts.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ts) * 1e3
res = dict(gpu=torch.cuda.get_device_name(dev), rows=[])
for name, cfg in (("Flash", FLASH), ("Pro EP48", MoEConfig(7168, 3072, 48, 6, 2.5))):
    layer = DSV4MoE.synthetic(cfg, seed=0, device=dev, keep_bf16=False).to(dev)
    for T in (1, 2, 3, 4):
        caps = {}
        for apart in (True, False):
            layer.shared_apart = apart; caps[apart] = layer.capture(T)
        layer.shared_apart = True
        same = True
        for i in range(3):
            x = (torch.randn(T, cfg.hidden, device=dev) * 0.5).to(torch.bfloat16)
            same &= bool(torch.equal(caps[True](x).clone(), caps[False](x).clone()))
        us = {True: [], False: []}
        for r in range(4):
            for a in (True, False) if r % 2 == 0 else (False, True): us[a].append(round(time_graph(caps[a].graph), 2))
        row = dict(problem=name, T=T, same_bits=same, apart_us=us[True], together_us=us[False],
                   apart_over_together=round(min(us[True]) / min(us[False]), 3))
        res["rows"].append(row); print(row, flush=True)
        del caps; torch.cuda.empty_cache()
    del layer; torch.cuda.empty_cache()
json.dump(res, open(OUT, "w"), indent=1)
