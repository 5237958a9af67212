"""A plain install (no dev extras) imports every module: IPython, matplotlib, ml_dtypes and cuda-python are loaded
lazily, only by the notebook helpers, the plots and the GPU paths that need them (the sm90 backend imports its CuTeDSL
kernel, dsv4_nvfp4.gemm.sm90_kernel, on the first launch: that module alone needs the [gpu] extra)."""
import subprocess
import sys

MODULES = ["dsv4_nvfp4", "dsv4_nvfp4.formats", "dsv4_nvfp4.quant", "dsv4_nvfp4.checkpoint", "dsv4_nvfp4.layout",
           "dsv4_nvfp4.runtime", "dsv4_nvfp4.quantize_cuda", "dsv4_nvfp4.norm", "dsv4_nvfp4.bench.core", "dsv4_nvfp4.routing",
           "dsv4_nvfp4.gemm", "dsv4_nvfp4.gemm.reference", "dsv4_nvfp4.gemm.sm90", "dsv4_nvfp4.gemm.sm100",
           "dsv4_nvfp4.swiglu", "dsv4_nvfp4.moe", "dsv4_nvfp4.cli", "dsv4_nvfp4.bench.kernels", "dsv4_nvfp4.bench.gemm",
           "dsv4_nvfp4.bench.mlp", "dsv4_nvfp4.bench.kv", "dsv4_nvfp4.bench.moe", "dsv4_nvfp4.bench.ep",
           "dsv4_nvfp4.ep.transport", "dsv4_nvfp4.ep.layer", "dsv4_nvfp4.ep.capture"]


def test_modules_import_without_dev_or_gpu_packages():
    blocked = ["IPython", "matplotlib", "ml_dtypes", "cuda", "cuda.core", "cuda.bindings", "cutlass", "nbdev"]
    code = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
            + "".join(f"import {m}\n" for m in MODULES) + "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
