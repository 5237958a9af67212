"""Tests for the ``dsv4-nvfp4`` console script (dsv4_nvfp4.cli.main)."""
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dsv4_nvfp4 import cli

NUM = r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?"


def run_main(argv):
    """main(argv) -> int; an argparse-style SystemExit is turned into its code."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # still a clean exit, not a traceback
        rc = e.code
    return rc


def numbers(line):
    return [float(m.replace(",", "")) for m in re.findall(NUM, line)]


def test_demo_prints_sqnr_and_bytes(capsys):
    rc = run_main(["demo"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 0, text
    assert "Traceback" not in text
    sqnr_lines = [ln for ln in text.splitlines() if "sqnr" in ln.lower()]
    assert sqnr_lines, f"no SQNR line in demo output:\n{text}"
    db_vals = [float(v) for ln in sqnr_lines for v in re.findall(r"([-+]?\d+(?:\.\d+)?)\s*dB", ln)]
    all_vals = [v for ln in sqnr_lines for v in numbers(ln)]
    # NVFP4 on Gaussian-like data is ~20 dB; any 4-bit format SQNR is in (5, 60) dB
    plausible = [v for v in (db_vals or all_vals) if 5.0 < v < 60.0]
    assert plausible, f"no plausible SQNR value in: {sqnr_lines}"
    for v in db_vals:
        assert 0.0 < v < 80.0, (v, sqnr_lines)
    byte_lines = [ln for ln in text.splitlines() if "byte" in ln.lower()]
    assert byte_lines, f"no bytes line in demo output:\n{text}"
    vals = [v for ln in byte_lines for v in numbers(ln)]
    assert any(v > 0 for v in vals), byte_lines
    assert all(np.isfinite(v) for v in vals)


def _write_modelopt(path):
    rng = np.random.default_rng(0)
    d = {}
    for name, (N, K) in {"model.layers.0.mlp.experts.0.gate_proj": (32, 64),
                         "model.layers.0.mlp.experts.0.down_proj": (64, 32)}.items():
        codes = rng.integers(0, 16, (N, K)).astype(np.uint8)
        d[f"{name}.weight"] = torch.from_numpy((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))
        d[f"{name}.weight_scale"] = torch.from_numpy(
            rng.integers(0x20, 0x50, (N, K // 16)).astype(np.uint8)).view(torch.float8_e4m3fn)
        d[f"{name}.weight_scale_2"] = torch.tensor(0.002, dtype=torch.float32)
        d[f"{name}.input_scale"] = torch.tensor(0.01, dtype=torch.float32)
    d["model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(d, path)


def test_demo_with_checkpoint(tmp_path, capsys):
    path = str(tmp_path / "model.safetensors")
    _write_modelopt(path)
    rc = run_main(["demo", "--checkpoint", path])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 0, text
    assert text.strip()
    assert "Traceback" not in text


def test_demo_missing_checkpoint(tmp_path, capsys):
    path = str(tmp_path / "does_not_exist.safetensors")
    rc = run_main(["demo", "--checkpoint", path])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc not in (0, None), text
    assert "Traceback" not in text
    low = text.lower()
    assert ("does_not_exist" in low or "not found" in low or "no such" in low
            or "not exist" in low), text


def test_demo_checkpoint_without_nvfp4(tmp_path, capsys):
    path = str(tmp_path / "dense.safetensors")
    save_file({"a.weight": torch.ones(4, 4, dtype=torch.bfloat16), "b.bias": torch.zeros(4)}, path)
    rc = run_main(["demo", "--checkpoint", path])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc not in (0, None), text
    assert "Traceback" not in text
    low = text.lower()
    assert "nvfp4" in low or "weight" in low, text


def test_demo_checkpoint_missing_weight_scale_2(tmp_path, capsys):
    path = str(tmp_path / "broken.safetensors")
    _write_modelopt(path)
    from safetensors.torch import load_file
    d = load_file(path)
    del d["model.layers.0.mlp.experts.0.gate_proj.weight_scale_2"]
    save_file(d, path)
    rc = run_main(["demo", "--checkpoint", path])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc not in (0, None), text
    assert "Traceback" not in text
    assert "weight_scale_2" in text, text


def test_demo_corrupt_checkpoint_is_a_clear_error(tmp_path, capsys):
    "A file that is not safetensors at all: a one-line error and exit code 2, no traceback."
    path = tmp_path / "corrupt.safetensors"
    path.write_bytes(b"\xff" * 64)
    assert cli.main(["demo", "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a readable safetensors file" in err and "Traceback" not in err


@pytest.mark.gpu
def test_demo_on_gpu_runs_the_kernels_bit_exact(capsys):
    "On a GPU box the demo runs the NVRTC kernels and reports them bit-exact with the CPU reference, with timings."
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert out.count("bit-exact with the CPU reference: yes") == 2, out
    times = [float(m) for m in re.findall(r"quantize \w+ \(bf16.*?: ([0-9.]+) us", out)]
    assert len(times) == 2 and all(t > 0 for t in times), out


def test_version_and_help_answer_without_torch():
    "`dsv4-nvfp4 --version` / `--help` parse before anything imports torch (the import alone takes seconds)."
    import subprocess
    import sys
    code = ("import sys\nfrom dsv4_nvfp4 import cli\nfor a in (['--version'], ['--help']):\n"
            "    try: cli.main(a)\n    except SystemExit as e: assert e.code == 0, e.code\n"
            "print('TORCH', 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    from dsv4_nvfp4 import __version__
    assert f"dsv4-nvfp4 {__version__}" in r.stdout and "demo" in r.stdout and "bench" in r.stdout, r.stdout
    assert "TORCH False" in r.stdout, r.stdout


def test_no_command_lists_the_commands(capsys):
    "A bare `dsv4-nvfp4` prints the usage with its commands (exit 2), not argparse's 'arguments are required'."
    assert run_main([]) == 2
    err = capsys.readouterr().err
    assert "demo" in err and "bench" in err and "--version" in err and "required" not in err, err


def test_demo_timings_exclude_the_warm_up(capsys):
    assert run_main(["demo"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "quantized in" in ln]
    assert len(lines) == 2 and all("after one untimed warm-up call" in ln for ln in lines), out


def test_checkpoint_demo_says_identical_not_inf_db(tmp_path, capsys):
    "Stored weights lie on the E2M1 grid: the legacy table gives the same values, said in words (no 'inf dB')."
    path = str(tmp_path / "model.safetensors")
    _write_modelopt(path)
    assert run_main(["demo", "--checkpoint", path]) == 0
    out = capsys.readouterr().out
    assert "inf" not in out and out.count("the legacy half-step table gives the same values") == 2, out


def test_quantize_then_inspect_round_trip(tmp_path, capsys):
    "`quantize` writes NVFP4 that loads back bit-exact with the reference quantizer; `inspect` lists it; errors are one line."
    from dsv4_nvfp4.checkpoint import load_modelopt_nvfp4
    from dsv4_nvfp4.quant import ref_quantize_nvfp4
    g = torch.Generator().manual_seed(0)
    src = {"l.0.mlp.up_proj.weight": torch.randn(96, 128, generator=g).bfloat16(), "l.0.norm.weight": torch.ones(128).bfloat16()}
    save_file(src, str(tmp_path / "in.safetensors"))
    assert run_main(["quantize", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "1 weight(s) to NVFP4, 1 tensor(s) copied" in out and "peak memory above the start" in out, out
    q = load_modelopt_nvfp4(tmp_path / "out.safetensors")["l.0.mlp.up_proj"].weight
    r = ref_quantize_nvfp4(src["l.0.mlp.up_proj.weight"])
    assert torch.equal(q.data, r.data) and torch.equal(q.scale.view(torch.uint8), r.scale.view(torch.uint8))
    assert run_main(["inspect", str(tmp_path / "out.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "l.0.mlp.up_proj" in out and "(96, 128)" in out and "1 NVFP4 layer(s)" in out, out
    assert run_main(["quantize", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"), "--no-progress"]) == 2
    assert "exists" in capsys.readouterr().err
    assert run_main(["inspect", str(tmp_path / "in.safetensors")]) == 2            # bf16 only: no NVFP4 layer
    assert "not an NVFP4 checkpoint" in capsys.readouterr().err


def test_quantize_interrupted_leaves_nothing(tmp_path, capsys, monkeypatch):
    "Ctrl-C part-way: exit code 130, no output and no temporary file."
    from dsv4_nvfp4 import checkpoint as CK
    save_file({"a.weight": torch.randn(32, 64).bfloat16(), "b.weight": torch.randn(32, 64).bfloat16()}, str(tmp_path / "in.safetensors"))
    calls = []
    def interrupt(*a, **k):
        calls.append(1)
        if len(calls) == 2: raise KeyboardInterrupt
        return real(*a, **k)
    real = CK.ref_quantize_nvfp4
    monkeypatch.setattr(CK, "ref_quantize_nvfp4", interrupt)
    assert run_main(["quantize", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"), "--no-progress"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]


def test_inspect_and_demo_read_compressed_tensors_too(tmp_path, capsys):
    "The format is detected: a compressed-tensors NVFP4 file is inspected and demoed like a ModelOpt one."
    from dsv4_nvfp4.checkpoint import save_compressed_tensors_nvfp4
    from dsv4_nvfp4.quant import ref_quantize_nvfp4
    path = tmp_path / "ct.safetensors"
    save_compressed_tensors_nvfp4(path, {"l.0.down_proj": ref_quantize_nvfp4(torch.randn(32, 64))})
    assert run_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(compressed-tensors NVFP4)" in out and "l.0.down_proj" in out, out
    assert run_main(["demo", "--checkpoint", str(path)]) == 0
    assert "(compressed-tensors)" in capsys.readouterr().out
    save_file({"e.weight": torch.zeros(4, 16, dtype=torch.int8), "e.scale": torch.zeros(4, 1, dtype=torch.uint8)}, str(tmp_path / "mx.safetensors"))
    assert run_main(["demo", "--checkpoint", str(tmp_path / "mx.safetensors")]) == 2
    assert "MXFP4" in capsys.readouterr().err


def test_quantize_compressed_tensors_and_inspect_dsv4_mxfp4(tmp_path, capsys):
    "`quantize --format compressed-tensors` writes that convention; `inspect` lists DSV4's MXFP4 experts and how they carry."
    from dsv4_nvfp4.checkpoint import load_nvfp4_checkpoint, save_dsv4_mxfp4
    from dsv4_nvfp4.quant import ref_quantize_mxfp4, ref_quantize_nvfp4
    g = torch.Generator().manual_seed(0)
    src = {"l.0.mlp.up_proj.weight": torch.randn(96, 128, generator=g).bfloat16()}
    save_file(src, str(tmp_path / "in.safetensors"))
    assert run_main(["quantize", str(tmp_path / "in.safetensors"), str(tmp_path / "ct.safetensors"), "--format", "compressed-tensors", "--no-progress"]) == 0
    assert "(compressed-tensors, 1 file(s))" in capsys.readouterr().out
    fmt, layers = load_nvfp4_checkpoint(tmp_path / "ct.safetensors")
    r = ref_quantize_nvfp4(src["l.0.mlp.up_proj.weight"])
    assert fmt == "compressed-tensors" and torch.equal(layers["l.0.mlp.up_proj"].weight.data, r.data)
    w = torch.zeros(8, 96); w[:, :64] = torch.randn(8, 64, generator=g); w[0, 64:] = 2.0 ** -40   # one block 2^40 below
    save_dsv4_mxfp4(tmp_path / "dsv4.safetensors", {"layers.0.ffn.experts.0.w1": ref_quantize_mxfp4(torch.randn(16, 64, generator=g)),
                                                   "layers.0.ffn.experts.1.w1": ref_quantize_mxfp4(w)})
    assert run_main(["inspect", str(tmp_path / "dsv4.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "(DSV4 MXFP4" in out and "experts.0.w1" in out and "(16, 64)" in out, out
    assert "exact (global scale 2^" in out and "1 block(s) out of range" in out and "1 of 2 run on the NVFP4 kernels" in out, out


def test_bench_ep_passes_its_token_counts(monkeypatch):
    "`bench ep --tokens ...` hands the sizes to bench_ep_main (the run itself needs torchrun and GPUs)."
    import dsv4_nvfp4.bench.ep as ep
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ep, "bench_ep_main", lambda out, tokens: seen.append(tokens) or 0)
    assert run_main(["bench", "ep", "--tokens", "64", "2048"]) == 0 and seen == [(64, 2048)]
    assert run_main(["bench", "ep"]) == 0 and seen[-1] == (1, 128, 2048, 8192)
    assert run_main(["bench", "ep", "--tokens", "x"]) == 2                      # not a number: argparse's usage error
