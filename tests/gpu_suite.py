"""Run the GPU suites (`pytest -m gpu` per test file, `nbdev_test --flags gpu` per notebook) split over the visible
GPUs: a greedy queue, multi-GPU jobs first, then longest first, each job pinned to its GPU(s) with CUDA_VISIBLE_DEVICES and its own log.

    python tests/gpu_suite.py OUT PHASE [--guard SECONDS] [--only JOB,JOB...] [--slots N]

PHASE `nvrtc`: what needs no CuTeDSL (the NVRTC kernels' tests and notebooks); `cute`: the rest (the GEMM, the MLP,
the MoE layer, EP on 2 GPUs, their notebooks); `all`: both. A job still running at the guard is stopped and reported
as such (never as passed); a job that needs more GPUs than the host has is reported as not run. `--slots N` runs
up to N jobs on each GPU at once (default 1): the suites hold no timings, so sharing a GPU changes no result, and most
of a job's time is compiling on the host's cores. Writes OUT/summary.md and OUT/<job>.log; pytest runs verbose, so a stopped job's log still
names every test that passed or failed before the stop."""
import os, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (name, command, GPUs, expected seconds): the expectations are last runs' times, to order the queue
NVRTC = [("pytest_kernels", "python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider -n {ngpu} tests/test_kernels_gpu.py", "all", 300),
         ("pytest_kv_route", "python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider tests/test_kv_gpu.py tests/test_moe_route_gpu.py tests/test_attention_gpu.py tests/test_bench.py", 1, 120)]
NVRTC_NBS = ["03_runtime", "03a_quantize_cuda", "03b_norm_quantize", "06_kv_compress", "07_dequant_gather", "07b_sparse_attention", "07c_bench_attn", "index"]
CUTE = [("pytest_ep_2gpu", "python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider tests/test_ep_gpu.py tests/test_ep_soak_gpu.py", 2, 250),
        ("pytest_gemm", "python3 -m pytest -v -rA --tb=short -m gpu -p no:cacheprovider tests/test_gemm_gpu.py tests/test_w4a8_gpu.py", 1, 220),
        ("pytest_mlp", "python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider tests/test_mlp_gpu.py tests/test_swiglu_gpu.py tests/test_mxfp4_gpu.py", 1, 190),
        ("pytest_moe", "python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider tests/test_moe_gpu.py tests/test_moe_formats_gpu.py -k 'not flash_layer_accuracy'", 1, 330),
        ("pytest_moe_flash", "python3 -m pytest -v -rA --tb=short -m gpu -p no:cacheprovider tests/test_moe_gpu.py -k 'flash_layer_accuracy and not w4a8'", 1, 450),
        ("pytest_moe_flash_w4a8", "python3 -m pytest -v -rA --tb=short -m gpu -p no:cacheprovider tests/test_moe_gpu.py -k 'flash_layer_accuracy and w4a8'", 1, 250),
        ("pytest_compile", "python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider tests/test_compile_gpu.py tests/test_cli.py", 1, 320)]


def notebooks(phase):
    gpu = sorted(p.stem for p in (ROOT / "nbs").glob("*.ipynb") if "#| gpu" in p.read_text() or '"#| gpu' in p.read_text())
    return [n for n in gpu if (n in NVRTC_NBS) == (phase == "nvrtc")]


def jobs(phase, ngpu):
    out = []
    if phase in ("nvrtc", "all"):
        out += [(n, c.format(ngpu=ngpu), max(ngpu, 1) if g == "all" else g, t) for n, c, g, t in NVRTC]
        out += [(f"nb_{n}", f"nbdev_test --path nbs/{n}.ipynb --flags gpu", 1, 60) for n in notebooks("nvrtc")]
    if phase in ("cute", "all"):
        out += CUTE + [(f"nb_{n}", f"nbdev_test --path nbs/{n}.ipynb --flags gpu", 1, 150) for n in notebooks("cute")]
        skip = "|".join(notebooks("nvrtc") + notebooks("cute"))          # every other notebook, on one GPU, 6 at a time
        out.append(("nb_rest", f"nbdev_test --flags gpu --n_workers 6 --skip_file_re '^({skip})\\.ipynb$'", 1, 300))
    return sorted(out, key=lambda j: (-j[2], -j[3]))   # multi-GPU jobs first (they need several GPUs free at once), then longest


def take(free, g):
    """g distinct GPUs that each have a free slot in `free` (a GPU's index once per free slot), the ones with the most
    free slots first, taken out of it; None if there are not g."""
    gpus = sorted(set(free), key=lambda x: (-free.count(x), free.index(x)))[:g]
    if len(gpus) < g: return None
    for x in gpus: free.remove(x)
    return gpus


def failures(out, names, per_job=40):
    """The failing tests and their assertion lines of each job in `names`, from its log, for summary.md, which is also
    printed at the end: a run returns a limited number of files, and the printed summary reaches the caller when the
    job logs and summary.md do not."""
    text = ""
    for n in names:
        f = out / f"{n}.log"
        lines = f.read_text(errors="replace").splitlines() if f.exists() else []
        bad = [l for l in lines if " FAILED" in l or " ERROR" in l or l.startswith(("E ", "FAILED ", "ERROR "))]
        if bad: text += f"\n### {n}\n\n```\n" + "\n".join(l[:240] for l in bad[:per_job]) + "\n```\n"
    return "\n## Failures\n" + text if text else ""


def gpu_count() -> int:
    import torch
    return torch.cuda.device_count()


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name(0)


def main():
    out, phase = Path(sys.argv[1]), sys.argv[2]
    guard = float(sys.argv[sys.argv.index("--guard") + 1]) if "--guard" in sys.argv else 540
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    slots = int(sys.argv[sys.argv.index("--slots") + 1]) if "--slots" in sys.argv else 1
    if slots < 1: raise SystemExit(f"gpu_suite: --slots must be >= 1, got {slots}")
    out.mkdir(parents=True, exist_ok=True)
    ngpu = gpu_count()
    vis = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    ids = lambda gpus: ",".join(vis[x] if len(vis) == ngpu else str(x) for x in gpus)   # GPU i: the parent's i-th visible one
    every = jobs(phase, ngpu)
    unknown = sorted(set(only or ()) - {j[0] for j in every})
    if unknown: raise SystemExit(f"gpu_suite: --only names no job of phase {phase!r}: {', '.join(unknown)} "
                                 f"(the jobs: {', '.join(j[0] for j in every)})")
    queue = [j for j in every if only is None or j[0] in only]
    free, running, done, t0 = [g for _ in range(slots) for g in range(ngpu)], [], [], time.time()
    for j in [j for j in queue if j[2] > ngpu]:
        done.append((j[0], j[1], "-", "0", f"NOT RUN (needs {j[2]} GPU{'s' if j[2] > 1 else ''})", "")); queue.remove(j)
    env0 = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="4", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                NVSHMEM_DISABLE_NVLS="1")   # NVLink multicast stays off on shared hosts
    while queue or running:
        for j in list(queue):                                         # start what fits, longest first
            name, cmd, g, _ = j
            gpus = take(free, g)
            if gpus is not None:
                env = dict(env0, CUDA_VISIBLE_DEVICES=ids(gpus), DSV4_TEST_GPUS=str(g))
                log = open(out / f"{name}.log", "w")
                p = subprocess.Popen(cmd, shell=True, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                running.append((j, gpus, p, time.time(), log)); queue.remove(j)
        time.sleep(1)
        for r in list(running):
            (name, cmd, g, _), gpus, p, ts, log = r
            over = time.time() - t0 > guard
            if p.poll() is not None or over:
                if p.poll() is None: os.killpg(p.pid, 9); p.wait(); rc = "STOPPED at the guard"
                else: rc = p.returncode
                log.close(); running.remove(r); free += gpus
                tail = (out / f"{name}.log").read_text().strip().splitlines()[-1:] or [""]
                done.append((name, cmd, ids(gpus), f"{time.time() - ts:.0f}", rc, tail[0][:160]))
                print(f"{name}: rc={rc} {time.time() - ts:.0f}s  {tail[0][:160]}", flush=True)
        if time.time() - t0 > guard and queue:
            for j in queue: done.append((j[0], j[1], "-", "0", "NOT STARTED (guard)", ""))
            queue = []
    rows = "\n".join(f"| {n} | `{c}` | {g} | {s} | {rc} | {t} |" for n, c, g, s, rc, t in done)
    (out / "summary.md").write_text(f"{gpu_name() if ngpu else 'no GPU'} x {ngpu}, phase {phase}, {time.time() - t0:.0f} s\n\n"
                                    "| job | command | GPUs | s | rc | last line |\n|---|---|---|---|---|---|\n" + rows + "\n"
                                    + failures(out, [d[0] for d in done if d[4] != 0]))
    print((out / "summary.md").read_text())
    sys.exit(0 if all(r[4] == 0 for r in done) else 1)


if __name__ == "__main__":
    main()
