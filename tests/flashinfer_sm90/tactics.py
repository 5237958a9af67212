"""GPU diagnostic of the FlashInfer peer's tactic sweep (after stage.sh's env.sh): for the DSV4-Flash layer shape, each path
(MXFP4 x bf16, MXFP4 x FP8 Humming) and each T given, run FlashInfer's autotuner with its debug log captured and report,
per GEMM, how many tactics it timed, the fastest few (tactic id, us), which it chose, and every reason a tactic was
skipped (the exception text, counted). Then time the tuned call once under torch.profiler and print the full (mangled)
names of its GEMM kernels, which carry the tile and cluster shapes. Writes OUT.json. The weights and the call are
tests/bench_peers_w4a8.py's (`_FlashInfer`), so the repository must be on PYTHONPATH.

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
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from bench_peers_w4a8 import _FlashInfer, is_cutlass_gemm         # the peer's weights and call, as the benchmark has them
    from flashinfer.jit.core import logger
    for h in list(logger.handlers): h.setLevel(logging.WARNING)          # keep the console quiet; the grabber sees all
    grab = Grab(); logger.addHandler(grab)
    E, H, I, k, dev = 256, 4096, 2048, 6, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    errors = {}
    fi = _FlashInfer((torch.randn(E, 2 * I, H, generator=g, device=dev) * 0.02).to(torch.bfloat16),
                     (torch.randn(E, H, I, generator=g, device=dev) * 0.02).to(torch.bfloat16), H, I, max(Ts), errors, topk=k)
    res = dict(gpu=torch.cuda.get_device_name(dev), shape=dict(E=E, H=H, I=I, top_k=k), errors=errors)
    for T in Ts:
        ids = torch.rand(T, E, generator=torch.Generator().manual_seed(T)).topk(k, dim=1).indices.to(torch.int32).to(dev)
        w = torch.full((T, k), 1 / k, device=dev)
        x = (torch.randn(T, H, generator=g, device=dev) * 0.5).to(torch.bfloat16)
        y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        for path in fi.prepared:
            call = lambda: fi.call(path, x, ids, w, y)
            grab.msgs.clear()
            fi.tune(path, x, ids, w, y)
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
                if is_cutlass_gemm(name): print(f"   {us:9.1f}  {name}")
            json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
