"""The fused decode attention's two partial kernels on the same inputs in one run: the 64-head CTA
(nvfp4_sparse_attn_partial64, what H % 64 == 0 launches) and the 16-head CTA (nvfp4_sparse_attn_partial, forced by
patching attention.attn_heads), with the gather-then-attend bf16 peer beside them; graph-replayed, L2 flushed clean,
median us. Also the largest relative difference per query between the two kernels' outputs. Writes OUT.json after
each row.

    python tests/attn_ab.py OUT.json"""
import json, sys
import torch

from dsv4_nvfp4 import attention as A
from dsv4_nvfp4.bench.attn import ATTN_CONTEXTS, ATTN_PROBLEMS, attn_inputs
from dsv4_nvfp4.bench.core import Timer, gpu_info

timer, res = Timer(), dict(info=gpu_info(), rows=[])
heads64 = A.attn_heads
for name, H, K, ratio in ATTN_PROBLEMS:
    for ctx in ATTN_CONTEXTS:
        for B in (1, 64, 128):
            a = attn_inputs(B, H, K, ratio, ctx)
            a.pop("kv_bytes"); a.pop("flops")
            out = torch.empty_like(a["q"])
            row = dict(problem=name, heads=H, batch=B, context=ctx)
            outs = {}
            for kind, fn in (("cta64", lambda h, b: A.ATTN64_HEADS), ("cta16", lambda h, b: A.ATTN_HEADS)):
                A.attn_heads = fn
                g, e = timer(lambda: A.sparse_attention_decode(**a, out=out))
                row[f"{kind}_us"] = round(g or e, 1)
                outs[kind] = A.sparse_attention_decode(**a).float()
            A.attn_heads = heads64
            g, e = timer(lambda: A.attend_gathered_bf16(**a))
            row["peer_us"] = round(g or e, 1)
            d = (outs["cta64"] - outs["cta16"]).flatten(1).norm(dim=1) / outs["cta16"].flatten(1).norm(dim=1).clamp_min(1e-30)
            row["max_rel_diff"] = float(d.max())
            row["cta64_over_cta16"] = round(row["cta16_us"] / row["cta64_us"], 3)
            row["peer_over_cta64"] = round(row["peer_us"] / row["cta64_us"], 3)
            res["rows"].append(row); print(row, flush=True)
            json.dump(res, open(sys.argv[1], "w"), indent=1)
            del a, out, outs; torch.cuda.empty_cache()
