"""The two transports side by side at small sizes (a GPU tool, not a test), under torchrun: `bench ep`'s layer
(`bench_ep_layer`) as `CapturedEP` at `bench_capacity`, with the shared expert beside the dispatch, on NCCL's kernels
and on the copy engines (forced, as tests/ep_gpu_check.py forces them), both payloads, timed by the bench's timer;
and the one-GPU layer captured over the W T tokens. Rank 0 prints one JSON line per size: ms per variant, and whether
each output equals the one-GPU layer's (with the one GPU's own routing: at larger T its router may route a token
differently, as `bench ep` reports).

    torchrun --nproc-per-node 2 tests/ep_transports.py [T ...]        (default 1 4 32 128 512)"""
import os, sys, json
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from dsv4_nvfp4.bench.ep import bench_capacity, bench_ep_layer, _timed
from dsv4_nvfp4.ep.capture import CapturedEP
from dsv4_nvfp4.ep.layer import EPMoE
from dsv4_nvfp4.moe import FLASH
from ep_gpu_check import forced
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"])); dist.init_process_group("nccl")
W, r, dev = dist.get_world_size(), dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
lay = bench_ep_layer(FLASH, dev)
eps = {p: EPMoE(lay, payload=p).to(dev) for p in ("bf16", "nvfp4")}
res = {}
for T in [int(a) for a in sys.argv[1:]] or [1, 4, 32, 128, 512]:
    g = torch.Generator(device=dev).manual_seed(1000 + T)
    x_all = (torch.randn(W * T, FLASH.hidden, generator=g, device=dev) * 0.5).to(torch.bfloat16)
    x = x_all[r * T:(r + 1) * T].contiguous()
    one = lay.capture(W * T); one(x_all)
    t1 = _timed(lambda: one(x_all), 20); want = one(x_all).clone(); del one
    row = {"one_graph": round(t1, 4)}
    for p, ep in eps.items():
        for ce in (False, True):
            with forced(ce, 0.0): c = CapturedEP(ep, T, capacity=bench_capacity(T, FLASH, W))
            y = c(x).clone()
            row[f"{p}_{'ce' if ce else 'k'}"] = round(_timed(lambda: c(x), 20), 4)
            # (exactness against the one-GPU layer's own routing: may differ in last bits of the router at W T rows)
            row[f"{p}_{'ce' if ce else 'k'}_same"] = bool(torch.equal(y, want[r * T:(r + 1) * T]))
            c.close(); del c
    res[T] = row
    if r == 0: print(T, json.dumps(row), flush=True)
dist.barrier(); dist.destroy_process_group()
