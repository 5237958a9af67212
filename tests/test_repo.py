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
