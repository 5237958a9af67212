"""Time the grouped GEMM and the MoE layer of one checkout of this package, graph-replayed, for an A/B of two
checkouts on the same GPU (a refactor that must not change the speed: run the old one, then the new one).

    PYTHONPATH=<checkout> python tests/ab_speed.py OUT.json [--gemm-only] [--min-tokens N]

Works on the layouts before and after the GEMM seam (it finds the synthetic timing weights and the timer where each
keeps them). Writes {problem/T: microseconds} and the GPU's name, after each row, so a run cut short keeps its rows.
--gemm-only leaves out the DSV4-Flash layer (building its synthetic weights takes minutes of host time); --min-tokens N
times only the rows of at least N tokens."""
import json, sys
import torch

import dsv4_nvfp4
try:                                                    # after the seam: the bench sub-package
    from dsv4_nvfp4.bench.core import Timer
    from dsv4_nvfp4.bench.gemm import GEMM_PROBLEMS, synthetic_weights
    from dsv4_nvfp4.gemm import grouped_gemm_nvfp4, wo_a_nvfp4
except ImportError:                                     # before: benchmarks inside the op modules
    from dsv4_nvfp4.bench import Timer
    from dsv4_nvfp4.grouped_gemm import GEMM_PROBLEMS, grouped_gemm_nvfp4, synthetic_weights, wo_a_nvfp4
from dsv4_nvfp4.moe import FLASH, DSV4MoE
from dsv4_nvfp4.routing import random_topk, route_topk

dev = torch.device("cuda")
timer, res = Timer(), {"gpu": torch.cuda.get_device_name(0), "root": dsv4_nvfp4.__file__}
MIN_T = int(sys.argv[sys.argv.index("--min-tokens") + 1]) if "--min-tokens" in sys.argv else 0
for name, E, N, K, T, topk, wo_a in GEMM_PROBLEMS:
    if T < MIN_T: continue
    pw = synthetic_weights(E, N, K, dev)
    if wo_a:
        x = torch.randn(T, E, K, device=dev).to(torch.bfloat16); out = torch.empty(T, E, N, dtype=torch.bfloat16, device=dev)
        fn = lambda: wo_a_nvfp4(x, pw, out=out)
    else:
        rt = route_topk(random_topk(T, E, topk, generator=torch.Generator().manual_seed(0)), E)
        offs, R = rt.expert_offsets.to(dev), rt.perm.numel()
        a = torch.randn(R, K, device=dev).to(torch.bfloat16); out = torch.empty(R, N, dtype=torch.bfloat16, device=dev)
        fn = lambda: grouped_gemm_nvfp4(a, pw, offs, out=out)
    g, e = timer(fn)
    res[f"gemm {name} T={T}"] = g; res[f"gemm eager {name} T={T}"] = e
    print(f"{name:34s} T={T:5d} graph {g:9.1f} us  eager {e:9.1f} us", flush=True)
    del pw; torch.cuda.empty_cache()
    json.dump(res, open(sys.argv[1], "w"), indent=1)
if "--gemm-only" in sys.argv[2:]: sys.exit(0)
layer = DSV4MoE.synthetic(FLASH, seed=0, device=dev, keep_bf16=False).to(dev)
for T in (1, 8, 128, 2048, 8192):
    if T < MIN_T: continue
    x = (torch.randn(T, FLASH.hidden, device=dev) * 0.5).to(torch.bfloat16)
    cap = layer.capture(T)
    res[f"moe Flash W4A16 T={T}"] = timer(lambda: cap(x))[1]
    print(f"moe Flash W4A16 T={T:5d} {res[f'moe Flash W4A16 T={T}']:9.1f} us", flush=True)
    del cap
    json.dump(res, open(sys.argv[1], "w"), indent=1)
