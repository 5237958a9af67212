"""Minimal flashinfer-jit-cache shim: exposes a prebuilt fused_moe_90 (SM90a, MXFP4 W4A16 + W4A8 Humming
kernels only) to flashinfer 0.7.2.post1's AOT loader (flashinfer/jit/env.py:_get_aot_providers).
Put the parent directory of this package on PYTHONPATH (or sys.path) before importing flashinfer.
The libraries must be at <this dir>/jit_cache/<module>/<module>.so: fused_moe_90, and trtllm_utils (the stream delay
kernel FlashInfer's autotuner launches before each tactic it times; without it every tactic raises and the sweep
falls back to its default tactic)."""
import pathlib
from types import SimpleNamespace

__version__ = "0.7.2.post1"  # must equal flashinfer.__version__ (or start with it + "+")

_JIT_CACHE_DIR = pathlib.Path(__file__).resolve().parent / "jit_cache"


def get_jit_cache_providers():
    return [
        SimpleNamespace(
            provider_id="peer3-fused-moe-90-mxfp4",
            distribution="flashinfer-jit-cache",
            version=__version__,  # must equal the shim __version__
            jit_cache_dir=str(_JIT_CACHE_DIR),
            cuda_architectures=["sm90a"],
            modules=["fused_moe_90", "trtllm_utils"],
        )
    ]
