"""GPU script for compute-sanitizer: every path of the fused decode attention once, on small shapes (the default split,
one split, a ragged 16-head batch, no window, window only, Pro's 128 heads), with the plan's kernel choice, then with
the 64-head mma.sync CTA and then the warpgroup-MMA kernel (sm_90a) forced wherever H allows. Run as
`compute-sanitizer --tool memcheck --report-api-errors no python3 tests/attn_sanitize.py` (likewise racecheck, synccheck).
Each call is also checked against the float64 reference (5e-3 relative per query) and its count of bad indices, so a
run that computes garbage fails even where the sanitizer reports nothing."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_attention_gpu import A, case, reference, rel_per_query, run      # noqa: E402

plan, plan_wg = A.attn_heads, A.attn_wg
SHAPES = (((2, 64, 128, 512), {}), ((2, 64, 128, 512), dict(splits=1)), ((3, 16, 37, 33), {}), ((2, 64, 0, 200), {}),
          ((2, 64, 128, 0), {}), ((1, 128, 128, 1024), {}), ((2, 64, 0, 40), {}))
for force, (args, kw) in [(f, a) for f in (None, 64, "wg") for a in SHAPES]:
    A.attn_heads = plan if force is None else (lambda H, B, S, smem_optin=None: 64 if H % 64 == 0 else 16)
    A.attn_wg = plan_wg if force is None else (lambda H, B, S, smem_optin=None, arch=None: force == "wg" and H % 64 == 0)
    c = case(*args)
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    o = run(c, bad_count=bad, **kw)
    torch.cuda.synchronize()
    B, H, W, K = args
    rel = float(rel_per_query(o, reference(c)).max())                      # the run also checks what it computed
    assert rel <= 5e-3 and bad.item() == (1 if B > 1 and K >= 8 else 0), (force, args, kw, rel, bad.item())
    print(force, args, kw, "ok", bad.item(), f"max relative error {rel:.1e}")
