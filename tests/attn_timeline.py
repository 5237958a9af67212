"""Timeline of one captured decode-attention step (a GPU tool, not a test): torch.profiler (CUPTI) over 30 replays of
a CUDA graph of `sparse_attention_decode`, the L2 flushed before each (moe_timeline.timeline); per kernel (the split
slots' kernel, then the merge) the median duration and the gap after the kernel before it, and the step's span. The
benchmark's problems (bench.attn.ATTN_PROBLEMS) at 32K context and the given batches.

    python tests/attn_timeline.py OUT.json [B ...]        (default B = 8 64 128)"""
import json, sys
from types import SimpleNamespace

import torch

from dsv4_nvfp4 import attention as A
from dsv4_nvfp4.bench.attn import ATTN_PROBLEMS, attn_inputs
from moe_timeline import timeline


def main():
    out, batches = sys.argv[1], [int(b) for b in sys.argv[2:]] or [8, 64, 128]
    dev = torch.device("cuda")
    flush = torch.zeros(32 << 20, dtype=torch.int64, device=dev)     # 256 MB read each time: L2 flushed clean
    res = dict(gpu=torch.cuda.get_device_name(dev), rows=[])
    for name, H, K, ratio in ATTN_PROBLEMS:
        for B in batches:
            a = attn_inputs(B, H, K, ratio, 32768)
            a.pop("kv_bytes"); a.pop("flops")
            o = torch.empty_like(a["q"])
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                             # warm up (compile, opt-in) off the capture
                A.sparse_attention_decode(**a, out=o)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                A.sparse_attention_decode(**a, out=o)
            row = dict(problem=name, batch=B, context=32768,
                       plan=A.attn_kernel(H, B, a["window"].shape[1] + a["indices"].shape[1], A.rt.smem_optin(0), A.rt.device_arch()),
                       **timeline(SimpleNamespace(graph=g), flush))
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            json.dump(res, open(out, "w"), indent=1)
            del a, o, g
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
