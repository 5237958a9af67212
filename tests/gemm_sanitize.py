"""GPU script for compute-sanitizer: the grouped GEMM's overlapped K loop (`GemmConfig.overlap`: every configuration
that has it, one and several units per CTA, K of 1 and 3 tiles, the plain and the NVFP4 SwiGLU epilogues), each checked
bit for bit against the plain loop. Run as `compute-sanitizer --tool memcheck --report-api-errors no python3
tests/gemm_sanitize.py` (likewise racecheck, synccheck)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout, installed or not
from dsv4_nvfp4 import gemm as GC, swiglu as SW
from dsv4_nvfp4.gemm import sm90 as S90
from dsv4_nvfp4.quant import NVFP4Experts
E, N, dev = 4, 512, "cuda"
g = torch.Generator().manual_seed(7)
cfgs = [c for c in [*S90.CONFIGS.values(), *S90.DECODE_WIDE.values()] if c.overlap]
for K in (128, 384):
    data = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g).to(dev)
    scale = torch.randint(0x30, 0x50, (E, N, K // 16), dtype=torch.uint8, generator=g).to(dev).view(torch.float8_e4m3fn)
    pw = GC.prepare_weights(NVFP4Experts(data, scale, torch.ones(E, dtype=torch.float32, device=dev), (E, N, K)))
    sizes = torch.tensor([3, 0, 40, 9])
    offs = torch.cumsum(sizes, 0).to(torch.int32).to(dev)
    R_ = int(sizes.sum())
    a = torch.randn(R_, K, generator=g).to(torch.bfloat16).to(dev)
    rs = torch.stack([torch.ones(R_), torch.rand(R_, generator=g)], 1).to(dev)
    a2 = torch.full((E,), 2e-3, device=dev)
    run = lambda cf, free: (GC.grouped_gemm_nvfp4(a, pw, offs, config=cf, sms_free=free),
                            SW.grouped_gemm_swiglu_nvfp4(a, pw, offs, swiglu_limit=7.0, row_scales=rs, scales_given=True,
                                                         config=cf, out_dtype="nvfp4", out_scale=a2, sms_free=free))
    for c in cfgs:
        for free in (0, 10_000):
            (y, q), (y0, q0) = run(c, free), run(c._replace(overlap=False), free)
            assert torch.equal(y, y0) and torch.equal(q.data, q0.data), (c, K, free)
torch.cuda.synchronize(); print("gemm_san: done", len(cfgs), "configurations")
