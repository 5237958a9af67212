"""Dump the fused decode attention's outputs on fixed inputs, or compare two dumps bit for bit: a kernel change that
keeps the arithmetic must keep every bit. Run it under two trees (PYTHONPATH) on the same GPU:

    PYTHONPATH=<base tree> python tests/attn_bits.py base.pt
    PYTHONPATH=<this tree> python tests/attn_bits.py new.pt
    python tests/attn_bits.py --compare base.pt new.pt

The cases: the benchmark's problems at 32K context and 1, 8, 64, 128 sequences with the plan's kernel and split, and
the same with one split and with 3 splits."""
import sys
import torch

if sys.argv[1] == "--compare":
    a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
    bad = [k for k in a if not torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))]
    print(f"{len(a) - len(bad)} of {len(a)} cases bit-identical" + (f"; differ: {bad}" if bad else ""))
    sys.exit(1 if bad or a.keys() != b.keys() else 0)

from dsv4_nvfp4 import attention as A
from dsv4_nvfp4.bench.attn import ATTN_PROBLEMS, attn_inputs

out = {}
for name, H, K, ratio in ATTN_PROBLEMS:
    for B in (1, 8, 64, 128):
        a = attn_inputs(B, H, K, ratio, 32768); a.pop("kv_bytes"); a.pop("flops")
        for splits in (None, 1, 3):
            out[f"{name} B={B} splits={splits}"] = A.sparse_attention_decode(**a, splits=splits).cpu()
        del a; torch.cuda.empty_cache()
torch.save(out, sys.argv[1])
print(len(out), "cases ->", sys.argv[1])
