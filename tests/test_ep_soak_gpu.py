"""GPU (2+ GPUs): a short run of the captured EP forward's soak test (tests/ep_soak.py under torchrun): every kept
transport and shared-expert placement, W4A4 with both payloads, 100 replays each with new tokens and routing and the
buffers NaN-filled before each, bit for bit against the one-GPU layer; and the deliberately broken event wait caught.
The long run (10,000 replays per variant) is `torchrun --nproc-per-node 2 tests/ep_soak.py --broken`."""
import os
import signal
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_ep_soak_short_run_is_exact_and_catches_a_broken_wait():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2: pytest.skip("needs 2 GPUs")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", os.path.join(here, "ep_soak.py"),
                          "--replays", "100", "--acts", "w4a4", "--broken"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, start_new_session=True)
    try: out, err = p.communicate(timeout=900)
    except subprocess.TimeoutExpired:                   # torchrun and its workers go together: none is left on the GPUs
        os.killpg(p.pid, signal.SIGKILL); out, err = p.communicate()
        pytest.fail("ep_soak did not finish in 900 s:\n" + out[-3000:] + err[-3000:])
    assert p.returncode == 0 and "SOAK OK" in out, out[-3000:] + err[-3000:]
    assert "BROKEN wait" in out and " 0 mismatching over the ranks" not in out
