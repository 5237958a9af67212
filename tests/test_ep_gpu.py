"""GPU: the expert-parallel layer over NCCL (multicast off) equals the one-GPU layer bit for bit, eager and captured in a
CUDA graph (tests/ep_gpu_check.py under torchrun): on 2 GPUs, and as a world of one on any GPU (the eager all-to-alls
over NCCL; captured, every slot is local and the fixed-shape steps run without a collective). One process per kind of
activation (W4A16, W4A4), so that each stays within minutes on a fresh machine (its GEMMs compile first)."""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("act", ["w4a16", "w4a4"])           # one process each: a run stays within minutes
@pytest.mark.parametrize("gpus", [1, 2])
def test_ep_over_nccl_is_bit_identical(gpus, act):
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus: pytest.skip(f"needs {gpus} GPU(s)")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), os.path.join(here, "ep_gpu_check.py"), act],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
