"""Repository hygiene: what the docs tools and the CLI write stays out of git."""
import subprocess
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
    for p in paths: nbformat.validate(nbformat.read(p, as_version=4))


def test_gpu_suite_slots_and_missing_gpus(tmp_path):
    "--slots shares a GPU between jobs but a multi-GPU job still gets distinct GPUs; a job needing more GPUs than the host has is reported, not run."
    import importlib.util, subprocess, sys
    spec = importlib.util.spec_from_file_location("gpu_suite", Path(__file__).parent / "gpu_suite.py")
    G = importlib.util.module_from_spec(spec); spec.loader.exec_module(G)
    free = [0, 1, 0, 1]                                   # 2 GPUs, 2 slots each
    assert G.take(free, 1) == [0] and free == [1, 0, 1]
    assert G.take(free, 2) == [1, 0] and free == [1]
    assert G.take(free, 2) is None and free == [1]       # one GPU left: a 2-GPU job waits
    free = [0, 0, 0]                                      # 1 GPU, 3 slots
    assert G.take(free, 2) is None and G.take(free, 1) == [0] and free == [0, 0]
    env = dict(__import__("os").environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "gpu_suite.py"), str(tmp_path), "cute", "--only", "pytest_gemm,pytest_ep_2gpu"],
                       env=env, capture_output=True, text=True, timeout=300)
    summary = (tmp_path / "summary.md").read_text()
    assert r.returncode == 1 and "pytest_gemm" in summary and "NOT RUN (needs 1 GPUs)" in summary and "NOT RUN (needs 2 GPUs)" in summary


def test_gpu_suite_summary_names_the_failures(tmp_path):
    "tests/gpu_suite.py puts each failing job's failed tests and assertion lines into summary.md (the file sure to come back)."
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_suite", Path(__file__).parent / "gpu_suite.py")
    G = importlib.util.module_from_spec(spec); spec.loader.exec_module(G)
    (tmp_path / "bad.log").write_text("tests/x.py::t1 PASSED\ntests/x.py::t2 FAILED [50%]\nE   assert 1 == 2\n")
    (tmp_path / "good.log").write_text("tests/x.py::t1 PASSED\n")
    text = G.failures(tmp_path, ["bad", "missing"])
    assert "### bad" in text and "t2 FAILED" in text and "E   assert 1 == 2" in text and "t1 PASSED" not in text
    assert G.failures(tmp_path, ["good"]) == ""
