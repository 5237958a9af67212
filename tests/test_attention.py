"""dsv4_nvfp4.attention: the float64 decode attention against an independent rendering of DeepSeek-V4's reference
structure (inference/model.py: one cache of window slots then compressed entries, the window's and the compressed
indices concatenated, -1 masked to -inf with a zero row, the sink added to the exponent sum, the output's RoPE dims
rotated back by the conjugate angle), on small shapes. CPU only."""
import math

import pytest
import torch

from dsv4_nvfp4 import attention as A
from dsv4_nvfp4.kv import CSA_RATIO, DSV4_ROPE, HCA_RATIO, KV_DIM, rope_freqs


def structured(q, kv_window, window_len, kv_comp, comp_idx, sink, scale, pos):
    "The reference's layout, vectorized: cache = [window | compressed], idx = [window idx (-1 pad) | comp idx + W]."
    B, H, D = q.shape
    W, Nc = kv_window.shape[1], kv_comp.shape[1]
    cache = torch.cat([kv_window, kv_comp], 1).double()                       # (B, W + Nc, D)
    win = torch.arange(W).expand(B, W)
    win = torch.where(win < window_len.view(B, 1), win, torch.full_like(win, -1))
    comp = torch.where((comp_idx >= 0) & (comp_idx < Nc), comp_idx + W, torch.full_like(comp_idx, -1))
    idx = torch.cat([win, comp], 1)                                           # (B, S)
    rows = cache[torch.arange(B).view(B, 1), idx.clamp(min=0)]                 # (B, S, D)
    rows = torch.where((idx >= 0).unsqueeze(-1), rows, torch.zeros_like(rows))
    s = torch.einsum("bhd,bsd->bhs", q.double(), rows) * scale
    s = torch.where((idx >= 0).view(B, 1, -1), s, torch.full_like(s, -math.inf))
    m = torch.maximum(s.amax(-1), sink.double().view(1, H))                   # the sink joins the running max
    e = torch.exp(s - m.unsqueeze(-1))
    o = torch.einsum("bhs,bsd->bhd", e, rows) / (e.sum(-1) + torch.exp(sink.double().view(1, H) - m)).unsqueeze(-1)
    d = DSV4_ROPE.dim
    z = torch.view_as_complex(o[..., -d:].reshape(B, H, -1, 2).contiguous())
    f = torch.polar(torch.ones(B, d // 2, dtype=torch.float64), pos.double().view(B, 1) * rope_freqs())   # freqs_cis
    o = torch.cat([o[..., :-d], torch.view_as_real(z * f.conj().view(B, 1, -1)).flatten(-2)], -1)
    return o


@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_the_reference_structure(seed):
    g = torch.Generator().manual_seed(seed)
    B, H, W, Nc, k = 3, 8, 16, 24, 6
    q = torch.randn(B, H, KV_DIM, generator=g) * 0.2
    kw, kc = torch.randn(B, W, KV_DIM, generator=g), torch.randn(B, Nc, KV_DIM, generator=g)
    wl = torch.randint(1, W + 1, (B,), generator=g)
    idx = torch.randint(-1, Nc + 3, (B, k), generator=g)                     # -1 and out-of-range entries included
    sink = torch.randn(H, generator=g)
    pos = torch.randint(0, 1 << 17, (B,), generator=g)
    got = A.ref_sparse_attention(q, kw, wl, kc, idx, sink, out_pos=pos)
    want = structured(q, kw, wl, kc, idx, sink, KV_DIM ** -0.5, pos)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_edge_cases():
    g = torch.Generator().manual_seed(9)
    B, H, W, Nc = 2, 4, 8, 10
    q = torch.randn(B, H, KV_DIM, generator=g) * 0.2
    kw, kc = torch.randn(B, W, KV_DIM, generator=g), torch.randn(B, Nc, KV_DIM, generator=g)
    sink = torch.randn(H, generator=g)
    # no valid slot: zeros (window empty, every index -1 or out of range)
    o = A.ref_sparse_attention(q, kw, torch.tensor([0, 0]), kc, torch.tensor([[-1, 10], [-5, 99]]), sink)
    assert torch.equal(o, torch.zeros_like(o))
    # one slot and no sink: the output is that slot exactly (softmax of one score)
    o = A.ref_sparse_attention(q, kw, torch.tensor([1, 0]), kc, torch.tensor([[-1], [4]]))
    assert torch.allclose(o[0], kw[0, 0].double().expand(H, -1)) and torch.allclose(o[1], kc[1, 4].double().expand(H, -1))
    # a NaN slot poisons exactly the queries that read it
    kc2 = kc.clone(); kc2[1, 4, 0] = float("nan")
    o = A.ref_sparse_attention(q, kw, torch.tensor([3, 3]), kc2, torch.tensor([[4, 5], [4, 5]]), sink)
    assert o[1].isnan().all() and not o[0].isnan().any()
    # the sink only shrinks the weights: a large sink drives the output to zero
    o = A.ref_sparse_attention(q, kw, torch.tensor([3, 3]), kc, torch.tensor([[4, 5], [4, 5]]), torch.full((H,), 1e3))
    assert o.abs().max() < 1e-100


def test_slot_counts():
    assert A.window_slots(0) == [0] and A.window_slots(200)[0] == 73 and len(A.window_slots(200)) == A.WINDOW
    assert [A.compressed_count(p, CSA_RATIO) for p in range(9)] == [0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert A.compressed_count(255, HCA_RATIO) == 2 and A.compressed_count(254, HCA_RATIO) == 1


def test_negative_window_length_reads_no_window_rows():
    "window_len < 0 means no window rows (as the kernel clamps it), not Python's slice from the end."
    g = torch.Generator().manual_seed(4)
    q, kw, kc = torch.randn(1, 2, KV_DIM, generator=g), torch.randn(1, 8, KV_DIM, generator=g), torch.randn(1, 5, KV_DIM, generator=g)
    idx = torch.tensor([[0, 3]])
    neg = A.ref_sparse_attention(q, kw, torch.tensor([-3]), kc, idx)
    assert torch.equal(neg, A.ref_sparse_attention(q, kw, torch.tensor([0]), kc, idx))
    assert torch.equal(A.ref_sparse_attention(q, kw, torch.tensor([-3]), kc, torch.tensor([[-1, -1]])), torch.zeros(1, 2, KV_DIM, dtype=torch.float64))


def test_kernel_choice():
    """The 64-head CTA where H % 64 == 0 and its work, B H / 64 CTAs x ceil(S / 32) tiles, is at least
    ATTN64_MIN_TILES; 16 heads elsewhere (the crossover measured in 07b: 16 Flash CSA sequences of 640 slots)."""
    assert A.ATTN64_MIN_TILES == 320 and A.ATTN64_HEADS == 64 and A.ATTN_TILE == 32
    assert A.attn_heads(64, 16, 640) == 64 and A.attn_heads(64, 15, 640) == 16        # Flash CSA: 320 and 300 tiles
    assert A.attn_heads(128, 5, 1152) == 64 and A.attn_heads(128, 4, 1152) == 16      # Pro CSA: 360 and 288 tiles
    assert A.attn_heads(64, 32, 384) == 64 and A.attn_heads(64, 16, 384) == 16        # Flash HCA at 32K: 384 and 192
    assert A.attn_heads(64, 1, 10 ** 5) == 64 and A.attn_heads(64, 1, 10208) == 16    # one long sequence: 3125 and 319
    assert A.attn_heads(48, 4096, 640) == 16 and A.attn_heads(64, 16, 609) == 64 and A.attn_heads(64, 16, 608) == 16
    # Hopper: the warpgroup-MMA kernel from ATTN_WG_MIN_TILES tiles of 64-head work up, where the device gives it its smem
    assert A.ATTN_WG_MIN_TILES == 64 and A.ATTN_WG_TILE == 64
    wg, p64, p16 = "nvfp4_sparse_attn_wg", "nvfp4_sparse_attn_partial64", "nvfp4_sparse_attn_partial"
    assert A.attn_kernel(64, 4, 640, arch="sm_90a") == wg and A.attn_kernel(64, 3, 640, arch="sm_90a") == p16   # 80, 60 tiles
    assert A.attn_kernel(128, 1, 1152, arch="sm_90a") == wg and A.attn_kernel(64, 1, 640, arch="sm_90a") == p16  # Pro 72, Flash 20
    assert A.attn_kernel(48, 64, 640, arch="sm_90a") == p16                                     # H not a multiple of 64
    assert A.attn_kernel(64, 64, 640, arch="sm_100a") == p64 and A.attn_kernel(64, 4, 640, arch="sm_100a") == p16
    assert A.attn_kernel(64, 64, 640, smem_optin=A.ATTN_WG_SMEM - 1, arch="sm_90a") == p64       # too little smem for it
    assert A.attn_kernel(64, 64, 640, smem_optin=A.ATTN_WG_SMEM, arch="sm_90a") == wg
    assert A.attn_kernel(64, 64, 640, smem_optin=99 * 1024, arch="sm_90a") == p16
    # its split: one CTA per SM at most once over (it takes a whole SM), whole 64-slot tiles
    assert A.attn_splits(128, 64, 640, 132, None, 64, A.ATTN_WG_TILE, True) == (1, 640)         # 128 CTAs: one split
    assert A.attn_splits(32, 64, 640, 132, None, 64, A.ATTN_WG_TILE, True) == (4, 192)          # 4 x 32 CTAs
    assert A.attn_splits(1, 64, 640, 132, None, 64, A.ATTN_WG_TILE, True) == (10, 64)           # a tile per CTA
    assert A.attn_splits(128, 128, 1152, 132, None, 64, A.ATTN_WG_TILE, True) == (1, 1152)      # 256 CTAs: never split
    nsplit, chunk = A.attn_splits(64, 64, 640, sms=132)              # 64 CTAs per split: about twice the SMs in all
    assert (nsplit, chunk) == (5, 128), (nsplit, chunk)
    nsplit, chunk = A.attn_splits(1, 64, 640, sms=132)               # 4 CTAs per split (16 heads each): a tile each
    assert (nsplit, chunk) == (20, 32), (nsplit, chunk)
    # a GPU whose blocks cannot opt in to the 64-head CTA's shared memory (sm_86/89/120: 99 KB) gets 16-head CTAs
    assert A.attn_heads(64, 64, 640, smem_optin=99 * 1024) == 16 and A.attn_heads(128, 128, 640, smem_optin=A.ATTN64_SMEM - 1) == 16
    assert A.attn_heads(64, 64, 640, smem_optin=227 * 1024) == 64 and A.attn_heads(64, 64, 640, smem_optin=A.ATTN64_SMEM) == 64
    assert A.attn_splits(64, 64, 640, sms=132, heads=16) == (2, 320)   # 256 CTAs per split: 2 splits
    with pytest.raises(ValueError, match="heads per CTA"):
        A.attn_splits(2, 48, 640, heads=64)
