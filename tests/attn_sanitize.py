"""GPU script for compute-sanitizer: every path of the fused decode attention once, on small shapes (the default split,
one split, a ragged 16-head batch, no window, window only, Pro's 128 heads). Run as
`compute-sanitizer --tool memcheck --report-api-errors no python3 tests/attn_sanitize.py` (likewise racecheck, synccheck)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_attention_gpu import case, run                                    # noqa: E402

for args, kw in (((2, 64, 128, 512), {}), ((2, 64, 128, 512), dict(splits=1)), ((3, 16, 37, 33), {}), ((2, 64, 0, 200), {}),
                 ((2, 64, 128, 0), {}), ((1, 128, 128, 1024), {})):
    c = case(*args)
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    o = run(c, bad_count=bad, **kw)
    torch.cuda.synchronize()
    print(args, kw, "ok", bad.item(), float(o.float().abs().mean()))
