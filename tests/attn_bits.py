"""Dump the fused decode attention's outputs on fixed inputs, or compare two dumps bit for bit: a kernel change that
keeps the arithmetic must keep every bit. Run it under two trees (PYTHONPATH) on the same GPU:

    PYTHONPATH=<base tree> python tests/attn_bits.py base.pt
    PYTHONPATH=<this tree> python tests/attn_bits.py new.pt
    python tests/attn_bits.py --compare base.pt new.pt

The cases: the benchmark's problems at 32K context and 1, 8, 64, 128 sequences with the plan's kernel and split, and
the same with one split and with 3 splits; at 8 and 64 sequences also a ragged step (`ragged`: short and empty
windows, -1 pads, indices outside the pool, a partial last tile, a sequence with no valid slot, a NaN entry)."""
import sys
import torch

if sys.argv[1] == "--compare":
    a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
    bad = [k for k in a if not torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))]   # NaN bits included
    print(f"{len(a) - len(bad)} of {len(a)} cases bit-identical" + (f"; differ: {bad}" if bad else ""))
    sys.exit(1 if bad or a.keys() != b.keys() else 0)

from dsv4_nvfp4 import attention as A
from dsv4_nvfp4.bench.attn import ATTN_PROBLEMS, attn_inputs

def ragged(a, seed=1):
    "The same step with what the benchmark never has: short and empty windows, -1 pads and indices outside the pool, a top-k list that is no multiple of 64 slots, a sequence with nothing valid, a NaN entry (its scale byte) some sequences select."
    dev = a["q"].device
    g = torch.Generator(device=dev).manual_seed(seed)
    B, cap = a["q"].shape[0], a["pool"].capacity
    nan_entry = int(a["indices"][-1, 3])
    idx = a["indices"][:, : max(a["indices"].shape[1] - 37, 1)].clone()
    r = torch.rand(idx.shape, device=dev, generator=g)
    idx[r < 0.1] = -1
    idx[(r >= 0.1) & (r < 0.12)] = cap + 5
    idx[(r >= 0.12) & (r < 0.13)] = -7
    wl = torch.randint(0, a["window"].shape[1] + 1, (B,), device=dev, generator=g, dtype=torch.int32)
    wl[0] = 0; idx[0] = -1                                             # sequence 0: no valid slot
    idx[-1, 3] = nan_entry                                             # the last sequence selects the NaN entry
    a["pool"].scale[nan_entry, 5] = float("nan")
    return dict(a, indices=idx, window_len=wl)


out = {}
for name, H, K, ratio in ATTN_PROBLEMS:
    for B in (1, 8, 64, 128):
        a = attn_inputs(B, H, K, ratio, 32768); a.pop("kv_bytes"); a.pop("flops")
        for splits in (None, 1, 3):
            out[f"{name} B={B} splits={splits}"] = A.sparse_attention_decode(**a, splits=splits).cpu()
        if B in (8, 64):
            r = ragged(a)
            for splits in (None, 1, 3):
                out[f"{name} B={B} ragged splits={splits}"] = A.sparse_attention_decode(**r, splits=splits).cpu()
        del a; torch.cuda.empty_cache()
torch.save(out, sys.argv[1])
print(len(out), "cases ->", sys.argv[1])
