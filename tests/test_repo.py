"""Repository hygiene: what the docs tools and the CLI write stays out of git."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", ["nbs/nbdev.yml", "nbs/sidebar.yml", "_proc/x.ipynb", "_docs/index.html",
                                  "_docs_check/x.html", "bench_gemm.json", "bench_kv.png"])
def test_generated_files_are_ignored(path):
    r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
    if r.returncode == 128: pytest.skip("not a git checkout")
    assert r.returncode == 0, f"{path} is not git-ignored"


def test_measured_records_are_not_ignored():
    r = subprocess.run(["git", "check-ignore", "-q", "nbs/measured/bench_new.json"], cwd=ROOT)
    if r.returncode == 128: pytest.skip("not a git checkout")
    assert r.returncode == 1, "nbs/measured/ must stay tracked"


def test_every_notebook_is_valid_nbformat():
    "Each notebook validates against the nbformat schema (a cell type nbconvert does not know breaks the docs)."
    import glob
    nbformat = pytest.importorskip("nbformat")
    paths = sorted(glob.glob(str(ROOT / "nbs" / "*.ipynb")))
    assert paths
    for p in paths:
        nbformat.validate(nbformat.read(p, as_version=4))
        cells = json.loads(Path(p).read_text())["cells"]   # nbformat 4.5: every cell has an id (it only warns)
        assert all("id" in c for c in cells), f"{p}: a cell without an id"


def _gpu_suite():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_suite", Path(__file__).parent / "gpu_suite.py")
    G = importlib.util.module_from_spec(spec); spec.loader.exec_module(G)
    return G


def test_gpu_suite_runs_every_test_file_with_gpu_tests():
    "A test file with a `gpu` mark that no job of tests/gpu_suite.py names would never run on the GPU host."
    G = _gpu_suite()
    named = {w for _, c, _, _ in G.NVRTC + G.CUTE for w in c.split()}
    gpu = re.compile(r"^\s*(@pytest\.mark\.gpu|pytestmark\b.*\bgpu\b)|marks\s*=.*pytest\.mark\.gpu", re.M)
    marked = [p.name for p in (ROOT / "tests").glob("test_*.py") if gpu.search(p.read_text())]
    assert len(marked) >= 10, marked
    assert [m for m in marked if f"tests/{m}" not in named] == []


def test_gpu_suite_take_gives_distinct_gpus_with_free_slots():
    "take(): g distinct GPUs, the one with the most free slots first; None (and nothing taken) when there are not g."
    G = _gpu_suite()
    free = [0, 1, 0, 1]                                   # 2 GPUs, 2 slots each
    assert G.take(free, 1) == [0] and free == [1, 0, 1]
    assert G.take(free, 1) == [1] and free == [0, 1]      # GPU 1 had more free slots
    assert G.take(free, 2) == [0, 1] and free == []
    free = [0, 0, 1]
    assert G.take(free, 2) == [0, 1] and free == [0]
    assert G.take(free, 2) is None and free == [0]        # one GPU left: a 2-GPU job waits
    free = [0, 0, 0]                                      # 1 GPU, 3 slots
    assert G.take(free, 2) is None and G.take(free, 1) == [0] and free == [0, 0]


def test_gpu_suite_runs_jobs_on_slots_of_the_visible_gpus(tmp_path, monkeypatch):
    """The scheduler with fake jobs on 2 fake GPUs, 2 slots each, the parent restricted to physical GPUs 5 and 7: each
    job sees the physical ids, a 2-GPU job both, a 3-GPU job is reported as not run (exit 1); every slot comes back;
    an --only name that is no job is refused before anything runs."""
    G = _gpu_suite()
    fake = [("two", "echo $CUDA_VISIBLE_DEVICES", 2, 9), ("one_a", "echo $CUDA_VISIBLE_DEVICES", 1, 5),
            ("one_b", "echo $CUDA_VISIBLE_DEVICES", 1, 4), ("one_c", "echo $CUDA_VISIBLE_DEVICES", 1, 3),
            ("three", "echo $CUDA_VISIBLE_DEVICES", 3, 1)]
    monkeypatch.setattr(G, "jobs", lambda phase, ngpu: list(fake))
    monkeypatch.setattr(G, "gpu_count", lambda: 2)
    monkeypatch.setattr(G, "gpu_name", lambda: "FakeGPU")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setattr(sys, "argv", ["gpu_suite.py", str(tmp_path), "all", "--slots", "2", "--guard", "60"])
    with pytest.raises(SystemExit) as e: G.main()
    assert e.value.code == 1                                          # the 3-GPU job did not run
    seen = {n: (tmp_path / f"{n}.log").read_text().strip() for n, *_ in fake[:4]}
    assert sorted(seen["two"].split(",")) == ["5", "7"], seen
    assert all(seen[n] in ("5", "7") for n in ("one_a", "one_b", "one_c")), seen
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("FakeGPU x 2") and "| three | `echo $CUDA_VISIBLE_DEVICES` | - | 0 | NOT RUN (needs 3 GPUs) |" in summary
    for n, *_ in fake[:4]:                               # job | command | GPUs (physical) | s | rc | last line
        cells = [c.strip() for c in next(l for l in summary.splitlines() if l.startswith(f"| {n} |")).split("|")[1:-1]]
        assert cells[2] == seen[n] and cells[4] == "0" and cells[5] == seen[n], cells
    monkeypatch.setattr(sys, "argv", ["gpu_suite.py", str(tmp_path), "all", "--slots", "0"])
    with pytest.raises(SystemExit, match="--slots must be >= 1"): G.main()
    monkeypatch.setattr(sys, "argv", ["gpu_suite.py", str(tmp_path), "all", "--only", "one_a,nb_04b_gemm_sm90"])
    with pytest.raises(SystemExit, match="--only names no job of phase 'all': nb_04b_gemm_sm90"): G.main()   # a typo runs nothing


def test_gpu_suite_on_a_host_without_gpus(tmp_path):
    "On a CPU host every job, the all-GPU one included, is reported as not run, and the script says so (exit 1)."
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "gpu_suite.py"), str(tmp_path), "all", "--only",
                        "pytest_gemm,pytest_ep_2gpu,pytest_kernels"], env=env, capture_output=True, text=True, timeout=300)
    summary = (tmp_path / "summary.md").read_text() if (tmp_path / "summary.md").exists() else ""
    assert r.returncode == 1 and summary.startswith("no GPU x 0"), r.stderr[-2000:]
    for name, n in (("pytest_gemm", 1), ("pytest_ep_2gpu", 2), ("pytest_kernels", 1)):
        assert f"| {name} | `" in summary and f"| - | 0 | NOT RUN (needs {n} GPU{'s' if n > 1 else ''}) |" in summary.split(f"| {name} | `")[1].splitlines()[0], summary


def test_gpu_suite_summary_names_the_failures(tmp_path):
    "tests/gpu_suite.py puts each failing job's failed tests and assertion lines into summary.md (the file sure to come back)."
    G = _gpu_suite()
    (tmp_path / "bad.log").write_text("tests/x.py::t1 PASSED\ntests/x.py::t2 FAILED [50%]\nE   assert 1 == 2\n")
    (tmp_path / "good.log").write_text("tests/x.py::t1 PASSED\n")
    text = G.failures(tmp_path, ["bad", "missing"])
    assert "### bad" in text and "t2 FAILED" in text and "E   assert 1 == 2" in text and "t1 PASSED" not in text
    assert G.failures(tmp_path, ["good"]) == ""


def test_ep_timeline_drops_the_next_replays_input_copies():
    """tests/ep_timeline.py: every replay but the last loses the harness's two trailing input copies (what the
    profiler puts after a replay's last kernel); a replay that does not end with them is refused."""
    import importlib.util
    from types import SimpleNamespace as E
    spec = importlib.util.spec_from_file_location("ep_timeline", Path(__file__).parent / "ep_timeline.py")
    T = importlib.util.module_from_spec(spec); spec.loader.exec_module(T)
    ev = lambda *names: [E(name=n) for n in names]
    reps = [ev("moe_route", "moe_combine", "Memcpy DtoD (Device -> Device)", "vectorized_elementwise_kernel<FillFunctor<long>>"),
            ev("moe_route", "moe_combine", "Memcpy DtoD (Device -> Device)", "vectorized_elementwise_kernel<FillFunctor<long>>"),
            ev("moe_route", "moe_combine")]
    assert [[e.name for e in r] for r in T.drop_next_inputs(reps)] == [["moe_route", "moe_combine"]] * 3
    with pytest.raises(AssertionError, match="unexpected tail"):
        T.drop_next_inputs([ev("moe_route", "moe_combine"), ev("moe_route")])


def test_route_probe_stamps_the_current_kernel():
    """tests/route_probe.py places its stamps in today's fused decode launch (every patch applies once), and refuses a
    kernel it cannot place them in rather than timing something else."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("route_probe", Path(__file__).parent / "route_probe.py")
    P = importlib.util.module_from_spec(spec); spec.loader.exec_module(P)
    src = (ROOT / "kernels_cu" / "moe_route.cu").read_text()
    out = P.patched_source(src)
    assert all(f"PST({i});" in out for i in range(3, 9)) and out.count("gtimer()") == 4
    with pytest.raises(SystemExit, match="cannot place a stamp"):
        P.patched_source(src.replace("scan_groups<kWarps * 32>(tot, wsum, ng, offsets);", "scan_groups<kWarps * 32>(tot, wsum, ng, offsets); "))
