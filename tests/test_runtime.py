"""Tests for dsv4_nvfp4.runtime: NVRTC compilation of kernels_cu/*.cu with no GPU, the compile cache, errors.

What is proved (CPU only: these run in CI, which has cuda-python + NVRTC but no GPU or driver):

* every ``kernels_cu/*.cu`` compiles with NVRTC for ``sm_90a`` (the verified Hopper target) and ``sm_100a``
  (Blackwell, compile-only), ``ok=True``;
* each cubin is checked *independently of the runtime's own parsing*: a small ELF64 reader (below) lists the
  symbols flagged as CUDA entry points (``STO_CUDA_ENTRY``) and they must be exactly the ``extern "C"`` kernel
  names written out by hand in ``EXPECTED_KERNELS`` (from the entry-point macros of each .cu file); the ELF
  header must say EM_CUDA and name the requested SM; the runtime's ``CompileResult.kernels`` must agree;
* kernels_cu/ has no compile-time switch that selects another kernel version: its only preprocessor conditionals are
  the ``#ifndef`` defaults of the constants listed in ``CONSTANTS`` (shape parameters, tuning constants) and tests of
  ``__CUDA_ARCH__``; every non-default value the launchers pass (``tests/ptx_hashes.py``'s ``tuning_builds``)
  compiles for both archs without spills; the row kernels' blocks per thread are the launchers';
* ptxas (``-v``) reports no register spills for any kernel (the row kernels keep a whole row in registers at
  1024 threads / CTA, so a spill would be a silent performance cliff);
* a broken .cu in a temporary kernels dir (``DSV4_NVFP4_KERNELS_DIR``) raises ``KernelCompileError`` whose
  message names the file and carries NVRTC's own log (``broken.cu(<line>): error: ... is undefined``);
  ``compile_all`` reports it as ``ok=False`` (or raises with ``raise_on_error=True``) and still compiles the rest;
* the disk cache (``DSV4_NVFP4_CACHE_DIR`` -> tmp_path): a first compile writes ``<key>.cubin``; a second
  compile in the same process is a memory hit; a *fresh process* gets ``cached == 'disk'`` with the same bytes
  and no NVRTC time; ``DSV4_NVFP4_NO_DISK_CACHE=1`` writes nothing; editing the .cu, a .cuh, the arch or the
  defines changes the key (and the edited source is recompiled, not served from the cache);
* a malformed arch string raises ``ValueError`` before NVRTC runs;
* without CUDA (``torch.cuda.is_available()`` False), every launcher given CPU tensors raises a clear
  ``ValueError`` naming the launcher and CUDA, and the runtime's GPU entry points raise ``CudaUnavailableError``
  (skipped on machines that have CUDA; the GPU behaviour is in test_kernels_gpu.py).

Compile tests are skipped (with the reason) only where cuda.core / NVRTC cannot be imported; CI installs them.
"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dsv4_nvfp4 import runtime as rt

ROOT = Path(__file__).resolve().parent.parent
REPO_KERNELS = ROOT / "kernels_cu"

# ------------------------------------------------------------------------------------------------------------
# The extern "C" entry points of each kernels_cu/*.cu, written out from the .cu sources (entry-point macros and
# their instantiations), not taken from the runtime.
_DT3 = ("bf16", "f16", "f32")
EXPECTED_KERNELS = {
    "nvfp4_quantize.cu": {"nvfp4_fill_u32", "nvfp4_gs_from_amax_inplace"}
    | {f"nvfp4_{k}_{dt}" for k in ("amax_tensor", "amax_rows", "quantize", "quantize_rowgs") for dt in _DT3},
    "nvfp4_dequantize.cu": {"nvfp4_dequantize_bf16", "nvfp4_dequantize_f32"},
    "nvfp4_gather.cu": {"nvfp4_gather_dequant_bf16"},
    "ep_plan.cu": {"ep_plan_count", "ep_plan_place", "ep_plan_one", "ep_pack_nvfp4", "ep_sort_count", "ep_sort_place", "ep_sort_one"},
    "nvfp4_rmsnorm_quantize.cu": {f"nvfp4_{k}_{dt}" for k in ("rmsnorm_quantize", "mhc_rmsnorm_quantize")
                                  for dt in _DT3},
    "fp8_quantize.cu": {f"fp8_quantize_rows_{dt}" for dt in _DT3},
    "nvfp4_sparse_attn.cu": {"nvfp4_sparse_attn_partial", "nvfp4_sparse_attn_partial64", "nvfp4_sparse_attn_wg",
                             "nvfp4_sparse_attn_combine"},
}
assert len(EXPECTED_KERNELS["nvfp4_quantize.cu"]) == 14  # 2 + 4 kinds x 3 dtypes

ARCHS = ("sm_90a", "sm_100a")
SMALL_CU = "nvfp4_gather.cu"  # the fastest file to compile (~0.2 s): used where any file will do


# ------------------------------------------------------------------------------------------------------------
# An ELF64 reader, independent of the runtime: the cubin's global function symbols and header fields
EM_CUDA = 190
STO_CUDA_ENTRY = 0x10


def elf_entry_points(blob: bytes) -> set:
    "Names of the global FUNC symbols of an ELF64 little-endian image that carry the CUDA entry-point flag."
    assert blob[:4] == b"\x7fELF", "not an ELF image"
    assert blob[4] == 2 and blob[5] == 1, "not ELF64 little-endian"
    (e_shoff,) = struct.unpack_from("<Q", blob, 0x28)
    e_shentsize, e_shnum, _ = struct.unpack_from("<HHH", blob, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", blob, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    names = set()
    for _name, sh_type, _fl, _addr, off, size, link, _info, _al, entsize in secs:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        stroff = secs[link][4]
        for j in range(size // entsize):
            st_name, st_info, st_other, _shndx, _value, _size = struct.unpack_from("<IBBHQQ", blob, off + j * entsize)
            if st_info & 0xF == 2 and st_info >> 4 == 1 and st_other & STO_CUDA_ENTRY:  # STT_FUNC, STB_GLOBAL
                end = blob.index(b"\0", stroff + st_name)
                names.add(blob[stroff + st_name:end].decode())
    return names


def elf_machine_and_sm(blob: bytes):
    "(e_machine, {candidate SM numbers from e_flags}) -- the SM sits in bits 8..15 (ABI v8) or 0..7 (older)."
    (e_machine,) = struct.unpack_from("<H", blob, 0x12)
    (e_flags,) = struct.unpack_from("<I", blob, 0x30)
    return e_machine, {(e_flags >> 8) & 0xFF, e_flags & 0xFF}


# ------------------------------------------------------------------------------------------------------------
# Fixtures
@pytest.fixture(scope="module")
def nvrtc():
    "Skip (with the reason) where cuda.core or NVRTC is missing; CI installs both, so there this never skips."
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed: NVRTC compile tests skipped")
    try:
        ver = rt.nvrtc_version()
    except ImportError as e:
        pytest.skip(f"NVRTC bindings not importable ({e}): NVRTC compile tests skipped")
    except RuntimeError as e:  # the bindings import but libnvrtc cannot be loaded
        pytest.skip(f"NVRTC library not loadable ({e}): NVRTC compile tests skipped")
    return ver


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    "Every runtime environment knob unset; the disk cache pointed at an empty tmp dir."
    for var in ("DSV4_NVFP4_KERNELS_DIR", "DSV4_NVFP4_NO_DISK_CACHE", "DSV4_NVFP4_ARCH", "DSV4_NVFP4_LINEINFO"):
        monkeypatch.delenv(var, raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSV4_NVFP4_CACHE_DIR", str(cache))
    return cache


def use_kernels_dir(monkeypatch, path: Path):
    "Point the runtime at `path` (env var, plus the import-time KERNELS_DIR constant if the module keeps one)."
    monkeypatch.setenv("DSV4_NVFP4_KERNELS_DIR", str(path))
    if hasattr(rt, "KERNELS_DIR"):
        monkeypatch.setattr(rt, "KERNELS_DIR", Path(path))
    assert Path(rt.kernels_dir()).resolve() == Path(path).resolve(), "DSV4_NVFP4_KERNELS_DIR was not honoured"


def copy_kernels(dst: Path) -> Path:
    "A private copy of kernels_cu/ (sources and headers) that a test may edit."
    shutil.copytree(REPO_KERNELS, dst)
    return dst


_compiled = {}


def compiled(arch):
    "compile_all(arch) once per session (fresh compiles: use_cache=False), ~4 s per arch."
    if arch not in _compiled:
        _compiled[arch] = rt.compile_all(arch)
    return _compiled[arch]


# ------------------------------------------------------------------------------------------------------------
# The sources
def test_kernel_files_are_the_cu_files_of_kernels_cu(monkeypatch):
    monkeypatch.delenv("DSV4_NVFP4_KERNELS_DIR", raising=False)
    want = sorted(p.name for p in REPO_KERNELS.glob("*.cu"))
    assert set(EXPECTED_KERNELS) <= set(want), "a kernels_cu/*.cu file this test expects is missing"
    assert sorted(rt.kernel_files()) == want
    assert all(not f.endswith(".cuh") for f in rt.kernel_files())  # headers are not programs
    assert rt.kernel_source("nvfp4_gather.cu") == (REPO_KERNELS / "nvfp4_gather.cu").read_text()


# ------------------------------------------------------------------------------------------------------------
# compile_all for both archs
@pytest.mark.parametrize("arch", ARCHS)
def test_compile_all_compiles_every_file(nvrtc, clean_env, arch):
    res = compiled(arch)
    assert sorted(res) == sorted(rt.kernel_files())
    failed = {f: r.error[:2000] for f, r in res.items() if not r.ok}
    assert not failed, f"NVRTC failed for {arch}: {failed}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("file", sorted(EXPECTED_KERNELS))
def test_cubin_has_the_expected_entry_points(nvrtc, clean_env, arch, file):
    r = compiled(arch)[file]
    assert r.ok, r.error[:2000]
    assert r.arch == arch and r.file == file
    cubin = bytes(r.cubin)
    machine, sms = elf_machine_and_sm(cubin)
    assert machine == EM_CUDA, f"e_machine {machine}, want EM_CUDA ({EM_CUDA})"
    sm = int(re.fullmatch(r"sm_(\d+)a?", arch).group(1))
    assert sm in sms, f"cubin e_flags name SM {sms}, want {sm} ({arch})"
    entries = elf_entry_points(cubin)
    want = EXPECTED_KERNELS[file]
    assert entries == want, f"missing {sorted(want - entries)}, unexpected {sorted(entries - want)}"
    assert set(r.kernels) == want  # the runtime's own list (used by get_kernel's error messages) agrees


@pytest.mark.parametrize("arch", ARCHS)
def test_other_kernel_files_have_entry_points(nvrtc, clean_env, arch):
    "Files added to kernels_cu/ after this test was written: they must compile and export at least one kernel."
    for f, r in compiled(arch).items():
        if f in EXPECTED_KERNELS:
            continue
        assert r.ok, r.error[:2000]
        assert elf_entry_points(bytes(r.cubin)), f"{f} ({arch}) exports no extern \"C\" __global__ kernel"


@pytest.mark.parametrize("arch", ARCHS)
def test_no_register_spills(nvrtc, clean_env, arch):
    res = compiled(arch)
    if not all(hasattr(r, "ptxas") for r in res.values()):
        pytest.skip("CompileResult exposes no ptxas report")
    for f, r in res.items():
        assert r.ok, r.error[:2000]
        entries = elf_entry_points(bytes(r.cubin))
        assert set(r.ptxas) == entries, (f"{f} ({arch}): ptxas -v reported {sorted(r.ptxas)}, "
                                         f"cubin has {sorted(entries)}")
        spills = {k: (v["spill_stores"], v["spill_loads"]) for k, v in r.ptxas.items()
                  if v["spill_stores"] or v["spill_loads"]}
        assert not spills, f"{f} ({arch}): register spills (store, load bytes): {spills}"
        regs = {k: v["registers"] for k, v in r.ptxas.items()}
        assert all(0 < n <= 255 for n in regs.values()), regs


def test_attention_wgmma_kernel_is_not_serialized(nvrtc, clean_env):
    """nvfp4_sparse_attn_wg for sm_90a: ptxas does not serialize its warpgroup MMAs (no "serialized" advisory: that
    would put a full wait after each one), and its loop holds them back to back: 16 score MMAs with nothing that waits
    on the tensor cores between them, then 4 for P . kv (from the SASS, where nvdisasm is installed); the loop's
    barriers, exps and length as 07b describes them."""
    import subprocess
    r = rt.compile_cubin("nvfp4_sparse_attn.cu", "sm_90a", use_cache=False, verbose_ptxas=True)
    assert "serialized" not in r.log, r.log[-3000:]
    try:
        from dsv4_nvfp4.gemm.sm90_kernel import _nvdisasm
        dis = _nvdisasm()
    except (ImportError, FileNotFoundError):
        pytest.skip("nvdisasm is not installed (the [dev] extra has it)")
    cub = clean_env.parent / "attn.cubin"
    cub.write_bytes(bytes(r.cubin))
    sass = subprocess.run([dis, "-c", str(cub)], capture_output=True, text=True, check=True).stdout
    body = re.split(r"//-+ \.text\.([A-Za-z_0-9]+) -+", sass)
    fn = dict(zip(body[1::2], body[2::2]))["nvfp4_sparse_attn_wg"]
    ops = [l.split("*/", 1)[1].strip() for l in fn.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", l)]
    qk = [i for i, o in enumerate(ops) if "HGMMA.64x64x16" in o]
    pv = [i for i, o in enumerate(ops) if "HGMMA.64x256x16" in o]
    assert len(qk) == 16 and len(pv) == 4, (len(qk), len(pv))
    between = [o for o in ops[qk[0]:qk[-1]] + ops[pv[0]:pv[-1]] if "DEPBAR" in o or "BAR.SYNC" in o]
    assert not between, between
    # one tile's loop, from the barrier that publishes the tile to the last P . kv MMA (07b, session 36): three
    # barriers (the tile, the partners' scores, the pair's P: a named barrier of 64 threads); at least 34 exp (32 p
    # through exp_ftz, with no subnormal path, and the two rescale factors through __expf, whose subnormal path
    # compares with -126: at most those two compares); 1667 static instructions with NVRTC 13.5 (1983 before the
    # softmax's loads were hoisted and exp_ftz came in), bounded with 5% of room for other toolkits
    top = next(i for i, o in enumerate(ops) if o.startswith("BAR.SYNC.DEFER_BLOCKING 0x0"))
    loop = ops[top:pv[-1] + 1]
    why = f"NVRTC {rt.nvrtc_version()}"
    bars = [o for o in loop if o.startswith("BAR.SYNC")]
    assert len(bars) == 3 and bars[2].rstrip(" ;").endswith(", 0x40"), (why, bars)
    subnormal = [o for o in loop if re.search(r",\s*-126\b", o)]
    assert sum("MUFU.EX2" in o for o in loop) >= 34 and len(subnormal) <= 2, (why, subnormal)
    assert len(loop) <= 1750, (why, len(loop))


# ------------------------------------------------------------------------------------------------------------
# Compile errors
BROKEN_CU = textwrap.dedent("""\
    #include "nvfp4_common.cuh"
    extern "C" __global__ void broken_kernel(int* p) {
        p[0] = undefined_symbol_xyz;
    }
    """)


@pytest.fixture
def broken_dir(nvrtc, clean_env, monkeypatch, tmp_path):
    "A kernels dir with the real headers, one good .cu and one that does not compile."
    d = tmp_path / "kernels_cu"
    d.mkdir()
    for h in REPO_KERNELS.glob("*.cuh"):
        shutil.copy(h, d / h.name)
    shutil.copy(REPO_KERNELS / SMALL_CU, d / SMALL_CU)
    (d / "broken.cu").write_text(BROKEN_CU)
    use_kernels_dir(monkeypatch, d)
    monkeypatch.setenv("DSV4_NVFP4_NO_DISK_CACHE", "1")
    return d


def test_broken_source_raises_kernel_compile_error(broken_dir):
    assert sorted(rt.kernel_files()) == sorted(["broken.cu", SMALL_CU])
    with pytest.raises(rt.KernelCompileError) as ei:
        rt.compile_cubin("broken.cu", "sm_90a")
    msg = str(ei.value)
    assert "broken.cu" in msg and "sm_90a" in msg
    assert "undefined_symbol_xyz" in msg and "is undefined" in msg  # NVRTC's own diagnostic text
    assert re.search(r"broken\.cu\(3\): error", msg), f"NVRTC log with file(line) missing from:\n{msg}"
    assert ei.value.file == "broken.cu" and ei.value.arch == "sm_90a"
    assert "undefined_symbol_xyz" in ei.value.log


def test_compile_all_reports_the_broken_file_and_compiles_the_rest(broken_dir):
    res = rt.compile_all("sm_90a")
    assert set(res) == {"broken.cu", SMALL_CU}
    assert not res["broken.cu"].ok
    assert "broken.cu" in res["broken.cu"].error and "undefined_symbol_xyz" in res["broken.cu"].error
    assert res["broken.cu"].cubin is None
    assert res[SMALL_CU].ok and elf_entry_points(bytes(res[SMALL_CU].cubin)) == EXPECTED_KERNELS[SMALL_CU]
    with pytest.raises(rt.KernelCompileError, match="broken.cu"):
        rt.compile_all("sm_90a", raise_on_error=True)


def test_broken_header_error_names_the_header(nvrtc, clean_env, monkeypatch, tmp_path):
    d = copy_kernels(tmp_path / "kernels_cu")
    use_kernels_dir(monkeypatch, d)
    monkeypatch.setenv("DSV4_NVFP4_NO_DISK_CACHE", "1")
    hdr = d / "nvfp4_common.cuh"
    hdr.write_text(hdr.read_text() + "\nstatic_assert(sizeof(int) == 3, \"header_is_broken_here\");\n")
    with pytest.raises(rt.KernelCompileError) as ei:
        rt.compile_cubin(SMALL_CU, "sm_90a")
    msg = str(ei.value)
    assert SMALL_CU in msg and "nvfp4_common.cuh" in msg and "header_is_broken_here" in msg


def test_missing_source_raises_file_not_found(nvrtc, clean_env):
    with pytest.raises(FileNotFoundError, match="no_such_kernel.cu"):
        rt.compile_cubin("no_such_kernel.cu", "sm_90a")


@pytest.mark.parametrize("arch", ["sm90a", "90a", "sm_", "SM_90A", "sm_90a ", "compute_90a", "sm_90x", "",
                                  "sm_90a; -DFOO"])
def test_invalid_arch_raises_value_error(nvrtc, clean_env, arch):
    with pytest.raises(ValueError, match="arch"):
        rt.compile_options(arch)
    with pytest.raises(ValueError, match="arch"):
        rt.compile_cubin(SMALL_CU, arch, use_cache=False)
    with pytest.raises(ValueError, match="arch"):
        rt.compile_all(arch)


# ------------------------------------------------------------------------------------------------------------
# The cache
_CHILD = textwrap.dedent("""\
    import hashlib, json, sys
    from dsv4_nvfp4 import runtime as rt
    r = rt.compile_cubin(sys.argv[1], sys.argv[2])
    print(json.dumps(dict(cached=r.cached, key=r.key, ok=r.ok, seconds=r.seconds,
                          sha=hashlib.sha256(bytes(r.cubin)).hexdigest(), kernels=sorted(r.kernels))))
    """)


def compile_in_fresh_process(file, arch):
    "compile_cubin in a new Python process (empty memory cache), same environment (cache dir, kernels dir)."
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    p = subprocess.run([sys.executable, "-c", _CHILD, file, arch], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _sha(b):
    import hashlib
    return hashlib.sha256(bytes(b)).hexdigest()


def test_disk_cache_is_written_and_hit(nvrtc, clean_env, monkeypatch, tmp_path):
    # a private copy with a unique comment: nothing in this process's memory cache can match its key
    d = copy_kernels(tmp_path / "kernels_cu")
    src = d / SMALL_CU
    src.write_text(src.read_text() + f"\n// cache test {tmp_path.name}\n")
    use_kernels_dir(monkeypatch, d)

    r1 = rt.compile_cubin(SMALL_CU, "sm_90a")
    assert r1.ok and r1.cached == "" and r1.seconds > 0
    assert len(r1.key) == 64 and re.fullmatch(r"[0-9a-f]{64}", r1.key)
    cubin_file = clean_env / f"{r1.key}.cubin"
    assert cubin_file.exists(), f"no disk cache entry in {clean_env}: {list(clean_env.glob('*'))}"
    assert cubin_file.read_bytes() == bytes(r1.cubin)
    assert not list(clean_env.glob("*.tmp")), "temporary files left behind"

    r2 = rt.compile_cubin(SMALL_CU, "sm_90a")
    assert r2.cached == "memory" and r2.key == r1.key and bytes(r2.cubin) == bytes(r1.cubin)

    child = compile_in_fresh_process(SMALL_CU, "sm_90a")
    assert child["ok"] and child["cached"] == "disk", child
    assert child["key"] == r1.key and child["sha"] == _sha(r1.cubin) and child["seconds"] == 0.0
    assert set(child["kernels"]) == EXPECTED_KERNELS[SMALL_CU]

    if hasattr(rt, "_mem_cache"):  # same check in process, where the in-memory cache can be emptied
        monkeypatch.setattr(rt, "_mem_cache", {})
        r3 = rt.compile_cubin(SMALL_CU, "sm_90a")
        assert r3.cached == "disk" and bytes(r3.cubin) == bytes(r1.cubin)

    # use_cache=False always compiles
    r4 = rt.compile_cubin(SMALL_CU, "sm_90a", use_cache=False)
    assert r4.cached == "" and r4.seconds > 0 and r4.key == r1.key


def test_no_disk_cache_env_writes_nothing(nvrtc, clean_env, monkeypatch, tmp_path):
    d = copy_kernels(tmp_path / "kernels_cu")
    src = d / SMALL_CU
    src.write_text(src.read_text() + f"\n// no-disk test {tmp_path.name}\n")
    use_kernels_dir(monkeypatch, d)
    monkeypatch.setenv("DSV4_NVFP4_NO_DISK_CACHE", "1")
    r = rt.compile_cubin(SMALL_CU, "sm_90a")
    assert r.ok and r.cached == ""
    assert not clean_env.exists() or not any(clean_env.iterdir())
    assert compile_in_fresh_process(SMALL_CU, "sm_90a")["cached"] == ""  # nothing on disk to hit


def test_cache_key_changes_with_source_headers_arch_and_defines(nvrtc, clean_env, monkeypatch, tmp_path):
    d = copy_kernels(tmp_path / "kernels_cu")
    use_kernels_dir(monkeypatch, d)
    src = d / SMALL_CU
    src.write_text(src.read_text() + f"\n// key test {tmp_path.name}\n")
    base = rt.compile_cubin(SMALL_CU, "sm_90a")
    assert rt.compile_cubin(SMALL_CU, "sm_90a").key == base.key  # deterministic

    src.write_text(src.read_text() + "\n// one more comment\n")
    edited = rt.compile_cubin(SMALL_CU, "sm_90a")
    assert edited.key != base.key
    assert edited.cached == "", "an edited source was served from the cache"

    hdr = d / "nvfp4_common.cuh"
    hdr.write_text(hdr.read_text() + "\n// header edit\n")
    hdr_edited = rt.compile_cubin(SMALL_CU, "sm_90a")
    assert hdr_edited.key not in (base.key, edited.key) and hdr_edited.cached == ""

    other_arch = rt.compile_cubin(SMALL_CU, "sm_100a")
    assert other_arch.key != hdr_edited.key
    defined = rt.compile_cubin(SMALL_CU, "sm_90a", {"DSV4_TEST_UNUSED_MACRO": 1})
    assert defined.key != hdr_edited.key
    assert len({base.key, edited.key, hdr_edited.key, other_arch.key, defined.key}) == 5


# ------------------------------------------------------------------------------------------------------------
# No CUDA: clear errors, no crash
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: tests the CPU-only behaviour")


@no_cuda
def test_launchers_reject_cpu_tensors_without_cuda():
    from dsv4_nvfp4 import norm as NM
    from dsv4_nvfp4 import quantize_cuda as QC
    from dsv4_nvfp4.quant import ref_quantize_nvfp4
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    q = ref_quantize_nvfp4(x)
    w = torch.ones(32)
    calls = [
        ("quantize_nvfp4_cuda", lambda: QC.quantize_nvfp4_cuda(x)),
        ("quantize_nvfp4_cuda", lambda: QC.quantize_nvfp4_cuda(x, 1.0, swizzle=True)),
        ("dequantize_nvfp4_cuda", lambda: QC.dequantize_nvfp4_cuda(q)),
        ("gather_dequant_nvfp4", lambda: QC.gather_dequant_nvfp4(q, torch.zeros(2, dtype=torch.int32))),
        ("dequant_rows_nvfp4", lambda: QC.dequant_rows_nvfp4(q, 0, 2)),
        ("rmsnorm_quantize_nvfp4", lambda: NM.rmsnorm_quantize_nvfp4(x, w)),
        ("mhc_rmsnorm_quantize_nvfp4", lambda: NM.mhc_rmsnorm_quantize_nvfp4(x.reshape(2, 2, 32), torch.ones(2, 2), w)),
    ]
    for name, fn in calls:
        with pytest.raises((ValueError, TypeError, rt.CudaUnavailableError)) as ei:
            fn()
        msg = str(ei.value)
        assert name in msg and "cuda" in msg.lower(), f"unclear error from {name}: {msg!r}"


@no_cuda
def test_runtime_gpu_entry_points_raise_cuda_unavailable(monkeypatch):
    monkeypatch.delenv("DSV4_NVFP4_ARCH", raising=False)
    with pytest.raises(rt.CudaUnavailableError, match="CUDA"):
        rt.device_arch()
    with pytest.raises(rt.CudaUnavailableError, match="CUDA"):
        rt.get_kernel(SMALL_CU, "nvfp4_gather_dequant_bf16")
    with pytest.raises(rt.CudaUnavailableError, match="CUDA"):
        rt.launch(SMALL_CU, "nvfp4_gather_dequant_bf16", (1, 1, 1), (32, 1, 1), [])
    assert issubclass(rt.CudaUnavailableError, RuntimeError)


def test_launch_raises_the_smem_limit_only_upwards(monkeypatch):
    """Above SMEM_DEFAULT_MAX a launch raises the kernel's dynamic shared memory limit once per new maximum, after the
    device's context is current; a smaller launch after a larger one keeps the larger limit; a driver refusal or a
    failing driver call is a KernelLaunchError naming the kernel (recorded on CPU: the driver is faked)."""
    from types import SimpleNamespace as NS
    events = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: NS(cuda_stream=0))
    monkeypatch.setattr(rt, "_torch_mod", torch)
    monkeypatch.setattr(rt, "_fast", {(0, "k.cu", "big", ()): ("KERNEL", None)})
    monkeypatch.setattr(rt, "_smem_max", {})
    monkeypatch.setattr(rt, "_ensure_context", lambda dev: events.append(("ctx", dev)))
    monkeypatch.setattr(rt, "_cc_stream", lambda dev, h: "STREAM")
    monkeypatch.setattr(rt, "_launcher", lambda cs, grid, block, shmem, kernel, args: events.append(("launch", shmem)))
    real_opt_in = rt._opt_in_smem
    monkeypatch.setattr(rt, "_opt_in_smem", lambda k, dev, shmem, name, file: events.append(("opt", shmem)))
    for shmem in (1024, 120_000, 120_000, 64_000, 150_000, 120_000):
        rt.launch("k.cu", "big", (1, 1, 1), (32, 1, 1), [], shmem=shmem)
    assert [e for e in events if e[0] != "ctx"] == [("launch", 1024), ("opt", 120_000), ("launch", 120_000), ("launch", 120_000),
                                                    ("launch", 64_000), ("opt", 150_000), ("launch", 150_000), ("launch", 120_000)]
    first_opt = events.index(("opt", 120_000))
    assert ("ctx", 0) in events[:first_opt], events                    # the context is current before the attribute is set
    assert rt._smem_max == {(0, "k.cu", "big", ()): 150_000}

    class FakeDriver:                                                   # the driver's attribute call, refusing or raising
        CUfunction_attribute = NS(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8)
        CUresult = NS(CUDA_SUCCESS=0)
        CUkernel = type("CUkernel", (), {})
        CUdevice = staticmethod(lambda d: d)
        result = 1
        @staticmethod
        def cuFuncSetAttribute(h, attr, v):
            if FakeDriver.result is None: raise RuntimeError("driver gone")
            return (FakeDriver.result,)
    monkeypatch.setattr(rt, "_driver", lambda: FakeDriver)
    with pytest.raises(rt.KernelLaunchError, match=r"big .*150000 bytes of dynamic shared memory refused"):
        real_opt_in(NS(handle=object()), 0, 150_000, "big", "k.cu")
    FakeDriver.result = None
    with pytest.raises(rt.KernelLaunchError, match=r"big .*driver gone"):
        real_opt_in(NS(handle=object()), 0, 150_000, "big", "k.cu")
    FakeDriver.result = 0
    real_opt_in(NS(handle=object()), 0, 150_000, "big", "k.cu")         # granted: no error


def test_device_arch_env_override(monkeypatch):
    "DSV4_NVFP4_ARCH overrides the detected arch (how a GPU-less machine picks the Blackwell build)."
    monkeypatch.setenv("DSV4_NVFP4_ARCH", "sm_100a")
    assert rt.device_arch() == "sm_100a"


def test_small_helpers():
    assert [rt.cdiv(a, 16) for a in (0, 1, 16, 17)] == [0, 1, 1, 2]
    assert [rt.round_up(a, 128) for a in (0, 1, 128, 129)] == [0, 128, 128, 256]
    assert rt.ptr(None) == 0
    # typed scalars: cuda.core packs a bare Python int/float as 64-bit, so launch arguments must carry their C type
    import numpy as np
    assert np.asarray(rt.i32(-1)).dtype == np.int32 and np.asarray(rt.u32(2**32 - 1)).dtype == np.uint32
    assert np.asarray(rt.i64(2**40)).dtype == np.int64 and np.asarray(rt.f32(0.1)).dtype == np.float32
    assert float(rt.f32(0.1)) == float(np.float32(0.1)) != 0.1


# ------------------------------------------------------------------------------------------------------------
# Compile-time constants: kernels_cu/ has no alternative kernel versions behind switches; what is left is a shape
# parameter or a tuning constant, and every value the launchers pass is compiled here (CPU, NVRTC)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ptx_hashes import build_name, tuning_builds  # noqa: E402

CONSTANTS = {                      # file -> the macros it lets a build define (#ifndef NAME ... #endif)
    "moe_route.cu": {"HID", "TOPK", "NE"},                                  # shapes: routing's launchers pass them
    "nvfp4_kv_compress.cu": {"RATIO", "KV_D", "ROPE", "SPLIT", "KV_UNROLL"},   # shapes + tuning: kv's launchers
    "ep_plan.cu": {"EP_MAXB", "EP_SORT_MAXK"},                              # key limits: the default build only
}


def test_compile_time_switches_are_the_listed_constants():
    """Every preprocessor conditional of kernels_cu/ is an `#ifndef` default of a listed constant or a test of
    __CUDA_ARCH__ or the compiler's arch-feature macros (`__CUDA_ARCH_FEAT_SM90_ALL`: sm_90a's wgmma; per-arch code,
    compiled for both archs above): no variant selected by a define."""
    found, other = {}, []
    for path in sorted(REPO_KERNELS.glob("*.cu*")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r"\s*#\s*(ifndef|ifdef|if|elif)\b(.*)", line)
            if not m: continue
            kind, cond = m.group(1), m.group(2).split("//")[0].strip()
            if kind == "ifndef":
                found.setdefault(path.name, set()).add(cond)
            elif {w for w in re.findall(r"[A-Za-z_]\w*", cond) if not re.fullmatch(r"__CUDA_ARCH_FEAT_SM\d+A?_ALL", w)} - {"defined", "__CUDA_ARCH__"}:
                other.append(f"{path.name}:{n}: {line.strip()}")
    assert not other, f"compile-time switches other than __CUDA_ARCH__: {other}"
    assert found == CONSTANTS, f"#ifndef constants {found}, listed {CONSTANTS}"


TUNING = tuning_builds()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("file,defines", TUNING, ids=[build_name(*b) for b in TUNING])
def test_every_constant_value_used_compiles(nvrtc, clean_env, arch, file, defines):
    "Each non-default build the launchers make compiles for both archs, with the file's entry points and no spills."
    assert set(defines) <= CONSTANTS[file], f"{file}: {sorted(set(defines) - CONSTANTS[file])} is not a constant of the file"
    r = rt.compile_cubin(file, arch, defines, use_cache=False, verbose_ptxas=True)
    assert r.ok, r.error[:2000]
    assert elf_entry_points(bytes(r.cubin)) == elf_entry_points(bytes(compiled(arch)[file].cubin))
    spills = {k: (v["spill_stores"], v["spill_loads"]) for k, v in r.ptxas.items() if v["spill_stores"] or v["spill_loads"]}
    assert not spills, f"{build_name(file, defines)} ({arch}): register spills {spills}"


def test_row_kernels_nb_matches_the_launchers():
    "The row kernels' 16-blocks per thread (the source's #defines) are the launchers' (they size the block from it)."
    from dsv4_nvfp4 import norm as NM
    from dsv4_nvfp4 import quantize_cuda as QC
    define = lambda f, nm: int(re.search(rf"^#define\s+{nm}\s+(\d+)", rt.kernel_source(f), re.M).group(1))
    assert (QC._ROWGS_NB, QC._ROWGS_NB32) == (define(QC.Q_CU, "NVFP4_ROWGS_NB"), define(QC.Q_CU, "NVFP4_ROWGS_NB32"))
    assert (NM._RMS_NB, NM._RMS_NB32, NM._MHC_NB) == tuple(define(NM.RN_CU, n) for n in ("NVFP4_RMS_NB", "NVFP4_RMS_NB32",
                                                                                         "NVFP4_MHC_NB"))


# ------------------------------------------------------------------------------------------------------------
# The launch ABI (CPU only)
def ptx_signatures(files) -> dict:
    "name -> (file, ['u64', 'u32', 'f32', ...]) from the NVRTC PTX of each file (the kernels' real parameter lists)."
    try:
        from cuda.bindings import nvrtc as N
    except ImportError:  # older cuda-python layout
        from cuda import nvrtc as N
    inc = rt.cuda_include_dirs() + [str(REPO_KERNELS)]
    sigs = {}
    for f in files:
        src = (REPO_KERNELS / f).read_bytes()
        err, prog = N.nvrtcCreateProgram(src, f.encode(), 0, [], [])
        opts = [b"-arch=compute_90a", b"-std=c++17"] + [f"-I{d}".encode() for d in inc]
        (res,) = N.nvrtcCompileProgram(prog, len(opts), opts)[:1]
        assert res == N.nvrtcResult.NVRTC_SUCCESS, f"PTX compile of {f} failed"
        err, n = N.nvrtcGetPTXSize(prog)
        buf = b" " * n
        N.nvrtcGetPTX(prog, buf)
        for m in re.finditer(r"\.entry (\w+)\((.*?)\)", buf.decode(errors="replace"), re.S):
            sigs[m.group(1)] = (f, re.findall(r"\.param \.(\w+)", m.group(2)))
    return sigs


def _kind(a):
    import numpy as np
    if isinstance(a, bool): return "bool?"
    if isinstance(a, int) or isinstance(a, (np.int64, np.uint64)): return "64"  # pointers are Python ints
    if isinstance(a, (np.int32, np.uint32)): return "32"
    if isinstance(a, np.float32): return "f32"
    return type(a).__name__


def test_launch_arguments_match_kernel_signatures(nvrtc, clean_env, monkeypatch):
    """Every launch the launchers make (run here on CPU tensors, launches recorded, not executed) names a kernel of
    the right file with exactly its PTX parameter count and 32/64-bit/f32 kinds, and a legal launch shape (the EP
    kernels: the block size their source is written for, and the package's key limits are the source's); the
    per-tensor fused gs is the sequence fill -> amax -> gs -> quantize on one stream."""
    from dsv4_nvfp4 import norm as NM
    from dsv4_nvfp4 import quantize_cuda as QC
    from dsv4_nvfp4.quant import ref_quantize_nvfp4
    if not hasattr(rt, "_DEVICE_TYPE"):
        pytest.skip("dsv4_nvfp4.runtime has no _DEVICE_TYPE switch to run its launchers on CPU tensors")
    import contextlib
    sigs = ptx_signatures(sorted(EXPECTED_KERNELS))
    calls, blocks = [], {}                                            # blocks: each kernel's block sizes launched
    monkeypatch.setattr(rt, "_DEVICE_TYPE", "cpu")
    shmems = {}                                                       # each kernel's dynamic shared memory launched
    monkeypatch.setattr(rt, "launch", lambda file, name, grid, block, args, **kw:
                        (calls.append((file, name, grid, block, list(args))), shmems.setdefault(name, set()).add(kw.get("shmem", 0))))
    monkeypatch.setattr(rt, "sm_count", lambda i: 132)
    optin = [227 * 1024]                                              # the device's per-block shared memory opt-in
    monkeypatch.setattr(rt, "smem_optin", lambda i: optin[0])
    arch = ["sm_100a"]                                                # the device's arch (sm_90a: the wgmma attention)
    monkeypatch.setattr(rt, "device_arch", lambda device=None: arch[0])
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())

    def run(fn):
        calls.clear()
        fn()
        assert calls, "no launch recorded"
        for file, name, grid, block, args in calls:
            assert name in sigs, f"launch of unknown kernel {name}"
            want_file, params = sigs[name]
            assert file == want_file, f"{name} launched from {file}, defined in {want_file}"
            want = ["64" if p in ("u64", "s64", "b64") else "32" if p in ("u32", "s32", "b32") else p for p in params]
            got = [_kind(a) for a in args]
            assert got == want, f"{name}: launched with {got}, the kernel takes {want}"
            g, b = tuple(grid), tuple(block)
            assert len(g) == 3 and len(b) == 3 and min(g) >= 1 and b[1:] == (1, 1), (name, g, b)
            assert 32 <= b[0] <= 1024 and b[0] % 32 == 0, (name, b)
            blocks.setdefault(name, set()).add(b[0])
        return [c[1] for c in calls]

    seen = set()
    x = torch.randn(130, 256, dtype=torch.bfloat16)
    for dt, sfx in ((torch.bfloat16, "bf16"), (torch.float16, "f16"), (torch.float32, "f32")):
        xd = x.to(dt)
        seq = run(lambda: QC.quantize_nvfp4_cuda(xd))
        assert seq == ["nvfp4_fill_u32", f"nvfp4_amax_tensor_{sfx}", "nvfp4_gs_from_amax_inplace",
                       f"nvfp4_quantize_{sfx}"], seq
        seen |= set(seq)
        seen |= set(run(lambda: QC.quantize_nvfp4_cuda(xd, swizzle=True)))
        seq = run(lambda: QC.quantize_nvfp4_cuda(xd, per_row=True))
        assert seq == [f"nvfp4_quantize_rowgs_{sfx}"], seq
        seen |= set(seq) | set(run(lambda: QC.quantize_nvfp4_cuda(xd, per_row=True, swizzle=True)))
        seq = run(lambda: QC.quantize_nvfp4_cuda(torch.randn(2, 16400).to(dt), per_row=True))  # K > 16384
        assert seq[0] == f"nvfp4_amax_rows_{sfx}" and seq[-1] == f"nvfp4_quantize_{sfx}", seq
        seen |= set(seq)
        seen |= set(run(lambda: QC.quantize_nvfp4_cuda(xd, 0.5)))
        seen |= set(run(lambda: QC.quantize_nvfp4_cuda(xd, torch.full((130,), 0.5), swizzle=True)))
    q = ref_quantize_nvfp4(x.float())
    from dsv4_nvfp4.layout import swizzle_scales
    for dt in (torch.bfloat16, torch.float32):
        seen |= set(run(lambda: QC.dequantize_nvfp4_cuda(q, dtype=dt)))
        seen |= set(run(lambda: QC.dequantize_nvfp4_cuda(q.data, swizzle_scales(q.scale), q.global_scale,
                                                        swizzled=True, dtype=dt)))
    idx = torch.tensor([0, -1, 5, 129], dtype=torch.int32)
    seen |= set(run(lambda: QC.gather_dequant_nvfp4(q, idx)))
    seen |= set(run(lambda: QC.gather_dequant_nvfp4(q, idx, bad_count=torch.zeros(1, dtype=torch.int32))))
    seen |= set(run(lambda: QC.dequant_rows_nvfp4(q, 3, 100)))
    w = torch.rand(256) + 0.5
    from dsv4_nvfp4.gemm import w4a8 as W8
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        seen |= set(run(lambda: W8.quantize_fp8_act_cuda(x.to(dt))))
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        seen |= set(run(lambda: NM.rmsnorm_quantize_nvfp4(x.to(dt), w, 1e-6)))
        seen |= set(run(lambda: NM.rmsnorm_quantize_nvfp4(x.to(dt), w, 1e-6, global_scale=torch.tensor(0.01),
                                                         swizzle=True)))
        seen |= set(run(lambda: NM.mhc_rmsnorm_quantize_nvfp4(x.to(dt).reshape(65, 2, 256), torch.rand(65, 2), w,
                                                             1e-6, round_to_bf16=True)))
    from dsv4_nvfp4.ep import transport as EPT                        # the expert-parallel layer's fused send plan
    Tm_, k_, R_ = 10, 3, 12
    plan_ = lambda Tm, R: run(lambda: EPT.ep_send_plan(torch.zeros(Tm, k_, dtype=torch.int32), torch.rand(Tm, k_), torch.tensor(Tm),
                                                       torch.tensor([1, 0]), torch.empty(Tm * k_, dtype=torch.int32),
                                                       torch.empty(R, 2, dtype=torch.int32), torch.empty(R, dtype=torch.long),
                                                       torch.zeros((), dtype=torch.long), per_rank=4, world=2, capacity=R // 2,
                                                       rank=1, far=R))
    assert plan_(Tm_, R_) == ["ep_plan_one"]                         # slots that fit one CTA: one launch
    seq = plan_(400, 800)                                            # 1200 slots: two CTAs, the count then the place
    assert seq == ["ep_plan_count", "ep_plan_place"], seq
    seen |= {"ep_plan_one"} | set(seq)
    H_ = 256                                                          # its NVFP4 payload, and the receiver's sort
    seen |= set(run(lambda: EPT.pack_nvfp4(torch.randn(Tm_, H_).bfloat16(), torch.zeros(Tm_ * k_, dtype=torch.int32),
                                           torch.zeros(R_, 2, dtype=torch.int32), torch.ones(8), R_,
                                           torch.empty(R_, H_ // 2, dtype=torch.uint8), torch.empty(R_, H_ // 16, dtype=torch.uint8))))
    meta_ = torch.zeros(R_, 2, dtype=torch.int32)
    from types import SimpleNamespace as NS
    from dsv4_nvfp4.ep.layer import EPMoE
    fake_ep = NS(per_rank=4, experts=range(4, 8), a1_all=torch.ones(8))
    seq = run(lambda: EPMoE.sort_decode(fake_ep, torch.zeros(R_, H_ // 2, dtype=torch.uint8), torch.zeros(R_, H_ // 16, dtype=torch.uint8),
                                        meta_[:, 1].view(torch.float32), meta_[:, 0]))
    assert seq == ["ep_sort_one", "nvfp4_gather_dequant_bf16"], seq
    seen |= set(seq)
    n_ = 1500                                                         # rows past one CTA: the count then the place
    seq = run(lambda: EPMoE.sort_decode(fake_ep, torch.zeros(n_, H_ // 2, dtype=torch.uint8), torch.zeros(n_, H_ // 16, dtype=torch.uint8),
                                        torch.ones(n_), torch.zeros(n_, dtype=torch.int32)))
    assert seq == ["ep_sort_count", "ep_sort_place", "nvfp4_gather_dequant_bf16"], seq
    seen |= set(seq)
    from dsv4_nvfp4 import attention as AT                            # the fused decode attention over the NVFP4 pool
    qa_, ia_ = torch.zeros(2, 64, 512, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.int32)
    seq = run(lambda: AT.sparse_attention_decode(qa_, AT.NVFP4KVPool(16), ia_, torch.zeros(2, 4, 512, dtype=torch.bfloat16),
                                                 torch.ones(2, dtype=torch.int32), sink=torch.zeros(64),
                                                 out_pos=torch.zeros(2, dtype=torch.int32), bad_count=torch.zeros(1, dtype=torch.int32)))
    assert seq == ["nvfp4_sparse_attn_partial", "nvfp4_sparse_attn_combine"], seq        # 2 x 64 heads, 12 slots: 16-head CTAs
    seen |= set(seq) | set(run(lambda: AT.sparse_attention_decode(qa_, AT.NVFP4KVPool(16), ia_)))
    nb_ = AT.ATTN64_MIN_TILES                                         # sequences of one tile each: just enough 64-head work
    qb_, ib_ = torch.zeros(nb_, 64, 512, dtype=torch.bfloat16), torch.zeros(nb_, 8, dtype=torch.int32)
    seq = run(lambda: AT.sparse_attention_decode(qb_, AT.NVFP4KVPool(16), ib_))          # enough sequences: 64-head CTAs
    assert seq == ["nvfp4_sparse_attn_partial64", "nvfp4_sparse_attn_combine"], seq
    seen |= set(seq)
    nsplit_, _ = AT.attn_splits(nb_, 64, 8, sms=132, heads=64)
    assert calls[0][2] == (nsplit_, 1, nb_), calls[0][2]     # grid (splits, H / 64, B)
    assert calls[1][2] == (nb_ * 64, 1, 1), calls[1][2]      # the merge: one CTA per (sequence, head)
    qc_ = torch.zeros(nb_, 128, 512, dtype=torch.bfloat16)   # Pro's 128 heads: two 64-head CTAs per split
    seq = run(lambda: AT.sparse_attention_decode(qc_, AT.NVFP4KVPool(16), ib_, splits=3))
    assert seq[0] == "nvfp4_sparse_attn_partial64" and calls[0][2] == (1, 2, nb_), calls[0]   # 8 slots: 1 split
    optin[0] = 99 * 1024                                              # an sm_86/89/120 GPU: 16-head CTAs, whatever the batch
    seq = run(lambda: AT.sparse_attention_decode(qb_, AT.NVFP4KVPool(16), ib_))
    assert seq == ["nvfp4_sparse_attn_partial", "nvfp4_sparse_attn_combine"], seq
    assert calls[0][2][1:] == (64 // AT.ATTN_HEADS, nb_), calls[0][2]
    optin[0] = 227 * 1024
    arch[0] = "sm_90a"                                               # Hopper: the warpgroup-MMA kernel from 64 tiles up
    nw_ = AT.ATTN_WG_MIN_TILES
    qw_, iw_ = torch.zeros(nw_, 64, 512, dtype=torch.bfloat16), torch.zeros(nw_, 8, dtype=torch.int32)
    seq = run(lambda: AT.sparse_attention_decode(qw_, AT.NVFP4KVPool(16), iw_))
    assert seq == ["nvfp4_sparse_attn_wg", "nvfp4_sparse_attn_combine"], seq
    iw2_ = torch.zeros(nw_, 640, dtype=torch.int32)                   # 10 tiles a sequence: one wave is 2 splits (5 if not)
    seq = run(lambda: AT.sparse_attention_decode(qw_, AT.NVFP4KVPool(16), iw2_))
    assert seq == ["nvfp4_sparse_attn_wg", "nvfp4_sparse_attn_combine"], seq
    assert AT.attn_splits(nw_, 64, 640, sms=132, heads=64, tile=AT.ATTN_WG_TILE, one_wave=False)[0] == 5
    assert calls[0][2] == (2, 1, nw_) and calls[0][4][12] == 320, (calls[0][2], calls[0][4][12])   # 2 x 5 whole tiles
    seen |= set(seq)
    seq = run(lambda: AT.sparse_attention_decode(qw_[: nw_ - 1], AT.NVFP4KVPool(16), iw_[: nw_ - 1]))
    assert seq[0] == "nvfp4_sparse_attn_partial", seq                 # one tile less: the 16-head CTA
    optin[0] = 200 * 1024                                             # too little for its 226 KB: the mma.sync kernels
    seq = run(lambda: AT.sparse_attention_decode(qb_, AT.NVFP4KVPool(16), ib_))
    assert seq[0] == "nvfp4_sparse_attn_partial64", seq
    optin[0], arch[0] = 227 * 1024, "sm_100a"
    assert blocks["nvfp4_sparse_attn_wg"] == {AT.ATTN_WG_THREADS} and shmems["nvfp4_sparse_attn_wg"] == {AT.ATTN_WG_SMEM}
    assert re.search(r"constexpr int kWThreads = (\d+);", rt.kernel_source("nvfp4_sparse_attn.cu")).group(1) == str(AT.ATTN_WG_THREADS)
    assert re.search(r"static_assert\(kWgSmem == (\d+)", rt.kernel_source("nvfp4_sparse_attn.cu")).group(1) == str(AT.ATTN_WG_SMEM)
    assert blocks["nvfp4_sparse_attn_partial64"] == {AT.ATTN64_THREADS} and shmems["nvfp4_sparse_attn_partial64"] == {AT.ATTN64_SMEM}
    assert blocks["nvfp4_sparse_attn_partial"] == {128} and shmems["nvfp4_sparse_attn_partial"] == {0}
    src = rt.kernel_source("nvfp4_sparse_attn.cu")                   # the shared memory the kernel asserts it takes
    assert re.search(r"static_assert\(sizeof\(SmemAttn64\) == (\d+)", src).group(1) == str(AT.ATTN64_SMEM)
    # the EP kernels count on their exact block size (fixed strides, warps per CTA) and size their shared counters by
    # their key limits; the launchers hard-code the former and check the latter against the package's constants
    EPm = EPT
    ep_src = rt.kernel_source("ep_plan.cu")
    define = lambda nm: int(re.search(rf"^#define\s+{nm}\s+(\d+)", ep_src, re.M).group(1))
    for nm in ("ep_plan_count", "ep_plan_place", "ep_plan_one", "ep_sort_count", "ep_sort_place", "ep_sort_one"):
        assert blocks[nm] == {define("EP_THREADS")} == {EPm._EP_THREADS}, (nm, blocks)
    assert blocks["ep_pack_nvfp4"] == {define("EP_PACK_THREADS")}, blocks
    assert (EPm.EP_PLAN_MAX_KEYS, EPm.EP_SORT_MAXK) == (define("EP_MAXB"), define("EP_SORT_MAXK"))
    assert (EPm.EP_GMAX, EPm.EP_PACK_MAXK) == (define("EP_GMAX"), define("EP_PACK_MAXK"))
    assert EPm.EP_WORK_INTS == 32 + define("EP_SORT_MAXK") * (define("EP_GMAX") + 1)    # the kernels' EP_WORK_INTS
    assert re.search(r"^#define\s+EP_WORK_INTS\s+\(32 \+ EP_SORT_MAXK \* EP_WSTRIDE\)", ep_src, re.M)
    assert re.search(r"^#define\s+EP_WSTRIDE\s+\(EP_GMAX \+ 1\)", ep_src, re.M)
    for n_ in (0, 1, 1024, 12288, 15488, 49152, 61568, 10 ** 6):    # the grids: at most EP_GMAX CTAs covering n slots
        G_, per_ = EPm.ep_grid(n_)
        assert 1 <= G_ <= EPm.EP_GMAX and per_ % EPm._EP_THREADS == 0 and per_ >= 2 * EPm._EP_THREADS and G_ * per_ >= n_
        assert (G_ - 1) * per_ < max(n_, 1)
    every = set().union(*EXPECTED_KERNELS.values())
    assert seen == every, f"kernels no launcher uses: {sorted(every - seen)}"
