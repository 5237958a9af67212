"""Expert parallelism on the CPU (gloo, 2 and 4 processes): the dispatch / combine of `EPMoE` against the single-process
layer on the concatenated batch, bit for bit, for both payloads, ragged and skewed routing, an empty rank, T = 1,
and the fixed shapes of `CapturedEP` (a capacity that overflows: NaN for exactly the tokens that lost a slot, the others
exact)."""
import io
import os
import queue
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4_nvfp4 import moe as M

CFG = M.MoEConfig(hidden=256, inter=128, num_experts=8, top_k=3, routed_scaling_factor=1.5)
TOKENS = {2: [5, 1], 4: [7, 0, 9, 1]}          # ragged, an empty rank, a single token
MAX_T, SMALL_CAP = 10, 4                        # `CapturedEP`'s fixed shapes: tokens per rank, and a capacity that overflows


def batches(W):
    g = torch.Generator().manual_seed(W)
    return [(torch.randn(T, CFG.hidden, generator=g) * 0.5).to(torch.bfloat16) for T in TOKENS[W]]


def skewed(W, k=CFG.top_k):
    "A given routing where rank 0 owns two of every token's three experts: one rank gets most of the rows."
    out, g = [], torch.Generator().manual_seed(100 + W)
    per = CFG.num_experts // W
    for T in TOKENS[W]:
        rows = []
        for _ in range(T):
            a = torch.randperm(per, generator=g)[:2].tolist()
            rows.append(a + [e for e in torch.randperm(CFG.num_experts, generator=g).tolist() if e not in a][: k - 2])
        w = torch.rand(T, k, generator=g) + 0.1
        out.append((w / w.sum(1, keepdim=True) * 1.5, torch.tensor(rows, dtype=torch.int32).reshape(T, k)))
    return out


def _worker(rank, W, path, q):
    from dsv4_nvfp4.ep.layer import EPMoE
    from dsv4_nvfp4.ep.capture import CapturedEP
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=W)
    try:
        res = {}
        xs, rt = batches(W), skewed(W)
        for act, payload in (("w4a16", "bf16"), ("w4a4", "bf16"), ("w4a4", "nvfp4")):
            ep = EPMoE(M.DSV4MoE.synthetic(CFG, seed=3, act=act), payload=payload)
            res[(act, payload)] = ep(xs[rank])
            res[(act, payload, "skewed")] = ep.forward_routed(xs[rank], *rt[rank])
            res[(act, payload, "fixed")] = CapturedEP(ep, MAX_T)(xs[rank]).clone()      # fixed shapes, no host read
            res[(act, payload, "fixed skewed")] = CapturedEP(ep, MAX_T, given=True)(xs[rank], *rt[rank]).clone()
        ep = EPMoE(M.DSV4MoE.synthetic(CFG, seed=3, act="w4a4"), payload="nvfp4")
        small = CapturedEP(ep, MAX_T, capacity=SMALL_CAP, given=True)                 # the skewed routing overflows it
        res["small"], res["small dropped"] = small(xs[rank], *rt[rank]).clone(), small.dropped
        try: small.check(); res["small check"] = "no error"
        except ValueError as e: res["small check"] = str(e)
        bad_ids = rt[rank][1].clone()                                                 # bad given ids: those tokens NaN
        if bad_ids.shape[0]: bad_ids[0, 0] = CFG.num_experts if rank % 2 == 0 else -1  # out of range
        if bad_ids.shape[0] > 1: bad_ids[1, 1] = bad_ids[1, 0]                         # repeated in a row
        res["given bad"] = CapturedEP(ep, MAX_T, given=True)(xs[rank], rt[rank][0], bad_ids).clone()
        try: CapturedEP(ep, MAX_T + rank); res["mismatch"] = "no error"              # ranks disagree: every rank raises
        except ValueError as e: res["mismatch"] = str(e)
        try: CapturedEP(ep, MAX_T, capacity=SMALL_CAP + rank); res["mismatch cap"] = "no error"
        except ValueError as e: res["mismatch cap"] = str(e)
        lay = M.DSV4MoE.synthetic(CFG, seed=3)
        try: EPMoE(lay, payload="nvfp4")
        except ValueError as e: res["nvfp4-w4a16"] = str(e)
        ep = EPMoE(lay)
        w1, ids1 = rt[rank][0][:1], rt[rank][1][:1].clone()
        if rank == W - 1: ids1[0, 0] = CFG.num_experts            # one rank has a bad id: every rank raises (none hangs)
        try: ep.forward_routed(xs[rank][:1], w1, ids1); res["bad"] = "no error"
        except ValueError as e: res["bad"] = str(e)
        buf = io.BytesIO(); torch.save(res, buf)
        q.put((rank, buf.getvalue()))      # plain bytes: tensors in a Queue travel as fds, gone once the worker exits
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _lost(W, rt, cap):
    "Which tokens lose a routed slot to a capacity of `cap` per (source, destination), and how many slots are lost."
    per, lost, n = CFG.num_experts // W, [], 0
    for r in range(W):
        ids = rt[r][1].long()
        key = ids // per                                                                   # the destination of each slot
        hit = key.reshape(-1)[None] == torch.arange(W)[:, None]                            # one row per destination
        pos = (hit.cumsum(1) - 1).gather(0, key.reshape(1, -1)).view_as(key)               # each slot's place in its bucket
        lost.append((pos >= cap).any(1)); n += int((pos >= cap).sum())
    return torch.cat(lost), n


@pytest.mark.parametrize("W", [2, 4])
def test_ep_layer_equals_the_single_process_layer(W):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        ps = [ctx.Process(target=_worker, args=(r, W, os.path.join(d, "store"), q)) for r in range(W)]
        for p in ps: p.start()
        got, t0 = {}, time.monotonic()
        while len(got) < W:                     # a worker that dies fails the test now (the others would wait in a collective)
            try: r, b = q.get(timeout=2); got[r] = torch.load(io.BytesIO(b)); continue
            except queue.Empty: pass
            dead = [p.exitcode for p in ps if p.exitcode not in (None, 0)]
            if dead or time.monotonic() - t0 > 600:
                for p in ps: p.kill()
                pytest.fail(f"gloo workers: exit codes {[p.exitcode for p in ps]} (a worker raised: its traceback is above), or over 600 s")
        for p in ps: p.join(timeout=60)
    assert all(p.exitcode == 0 for p in ps)
    x, rt = torch.cat(batches(W)), skewed(W)
    w, ids = torch.cat([r[0] for r in rt]), torch.cat([r[1] for r in rt])
    for act, payload in (("w4a16", "bf16"), ("w4a4", "bf16"), ("w4a4", "nvfp4")):
        lay = M.DSV4MoE.synthetic(CFG, seed=3, act=act)
        ep = torch.cat([got[r][(act, payload)] for r in range(W)])
        assert torch.equal(ep, lay(x)), f"{act} {payload}: {(ep != lay(x)).sum().item()} values differ"
        sk = torch.cat([got[r][(act, payload, "skewed")] for r in range(W)])
        assert torch.equal(sk, lay.forward_routed(x, w, ids)), f"{act} {payload} skewed routing"
        fx = torch.cat([got[r][(act, payload, "fixed")] for r in range(W)])
        assert torch.equal(fx, lay(x)), f"{act} {payload} fixed shapes"
        fx = torch.cat([got[r][(act, payload, "fixed skewed")] for r in range(W)])
        assert torch.equal(fx, lay.forward_routed(x, w, ids)), f"{act} {payload} fixed shapes, skewed routing"
    # the small capacity: a slot fits when it is among the first SMALL_CAP its source rank sends to its destination
    # (in token order); a token with a slot that does not is NaN, every other token exact
    lay = M.DSV4MoE.synthetic(CFG, seed=3, act="w4a4")
    want = lay.forward_routed(x, w, ids)
    for key, cap in (("small", SMALL_CAP),):
        lost, n_lost = _lost(W, rt, cap)
        assert lost.any() and not lost.all(), f"{key}: the test's capacity must drop some tokens and keep others"
        small = torch.cat([got[r][key] for r in range(W)])
        assert torch.isnan(small).all(1).equal(lost) and not torch.isnan(small[~lost]).any(), key
        assert torch.equal(small[~lost], want[~lost]), key
        assert sum(got[r][key + " dropped"] for r in range(W)) == n_lost, key
    bad = torch.cat([torch.arange(T) < 2 for T in TOKENS[W]])                  # each rank's first two tokens (where it has them)
    gb = torch.cat([got[r]["given bad"] for r in range(W)])
    assert torch.isnan(gb).all(1).equal(bad) and torch.equal(gb[~bad], want[~bad]), "bad given ids: NaN for exactly those tokens"
    assert all(("did not fit the capacity 4" in got[r]["small check"]) == bool(got[r]["small dropped"]) for r in range(W))
    assert all("every rank must capture the same" in got[r]["mismatch"] for r in range(W))
    assert all("every rank must capture the same" in got[r]["mismatch cap"] for r in range(W))   # no rank left waiting
    assert "act='w4a4'" in got[0]["nvfp4-w4a16"]
    assert all("expert ids must be in [0, 8)" in got[r]["bad"] for r in range(W)), [got[r]["bad"] for r in range(W)]


def test_partition_and_payload_bytes():
    from dsv4_nvfp4.ep.transport import ep_experts, payload_bytes
    assert [list(ep_experts(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="evenly"): ep_experts(10, 4, 0)
    b = payload_bytes(7168)
    assert b["bf16"] / b["nvfp4"] >= 3.5 and b["nvfp4"] == 7168 // 2 + 7168 // 16 + 8


def test_the_schedule_is_a_size_rule():
    "One schedule per (payload, size): NCCL's kernels below 128 tokens per rank, the copy engines from 128 (both payloads); the shared expert split from 2048."
    from dsv4_nvfp4.ep.capture import SCHEDULE_CE_MIN_T, SCHEDULE_LARGE_T, capture_schedule
    for T in (1, 4, SCHEDULE_CE_MIN_T - 1):
        assert capture_schedule("bf16", T, 2, True) == (False, 0.0) and capture_schedule("nvfp4", T, 2, True) == (False, 0.0)
    for T in (SCHEDULE_CE_MIN_T, SCHEDULE_LARGE_T - 1):
        assert capture_schedule("bf16", T, 2, True) == (True, 0.0) and capture_schedule("nvfp4", T, 2, True) == (True, 0.0)
    for T in (SCHEDULE_LARGE_T, 8192):
        assert capture_schedule("bf16", T, 2, True) == (True, 0.5) and capture_schedule("nvfp4", T, 2, True) == (True, 0.75)
    assert not capture_schedule("nvfp4", 8192, 1, True).copy_engines and not capture_schedule("nvfp4", 8192, 2, False).copy_engines
