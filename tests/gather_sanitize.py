"""GPU script for compute-sanitizer: the GEMM's gather variant (`in_rows`; tiles 8 and 32, one and four warpgroups) on
ragged routings of 1, 9 and 40 tokens with a row outside x, each checked against the plain GEMM of the gathered rows.
Run as `compute-sanitizer --tool memcheck --report-api-errors no python3 tests/gather_sanitize.py` (likewise racecheck)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout, installed or not
from dsv4_nvfp4 import gemm as GC, routing as R
from dsv4_nvfp4.gemm import sm90 as S90
from dsv4_nvfp4.quant import NVFP4Experts
E, N, K, k, dev = 16, 512, 1024, 6, "cuda"
g = torch.Generator().manual_seed(5)
data = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g).to(dev)
scale = torch.randint(0x30, 0x50, (E, N, K // 16), dtype=torch.uint8, generator=g).to(dev).view(torch.float8_e4m3fn)
pw = GC.prepare_weights(NVFP4Experts(data, scale, torch.ones(E, dtype=torch.float32, device=dev), (E, N, K)))
for T in (1, 9, 40):
    x = torch.randn(T + 2, K, generator=g).to(torch.bfloat16).to(dev)
    rt = R.route_topk(R.random_topk(T, E, k, generator=torch.Generator().manual_seed(T)), E)
    rows = rt.token.to(torch.int32); rows[0] = -3 if T > 1 else rows[0]
    offs, rows = rt.expert_offsets.to(dev), rows.to(dev)
    for c in (S90.CONFIGS[8], S90.CONFIGS[32], S90.DECODE_WIDE[8], S90.DECODE_WIDE[32]):
        got = GC.grouped_gemm_nvfp4(x, pw, offs, in_rows=rows, config=c)
        assert torch.equal(got, GC.grouped_gemm_nvfp4(GC.gather_rows(x, rows), pw, offs, config=c)), (T, c)
torch.cuda.synchronize(); print("gather_san: done")
