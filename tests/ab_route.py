"""Time the layer's small kernels of one checkout of this package, graph-replayed behind the clean L2 flush, for an A/B
of two checkouts on the same GPU (run the old one, then the new one; PYTHONPATH picks the checkout). No CuTeDSL needed.

    PYTHONPATH=<checkout> python tests/ab_route.py OUT.json

Rows, for DSV4-Flash and Pro EP48 shapes: the fused decode launch (`route_permute_fused`) at T = 1, 2, 4 with bf16 and
W4A4 rows, `route_rows` alone at T = 8 .. 8192 and `combine_tokens` at T = 1 .. 8192."""
import json, sys
import torch

import dsv4_nvfp4
from dsv4_nvfp4 import routing as R
from dsv4_nvfp4.bench.core import Timer

timer, dev, k = Timer(), "cuda", 6
res = {"gpu": torch.cuda.get_device_name(0), "root": dsv4_nvfp4.__file__}
for name, (H, E) in {"flash": (4096, 256), "pro_ep48": (7168, 48)}.items():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(E, H, generator=g) * H ** -0.5).bfloat16().to(dev)
    bias = (torch.randn(E, generator=g) * 0.05).to(dev)
    for T in (1, 2, 4):
        x = torch.randn(T, H, generator=g).bfloat16().to(dev)
        for act in ("w4a16", "w4a4"):
            buf = R.route_buffers(T, E, k, H, dev)
            a1 = torch.full((buf.groups,), 0.01, device=dev) if act == "w4a4" else None
            res[f"route_small {name} {act} T={T}"] = timer(lambda: R.route_permute_fused(x, w, buf, bias, a1_scales=a1))[0]
    for T in (1, 8, 32, 128, 2048, 8192):
        x = torch.randn(T, H, generator=g).bfloat16().to(dev)
        buf = R.route_buffers(T, E, k, H, dev)
        lg = R.router_logits(x, w, out=buf.logits[:T])
        if T >= 8: res[f"route_rows {name} T={T}"] = timer(lambda: R.route_rows(buf, T, lg, bias))[0]
        R.route_rows(buf, T, lg, bias); R.permute_rows(x, buf)
        rows = torch.randn(T * (k + 1), H, device=dev).bfloat16(); out = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
        res[f"combine {name} T={T}"] = timer(lambda: R.combine_tokens(rows, buf, out))[0]
    print(json.dumps({key: round(v, 1) for key, v in res.items() if name in key}), flush=True)
    json.dump(res, open(sys.argv[1], "w"), indent=1)
