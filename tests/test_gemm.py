"""Tests for dsv4_nvfp4.gemm: routing, checked offsets, stacked experts, the float64 grouped GEMM reference,
prepared weight layout and the wo_a case.

Expected values come from
* hand arithmetic (written next to each constant), or
* independent computations: numpy stable argsort / bincount for routing; `dsv4_nvfp4.quant.dequantize_nvfp4`
  per operand followed by a numpy float64 matmul per expert for the GEMM (equal to the reference bit for bit when
  every global scale is a power of two, because then the fp32 dequantization is exact); ml_dtypes as the
  E2M1 / E4M3 / bf16 value oracle; an integer-arithmetic float64 -> bf16 rounding.
"""
import ml_dtypes
import numpy as np
import pytest
import torch

from dsv4_nvfp4 import checkpoint as CK
from dsv4_nvfp4 import grouped_gemm as GG
from dsv4_nvfp4 import quant as Q
from dsv4_nvfp4 import routing as R
from dsv4_nvfp4 import gemm_sm90 as S90
from dsv4_nvfp4.layout import swizzle_scales
from dsv4_nvfp4.checkpoint import ModelOptNVFP4, load_modelopt_nvfp4, save_modelopt_nvfp4
from dsv4_nvfp4.quant import NVFP4Tensor, ref_dequantize_nvfp4, ref_quantize_nvfp4

I32 = torch.int32


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def offsets_from_sizes(sizes):
    return torch.tensor(np.cumsum(sizes), dtype=I32)


def np_grouped(a_deq, w_deq, sizes):
    """Independent reference: float64 numpy matmul per expert on dequantized operands."""
    a, w = np.asarray(a_deq, np.float64), np.asarray(w_deq, np.float64)
    out = np.zeros((a.shape[0], w.shape[1]), np.float64)
    start = 0
    for e, m in enumerate(sizes):
        out[start:start + m] = a[start:start + m] @ w[e].T
        start += m
    return out


def pow2_experts(E, N, K, seed):
    g = gen(seed)
    return Q.stack_experts([ref_quantize_nvfp4(torch.randn(N, K, generator=g) * 3, 2.0 ** -(6 + e % 4))
                            for e in range(E)])


def np_bf16_rne(x):
    """float64 -> bf16 value (float64), round to nearest even on the exact value, normal range only."""
    x = np.asarray(x, np.float64)
    m, ex = np.frexp(np.abs(x))                       # |x| = m 2^ex, m in [0.5, 1)
    s = np.ldexp(m, 8)                                # 8 significant bits: integer part of s
    fl = np.floor(s)
    frac = s - fl                                     # exact
    up = (frac > 0.5) | ((frac == 0.5) & (fl % 2 == 1))
    r = np.ldexp(fl + up, ex - 8)
    return np.where(x == 0, x, np.sign(x) * r)


# ---------------------------------------------------------------------------------------------
# the exactness claim behind in-kernel decode


def test_every_e2m1_times_e4m3_product_is_a_bf16_value():
    e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)
    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    e4m3 = e4m3[np.isfinite(e4m3)]
    assert e4m3.size == 254
    p = e2m1[:, None] * e4m3[None, :]
    back = p.astype(ml_dtypes.bfloat16).astype(np.float64)   # exact values need no rounding, so any cast works
    assert np.array_equal(back, p)
    sub = e4m3[(np.abs(e4m3) < 2.0 ** -6) & (e4m3 != 0)]     # subnormal scales m * 2^-9
    assert sorted(set(np.abs(sub) * 2 ** 9)) == [1, 2, 3, 4, 5, 6, 7]
    ps = e2m1[:, None] * sub[None, :]
    assert np.array_equal(ps.astype(ml_dtypes.bfloat16).astype(np.float64), ps)
    assert np.abs(p[p != 0]).min() == 2.0 ** -10 and np.abs(p).max() == 2688.0
    # and FP8 would not do: e.g. 1.5 * 1.875 = 2.8125 needs 6 significant bits
    assert float(np.float64(2.8125).astype(ml_dtypes.float8_e4m3fn)) != 2.8125


# ---------------------------------------------------------------------------------------------
# routing


@pytest.mark.parametrize("T,E,k", [(1, 4, 1), (1, 8, 6), (37, 16, 6), (200, 256, 6), (5, 3, 3)])
def test_route_topk_matches_numpy(T, E, k):
    ids = R.random_topk(T, E, k, generator=gen(T))
    rt = R.route_topk(ids, E)
    flat = ids.numpy().reshape(-1)
    perm = np.argsort(flat, kind="stable")
    assert rt.perm.tolist() == perm.tolist()
    assert rt.token.tolist() == (perm // k).tolist()
    assert rt.expert_offsets.dtype == I32
    assert rt.expert_offsets.tolist() == np.cumsum(np.bincount(flat, minlength=E)).tolist()
    assert rt.inv.shape == (T, k)
    assert (rt.perm[rt.inv.reshape(-1)] == torch.arange(T * k)).all()
    assert (np.diff(flat[perm]) >= 0).all()                                    # expert-major
    assert all(len(set(r)) == k for r in ids.tolist())                          # random_topk: distinct experts
    R.check_offsets(rt.expert_offsets, T * k, E)


def test_route_topk_empty_experts_and_hand_case():
    rt = R.route_topk(torch.tensor([[0, 3], [3, 1], [0, 1], [3, 0], [1, 3]], dtype=I32), 6)
    assert rt.expert_offsets.tolist() == [3, 6, 6, 10, 10, 10]   # experts 2, 4, 5 empty
    assert R.group_sizes(rt.expert_offsets).tolist() == [3, 3, 0, 4, 0, 0]
    assert rt.token.tolist() == [0, 2, 3, 1, 2, 4, 0, 1, 3, 4]


def test_route_topk_bad_input():
    with pytest.raises(TypeError, match="integer"):
        R.route_topk(torch.tensor([[0.0, 1.0]]), 4)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        R.route_topk(torch.tensor([[0, 4]]), 4)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        R.route_topk(torch.tensor([[-1, 2]]), 4)
    with pytest.raises(ValueError, match=r"\(T, k\)"):
        R.route_topk(torch.tensor([0, 1]), 4)
    with pytest.raises(ValueError, match="k <= num_experts"):
        R.random_topk(3, 4, 5)


def test_ref_combine_matches_loop():
    T, E, k, N = 7, 5, 2, 3
    ids = R.random_topk(T, E, k, generator=gen(3))
    rt = R.route_topk(ids, E)
    c = torch.randn(T * k, N, generator=gen(4), dtype=torch.float64)
    p = torch.rand(T, k, generator=gen(5), dtype=torch.float64)
    want = np.zeros((T, N))
    rows = {int(a): r for r, a in enumerate(rt.perm.tolist())}   # assignment -> row
    for t in range(T):
        for j in range(k):
            want[t] += p[t, j].item() * c[rows[t * k + j]].numpy()
    np.testing.assert_allclose(R.ref_combine(c, rt, p).numpy(), want, rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="weights"):
        R.ref_combine(c, rt, p[:, :1])


# ---------------------------------------------------------------------------------------------
# checked offsets


def test_check_offsets_accepts_good_tables():
    for offs, rows in [([0], 0), ([0, 0, 5], 5), ([5, 5, 5], 5), ([1, 2, 3], 3)]:
        t = torch.tensor(offs, dtype=I32)
        assert R.check_offsets(t, rows) is t


@pytest.mark.parametrize("offs,rows,exc,msg", [
    (torch.tensor([1, 2, 3], dtype=torch.int64), 3, TypeError, "int32"),
    (torch.tensor([1, 2, 3], dtype=torch.int16), 3, TypeError, "int32"),
    (torch.tensor([1.0, 3.0]), 3, TypeError, "int32"),
    ([1, 2, 3], 3, TypeError, "torch.Tensor"),
    (torch.tensor([3, 2, 3], dtype=I32), 3, ValueError, r"non-decreasing: offsets\[1\] = 2 < offsets\[0\] = 3"),
    (torch.tensor([1, 2, 4], dtype=I32), 3, ValueError, "end at the row count 3"),
    (torch.tensor([1, 2, 2], dtype=I32), 3, ValueError, "end at the row count 3"),
    (torch.tensor([-1, 3], dtype=I32), 3, ValueError, ">= 0"),
    (torch.zeros(2, 2, dtype=I32), 0, ValueError, "1-D"),
    (torch.zeros(0, dtype=I32), 0, ValueError, "1-D"),
])
def test_check_offsets_bad(offs, rows, exc, msg):
    with pytest.raises(exc, match=msg):
        R.check_offsets(offs, rows)


def test_check_offsets_expert_count():
    with pytest.raises(ValueError, match="one per expert"):
        R.check_offsets(torch.tensor([1, 2], dtype=I32), 2, num_experts=3)


# ---------------------------------------------------------------------------------------------
# stacked experts


def test_stack_experts_keeps_each_expert():
    g = gen(1)
    ws = [ref_quantize_nvfp4(torch.randn(20, 40, generator=g) * (10.0 ** e)) for e in range(3)]
    st = Q.stack_experts(ws)
    assert st.shape == (3, 20, 40) and st.data.shape == (3, 20, 24) and st.scale.shape == (3, 20, 3)
    assert st.global_scale.tolist() == [w.global_scale.item() for w in ws]
    for e, w in enumerate(ws):
        assert torch.equal(st.expert(e).data, w.data)
        assert torch.equal(st.dequantize()[e], ref_dequantize_nvfp4(w))
    # quantize_experts = each expert quantized alone
    x = torch.randn(2, 16, 32, generator=g) * torch.tensor([1.0, 100.0])[:, None, None]
    qe = Q.quantize_experts(x)
    for e in range(2):
        q = ref_quantize_nvfp4(x[e])
        assert torch.equal(qe.data[e], q.data) and qe.global_scale[e] == q.global_scale


def test_nvfp4experts_validation():
    st = Q.stack_experts([ref_quantize_nvfp4(torch.randn(8, 32)) for _ in range(2)])
    with pytest.raises(ValueError, match="one per expert"):
        Q.NVFP4Experts(st.data, st.scale, torch.ones((), dtype=torch.float32), st.shape)
    with pytest.raises(ValueError, match="one per expert"):
        Q.NVFP4Experts(st.data, st.scale, torch.ones(2, 8), st.shape)
    with pytest.raises(TypeError, match="float32"):
        Q.NVFP4Experts(st.data, st.scale, torch.ones(2, dtype=torch.float64), st.shape)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        Q.NVFP4Experts(st.data, st.scale.view(torch.uint8), st.global_scale, st.shape)
    with pytest.raises(ValueError, match="needs data"):
        Q.NVFP4Experts(st.data[..., :8], st.scale, st.global_scale, st.shape)
    with pytest.raises(ValueError, match=r"\(E, N, K\)"):
        Q.NVFP4Experts(st.data[0], st.scale[0], st.global_scale, (8, 32))
    with pytest.raises(ValueError, match="per-row"):
        Q.stack_experts([ref_quantize_nvfp4(torch.randn(8, 32), per_row=True)])
    with pytest.raises(ValueError, match="differ in shape"):
        Q.stack_experts([ref_quantize_nvfp4(torch.randn(8, 32)), ref_quantize_nvfp4(torch.randn(8, 48))])
    with pytest.raises(TypeError, match="not an NVFP4Tensor"):
        Q.stack_experts([torch.zeros(8, 32)])
    with pytest.raises(ValueError, match="at least one"):
        Q.stack_experts([])


# ---------------------------------------------------------------------------------------------
# the float64 reference: tier 2, exactly representable inputs


CASES = [  # (group sizes, N, K): ragged with empty experts, one token, K not a multiple of 128 (or of 16)
    ([3, 0, 5, 1, 0, 7], 24, 128),
    ([0, 0, 1, 0], 16, 64),                 # one token in total
    ([2, 0, 9], 40, 200),                   # K not a multiple of 16
    ([4, 6, 0, 2], 32, 336),                # K multiple of 16, not of 128
    ([0, 12, 5, 0, 0, 3, 8, 1], 64, 2048),  # DSV4 L2-like K
    ([0, 0, 0], 8, 32),                     # no rows at all
]


@pytest.mark.parametrize("sizes,N,K", CASES)
def test_ref_w4a4_exact_vs_dequantize_numpy(sizes, N, K):
    R, E = sum(sizes), len(sizes)
    g = gen(R + K)
    w = pow2_experts(E, N, K, seed=K)
    gs_rows = torch.tensor([2.0 ** -(3 + r % 5) for r in range(R)], dtype=torch.float32)
    a = ref_quantize_nvfp4(torch.randn(R, K, generator=g) * 5, gs_rows)           # per-row power-of-two gs
    got = GG.ref_grouped_gemm_nvfp4(a, w, offsets_from_sizes(sizes))
    assert got.dtype == torch.float64 and got.shape == (R, N)
    want = np_grouped(ref_dequantize_nvfp4(a).numpy(), w.dequantize().numpy(), sizes)
    assert np.array_equal(got.numpy(), want)
    if R:
        assert np.abs(want).max() > 0                                          # not vacuous
    # scalar activation global scale too
    a1 = ref_quantize_nvfp4(torch.randn(R, K, generator=g), 0.125)
    want1 = np_grouped(ref_dequantize_nvfp4(a1).numpy(), w.dequantize().numpy(), sizes)
    assert np.array_equal(GG.ref_grouped_gemm_nvfp4(a1, w, offsets_from_sizes(sizes)).numpy(), want1)


@pytest.mark.parametrize("sizes,N,K", CASES)
def test_ref_w4a16_exact_vs_dequantize_numpy(sizes, N, K):
    R, E = sum(sizes), len(sizes)
    w = pow2_experts(E, N, K, seed=K + 1)
    a = (torch.randn(R, K, generator=gen(K)) * 2).to(torch.bfloat16)
    got = GG.ref_grouped_gemm_nvfp4(a, w, offsets_from_sizes(sizes))
    want = np_grouped(a.float().numpy(), w.dequantize().numpy(), sizes)
    assert np.array_equal(got.numpy(), want)


def test_ref_hand_values():
    # expert 0: every code 1.0 (code 2), block scales 2 and 0.5, gs 0.25; expert 1: every code -6 (code 15), scale 1
    def const(rows, code, scales, gs):
        K = 16 * len(scales)
        return NVFP4Tensor(torch.full((rows, K // 2), code | code << 4, dtype=torch.uint8),
                           torch.tensor(scales).expand(rows, -1).to(torch.float8_e4m3fn),
                           torch.tensor(gs, dtype=torch.float32), (rows, K))
    w = Q.stack_experts([const(3, 2, [2.0, 0.5], 0.25), const(3, 15, [1.0, 1.0], 1.0)])
    a = NVFP4Tensor(const(4, 2, [1.0, 1.0], 1.0).data, const(4, 2, [1.0, 1.0], 1.0).scale,
                    torch.tensor([1.0, 2.0, 0.5, 3.0]), (4, 32))
    c = GG.ref_grouped_gemm_nvfp4(a, w, torch.tensor([1, 4], dtype=I32))
    # row 0 (expert 0): (16*2 + 16*0.5) * 0.25 * 1 = 10; rows 1-3 (expert 1): 32 * -6 * gs_a
    assert c[:, 0].tolist() == [10.0, -384.0, -96.0, -576.0]
    assert c.shape == (4, 3) and (c == c[:, :1]).all()


def test_ref_realistic_global_scales_close_to_dequantize():
    sizes, N, K = [5, 0, 11, 3], 48, 256
    g = gen(9)
    w = Q.quantize_experts(torch.randn(4, N, K, generator=g))
    a = ref_quantize_nvfp4(torch.randn(sum(sizes), K, generator=g), per_row=True)
    got = GG.ref_grouped_gemm_nvfp4(a, w, offsets_from_sizes(sizes)).numpy()
    want = np_grouped(ref_dequantize_nvfp4(a).numpy(), w.dequantize().numpy(), sizes)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 0 < rel < 1e-6, f"rel={rel} for sizes={sizes} N={N} K={K}"   # fp32 dequant rounding only


def test_ref_bf16_output_is_one_rounding():
    sizes, N, K = [6, 0, 9], 32, 160
    w = Q.quantize_experts(torch.randn(3, N, K, generator=gen(2)))
    a = torch.randn(15, K, generator=gen(3)).to(torch.bfloat16)
    f64 = GG.ref_grouped_gemm_nvfp4(a, w, offsets_from_sizes(sizes))
    b = GG.ref_grouped_gemm_nvfp4(a, w, offsets_from_sizes(sizes), out_dtype=torch.bfloat16)
    assert b.dtype == torch.bfloat16
    assert np.array_equal(b.double().numpy(), np_bf16_rne(f64.numpy()))
    # the double-rounding case: 1 + 2^-8 + 2^-40 must round up to 1 + 2^-7
    v = torch.tensor([1 + 2.0 ** -8 + 2.0 ** -40, -(1 + 2.0 ** -8 + 2.0 ** -40), 1 + 2.0 ** -8], dtype=torch.float64)
    assert GG._f64_to_bf16(v).double().tolist() == [1 + 2.0 ** -7, -(1 + 2.0 ** -7), 1.0]
    assert np_bf16_rne(v.numpy()).tolist() == [1 + 2.0 ** -7, -(1 + 2.0 ** -7), 1.0]
    with pytest.raises(ValueError, match="out_dtype"):
        GG.ref_grouped_gemm_nvfp4(a, w, offsets_from_sizes(sizes), out_dtype=torch.float32)


def test_ref_bad_input():
    w = pow2_experts(3, 16, 64, seed=0)
    offs = torch.tensor([2, 2, 5], dtype=I32)
    a = torch.randn(5, 64).to(torch.bfloat16)
    GG.ref_grouped_gemm_nvfp4(a, w, offs)  # the good call works
    with pytest.raises(ValueError, match="K mismatch: activations have K = 48, weights K = 64"):
        GG.ref_grouped_gemm_nvfp4(a[:, :48], w, offs)
    with pytest.raises(ValueError, match="K mismatch"):
        GG.ref_grouped_gemm_nvfp4(ref_quantize_nvfp4(torch.randn(5, 80)), w, offs)
    for dt in (torch.float32, torch.float16, torch.float64, torch.int32):
        with pytest.raises(TypeError, match="bf16"):
            GG.ref_grouped_gemm_nvfp4(a.to(dt), w, offs)
    with pytest.raises(TypeError, match="NVFP4Tensor or a bf16"):
        GG.ref_grouped_gemm_nvfp4(a.float().numpy(), w, offs)
    with pytest.raises(ValueError, match="2-D"):
        GG.ref_grouped_gemm_nvfp4(ref_quantize_nvfp4(torch.randn(5, 1, 64)), w, offs)
    with pytest.raises(TypeError, match="NVFP4Experts"):
        GG.ref_grouped_gemm_nvfp4(a, w.expert(0), offs)
    with pytest.raises(TypeError, match="int32"):
        GG.ref_grouped_gemm_nvfp4(a, w, offs.long())
    with pytest.raises(ValueError, match="non-decreasing"):
        GG.ref_grouped_gemm_nvfp4(a, w, torch.tensor([3, 2, 5], dtype=I32))
    with pytest.raises(ValueError, match="end at the row count 5"):
        GG.ref_grouped_gemm_nvfp4(a, w, torch.tensor([2, 2, 4], dtype=I32))
    with pytest.raises(ValueError, match="one per expert"):
        GG.ref_grouped_gemm_nvfp4(a, w, torch.tensor([2, 5], dtype=I32))


# ---------------------------------------------------------------------------------------------
# prepared weights


@pytest.mark.parametrize("K,k_tile,Kt", [(200, 128, 256), (256, 128, 256), (208, 64, 256), (4096, 128, 4096),
                                          (7168, 256, 7168), (48, 128, 128)])
def test_prepare_weights_layout(K, k_tile, Kt):
    E, N = 3, 136
    w = Q.quantize_experts(torch.randn(E, N, K, generator=gen(K)))
    p = GG.prepare_weights(w, k_tile=k_tile)
    Kp = -(-K // 16) * 16
    assert p.w_fp4.dtype == torch.uint8 and p.w_fp4.shape == (E, N, Kt // 2) and p.w_fp4.is_contiguous()
    assert p.w_sf.dtype == torch.float8_e4m3fn and p.w_sf.shape == (E, N, Kt // 16) and p.w_sf.is_contiguous()
    assert p.w_sf_swz.shape == (E, 256, -(-Kt // 16 // 4) * 4)
    assert p.w_gs.dtype == torch.float32 and torch.equal(p.w_gs, w.global_scale)
    assert p.shape == (E, N, K) and p.a_gs is None
    assert torch.equal(p.w_fp4[..., :Kp // 2], w.data)
    assert int(p.w_fp4[..., Kp // 2:].sum()) == 0
    assert torch.equal(p.w_sf.view(torch.uint8)[..., :Kp // 16], w.scale.view(torch.uint8))
    assert int(p.w_sf.view(torch.uint8)[..., Kp // 16:].sum()) == 0
    for e in range(E):
        assert torch.equal(p.w_sf_swz[e].view(torch.uint8), swizzle_scales(p.w_sf[e]).view(torch.uint8))
    back = p.experts()
    assert back.shape == w.shape and torch.equal(back.data, w.data) and torch.equal(back.global_scale, w.global_scale)


def test_prepare_weights_inputs_and_errors(tmp_path):
    ws = [ref_quantize_nvfp4(torch.randn(16, 64, generator=gen(e))) for e in range(2)]
    from_list = GG.prepare_weights(ws)
    assert torch.equal(from_list.w_fp4, GG.prepare_weights(Q.stack_experts(ws)).w_fp4)
    path = tmp_path / "m.safetensors"
    save_modelopt_nvfp4(path, {f"blk.experts.{e}.down": w for e, w in enumerate(ws)},
                        {f"blk.experts.{e}.down": 0.25 * (e + 1) for e in range(2)})
    ck = load_modelopt_nvfp4(path)
    pm = GG.prepare_weights(CK.modelopt_experts(ck, "blk.experts.{e}.down", 2))
    assert torch.equal(pm.w_fp4, from_list.w_fp4) and torch.equal(pm.w_gs, from_list.w_gs)
    assert pm.a_gs.tolist() == [0.25, 0.5]
    no_inp = GG.prepare_weights([ModelOptNVFP4(w) for w in ws])
    assert no_inp.a_gs is None
    with pytest.raises(KeyError, match="missing"):
        CK.modelopt_experts(ck, "blk.experts.{e}.down", 3)
    with pytest.raises(ValueError, match=r"\{e\}"):
        CK.modelopt_experts(ck, "blk.experts.0.down", 1)
    with pytest.raises(ValueError, match="multiple of 64"):
        GG.prepare_weights(ws, k_tile=96)
    with pytest.raises(TypeError, match="NVFP4Experts"):
        GG.prepare_weights(torch.zeros(2, 16, 32))


# ---------------------------------------------------------------------------------------------
# wo_a: every token through every group


@pytest.mark.parametrize("T,Gn,K,N", [(1, 8, 64, 16), (5, 4, 96, 24), (3, 16, 48, 8)])
def test_wo_a_reference(T, Gn, K, N):
    g = gen(T * Gn)
    x = (torch.randn(T, Gn, K, generator=g) * 2).to(torch.bfloat16)
    v = GG.wo_a_view(x)
    assert v.shape == (Gn, T, K) and v.stride() == (K, Gn * K, 1) and v.data_ptr() == x.data_ptr()
    w = pow2_experts(Gn, N, K, seed=T)
    wd = w.dequantize().numpy().astype(np.float64)
    got = GG.ref_wo_a_nvfp4(x, w)
    assert got.shape == (T, Gn, N)
    assert np.array_equal(got.numpy(), np.einsum("bhr,hdr->bhd", x.float().numpy().astype(np.float64), wd))
    # NVFP4 activations with a per-(token, group) power-of-two global scale
    gs = torch.tensor([[2.0 ** -((t + h) % 5) for h in range(Gn)] for t in range(T)], dtype=torch.float32)
    xq = ref_quantize_nvfp4(x.float(), gs)
    assert xq.global_scale.shape == (T, Gn)
    got_q = GG.ref_wo_a_nvfp4(xq, w)
    want_q = np.einsum("bhr,hdr->bhd", ref_dequantize_nvfp4(xq).numpy().astype(np.float64), wd)
    assert np.array_equal(got_q.numpy(), want_q)
    vq = GG.wo_a_view(xq)
    assert vq.data.data_ptr() == xq.data.data_ptr() and vq.global_scale.shape == (Gn, T)
    with pytest.raises(ValueError, match="groups"):
        GG.ref_wo_a_nvfp4(x, pow2_experts(Gn + 1, N, K, seed=0))
    with pytest.raises(ValueError, match=r"\(T, G, K\)"):
        GG.wo_a_view(x[0])


# ================================================================================================================
# The sm_90a kernel's weight layout and host-side launcher (CPU: layout model, config choice, errors, compilation)
@pytest.mark.parametrize("E,N,K", [(1, 64, 128), (2, 128, 256), (3, 192, 384)])
def test_sm90_slabs_decode_exactly(E, N, K):
    # the CPU model of the kernel's bit operations recovers e2m1 * s * 2^-7 for every element; oracle: ml_dtypes
    g = gen(E)
    w = torch.randn(E, N, K, generator=g) * torch.rand(E, N, 1, generator=g) ** 8    # tiny rows: subnormal e4m3 scales
    w[0, 1, :16] = 0                                                                 # a zero block (scale 0)
    q = Q.quantize_experts(w)
    t = S90.tile_weights_sm90(q.data, q.scale)
    assert t.shape == (E * N // 64 * K // 128 * 18, 256) and t.dtype == torch.uint8
    codes = np.stack([q.data.numpy() & 15, q.data.numpy() >> 4], -1).reshape(E, N, K).astype(np.uint8)
    e2m1 = np.array([float(np.uint8(c).view(ml_dtypes.float4_e2m1fn)) for c in range(16)])[codes]
    s = q.scale.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    want = e2m1 * np.repeat(s, 16, -1) * 2.0 ** -7
    assert (s[s > 0].min() < 2.0 ** -6) and (s == 0).any()                        # the hard cases are present
    np.testing.assert_array_equal(S90.emulate_decode_sm90(t, E, N, K).numpy(), want)


def test_sm90_scale_codes():
    # every finite non-negative e4m3 value: (code << 4) | 0x7000 read as bf16 is s * 2^119 exactly; zero -> code 0
    allv = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ok = torch.isfinite(allv.float()) & (allv.float() >= 0)
    sf = allv[ok]
    c = S90.scale_codes(sf).to(torch.int32)
    bits = ((c << 4) | 0x7000).numpy().astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    s = sf.float().double().numpy()
    np.testing.assert_array_equal(np.where(s > 0, bits, 0.0), s * 2.0 ** 119)
    assert set(c[s == 0].tolist()) == {0}                 # +0 and -0
    with pytest.raises(ValueError, match="finite"):
        S90.scale_codes(torch.tensor([-1.0]).to(torch.float8_e4m3fn))


def test_sm90_slab_order():
    # hand-placed: weight (row 9, col 1) of slab 0: row 9 = r1 = r0 + 8 with r0 = lane // 4 = 1, col 1 = c + 1 with
    # c = 2 (lane % 4) = 0 -> lane 4 of warp 0, thread 4; value v3 = (r1, c+1) is pair 1's high element: nibble
    # slot 5 of its word for K block 0 -> byte 2 (high nibble) of thread 4's first 16 bytes, at 4 * 16 + 2 = 66
    w_fp4 = torch.zeros(1, 64, 64, dtype=torch.uint8)
    w_fp4[0, 9, 0] = 0x70                              # element (9, 1) = code 7 (high nibble of byte 0 of row 9)
    sf = torch.zeros(1, 64, 8).to(torch.float8_e4m3fn)
    t = S90.tile_weights_sm90(w_fp4, sf).view(-1)
    nz = torch.nonzero(t[:4096]).flatten().tolist()
    assert nz == [66] and t[66].item() == 0x70


def test_pick_config(monkeypatch):
    monkeypatch.delenv("DSV4_GEMM_CONFIG", raising=False)
    assert GG.pick_config(6, 256).tok_tile == 16           # 1 token top-6: 1 row per active expert
    assert GG.pick_config(192, 256).tok_tile == 16         # 192 rows over 192 experts at most
    assert GG.pick_config(3072, 256).tok_tile == 16        # 12 rows per expert
    assert GG.pick_config(12288, 256).tok_tile == 64       # 48
    assert GG.pick_config(49152, 256).tok_tile == 128      # 192
    assert GG.pick_config(8 * 32, 8).tok_tile == 32
    monkeypatch.setenv("DSV4_GEMM_CONFIG", "64")
    assert GG.pick_config(6, 256).tok_tile == 64
    monkeypatch.setenv("DSV4_GEMM_CONFIG", "48")
    with pytest.raises(ValueError, match="one of"):
        GG.pick_config(6, 256)


def test_smem_fits():
    for cfg in S90.CONFIGS.values():
        assert S90.smem_bytes(cfg) <= 227 * 1024, cfg


def test_launcher_bad_input_cpu():
    w = Q.quantize_experts(torch.randn(2, 64, 128, generator=gen(3)))
    pw = GG.prepare_weights(w)
    a = torch.randn(4, 128).to(torch.bfloat16)
    offs = torch.tensor([2, 4], dtype=I32)
    with pytest.raises(TypeError, match="PreparedWeights"):
        GG.grouped_gemm_nvfp4(a, w, offs)
    with pytest.raises(TypeError, match="bf16"):
        GG.grouped_gemm_nvfp4(a.float(), pw, offs)
    with pytest.raises(ValueError, match="K mismatch"):
        GG.grouped_gemm_nvfp4(a[:, :96].contiguous(), pw, offs)
    with pytest.raises(ValueError, match="CUDA"):
        GG.grouped_gemm_nvfp4(a, pw, offs)
    with pytest.raises(ValueError, match="sm_90a layout"):
        GG.grouped_gemm_nvfp4(a, GG.prepare_weights(w, k_tile=64), offs)
    with pytest.raises(TypeError, match="PreparedWeights"):
        GG.wo_a_nvfp4(a.view(4, 1, 128), w)
    with pytest.raises(ValueError, match="k_tile = 128"):
        GG.prepare_weights(w, k_tile=64, sm90=True)


@pytest.mark.parametrize("tok_tile", sorted(S90.CONFIGS))
def test_sm90_kernel_compiles_without_gpu(tok_tile, monkeypatch):
    # CuTeDSL builds the kernel for sm_90a from fake tensors (no GPU): MLIR -> PTX -> cubin
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")       # compile_sm90 also passes --gpu-arch=sm_90a explicitly
    pytest.importorskip("cutlass")
    cfg = S90.CONFIGS[tok_tile]
    assert S90.compile_sm90(cfg) is not None
    if tok_tile == 16:
        assert S90.compile_sm90(cfg._replace(epilogue=S90.Epilogue.WO_A_ROW_GS)) is not None


def test_launch_fast_path_keeps_every_check(monkeypatch):
    """After a good call the launcher takes its fast path; any argument the full checks would refuse still gets the
    full path and its error (run on CPU tensors with the launch recorded, not executed)."""
    from dsv4_nvfp4 import runtime as rt
    monkeypatch.setattr(rt, "_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(GG, "_sm100", lambda: False)
    calls = []
    class FakeSm90:
        @staticmethod
        def run_sm90(cfg, w_sm90, a, out, offs, gs_w, gs_a, *optional, **kw): calls.append((cfg.tok_tile, a.shape, out.data_ptr()))
    monkeypatch.setitem(GG._ARCH, "sm90", FakeSm90)
    pw = GG.prepare_weights(Q.quantize_experts(torch.randn(4, 128, 256, generator=gen(9))))
    a = torch.randn(6, 256).to(torch.bfloat16)
    offs = torch.tensor([1, 3, 3, 6], dtype=I32)
    out = torch.empty(6, 128, dtype=torch.bfloat16)
    full = []
    operands = GG.gemm_operands
    monkeypatch.setattr(GG, "gemm_operands", lambda *args: full.append(1) or operands(*args))
    for _ in range(3): GG.grouped_gemm_nvfp4(a, pw, offs, out=out)
    assert len(calls) == 3 and len(full) == 1, "the 2nd and 3rd calls take the fast path"
    big = torch.empty(64, 300).to(torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        GG.grouped_gemm_nvfp4(big[:6, :256], pw, offs, out=out)
    with pytest.raises(ValueError, match="aligned"):
        GG.grouped_gemm_nvfp4(a, pw, offs, out=torch.empty(6 * 128 + 1, dtype=torch.bfloat16)[1:].view(6, 128))
    with pytest.raises(TypeError, match="int32"):
        GG.grouped_gemm_nvfp4(a, pw, offs.long(), out=out)
    with pytest.raises(ValueError, match=r"\(E,\)"):
        GG.grouped_gemm_nvfp4(a, pw, offs[:3], out=out)
    with pytest.raises(ValueError, match="out must have shape"):
        GG.grouped_gemm_nvfp4(a, pw, offs, out=torch.empty(6, 136, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="K mismatch"):
        GG.grouped_gemm_nvfp4(torch.randn(6, 128).to(torch.bfloat16), pw, offs, out=out)
    assert len(calls) == 3


@pytest.mark.parametrize("tok_tile", sorted(S90.CONFIGS))
def test_sm90_variants_no_spills_and_no_serialized_wgmma(tok_tile, tmp_path, monkeypatch):
    """ptxas (when installed: the GPU host has it) on the PTX of the plain and the overlapped mainloop, bf16 and NVFP4
    activations: no register spills, and no warning that the WGMMAs are serialized (C7511 / C7512, for lack of
    registers: the overlap's failure mode, which would put a full wait after every WGMMA)."""
    import re, shutil, subprocess
    ptxas = shutil.which("ptxas")
    if ptxas is None: pytest.skip("ptxas is not installed")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    pytest.importorskip("cutlass")
    base = S90.CONFIGS[tok_tile]
    for n, cfg in enumerate([base, base._replace(overlap=True),
                             base._replace(epilogue=S90.Epilogue.SWIGLU_NVFP4, a_fp4=True),
                             base._replace(epilogue=S90.Epilogue.SWIGLU_NVFP4, a_fp4=True, overlap=True)]):
        d = tmp_path / str(n); d.mkdir()
        S90.compile_sm90(cfg, options=f"--keep-ptx --dump-dir={d}")
        (ptx,) = d.glob("*.ptx")
        rep = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(d / "k.cubin")], capture_output=True, text=True)
        assert rep.returncode == 0, rep.stderr[-2000:]
        assert "serialized" not in rep.stderr, f"{cfg}: ptxas serialized the WGMMAs: {rep.stderr[-600:]}"
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", rep.stderr)]
        assert spills and max(spills) == 0, f"{cfg}: spills {spills}"


def test_sms_free_is_checked():
    "The SMs a launch leaves free are an argument, a non-negative int: anything else is refused by name."
    for bad in (-1, 1.5, True, "4", None):
        with pytest.raises(ValueError, match="sms_free must be an int >= 0"): GG.check_sms_free(bad, "grouped_gemm_nvfp4")
    for ok in (0, 8, 132): GG.check_sms_free(ok, "grouped_gemm_nvfp4")
