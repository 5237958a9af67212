"""The fused decode attention's three partial kernels on the same inputs in one run, each forced by patching
attention.attn_heads / attention.attn_wg: the 64-head mma.sync CTA (nvfp4_sparse_attn_partial64), the 16-head one
(nvfp4_sparse_attn_partial) and the warpgroup-MMA kernel (nvfp4_sparse_attn_wg, sm_90a), with the gather-then-attend
bf16 peer beside them and the kernel `attn_kernel` would pick (`plan`); graph-replayed, L2 flushed clean, median us.
Also the largest relative difference per query between the kernels' outputs. Writes OUT.json after each row. With
BASE_CU (a copy of kernels_cu/nvfp4_sparse_attn.cu from another commit, put in kernels_cu/ under that name), the base's
kernel of each kind is timed beside the tree's (`base_<kind>_us`, None where the base has no such kernel) and their
outputs compared bit for bit (`<kind>_same_bits`: a change that keeps the arithmetic must keep every bit).

    python tests/attn_ab.py OUT.json [--base BASE_CU] [--batches 1 32 64 128] [--contexts 32768 131072]"""
import argparse, json
import torch

from dsv4_nvfp4 import attention as A
from dsv4_nvfp4.bench.attn import ATTN_CONTEXTS, ATTN_PROBLEMS, attn_inputs
from dsv4_nvfp4.bench.core import Timer, gpu_info

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--base", default=None)
ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64, 128])   # 32: Flash's 16-head pick, Pro's 64-head one
ap.add_argument("--contexts", type=int, nargs="+", default=None)
args = ap.parse_args()
timer, res = Timer(), dict(info=gpu_info(), rows=[])
base_cu = args.base
tree_cu = A.ATTN_CU
plan_heads, plan_wg = A.attn_heads, A.attn_wg   # the plan (restored after each forced set)
for name, H, K, ratio in ATTN_PROBLEMS:
    for ctx in args.contexts or ATTN_CONTEXTS:
        for B in args.batches:
            a = attn_inputs(B, H, K, ratio, ctx)
            a.pop("kv_bytes"); a.pop("flops")
            out = torch.empty_like(a["q"])
            row = dict(problem=name, heads=H, batch=B, context=ctx,
                       plan=A.attn_kernel(H, B, a["window"].shape[1] + a["indices"].shape[1], A.rt.smem_optin(0), A.rt.device_arch()))
            outs = {}
            for kind, fn in (("cta64", lambda h, b, s, smem_optin=None: A.ATTN64_HEADS), ("cta16", lambda h, b, s, smem_optin=None: A.ATTN_HEADS),
                             ("wg", lambda h, b, s, smem_optin=None: A.ATTN64_HEADS)):
                A.attn_heads = fn
                A.attn_wg = (lambda *a, **k: True) if kind == "wg" else (lambda *a, **k: False)
                g, e = timer(lambda: A.sparse_attention_decode(**a, out=out))
                row[f"{kind}_us"] = round(g or e, 1)
                outs[kind] = A.sparse_attention_decode(**a).float()
                if base_cu:                          # the base's kernel of this kind, where the base has it
                    A.ATTN_CU = base_cu
                    try:
                        g, e = timer(lambda: A.sparse_attention_decode(**a, out=out))
                        row[f"base_{kind}_us"] = round(g or e, 1)
                        row[f"{kind}_same_bits"] = bool(torch.equal(A.sparse_attention_decode(**a).float(), outs[kind]))
                    except A.rt.KernelLaunchError:
                        row[f"base_{kind}_us"] = None
                    A.ATTN_CU = tree_cu
            A.attn_heads, A.attn_wg = plan_heads, plan_wg
            g, e = timer(lambda: A.attend_gathered_bf16(**a))
            row["peer_us"] = round(g or e, 1)
            d = (outs["cta64"] - outs["cta16"]).flatten(1).norm(dim=1) / outs["cta16"].flatten(1).norm(dim=1).clamp_min(1e-30)
            row["max_rel_diff"] = float(d.max())
            row["cta64_over_cta16"] = round(row["cta16_us"] / row["cta64_us"], 3)
            row["wg_over_cta64"] = round(row["cta64_us"] / row["wg_us"], 3)
            dw = (outs["wg"] - outs["cta64"]).flatten(1).norm(dim=1) / outs["cta64"].flatten(1).norm(dim=1).clamp_min(1e-30)
            row["wg_max_rel_diff"] = float(dw.max())
            row["peer_over_cta64"] = round(row["peer_us"] / row["cta64_us"], 3)
            res["rows"].append(row); print(row, flush=True)
            json.dump(res, open(args.out, "w"), indent=1)
            del a, out, outs; torch.cuda.empty_cache()
