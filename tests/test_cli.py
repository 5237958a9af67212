"""Tests for the ``dsv4-nvfp4`` console script (dsv4_nvfp4.cli.main)."""
import os
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


# --- `quantize` / `inspect`: what is kept and why, stacked experts, outliers, bad input (each leaves no output) ---

def _quantize(capsys, *argv):
    "(rc, stdout, stderr) of `dsv4-nvfp4 quantize ARGV --no-progress`."
    rc = run_main(["quantize", *map(str, argv), "--no-progress"])
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return rc, out.out, out.err


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_quantize_reports_each_kept_weight_and_a_count_per_reason(tmp_path, capsys):
    "int32, 1-D, K = 1000, 3-D (not experts) and a skip-pattern name: each listed with its reason, then counts per reason."
    save_file({"m.a.weight": torch.randint(0, 9, (32, 64), dtype=torch.int32), "m.b.weight": torch.randn(64),
               "m.c.weight": torch.randn(8, 1000), "m.conv.weight": torch.randn(4, 32, 16),
               "m.input_layernorm.weight": torch.ones(64), "m.q_proj.weight": torch.randn(16, 64)},
              str(tmp_path / "in.safetensors"))
    rc, out, _ = _quantize(capsys, tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    assert rc == 0, out
    assert "6 input tensor(s): 1 weight(s) to NVFP4, 5 tensor(s) copied" in out, out
    assert "5 weight(s) kept as they are:" in out, out
    assert "m.a.weight: int32: quantized are bf16, fp16, fp32" in out
    assert "m.b.weight: 1-D (64,)" in out
    assert "m.c.weight: K = 1000 is not a multiple of 16" in out
    assert "m.conv.weight: 3-D (4, 32, 16)" in out
    assert "m.input_layernorm.weight: the name matches the skip pattern ('norm')" in out
    assert "kept, by reason: rank 2, dtype 1, K % 16 1, skip pattern 1" in out, out


def test_quantize_progress_bar_counts_input_tensors(tmp_path, capsys):
    "The bar's total is the number of input tensors, the unit the summary counts in."
    save_file({"a.weight": torch.randn(32, 64), "b.weight": torch.randn(16, 64),
               "norm.weight": torch.ones(64)}, str(tmp_path / "in.safetensors"))
    assert run_main(["quantize", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")]) == 0
    out = capsys.readouterr()
    assert "3 input tensor(s): 2 weight(s) to NVFP4, 1 tensor(s) copied" in out.out
    assert "3/3" in out.err, out.err


def test_quantize_stacked_experts_per_expert(tmp_path, capsys):
    "A synthetic (E, N, K) experts tensor: one global scale per expert, written as per-expert layers our loader reads."
    from dsv4_nvfp4.checkpoint import load_modelopt_nvfp4, load_nvfp4_checkpoint, modelopt_experts
    from dsv4_nvfp4.quant import ref_quantize_nvfp4
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4, 48, 64, generator=g) * torch.tensor([1e-3, 1e-1, 1.0, 30.0])[:, None, None]).bfloat16()
    save_file({"model.layers.0.mlp.experts.gate_up_proj": w}, str(tmp_path / "in.safetensors"))
    rc, out, _ = _quantize(capsys, tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    assert rc == 0 and "4 expert(s) from 1 stacked tensor(s), one global scale each" in out, out
    ex = modelopt_experts(load_modelopt_nvfp4(tmp_path / "out.safetensors"), "model.layers.0.mlp.experts.{e}.gate_up_proj", 4)
    gs = [m.weight.global_scale.item() for m in ex]
    assert len(set(gs)) == 4, gs
    for e in range(4):
        r = ref_quantize_nvfp4(w[e])
        assert torch.equal(ex[e].weight.data, r.data) and torch.equal(ex[e].weight.global_scale, r.global_scale), e
        assert torch.equal(ex[e].weight.scale.view(torch.uint8), r.scale.view(torch.uint8)), e
    rc, out, _ = _quantize(capsys, tmp_path / "in.safetensors", tmp_path / "ct.safetensors", "--format", "compressed-tensors")
    fmt, layers = load_nvfp4_checkpoint(tmp_path / "ct.safetensors")
    assert rc == 0 and fmt == "compressed-tensors" and len(layers) == 4
    assert torch.equal(layers["model.layers.0.mlp.experts.2.gate_up_proj"].weight.data, ex[2].weight.data)
    assert run_main(["inspect", str(tmp_path / "out.safetensors")]) == 0
    assert "4 NVFP4 layer(s)" in capsys.readouterr().out


def test_quantize_warns_on_an_outlier_naming_the_tensor(tmp_path, capsys):
    "One 1e30 in an fp32 tensor: every other block underflows; a warning names the tensor and says what to do."
    w = torch.randn(64, 256); w[3, 9] = 1e30
    save_file({"m.spiky.weight": w, "m.fine.weight": torch.randn(64, 256)}, str(tmp_path / "in.safetensors"))
    rc, out, err = _quantize(capsys, tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    assert rc == 0, err
    warn = [ln for ln in err.splitlines() if ln.startswith("dsv4-nvfp4: warning:")]
    assert len(warn) == 1 and "m.spiky.weight: 1023 of its 1024 nonzero blocks (99.9%) quantize to all zeros" in warn[0], err
    assert "--skip" in warn[0] and "m.fine" not in err


def test_quantize_nan_names_the_tensor_and_leaves_nothing(tmp_path, capsys):
    w = torch.randn(32, 64); w[1, 2] = float("nan")
    save_file({"m.a.weight": torch.randn(32, 64), "m.b.weight": w}, str(tmp_path / "in.safetensors"))
    rc, _, err = _quantize(capsys, tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    assert rc == 2 and "m.b.weight in in.safetensors holds NaN or Inf values" in err, err
    assert len(err.strip().splitlines()) == 1 and _names(tmp_path) == ["in.safetensors"]


def test_quantize_truncated_file_is_one_line_naming_file_and_tensor(tmp_path, capsys):
    save_file({"m.w.weight": torch.randn(256, 1024).bfloat16()}, str(tmp_path / "in.safetensors"))
    os.truncate(tmp_path / "in.safetensors", 140000)
    rc, _, err = _quantize(capsys, tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "in.safetensors: truncated: tensor m.w.weight" in err, err
    assert _names(tmp_path) == ["in.safetensors"]
    assert run_main(["inspect", str(tmp_path / "in.safetensors")]) == 2
    assert "truncated: tensor m.w.weight" in capsys.readouterr().err


def test_quantize_overwrite_onto_itself_is_refused(tmp_path, capsys):
    save_file({"m.w.weight": torch.randn(32, 64)}, str(tmp_path / "in.safetensors"))
    before = (tmp_path / "in.safetensors").read_bytes()
    rc, _, err = _quantize(capsys, tmp_path / "in.safetensors", tmp_path / "in.safetensors", "--overwrite")
    assert rc == 2 and "is the input" in err, err
    assert (tmp_path / "in.safetensors").read_bytes() == before and _names(tmp_path) == ["in.safetensors"]
    (tmp_path / "ck").mkdir()
    save_file({"m.w.weight": torch.randn(32, 64)}, str(tmp_path / "ck" / "model.safetensors"))
    rc, _, err = _quantize(capsys, tmp_path / "ck", tmp_path / "ck", "--overwrite")
    assert rc == 2 and "is the input" in err and _names(tmp_path / "ck") == ["model.safetensors"], err


def test_quantize_existing_output_names_the_cli_flag(tmp_path, capsys):
    save_file({"m.w.weight": torch.randn(32, 64)}, str(tmp_path / "in.safetensors"))
    (tmp_path / "out.safetensors").write_bytes(b"keep me")
    rc, _, err = _quantize(capsys, tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    assert rc == 2 and "pass --overwrite" in err and "overwrite=True" not in err, err
    assert (tmp_path / "out.safetensors").read_bytes() == b"keep me"


def test_index_pointing_outside_its_folder_is_refused_everywhere(tmp_path, capsys):
    "`../outside.safetensors` in weight_map: quantize, inspect and the library loader refuse it, naming it; nothing is read or written."
    import json
    from dsv4_nvfp4.checkpoint import load_modelopt_nvfp4, load_nvfp4_checkpoint
    from dsv4_nvfp4.quant import ref_quantize_nvfp4
    from dsv4_nvfp4.checkpoint import save_modelopt_nvfp4
    save_modelopt_nvfp4(tmp_path / "outside.safetensors", {"secret": ref_quantize_nvfp4(torch.randn(16, 64))})
    ck = tmp_path / "ck"; ck.mkdir()
    save_file({"m.w.weight": torch.randn(16, 64)}, str(ck / "model-1.safetensors"))
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "m.w.weight": "model-1.safetensors", "secret.weight": "../outside.safetensors"}}))
    rc, _, err = _quantize(capsys, ck, tmp_path / "out")
    assert rc == 2 and "'../outside.safetensors', which is outside the checkpoint folder" in err, err
    assert not (tmp_path / "out").exists() and not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    assert run_main(["inspect", str(ck)]) == 2
    err = capsys.readouterr().err
    assert "outside the checkpoint folder" in err and "Traceback" not in err, err
    for load in (load_modelopt_nvfp4, load_nvfp4_checkpoint):
        with pytest.raises(ValueError, match="outside the checkpoint folder"): load(ck)
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"m.w.weight": str(tmp_path / "outside.safetensors")}}))
    with pytest.raises(ValueError, match="outside the checkpoint folder"): load_modelopt_nvfp4(ck)   # an absolute path
    os.symlink(tmp_path / "outside.safetensors", ck / "link.safetensors")
    (ck / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"secret.weight": "link.safetensors"}}))
    with pytest.raises(ValueError, match="outside the checkpoint folder"): load_modelopt_nvfp4(ck)   # a symlink out
    assert _names(tmp_path) == ["ck", "outside.safetensors"]


def test_inspect_bf16_points_to_quantize(tmp_path, capsys):
    save_file({"m.w.weight": torch.randn(32, 64).bfloat16()}, str(tmp_path / "in.safetensors"))
    assert run_main(["inspect", str(tmp_path / "in.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "It holds 1 bf16 / fp16 / fp32 weight(s): convert it with `dsv4-nvfp4 quantize" in err, err
    assert len(err.strip().splitlines()) == 1 and _names(tmp_path) == ["in.safetensors"]


def test_quantize_runs_as_a_subprocess(tmp_path):
    "The console entry point as a user runs it: the summary on stdout, a clear error and exit 2 for a bad input."
    import subprocess
    import sys
    save_file({"m.w.weight": torch.randn(32, 64), "m.c.weight": torch.randn(8, 1000)}, str(tmp_path / "in.safetensors"))
    cmd = [sys.executable, "-m", "dsv4_nvfp4.cli", "quantize", str(tmp_path / "in.safetensors"), str(tmp_path / "o.safetensors"), "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0 and "m.c.weight: K = 1000 is not a multiple of 16" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 2 and "pass --overwrite" in r.stderr and "Traceback" not in r.stderr, r.stderr
