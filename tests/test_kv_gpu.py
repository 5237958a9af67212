"""GPU: the fused KV compressor (kernels_cu/nvfp4_kv_compress.cu) against the float64 reference (dsv4_nvfp4.kv):
pool bytes equal quantize_nvfp4 of the kernel's own fp32 entry, entries close to float64 (cosine reported), prefill
and token-by-token decode fill identical pools and states, slots skipped or counted, NaN confined, graph replay."""
import math

import pytest
import torch

from dsv4_nvfp4 import kv as K
from dsv4_nvfp4.quantize_cuda import quantize_nvfp4
from dsv4_nvfp4.quant import ref_quantize_nvfp4

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def projections(ratio, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    coff, T = K.coff_of(ratio), sum(lens)
    kv = torch.randn(T, coff * 512, generator=g)
    sc = 2 * torch.randn(T, coff * 512, generator=g)
    ape = 0.5 * torch.randn(ratio, coff * 512, generator=g)
    w = torch.rand(512, generator=g) + 0.5
    return kv, sc, ape, w


def prefill(ratio, lens, seed=0, slots=None, state=False, bad=None, split=None):
    kv, sc, ape, w = projections(ratio, lens, seed)
    cu = [0]
    for n in lens: cu.append(cu[-1] + n)
    n_ent = sum(n // ratio for n in lens)
    pool = K.NVFP4KVPool(max(n_ent, 1) + 3, device=DEV)
    sl = torch.arange(n_ent, dtype=torch.int32, device=DEV) if slots is None else slots.to(DEV)
    dbg = torch.empty(n_ent, 512, device=DEV)
    st = K.compress_state(len(lens), ratio, device=DEV, split=split) if state else None
    K.compress_prefill(kv.to(DEV), sc.to(DEV), cu, ape.to(DEV), w.to(DEV), ratio, pool, sl, state=st, bad=bad, debug_entries=dbg, split=split)
    return (kv, sc, ape, w, cu), pool, dbg, st


def same_pool(a, b, rows=None):
    rows = slice(None) if rows is None else rows
    return (torch.equal(a.data[rows], b.data[rows]) and torch.equal(a.scale[rows].view(torch.uint8), b.scale[rows].view(torch.uint8))
            and torch.equal(a.global_scale[rows], b.global_scale[rows]))


@pytest.mark.parametrize("ratio,lens,split", [(4, [13, 4, 9, 3], None), (128, [300, 128, 5, 257], None), (128, [300, 128, 5, 257], 1),
                                              (8, [40], 2), (128, [300, 128, 5, 257], 8), (4, [13, 4, 9, 3], 2),
                                              (4, [13, 4, 9, 3], 4)])
def test_prefill_against_reference(ratio, lens, split, capsys):
    (kv, sc, ape, w, cu), pool, dbg, _ = prefill(ratio, lens, split=split)
    want = torch.cat([K.ref_compress_kv(kv[a:b], sc[a:b], ape, w, ratio)[0] for a, b in zip(cu, cu[1:])])
    got = dbg.cpu().double()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=1)
    assert cos.min().item() > 0.99999, "the fp32 entry vs float64"
    # the pool is quantize_nvfp4 of the kernel's own fp32 entry, bit for bit
    q = quantize_nvfp4(dbg, per_row=True)
    n = dbg.shape[0]
    assert torch.equal(pool.data[:n], q.data) and torch.equal(pool.scale[:n].view(torch.uint8), q.scale.view(torch.uint8))
    assert torch.equal(pool.global_scale[:n], q.global_scale.reshape(-1))
    # against the reference's own quantization of its (float64 -> fp32) entries: equal except near rounding boundaries
    # a 16-block differs when one of its values (or its amax) sits within the fp32-vs-float64 error of a rounding
    # boundary: counted in blocks (one such block can change up to 8 code bytes), reported, and rare
    r = ref_quantize_nvfp4(want.float(), per_row=True)
    blocks = ((pool.data[:n].cpu().view(n, 32, 8) != r.data.view(n, 32, 8)).any(-1)
              | (pool.scale[:n].cpu().view(torch.uint8) != r.scale.view(torch.uint8))).sum().item()
    deq = pool.dequantize(torch.arange(n)).cpu().double()
    cq = torch.nn.functional.cosine_similarity(deq, want, dim=1)
    with capsys.disabled():
        print(f"\nratio {ratio} split {split or K.kv_split(ratio)}: {n} entries; fp32 entry cosine >= {cos.min().item():.7f}; 16-blocks differing from the fp32 "
              f"reference's quantization {blocks} of {n * 32}; NVFP4 entry cosine {cq.min().item():.5f} .. {cq.max().item():.5f}")
    assert blocks <= max(2, n * 32 // 100)


@pytest.mark.parametrize("ratio,lens", [(4, [13, 4, 9, 3]), (128, [300, 128, 5, 257])])
def test_unroll_changes_no_bit(monkeypatch, ratio, lens):
    "KV_UNROLL (loads issued ahead) changes the schedule, not the pooling order: the same entries, bit for bit."
    _, pool, dbg, st = prefill(ratio, lens, seed=7, state=True)
    for u in (1, 4, 8):
        monkeypatch.setitem(K.KV_UNROLL, ratio, u)
        _, pool_u, dbg_u, st_u = prefill(ratio, lens, seed=7, state=True)
        assert torch.equal(dbg_u, dbg) and same_pool(pool_u, pool), f"KV_UNROLL {u}"
        assert torch.equal(st_u.chains, st.chains)


@pytest.mark.parametrize("unroll,split", [(None, None), (1, None), (8, None), (None, 1), (None, 2), (None, "max")])
@pytest.mark.parametrize("ratio,lens", [(4, [13, 4, 9, 3, 0, 8]), (128, [300, 5, 257, 128, 0, 256])])
def test_prefill_equals_token_by_token_decode(monkeypatch, ratio, lens, unroll, split):
    "The decode's running softmaxes give the prefill's entries and state, bit for bit, for every split (4 for CSA, 8 for HCA)."
    if unroll is not None: monkeypatch.setitem(K.KV_UNROLL, ratio, unroll)
    if split == "max": split = 4 if ratio == 4 else 8
    (kv, sc, ape, w, cu), pool, dbg, st = prefill(ratio, lens, seed=1, state=True, split=split)
    B, coff = len(lens), K.coff_of(ratio)
    dec = K.NVFP4KVPool(pool.capacity, device=DEV)
    ds = K.compress_state(B, ratio, device=DEV, split=split)
    ent0 = [sum(n // ratio for n in lens[:b]) for b in range(B)]
    ddbg = torch.zeros(dbg.shape[0], 512, device=DEV)
    kvd, scd, aped, wd = kv.to(DEV), sc.to(DEV), ape.to(DEV), w.to(DEV)
    for t in range(max(lens)):
        rows = torch.tensor([cu[b] + min(t, lens[b] - 1) for b in range(B)])
        pos = torch.tensor([t if t < lens[b] else -1 for b in range(B)], device=DEV)
        slots = torch.tensor([ent0[b] + t // ratio if t < lens[b] else -1 for b in range(B)], dtype=torch.int32, device=DEV)
        one = torch.empty(B, 512, device=DEV)
        K.compress_decode(kvd[rows.to(DEV)], scd[rows.to(DEV)], pos, aped, wd, ratio, dec, slots, ds, debug_entries=one, split=split)
        for b in range(B):
            if t < lens[b] and t % ratio == ratio - 1: ddbg[ent0[b] + t // ratio] = one[b]
    assert torch.equal(ddbg, dbg), "the same fp32 entries"
    assert same_pool(dec, pool)
    assert torch.equal(ds.chains, st.chains), "the prefill leaves the state the decode reaches"


def test_decode_continues_a_prefill_and_replays_in_a_graph():
    ratio, L, extra = 4, 10, 9
    kv, sc, ape, w = projections(ratio, [L + extra], seed=2)
    full = K.NVFP4KVPool(8, device=DEV)
    K.compress_prefill(kv.to(DEV), sc.to(DEV), [0, L + extra], ape.to(DEV), w.to(DEV), ratio, full, torch.arange(4, dtype=torch.int32, device=DEV))
    pool = K.NVFP4KVPool(8, device=DEV)
    st = K.compress_state(1, ratio, device=DEV)
    K.compress_prefill(kv[:L].to(DEV), sc[:L].to(DEV), [0, L], ape.to(DEV), w.to(DEV), ratio, pool, torch.arange(2, dtype=torch.int32, device=DEV), state=st)
    x_kv, x_sc = torch.zeros(1, 1024, device=DEV), torch.zeros(1, 1024, device=DEV)
    pos, slot = torch.full((1,), -1, dtype=torch.int64, device=DEV), torch.zeros(1, dtype=torch.int32, device=DEV)
    apd, wd = ape.to(DEV), w.to(DEV)
    step = lambda: K.compress_decode(x_kv, x_sc, pos, apd, wd, ratio, pool, slot, st)
    step()                                                                   # position -1: loads the kernel, changes nothing
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
    torch.cuda.current_stream().wait_stream(s)
    for t in range(L, L + extra):                                            # new inputs, positions and slots each replay
        x_kv.copy_(kv[t:t + 1]); x_sc.copy_(sc[t:t + 1]); pos.fill_(t); slot.fill_(t // ratio)
        g.replay()
    torch.cuda.synchronize()
    end = K.compress_state(1, ratio, device=DEV)                             # the state a prefill of everything leaves
    K.compress_prefill(kv.to(DEV), sc.to(DEV), [0, L + extra], ape.to(DEV), w.to(DEV), ratio, K.NVFP4KVPool(8, device=DEV),
                       torch.arange(4, dtype=torch.int32, device=DEV), state=end)
    assert torch.equal(st.chains, end.chains)
    assert same_pool(pool, full, slice(0, (L + extra) // ratio))


def test_slots_skip_and_bad_slots_are_counted_never_written():
    bad = torch.zeros(1, dtype=torch.int32, device=DEV)
    slots = torch.tensor([0, -1, 7, 2], dtype=torch.int32)                   # capacity 4 + 3 = 7: slot 7 is out of range
    (_, _, _, _, _), pool, dbg, _ = prefill(4, [16], seed=3, slots=slots, bad=bad)
    assert bad.item() == 1
    q = quantize_nvfp4(dbg, per_row=True)
    assert torch.equal(pool.data[0], q.data[0]) and torch.equal(pool.data[2], q.data[3])
    untouched = [1, 3, 4, 5, 6]
    assert (pool.data[untouched] == 0).all() and (pool.global_scale[untouched] == 1).all()


@pytest.mark.parametrize("where", ["kv", "score"])
def test_nan_in_a_projection_is_confined_to_its_entry(where):
    ratio = 4
    kv, sc, ape, w = projections(ratio, [16], seed=4)
    (kv if where == "kv" else sc)[9, 700] = float("nan")                     # window 2, the current half
    pool = K.NVFP4KVPool(4, device=DEV)
    K.compress_prefill(kv.to(DEV), sc.to(DEV), [0, 16], ape.to(DEV), w.to(DEV), ratio, pool, torch.arange(4, dtype=torch.int32, device=DEV))
    clean = K.NVFP4KVPool(4, device=DEV)
    kv2, sc2 = kv.clone(), sc.clone(); kv2[9, 700] = sc2[9, 700] = 0.0
    K.compress_prefill(kv2.to(DEV), sc2.to(DEV), [0, 16], ape.to(DEV), w.to(DEV), ratio, clean, torch.arange(4, dtype=torch.int32, device=DEV))
    d = pool.dequantize(torch.arange(4)).cpu()
    assert d[2].isnan().all() and not d[[0, 1, 3]].isnan().any()
    assert same_pool(pool, clean, [0, 1, 3])


def test_gathers_equal_the_reference_and_count_bad_indices():
    from dsv4_nvfp4 import gather as G
    (_, _, _, _, _), pool, _, _ = prefill(4, [64, 40], seed=5)                  # 26 entries in a pool of 29
    cap = pool.capacity
    idx = torch.tensor([[0, 5, -1, 25], [3, cap, -7, 12]], dtype=torch.int32)   # two out of range, one -1
    bad = torch.zeros(1, dtype=torch.int32, device=DEV)
    got = G.gather_kv_topk(pool, idx.to(DEV), bad_count=bad)
    want = G.ref_gather_kv(pool, idx)
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16)), "bit for bit"
    assert bad.item() == 2 and not got[0, 2].any() and not got[1, 1].any()
    big = torch.zeros(20, 3 * 512, dtype=torch.bfloat16, device=DEV)            # rows of a wider buffer: strided
    G.gather_kv_dense(pool, 4, 20, out=big[:, 512:1024])
    assert torch.equal(big[:, 512:1024].cpu().view(torch.int16), G.ref_gather_kv(pool, torch.arange(4, 24)).view(torch.int16))
    assert not big[:, :512].any() and not big[:, 1024:].any()
    with pytest.raises(ValueError):
        G.gather_kv_dense(pool, cap - 2, 5)


def test_decode_skips_and_counts_bad_slots():
    ratio, B = 4, 3
    kv, sc, ape, w = projections(ratio, [4 * B], seed=6)
    pool, st = K.NVFP4KVPool(2, device=DEV), K.compress_state(B, ratio, device=DEV)
    bad = torch.zeros(1, dtype=torch.int32, device=DEV)
    slots = torch.tensor([1, -1, 2], dtype=torch.int32, device=DEV)          # 2 is outside the pool of 2
    for t in range(ratio):                                                   # three sequences close window 0 at t = 3
        rows = torch.tensor([4 * b + t for b in range(B)])
        K.compress_decode(kv[rows].to(DEV), sc[rows].to(DEV), torch.full((B,), t, device=DEV), ape.to(DEV), w.to(DEV), ratio,
                          pool, slots, st, bad=bad)
    assert bad.item() == 1
    assert (pool.data[0] == 0).all() and pool.global_scale[0].item() == 1.0 and (pool.data[1] != 0).any()
    with pytest.raises(ValueError, match="at least one"):
        K.compress_decode(kv[:B].to(DEV), sc[:B].to(DEV), torch.zeros(B, dtype=torch.int64, device=DEV), ape.to(DEV), w.to(DEV), ratio,
                          pool, slots, st, bad=torch.zeros(0, dtype=torch.int32, device=DEV))
