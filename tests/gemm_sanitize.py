"""GPU script for compute-sanitizer: the grouped GEMM's overlapped K loop (`GemmConfig.overlap`: every configuration
that has it, one and several units per CTA, K of 1 and 3 tiles, the plain and the NVFP4 SwiGLU epilogues), each checked
bit for bit against the plain loop; and the overlapped W4A8 loop (the W4A8 plan's prefill configuration: K of 1 and 2
promotion groups, table and F2FP experts, ragged rows with an empty expert, both epilogues, one and many units per CTA;
and its staged epilogue at tok_tile 64 too, where threads 64-127 hold no token and must not write a token scale (one
would land in the other warpgroup's: a shared-memory race that racecheck reports and memcheck cannot see),
checked against the plain W4A8 loop within 1e-2 relative Frobenius (not the same bits: the promotion interval differs). Run as `compute-sanitizer --tool memcheck --report-api-errors no python3
tests/gemm_sanitize.py` (likewise racecheck, synccheck); an argument `bf16` or `w4a8` runs that part only (racecheck
takes long enough that the two parts are worth running side by side on two GPUs)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout, installed or not
from dsv4_nvfp4 import gemm as GC, swiglu as SW
from dsv4_nvfp4.gemm import sm90 as S90
from dsv4_nvfp4.quant import NVFP4Experts
E, N, dev = 4, 512, "cuda"
g = torch.Generator().manual_seed(7)
part = sys.argv[1] if len(sys.argv) > 1 else "all"
assert part in ("all", "bf16", "w4a8"), f"unknown part {part!r}: all, bf16 or w4a8"
cfgs = [c for c in [*S90.CONFIGS.values(), *S90.DECODE_WIDE.values()] if c.overlap] if part != "w4a8" else []
for K in ((128, 384) if cfgs else ()):
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
from dsv4_nvfp4.gemm import sm90_kernel as S90K, w4a8 as W
from _gpu_helpers import mixed_w4a8_experts                 # (tests/ is the script's directory: on the path)
sms = torch.cuda.get_device_properties(0).multi_processor_count
for K in ((512, 1024) if part != "bf16" else ()):
    mx = mixed_w4a8_experts(E, 256, K, g)
    tiled, cm, table = W.tile_weights_w4a8_mixed(mx)
    rows = W.w4a8_row_scales(cm, table=table).to(dev)
    offs = torch.tensor([5, 0, 200, 61]).cumsum(0).to(torch.int32).to(dev)
    R_ = int(offs[-1])
    a = W.ref_quantize_fp8_act(torch.randn(R_, K, generator=g))
    p = torch.rand(R_, generator=g) + 0.5
    for epi, tt in ((S90.Epilogue.BF16_ROW_GS, 128), (S90.Epilogue.SWIGLU_BF16, 128), (S90.Epilogue.BF16_ROW_GS, 64)):
        cfg = W.W4A8_OV_CONFIG._replace(fp8=True, table=True, overlap=True, epilogue=epi, tok_tile=tt)
        sc = (torch.stack([a.scale[:, 0], p], 1) if epi.swiglu else a.scale).to(dev)
        for free in (0, sms - 1):
            outs = []
            for c in (cfg, S90.CONFIGS[64]._replace(fp8=True, table=True, overlap=False, epilogue=epi)):
                out = torch.empty(R_, 128 if epi.swiglu else 256, dtype=torch.bfloat16, device=dev)
                S90K.run_sm90(c, tiled.to(dev), a.data.to(dev), out, offs, mx.global_scale.to(dev), sc, sf_c=rows, sms_free=free)
                outs.append(out.float())
            d = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
            assert d < 1e-2, (K, epi.name, free, d)
torch.cuda.synchronize(); print("gemm_san: done", part, len(cfgs), "bf16 configurations", "and the overlapped W4A8 loop" * (part != "bf16"))
