"""Write the build.ninja of FlashInfer's small trtllm_utils module (its stream delay kernel, which the autotuner launches
before every tactic it times: without it each tactic raises under FLASHINFER_DISABLE_JIT and the sweep falls back to
the default tactic). build.sh runs it after gen_min.py and builds it with ninja."""
import os, sys, types
ROOT = os.environ["FI_ROOT"]
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", f"{ROOT}/ws")
sys.path.insert(0, f"{ROOT}/src")
pkg = types.ModuleType("flashinfer"); pkg.__path__ = [f"{ROOT}/src/flashinfer"]; sys.modules["flashinfer"] = pkg
from flashinfer.jit.tllm_utils import gen_trtllm_utils_module
spec = gen_trtllm_utils_module()
spec.write_ninja()
print(spec.ninja_path)
