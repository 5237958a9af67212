"""GPU: the fused NVFP4 sparse decode attention (`attention.sparse_attention_decode`, kernels_cu/nvfp4_sparse_attn.cu)
against the float64 reference on the same NVFP4 entries, its determinism (run to run, across splits' graph replays),
the properties the reference states (no slot: zeros; NaN stays in its sequence; bad indices counted and never read),
its refusals, the torch.compile custom op, and the bf16 gather-then-attend peer."""
import pytest
import torch

from dsv4_nvfp4 import attention as A
from dsv4_nvfp4.kv import KV_DIM, NVFP4KVPool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def case(B=4, H=64, W=128, K=512, cap=4096, seed=0, q_scale=2.0):
    "A pool and one decode step: ragged windows, -1 padding and one out-of-range index, a sink, positions."
    g = torch.Generator().manual_seed(seed)
    chan = torch.exp(torch.randn(KV_DIM, generator=g) * 0.5)
    pool = NVFP4KVPool(cap).write_ref(torch.arange(cap), torch.randn(cap, KV_DIM, generator=g) * chan)
    pool.data, pool.scale, pool.global_scale = pool.data.to(DEV), pool.scale.to(DEV), pool.global_scale.to(DEV)
    q = (torch.randn(B, H, KV_DIM, generator=g) * q_scale).to(torch.bfloat16)
    win = (torch.randn(B, W, KV_DIM, generator=g) * chan).to(torch.bfloat16) if W else None
    wl = torch.randint(0, W + 1, (B,), generator=g, dtype=torch.int32) if W else None
    if W: wl[0] = W
    idx = torch.randint(0, cap, (B, K), generator=g, dtype=torch.int32)
    if K >= 8:
        idx[:, -K // 8:] = -1
        if B > 1: idx[1, 3] = cap + 5
    sink = torch.randn(H, generator=g)
    pos = torch.randint(0, 1 << 17, (B,), generator=g, dtype=torch.int32)
    to = lambda t: None if t is None else t.to(DEV)
    return dict(pool=pool, q=to(q), window=to(win), window_len=to(wl), indices=to(idx), sink=to(sink), out_pos=to(pos))


def reference(c, sink=True, pos=True):
    B = c["q"].shape[0]
    kc = c["pool"].dequantize().cpu().unsqueeze(0).expand(B, -1, -1)
    W = 0 if c["window"] is None else c["window"].shape[1]
    win = c["window"].cpu() if W else torch.zeros(B, 0, KV_DIM)
    wl = c["window_len"].cpu() if W else torch.zeros(B, dtype=torch.int32)
    return A.ref_sparse_attention(c["q"].cpu(), win, wl, kc, c["indices"].cpu(), c["sink"].cpu() if sink else None,
                                  out_pos=c["out_pos"].cpu() if pos else None)


def run(c, **kw):
    return A.sparse_attention_decode(c["q"], c["pool"], c["indices"], c["window"], c["window_len"], sink=c["sink"],
                                     out_pos=c["out_pos"], **kw)


def rel_per_query(got, want):
    return ((got.cpu().double() - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2)).clamp_min(1e-300))


@pytest.fixture(params=[16, 64, "wg"], ids=["cta16", "cta64", "wg"])
def cta(request, monkeypatch):
    """Each partial kernel whatever the batch: 16 heads per CTA, 64 (nvfp4_sparse_attn_partial64) or 64 on the warpgroup
    MMA (nvfp4_sparse_attn_wg, sm_90a only), the last two where H % 64 == 0."""
    heads = 16 if request.param == 16 else 64
    if request.param == "wg" and A.rt.device_arch() != "sm_90a": pytest.skip("nvfp4_sparse_attn_wg runs on sm_90a only")
    monkeypatch.setattr(A, "attn_heads", lambda H, B, S, smem_optin=None: heads if H % heads == 0 else A.ATTN_HEADS)
    monkeypatch.setattr(A, "attn_wg", lambda H, B, S, smem_optin=None, arch=None: request.param == "wg" and H % 64 == 0)
    return request.param


@pytest.mark.parametrize("B,H,W,K", [(4, 64, 128, 512),      # DSV4-Flash CSA step
                                     (3, 128, 128, 1024),    # DSV4-Pro CSA step
                                     (2, 64, 0, 200),        # no window (K not a multiple of the tile)
                                     (2, 64, 128, 0),        # window only (Flash's first layers)
                                     (5, 16, 37, 33),        # ragged sizes, one head tile
                                     (3, 64, 37, 100),       # a window that ends mid-tile, 64 heads
                                     (2, 128, 45, 200),      # the same, Pro's two 64-head CTAs
                                     (2, 64, 0, 40)])        # fewer slots than one 64-slot tile
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_against_float64_reference(B, H, W, K, splits, cta):
    c = case(B, H, W, K)
    bad = torch.zeros(1, dtype=torch.int32, device=DEV)
    got = run(c, bad_count=bad, splits=splits)
    rel = rel_per_query(got, reference(c))
    assert rel.max().item() <= 5e-3, f"relative error per query {rel.tolist()}"
    assert bad.item() == (1 if B > 1 and K >= 8 else 0)


def test_bit_identical_run_to_run_and_graph_replays(cta):
    c = case(8, 64, 128, 512, seed=3)
    a = run(c)
    assert all(torch.equal(a, run(c)) for _ in range(3))
    out = torch.empty_like(a)
    run(c, out=out)                                          # warm (the RoPE table is copied on first use)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        run(c, out=out)
    for seed in (3, 4):                                      # new inputs in place, then replay
        n = case(8, 64, 128, 512, seed=seed)
        for k in ("q", "window", "window_len", "indices"): c[k].copy_(n[k])
        gr.replay(); torch.cuda.synchronize()
        assert torch.equal(out, run(c)), "a graph replay differs from an eager call"
    # the split count changes the summation order, not the answer beyond rounding
    d = (run(c, splits=1).double() - run(c, splits=5).double()).norm() / run(c, splits=1).double().norm()
    assert d.item() < 2e-3


@pytest.mark.parametrize("splits", [None, 1])          # 1: every tile of a sequence in one CTA (NaN across tiles)
def test_empty_sequence_nan_and_sink(cta, splits):
    c = case(4, 64, 128, 256, seed=5)
    c["window_len"][2] = 0
    c["indices"][2] = -1                                     # sequence 2 reads nothing
    e = int(c["indices"][0, 0])
    rest = c["indices"][1:]
    rest[rest == e] = (e + 1) % c["pool"].capacity            # an entry only sequence 0 reads
    c["pool"].global_scale[e] = float("nan")
    got = run(c, splits=splits)
    assert torch.equal(got[2], torch.zeros_like(got[2])), "no valid slot: zeros"
    assert got[0].isnan().all() and not got[[1, 3]].isnan().any(), "NaN only where its entry was read"
    c["pool"].global_scale[e] = 0.01
    c["sink"] = torch.full_like(c["sink"], -1e4)
    rel = rel_per_query(run(c, splits=splits)[[0, 1, 3]], reference(c, sink=False)[[0, 1, 3]])
    assert rel.max().item() <= 5e-3, "a very negative sink is no sink"


def test_refuses_bad_input():
    c = case(2, 64, 128, 64)
    cases = [(TypeError, "q must be bfloat16", dict(q=c["q"].float())),
             (ValueError, "multiple of 16", dict(q=c["q"][:, :40].contiguous())),
             (TypeError, "indices must be int32", dict(indices=c["indices"].long())),
             (ValueError, "indices must be", dict(indices=c["indices"][:1].contiguous())),
             (ValueError, "window_len .* is needed", dict(window_len=None)),
             (TypeError, "sink must be float32", dict(sink=c["sink"].double())),
             (ValueError, "out_pos must be", dict(out_pos=c["out_pos"][:1].contiguous()))]
    for exc, msg, kw in cases:
        d = dict(c, **kw)
        with pytest.raises(exc, match=msg):
            run(d)
    with pytest.raises(ValueError, match="nothing to attend"):
        A.sparse_attention_decode(c["q"], c["pool"], c["indices"][:, :0].contiguous())
    with pytest.raises(ValueError, match="scale must be"):
        run(c, scale=float("nan"))


def test_custom_op_under_torch_compile():
    c = case(2, 64, 128, 128, seed=7)
    p = c["pool"]
    scale = KV_DIM ** -0.5

    def f(q, idx, win, wl, sink, pos):
        return torch.ops.dsv4_nvfp4.sparse_attention_decode(q, p.data, p.scale, p.global_scale, idx, win, wl, sink, pos, scale) * 2

    want = f(c["q"], c["indices"], c["window"], c["window_len"], c["sink"], c["out_pos"])
    got = torch.compile(f, fullgraph=True)(c["q"], c["indices"], c["window"], c["window_len"], c["sink"], c["out_pos"])
    assert torch.equal(want, got) and torch.equal(want, run(c) * 2)


def test_bf16_peer_path():
    "The benchmark's peer computes the same attention (bf16 scores: looser than the fused kernel's fp32 ones)."
    c = case(4, 64, 128, 512, seed=9)
    want = reference(c)
    peer = A.attend_gathered_bf16(c["q"], c["pool"], c["indices"], c["window"], c["window_len"], sink=c["sink"],
                                  out_pos=c["out_pos"])
    fused = rel_per_query(run(c), want).max().item()
    other = rel_per_query(peer, want).max().item()
    print(f"relative error per query: fused {fused:.2e}, gather + bf16 attention {other:.2e}")
    assert other < 3e-2 and fused <= 5e-3


def test_without_sink_and_rotation_ragged_lengths_and_bad_indices(cta):
    "The kernel's no-sink and no-rotation paths; window lengths below 0 and above W clamp; an index below -1 is counted."
    c = case(4, 64, 128, 256, seed=11)
    c["window_len"][1], c["window_len"][2] = -3, 128 + 50
    c["indices"][0, 5] = -7
    bad = torch.zeros(1, dtype=torch.int32, device=DEV)
    got = A.sparse_attention_decode(c["q"], c["pool"], c["indices"], c["window"], c["window_len"], bad_count=bad)
    rel = rel_per_query(got, reference(c, sink=False, pos=False))
    assert rel.max().item() <= 5e-3, f"relative error per query {rel.tolist()}"
    assert bad.item() == 2                                   # -7 and the out-of-range slot of case()


def test_bf16_peer_edge_cases():
    "The peer keeps the fused op's promises too: no slot gives zeros, a NaN stays in the sequence that read it."
    c = case(3, 64, 128, 128, seed=13)
    c["window_len"][2] = 0
    c["indices"][2] = -1
    e = int(c["indices"][0, 0])
    rest = c["indices"][1:]
    rest[rest == e] = (e + 1) % c["pool"].capacity
    c["pool"].global_scale[e] = float("nan")
    for sink in (None, c["sink"]):
        peer = A.attend_gathered_bf16(c["q"], c["pool"], c["indices"], c["window"], c["window_len"], sink=sink)
        assert torch.equal(peer[2], torch.zeros_like(peer[2]))
        assert peer[0].isnan().all() and not peer[1].isnan().any()


def test_refuses_a_rope_it_does_not_rotate_and_host_tensors():
    from dsv4_nvfp4.kv import RopeConfig
    c = case(2, 64, 128, 64)
    with pytest.raises(ValueError, match="rope.dim"):
        run(c, rope=RopeConfig(dim=32))
    with pytest.raises(ValueError, match="CUDA tensor"):
        run(dict(c, indices=c["indices"].cpu()))
