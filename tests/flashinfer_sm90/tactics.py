"""GPU diagnostic of the FlashInfer peer's tactic sweep (after stage.sh's env.sh): for the DSV4-Flash layer shape, each path
(MXFP4 x bf16, MXFP4 x FP8 Humming) and each T given, run FlashInfer's autotuner with its debug log captured and report,
per GEMM, how many tactics it timed, the fastest few (tactic id, us), which it chose, and every reason a tactic was
skipped (the exception text, counted). Then time the tuned call once under torch.profiler and print the full (mangled)
names of its GEMM kernels, which carry the tile and cluster shapes. Writes OUT.json.

    python tests/flashinfer_sm90/tactics.py OUT.json [T ...]        (default T = 2048)"""
import collections, json, logging, os, re, sys
os.environ.setdefault("FLASHINFER_DISABLE_JIT", "1")
os.environ["FLASHINFER_LOGGING_LEVEL"] = "DEBUG"
import torch
from torch.profiler import ProfilerActivity, profile


class Grab(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG); self.msgs = []
    def emit(self, rec): self.msgs.append(rec.getMessage())


def main():
    out, Ts = sys.argv[1], [int(a) for a in sys.argv[2:]] or [2048]
    from flashinfer.jit.core import logger
    from flashinfer.fused_moe import cutlass_fused_moe
    from flashinfer.fused_moe.prepare import prepare_cutlass_humming_weights, prepare_cutlass_w4a16_weights
    from flashinfer import autotune
    for h in list(logger.handlers): h.setLevel(logging.WARNING)          # keep the console quiet; the grabber sees all
    grab = Grab(); logger.addHandler(grab)
    E, H, I, k, dev = 256, 4096, 2048, 6, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    kw = dict(num_local_experts=E, hidden_size=H, intermediate_size=I, device=dev)
    prep = {"w4a16": prepare_cutlass_w4a16_weights(w13, w2, **kw), "w4a8": prepare_cutlass_humming_weights(w13, w2, **kw)}
    del w13, w2; torch.cuda.empty_cache()
    res = dict(gpu=torch.cuda.get_device_name(dev), shape=dict(E=E, H=H, I=I, top_k=k))
    for T in Ts:
        ids = torch.rand(T, E, generator=torch.Generator().manual_seed(T)).topk(k, dim=1).indices.to(torch.int32).to(dev)
        w = torch.full((T, k), 1 / k, device=dev)
        x = (torch.randn(T, H, generator=g, device=dev) * 0.5).to(torch.bfloat16)
        y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        for path, v in prep.items():
            if path == "w4a16":
                qs, extra = [v["fc1_expert_scales"].view(torch.int32), v["fc2_expert_scales"].view(torch.int32)], {}
            else:
                qs = [v["fc1_expert_scales"].view(torch.int32), v["fc1_residual_scale"], v["fc2_act_global"],
                      v["fc2_expert_scales"].view(torch.int32), v["fc2_residual_scale"]]
                extra = dict(use_wfp4afp8_humming=True)
            call = lambda: cutlass_fused_moe(x, ids, w, v["fc1_expert_weights"], v["fc2_expert_weights"], torch.bfloat16, qs,
                                             output=y, use_w4_group_scaling=True, tune_max_num_tokens=max(Ts), **extra)
            grab.msgs.clear()
            with autotune(True, tuning_buckets=(T,)): call()
            torch.cuda.synchronize()
            r, seg = dict(T=T, path=path), []
            for m in grab.msgs:                   # each GEMM's sweep ends with its summary line (or its chosen tactic)
                seg.append(m)
                op = re.search(r"trtllm::fused_moe::(gemm[12])", m)
                if op and ("Skipped" in m or "profiling chosen runner" in m):
                    d = r.setdefault(op.group(1), dict(skipped=collections.Counter(), profiled=[], chosen=None))
                    for q in seg:
                        if "due to failure while profiling:" in q:
                            d["skipped"][re.sub(r"\d+", "#", q.split("due to failure while profiling:", 1)[1].strip())[:300]] += 1
                        elif q.startswith("[Autotuner]: profiling ") and "avg_time" in q:
                            t = re.search(r" (-?\d+), shapes=.*avg_time (\S+)", q)
                            d["profiled"].append((int(t.group(1)), float(t.group(2))) if t else q[:200])
                        elif "profiling chosen runner" in q: d["chosen"] = q[:300]
                    seg = []
            for op in ("gemm1", "gemm2"):
                if op in r: r[op]["skipped"] = dict(r[op]["skipped"].most_common(8))
            for _ in range(3): call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                call(); torch.cuda.synchronize()
            r["kernels"] = [(e.name, round(e.time_range.elapsed_us(), 1)) for e in
                            sorted((e for e in p.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)]
            r["log"] = [m[:400] for m in grab.msgs[:600]]
            res[f"{path} T={T}"] = r
            print(f"== {path} T={T}")
            for op in ("gemm1", "gemm2"):
                d = r.get(op, {})
                print("  ", op, "profiled", len(d.get("profiled", [])), "skipped", d.get("skipped"), "\n    chosen", d.get("chosen"))
                print("      fastest:", sorted((q for q in d.get("profiled", []) if isinstance(q, tuple)), key=lambda q: q[1])[:6])
            for name, us in r["kernels"]:
                if "device_kernel" in name: print(f"   {us:9.1f}  {name}")
            json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
