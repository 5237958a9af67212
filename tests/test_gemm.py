"""Tests for dsv4_nvfp4.gemm: routing, checked offsets, stacked experts, the float64 grouped GEMM reference,
each backend's prepared weight layout, the wo_a case, and the seam (backends, registry, plans, the ops' refusals).

Expected values come from
* hand arithmetic (written next to each constant), or
* independent computations: numpy stable argsort / bincount for routing; `dsv4_nvfp4.quant.dequantize_nvfp4`
  per operand followed by a numpy float64 matmul per expert for the GEMM (equal to the reference bit for bit when
  every global scale is a power of two, because then the fp32 dequantization is exact); ml_dtypes as the
  E2M1 / E4M3 / bf16 value oracle; an integer-arithmetic float64 -> bf16 rounding.
"""
import itertools
import ml_dtypes
import numpy as np
import pytest
import torch

from dsv4_nvfp4 import checkpoint as CK
from dsv4_nvfp4 import quant as Q
from dsv4_nvfp4 import routing as R
from dsv4_nvfp4 import gemm as GC
from dsv4_nvfp4.gemm import reference as GR
from dsv4_nvfp4.gemm import sm90 as S90
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
    got = GR.ref_grouped_gemm_nvfp4(a, w, offsets_from_sizes(sizes))
    assert got.dtype == torch.float64 and got.shape == (R, N)
    want = np_grouped(ref_dequantize_nvfp4(a).numpy(), w.dequantize().numpy(), sizes)
    assert np.array_equal(got.numpy(), want)
    if R:
        assert np.abs(want).max() > 0                                          # not vacuous
    # scalar activation global scale too
    a1 = ref_quantize_nvfp4(torch.randn(R, K, generator=g), 0.125)
    want1 = np_grouped(ref_dequantize_nvfp4(a1).numpy(), w.dequantize().numpy(), sizes)
    assert np.array_equal(GR.ref_grouped_gemm_nvfp4(a1, w, offsets_from_sizes(sizes)).numpy(), want1)


@pytest.mark.parametrize("sizes,N,K", CASES)
def test_ref_w4a16_exact_vs_dequantize_numpy(sizes, N, K):
    R, E = sum(sizes), len(sizes)
    w = pow2_experts(E, N, K, seed=K + 1)
    a = (torch.randn(R, K, generator=gen(K)) * 2).to(torch.bfloat16)
    got = GR.ref_grouped_gemm_nvfp4(a, w, offsets_from_sizes(sizes))
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
    c = GR.ref_grouped_gemm_nvfp4(a, w, torch.tensor([1, 4], dtype=I32))
    # row 0 (expert 0): (16*2 + 16*0.5) * 0.25 * 1 = 10; rows 1-3 (expert 1): 32 * -6 * gs_a
    assert c[:, 0].tolist() == [10.0, -384.0, -96.0, -576.0]
    assert c.shape == (4, 3) and (c == c[:, :1]).all()


def test_ref_realistic_global_scales_close_to_dequantize():
    sizes, N, K = [5, 0, 11, 3], 48, 256
    g = gen(9)
    w = Q.quantize_experts(torch.randn(4, N, K, generator=g))
    a = ref_quantize_nvfp4(torch.randn(sum(sizes), K, generator=g), per_row=True)
    got = GR.ref_grouped_gemm_nvfp4(a, w, offsets_from_sizes(sizes)).numpy()
    want = np_grouped(ref_dequantize_nvfp4(a).numpy(), w.dequantize().numpy(), sizes)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 0 < rel < 1e-6, f"rel={rel} for sizes={sizes} N={N} K={K}"   # fp32 dequant rounding only


def test_ref_bf16_output_is_one_rounding():
    sizes, N, K = [6, 0, 9], 32, 160
    w = Q.quantize_experts(torch.randn(3, N, K, generator=gen(2)))
    a = torch.randn(15, K, generator=gen(3)).to(torch.bfloat16)
    f64 = GR.ref_grouped_gemm_nvfp4(a, w, offsets_from_sizes(sizes))
    b = GR.ref_grouped_gemm_nvfp4(a, w, offsets_from_sizes(sizes), out_dtype=torch.bfloat16)
    assert b.dtype == torch.bfloat16
    assert np.array_equal(b.double().numpy(), np_bf16_rne(f64.numpy()))
    # the double-rounding case: 1 + 2^-8 + 2^-40 must round up to 1 + 2^-7
    v = torch.tensor([1 + 2.0 ** -8 + 2.0 ** -40, -(1 + 2.0 ** -8 + 2.0 ** -40), 1 + 2.0 ** -8], dtype=torch.float64)
    assert GR._f64_to_bf16(v).double().tolist() == [1 + 2.0 ** -7, -(1 + 2.0 ** -7), 1.0]
    assert np_bf16_rne(v.numpy()).tolist() == [1 + 2.0 ** -7, -(1 + 2.0 ** -7), 1.0]
    with pytest.raises(ValueError, match="out_dtype"):
        GR.ref_grouped_gemm_nvfp4(a, w, offsets_from_sizes(sizes), out_dtype=torch.float32)


def test_ref_bad_input():
    w = pow2_experts(3, 16, 64, seed=0)
    offs = torch.tensor([2, 2, 5], dtype=I32)
    a = torch.randn(5, 64).to(torch.bfloat16)
    GR.ref_grouped_gemm_nvfp4(a, w, offs)  # the good call works
    with pytest.raises(ValueError, match="K mismatch: activations have K = 48, weights K = 64"):
        GR.ref_grouped_gemm_nvfp4(a[:, :48], w, offs)
    with pytest.raises(ValueError, match="K mismatch"):
        GR.ref_grouped_gemm_nvfp4(ref_quantize_nvfp4(torch.randn(5, 80)), w, offs)
    for dt in (torch.float32, torch.float16, torch.float64, torch.int32):
        with pytest.raises(TypeError, match="bf16"):
            GR.ref_grouped_gemm_nvfp4(a.to(dt), w, offs)
    with pytest.raises(TypeError, match="NVFP4Tensor or a bf16"):
        GR.ref_grouped_gemm_nvfp4(a.float().numpy(), w, offs)
    with pytest.raises(ValueError, match="2-D"):
        GR.ref_grouped_gemm_nvfp4(ref_quantize_nvfp4(torch.randn(5, 1, 64)), w, offs)
    with pytest.raises(TypeError, match="NVFP4Experts"):
        GR.ref_grouped_gemm_nvfp4(a, w.expert(0), offs)
    with pytest.raises(TypeError, match="int32"):
        GR.ref_grouped_gemm_nvfp4(a, w, offs.long())
    with pytest.raises(ValueError, match="non-decreasing"):
        GR.ref_grouped_gemm_nvfp4(a, w, torch.tensor([3, 2, 5], dtype=I32))
    with pytest.raises(ValueError, match="end at the row count 5"):
        GR.ref_grouped_gemm_nvfp4(a, w, torch.tensor([2, 2, 4], dtype=I32))
    with pytest.raises(ValueError, match="one per expert"):
        GR.ref_grouped_gemm_nvfp4(a, w, torch.tensor([2, 5], dtype=I32))


# ---------------------------------------------------------------------------------------------
# prepared weights


def e2m1_times_s(data, scale):
    "float64 (..., N, Kp) `e2m1 * s` of packed codes and e4m3 block scales; oracle: ml_dtypes (not the package's decode)."
    d = data.numpy()
    codes = np.stack([d & 15, d >> 4], -1).reshape(*d.shape[:-1], 2 * d.shape[-1]).astype(np.uint8)
    e2m1 = np.array([float(np.uint8(c).view(ml_dtypes.float4_e2m1fn)) for c in range(16)])[codes]
    s = scale.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return e2m1 * np.repeat(s, 16, -1)


@pytest.mark.parametrize("K", [200, 256, 208, 4096, 7168, 48])
def test_prepare_weights_layout(K):
    """Each backend keeps only what it reads: the reference the codes and scales as they are; sm90 the register-fragment
    slabs (N padded to 128, K to 128) and the global scales, decoding (CPU model of the kernel) to the zero-padded
    `e2m1 * s`; sm100 the codes with K padded to 128 and the 32_4_4-swizzled scales."""
    E, N = 3, 136
    w = Q.quantize_experts(torch.randn(E, N, K, generator=gen(K)))
    Kp = -(-K // 16) * 16                       # the codes / scales NVFP4Experts hold: K rounded up to whole blocks
    Kt, Np = -(-K // 128) * 128, 256
    # reference
    pr = GC.prepare_weights(w, device="cpu", backend="reference")
    assert type(pr) is GR.ReferenceWeights and pr.backend == "reference" and pr.shape == (E, N, K) and pr.a_gs is None
    assert sorted(pr.tensors()) == ["data", "scale", "w_gs"] and pr.device == torch.device("cpu")
    assert torch.equal(pr.data, w.data) and torch.equal(pr.scale.view(torch.uint8), w.scale.view(torch.uint8))
    assert pr.w_gs.dtype == torch.float32 and torch.equal(pr.w_gs, w.global_scale)
    assert pr.nbytes == w.data.numel() + w.scale.numel() + 4 * E
    back = pr.experts()
    assert back.shape == w.shape and torch.equal(back.data, w.data) and torch.equal(back.global_scale, w.global_scale)
    # sm90
    p9 = GC.prepare_weights(w, device="cpu", backend="sm90")
    assert type(p9) is S90.Sm90Weights and p9.backend == "sm90" and p9.shape == (E, N, K) and p9.a_gs is None
    assert sorted(p9.tensors()) == ["w_gs", "w_sm90"]
    assert p9.w_sm90.dtype == torch.uint8 and p9.w_sm90.is_contiguous()
    assert p9.w_sm90.shape == (E * Np // 64 * Kt // 128 * 18, 256) and p9.nbytes == p9.w_sm90.numel() + 4 * E
    assert torch.equal(p9.w_gs, w.global_scale)
    want = np.zeros((E, Np, Kt))
    want[:, :N, :Kp] = e2m1_times_s(w.data, w.scale)
    np.testing.assert_array_equal((S90.emulate_decode_sm90(p9.w_sm90, E, Np, Kt) * S90.DECODE_SCALE).numpy(), want)
    # sm100 (laid out on any machine; it runs on Blackwell only)
    from dsv4_nvfp4.gemm import sm100 as S100
    p10 = GC.prepare_weights(w, device="cpu", backend="sm100")
    assert type(p10) is S100.Sm100Weights and p10.backend == "sm100" and sorted(p10.tensors()) == ["w_fp4", "w_gs", "w_sf_swz"]
    assert p10.w_fp4.dtype == torch.uint8 and p10.w_fp4.shape == (E, N, Kt // 2) and p10.w_fp4.is_contiguous()
    assert torch.equal(p10.w_fp4[..., :Kp // 2], w.data) and int(p10.w_fp4[..., Kp // 2:].sum()) == 0
    assert p10.w_sf_swz.dtype == torch.float8_e4m3fn and p10.w_sf_swz.shape == (E, Np, -(-Kt // 16 // 4) * 4)
    sf = torch.zeros(E, N, Kt // 16, dtype=torch.uint8)
    sf[..., :Kp // 16] = w.scale.view(torch.uint8)
    for e in range(E):
        assert torch.equal(p10.w_sf_swz[e].view(torch.uint8), swizzle_scales(sf[e].view(torch.float8_e4m3fn)).view(torch.uint8))
    assert torch.equal(p10.w_gs, w.global_scale)


def test_prepare_weights_inputs_and_errors(tmp_path):
    ws = [ref_quantize_nvfp4(torch.randn(16, 64, generator=gen(e))) for e in range(2)]
    from_list = GC.prepare_weights(ws, device="cpu", backend="sm90")
    assert torch.equal(from_list.w_sm90, GC.prepare_weights(Q.stack_experts(ws), device="cpu", backend="sm90").w_sm90)
    path = tmp_path / "m.safetensors"
    save_modelopt_nvfp4(path, {f"blk.experts.{e}.down": w for e, w in enumerate(ws)},
                        {f"blk.experts.{e}.down": 0.25 * (e + 1) for e in range(2)})
    ck = load_modelopt_nvfp4(path)
    pm = GC.prepare_weights(CK.modelopt_experts(ck, "blk.experts.{e}.down", 2), device="cpu", backend="sm90")
    assert torch.equal(pm.w_sm90, from_list.w_sm90) and torch.equal(pm.w_gs, from_list.w_gs)
    assert pm.a_gs.tolist() == [0.25, 0.5] and sorted(pm.tensors()) == ["a_gs", "w_gs", "w_sm90"]
    pr = GC.prepare_weights(CK.modelopt_experts(ck, "blk.experts.{e}.down", 2), device="cpu", backend="reference")
    assert pr.a_gs.tolist() == [0.25, 0.5] and torch.equal(pr.data, Q.stack_experts(ws).data)
    assert pr.to("cpu").a_gs.tolist() == [0.25, 0.5]                          # .to keeps every field
    no_inp = GC.prepare_weights([ModelOptNVFP4(w) for w in ws], device="cpu", backend="sm90")
    assert no_inp.a_gs is None
    with pytest.raises(KeyError, match="missing"):
        CK.modelopt_experts(ck, "blk.experts.{e}.down", 3)
    with pytest.raises(ValueError, match=r"\{e\}"):
        CK.modelopt_experts(ck, "blk.experts.0.down", 1)
    with pytest.raises(TypeError, match="NVFP4Experts"):
        GC.prepare_weights(torch.zeros(2, 16, 32))
    with pytest.raises(ValueError, match="no GEMM backend 'nope'"):
        GC.prepare_weights(ws, device="cpu", backend="nope")
    if not torch.cuda.is_available():                                         # the registry's choice for the CPU
        assert GC.prepare_weights(ws).backend == "reference"


# ---------------------------------------------------------------------------------------------
# wo_a: every token through every group


@pytest.mark.parametrize("T,Gn,K,N", [(1, 8, 64, 16), (5, 4, 96, 24), (3, 16, 48, 8)])
def test_wo_a_reference(T, Gn, K, N):
    g = gen(T * Gn)
    x = (torch.randn(T, Gn, K, generator=g) * 2).to(torch.bfloat16)
    v = GR.wo_a_view(x)
    assert v.shape == (Gn, T, K) and v.stride() == (K, Gn * K, 1) and v.data_ptr() == x.data_ptr()
    w = pow2_experts(Gn, N, K, seed=T)
    wd = w.dequantize().numpy().astype(np.float64)
    got = GR.ref_wo_a_nvfp4(x, w)
    assert got.shape == (T, Gn, N)
    assert np.array_equal(got.numpy(), np.einsum("bhr,hdr->bhd", x.float().numpy().astype(np.float64), wd))
    # NVFP4 activations with a per-(token, group) power-of-two global scale
    gs = torch.tensor([[2.0 ** -((t + h) % 5) for h in range(Gn)] for t in range(T)], dtype=torch.float32)
    xq = ref_quantize_nvfp4(x.float(), gs)
    assert xq.global_scale.shape == (T, Gn)
    got_q = GR.ref_wo_a_nvfp4(xq, w)
    want_q = np.einsum("bhr,hdr->bhd", ref_dequantize_nvfp4(xq).numpy().astype(np.float64), wd)
    assert np.array_equal(got_q.numpy(), want_q)
    vq = GR.wo_a_view(xq)
    assert vq.data.data_ptr() == xq.data.data_ptr() and vq.global_scale.shape == (Gn, T)
    with pytest.raises(ValueError, match="groups"):
        GR.ref_wo_a_nvfp4(x, pow2_experts(Gn + 1, N, K, seed=0))
    with pytest.raises(ValueError, match=r"\(T, G, K\)"):
        GR.wo_a_view(x[0])


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
    # c = 2 (lane % 4) = 0 -> lane 4 of warp 0, thread 4; value v3 = (r1, c+1) is the high half of fragment register 1,
    # which the decode takes as rotl(w, 12) & mask: code 7's magnitude bits (bf16 bits 22-24) come from word bits 10-12,
    # i.e. byte 1 of thread 4's word for K block 0 (bytes 64-67) = 0x1C
    assert S90.DECODE_ROTATIONS[1] == (12,)
    w_fp4 = torch.zeros(1, 64, 64, dtype=torch.uint8)
    w_fp4[0, 9, 0] = 0x70                              # element (9, 1) = code 7 (high nibble of byte 0 of row 9)
    sf = torch.zeros(1, 64, 8).to(torch.float8_e4m3fn)
    t = S90.tile_weights_sm90(w_fp4, sf).view(-1)
    nz = torch.nonzero(t[:4096]).flatten().tolist()
    assert nz == [65] and t[65].item() == 0x1C
    # the scale bytes of quad q: word i = r0's blocks (2i, 2i+1), then r1's
    sf = torch.zeros(1, 64, 8)
    sf[0, 9, 3] = 1.0                                  # row 9 = r1 of quad 1, K block 3 -> word 1, byte 3
    t = S90.tile_weights_sm90(torch.zeros(1, 64, 64, dtype=torch.uint8), sf.to(torch.float8_e4m3fn)).view(-1)
    nz = torch.nonzero(t[4096:]).flatten().tolist()
    assert nz == [16 + 4 + 3] and t[4096 + 23].item() == S90.scale_codes(torch.tensor([1.0])).item()


def test_sm90_decode_program():
    # the encoder inverts the decode program on every word (a linear bijection over GF(2): random words suffice to
    # catch a wrong term, and the all-ones / single-bit words pin every column)
    w = torch.cat([torch.randint(0, 2 ** 32, (4096,), generator=gen(7), dtype=torch.int64),
                   torch.tensor([0, 0xFFFFFFFF] + [1 << b for b in range(32)], dtype=torch.int64)])
    o = S90.decode_words(w)
    assert int((o & ~S90.BF16_CODE_MASK).abs().sum()) == 0          # every register holds code bits only
    assert torch.equal(S90.encode_words(o), w)
    # four rotations is the least: with three, the four registers' mask bits would have to tile the word, and no
    # three rotations of the mask are disjoint from it and each other with a fourth filling the rest
    M = {p for p in range(32) if S90.BF16_CODE_MASK >> p & 1}
    rot = lambda s: {(p - s) % 32 for p in M}
    tilings = [s for s in itertools.combinations(range(1, 32), 3) if len(M | rot(s[0]) | rot(s[1]) | rot(s[2])) == 32]
    assert tilings == []
    assert len({s for r in S90.DECODE_ROTATIONS for s in r} - {0}) == 4


def test_pick_config():
    pytest.importorskip("cutlass")                           # the candidates are what the kernel can run
    assert S90.pick_config(6, 256).tok_tile == 8            # 1 token top-6: 1 row per active expert
    assert S90.pick_config(192, 256).tok_tile == 8          # 192 rows over 192 experts at most
    assert S90.pick_config(1280, 256).tok_tile == 8         # 5 rows per expert: 1.5 x 5 = 7 fits 8
    assert S90.pick_config(2048, 256).tok_tile == 16        # 8 rows per expert: the tile holds 1.5x the mean (12)
    assert S90.pick_config(3072, 256).tok_tile == 32        # 12 rows per expert: 18
    assert S90.pick_config(8 * 21, 8).tok_tile == 32        # 21: 31
    assert S90.pick_config(8 * 22, 8).tok_tile == 32        # 22: 33 is past 32, the mean itself is asked: 32
    assert S90.pick_config(8 * 33, 8).tok_tile == 64
    assert S90.pick_config(12288, 256).tok_tile == 64       # 48
    assert S90.pick_config(49152, 256).tok_tile == 64       # 192: tok_tile 64 up to TT64_MAX_ROWS (measured)
    assert S90.pick_config(8 * 300, 8).tok_tile == 128      # 300
    assert S90.pick_config(8 * 32, 8).tok_tile == 32
    # four consumer warpgroups for tok_tile 64 where N (padded to 128) splits into 256-row units, never otherwise
    assert S90.pick_config(12288, 256, 4096, 4096) == S90.WIDE_CONFIG and S90.WIDE_CONFIG.wgs == 4
    assert S90.pick_config(49152, 256, 4096, 7168) == S90.WIDE_CONFIG                      # Pro's L2: 7168 = 28 x 256
    assert S90.pick_config(12288, 256, 4096, 4096 + 64) == S90.CONFIGS[64]                 # padded to 4224
    assert S90.pick_config(12288, 256, 4096, 384) == S90.CONFIGS[64]
    assert S90.pick_config(8 * 300, 8, 4096, 4096).wgs == 2
    # the decode tiles take four warpgroups once the 256-row units fill the SMs WIDE_MIN_WAVES times over: N = 4096
    # is 16 units per expert, so 33 experts (33 rows) are 528 = 4 x 132 units and 32 are not
    sms = S90.device_smem()[2]
    assert S90.pick_config(6, 256, 4096, 4096) == S90.CONFIGS[8]                           # T = 1: 96 units
    need = -(-S90.WIDE_MIN_WAVES * sms // 16)
    assert S90.pick_config(need, 256, 4096, 4096) == S90.DECODE_WIDE[8]
    assert S90.pick_config(need - 1, 256, 4096, 4096) == S90.CONFIGS[8]
    assert S90.pick_config(need, 256, 4096, 4096 + 64) == S90.CONFIGS[8]                   # 4224: no 256-row units
    assert S90.pick_config(3072, 256, 4096, 4096) == S90.DECODE_WIDE[32]
    assert all(c.wgs == 4 and c.stages == 6 for c in S90.DECODE_WIDE.values())


def test_plans_refuse_four_warpgroups_where_n_does_not_split():
    pytest.importorskip("cutlass")
    from dsv4_nvfp4.gemm import w4a8 as W
    for b, act in ((S90.Sm90Backend(), "bf16"), (W.Sm90W4A8Backend(), "fp8")):
        p = GC.Problem(12288, 256, 384, 4096, act, "bf16", True)
        assert b.plan(p).cfg.wgs == 2
        with pytest.raises(ValueError, match="256-row units: N = 384"):
            b.plan(p, S90.WIDE_CONFIG)
        assert b.plan(p._replace(n=512), S90.WIDE_CONFIG).cfg.wgs == 4


def test_smem_fits():
    for cfg in S90.CONFIGS.values():
        assert S90.smem_bytes(cfg) <= 227 * 1024, cfg


def test_launcher_bad_input_cpu():
    w = Q.quantize_experts(torch.randn(2, 64, 128, generator=gen(3)))
    pw = GC.prepare_weights(w, device="cpu", backend="sm90")               # Hopper's layout, built on the CPU
    a = torch.randn(4, 128).to(torch.bfloat16)
    offs = torch.tensor([2, 4], dtype=I32)
    with pytest.raises(TypeError, match="ExpertWeights"):
        GC.grouped_gemm_nvfp4(a, w, offs)
    with pytest.raises(TypeError, match="bf16"):
        GC.grouped_gemm_nvfp4(a.float(), pw, offs)
    with pytest.raises(ValueError, match="K mismatch"):
        GC.grouped_gemm_nvfp4(a[:, :96].contiguous(), pw, offs)
    with pytest.raises(ValueError, match="prepared for the sm90 backend, which does not run on cpu"):
        GC.grouped_gemm_nvfp4(a, pw, offs)
    with pytest.raises(TypeError, match="ExpertWeights"):
        GC.wo_a_nvfp4(a.view(4, 1, 128), w)
    with pytest.raises(ValueError, match="prepared for the sm90 backend, which does not run on cpu"):
        GC.wo_a_nvfp4(a.view(2, 2, 128), pw)


@pytest.mark.parametrize("tok_tile", sorted(S90.CONFIGS))
def test_sm90_kernel_compiles_without_gpu(tok_tile, monkeypatch):
    # CuTeDSL builds the kernel for sm_90a from fake tensors (no GPU): MLIR -> PTX -> cubin
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")       # compile_sm90 also passes --gpu-arch=sm_90a explicitly
    pytest.importorskip("cutlass")
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    cfg = S90.CONFIGS[tok_tile]
    assert S90K.compile_sm90(cfg) is not None
    if tok_tile == 16:
        assert S90K.compile_sm90(cfg._replace(epilogue=S90.Epilogue.WO_A_ROW_GS)) is not None
    if tok_tile in (16, 64):                            # the row map of the plain epilogues (the EP receiver's L2: per row)
        assert S90K.compile_sm90(cfg._replace(epilogue=S90.Epilogue.BF16_ROW_GS, row_map=True)) is not None
        assert S90K.compile_sm90(S90.WIDE_CONFIG._replace(epilogue=S90.Epilogue.BF16_ROW_GS, row_map=True)) is not None


def test_out_rows_reference_is_the_plain_product_scattered(monkeypatch):
    """`out_rows` on the reference backend: row i of C lands at out[out_rows[i]]; indices outside out's rows are not
    stored (the rest of out is untouched); the checks refuse what does not fit."""
    E, N, K = 3, 32, 64
    w = GC.prepare_weights(pow2_experts(E, N, K, seed=3), device="cpu", backend="reference")
    a = (torch.randn(10, K, generator=gen(4)) * 2).to(torch.bfloat16)
    offs = torch.tensor([2, 2, 10], dtype=I32)
    plain = GC.grouped_gemm_nvfp4(a, w, offs)
    to = torch.tensor([5, 0, 11, 3, -1, 12, 7, 1, 2, 4], dtype=I32)       # 12: outside out's 12 rows; -1 likewise
    out = torch.full((12, N), 7.0, dtype=torch.bfloat16)
    assert GC.grouped_gemm_nvfp4(a, w, offs, out=out, out_rows=to) is out
    for i in range(10):
        if 0 <= to[i] < 12: assert torch.equal(out[to[i]], plain[i]), i
    assert bool((out[[6, 8, 9, 10]] == 7).all())                           # no row was mapped there
    with pytest.raises(ValueError, match="needs out="): GC.grouped_gemm_nvfp4(a, w, offs, out_rows=to)
    with pytest.raises(TypeError, match="out_rows"): GC.grouped_gemm_nvfp4(a, w, offs, out=out, out_rows=to.long())
    with pytest.raises(ValueError, match=r"out_rows must be \(10,\)"): GC.grouped_gemm_nvfp4(a, w, offs, out=out, out_rows=to[:9])
    with pytest.raises(ValueError, match="out"): GC.grouped_gemm_nvfp4(a, w, offs, out=torch.empty(12, N + 1, dtype=torch.bfloat16), out_rows=to)
    monkeypatch.setattr(GR.ReferenceBackend, "stores_rows", False)
    with pytest.raises(ValueError, match="cannot store rows"): GC.grouped_gemm_nvfp4(a, w, offs, out=out, out_rows=to)


def test_in_rows_reads_the_mapped_rows():
    """`in_rows`: routed row i reads a[in_rows[i]] (a of T token rows), the product of the gathered rows bit for bit; an
    index outside a's rows reads a zero row (check=True refuses it); bf16 activations only; the checks refuse the rest."""
    E, N, K, T = 3, 32, 64, 4
    w = GC.prepare_weights(pow2_experts(E, N, K, seed=5), device="cpu", backend="reference")
    x = (torch.randn(T, K, generator=gen(6)) * 2).to(torch.bfloat16)
    offs = torch.tensor([3, 3, 8], dtype=I32)
    rows = torch.tensor([2, 0, 3, 1, 1, 3, 0, 2], dtype=I32)
    assert torch.equal(GC.grouped_gemm_nvfp4(x, w, offs, in_rows=rows), GC.grouped_gemm_nvfp4(x[rows.long()], w, offs))
    bad = rows.clone(); bad[1], bad[6] = -1, T                          # outside a's rows: zero rows
    xz = x[rows.long()].clone(); xz[[1, 6]] = 0
    got = GC.grouped_gemm_nvfp4(x, w, offs, in_rows=bad)
    assert torch.equal(got, GC.grouped_gemm_nvfp4(xz, w, offs)) and bool((got[[1, 6]] == 0).all())
    assert torch.equal(GC.gather_rows(x, bad), xz) and GC.gather_rows(x[:0], bad).shape == (8, K)
    with pytest.raises(ValueError, match="outside a's 4 rows"): GC.grouped_gemm_nvfp4(x, w, offs, in_rows=bad, check=True)
    with pytest.raises(TypeError, match="in_rows"): GC.grouped_gemm_nvfp4(x, w, offs, in_rows=rows.long())
    with pytest.raises(ValueError, match="offsets|8"): GC.grouped_gemm_nvfp4(x, w, offs, in_rows=rows[:7], check=True)
    x4 = Q.ref_quantize_nvfp4(x.float()) if hasattr(Q, "ref_quantize_nvfp4") else ref_quantize_nvfp4(x.float())
    with pytest.raises(ValueError, match="bf16 activations"): GC.grouped_gemm_nvfp4(x4, w, offs, in_rows=rows)


def test_in_rows_sm90_plans_the_gather_variant(monkeypatch):
    """The sm90 backend reads `in_rows` in the kernel (the gather variant, the map passed to the launch) at the decode
    tiles of the plain kind, and gathers first everywhere else (a tile past GATHER_MAX_TT, with out_rows); the kernel
    refuses the variant where it is not built (recorded launches on CPU tensors made to look like a Hopper device). The
    plan's own choice gathers at up to one routed row per expert on average; a configuration given gathers wherever it can."""
    pytest.importorskip("cutlass")
    from dsv4_nvfp4 import runtime as rt
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    monkeypatch.setattr(rt, "_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(GC, "_FAST", {})
    calls = []
    monkeypatch.setattr(S90K, "run_sm90", lambda cfg, w, a, *args, gather_map=None, **kw: calls.append((cfg, a, gather_map)))
    pw = GC.prepare_weights(Q.quantize_experts(torch.randn(8, 128, 256, generator=gen(9))), device="cpu", backend="sm90")
    x, offs = torch.randn(3, 256).to(torch.bfloat16), torch.tensor([1, 3, 3, 6, 6, 6, 6, 6], dtype=I32)
    rows = torch.tensor([2, 0, 1, 2, 0, 1], dtype=I32)
    GC.grouped_gemm_nvfp4(x, pw, offs, out=torch.empty(6, 128, dtype=torch.bfloat16), in_rows=rows)
    GC.grouped_gemm_nvfp4(x[rows.long()], pw, offs, out=torch.empty(6, 128, dtype=torch.bfloat16))
    (c1, a1, m1), (c2, a2, m2) = calls
    assert c1.gather and a1 is x and m1 is rows and not c2.gather and m2 is None and c1._replace(gather=False) == c2
    calls.clear()                                                     # a prefill tile: gathered first, the plain variant
    GC.grouped_gemm_nvfp4(x, pw, offs, out=torch.empty(6, 128, dtype=torch.bfloat16), in_rows=rows, config=S90.CONFIGS[64])
    ((c3, a3, m3),) = calls
    assert not c3.gather and m3 is None and torch.equal(a3, x[rows.long()])
    from dsv4_nvfp4.gemm.sm90_kernel import GATHER_MAX_TT
    b = S90.Sm90Backend()
    p = GC.Problem(6, 256, 4096, 4096, in_rows=True)
    assert b.gathers(p) and b.plan(p).cfg.gather
    assert not b.gathers(p._replace(rows=12288)) and not b.gathers(p._replace(out_rows=True))
    assert b.gathers(p._replace(rows=256)) and not b.gathers(p._replace(rows=257))          # one routed row per expert on average
    assert S90.pick_config(257, 256, 4096, 4096).tok_tile <= GATHER_MAX_TT and b.gathers(p._replace(rows=257), S90.CONFIGS[16])
    assert not b.gathers(p._replace(epilogue="swiglu_bf16")) and not b.gathers(p._replace(in_rows=False))
    from dsv4_nvfp4.gemm.sm90_kernel import GroupedGemmSm90
    lim = dict(smem_limit=S90.HOPPER_SMEM_PER_BLOCK)
    for tt in (8, 16, 32):
        assert tt <= GATHER_MAX_TT and GroupedGemmSm90.can_implement(S90.CONFIGS[tt]._replace(gather=True), 4, 256, **lim)[0]
    for cfg in (S90.CONFIGS[64]._replace(gather=True), S90.CONFIGS[16]._replace(gather=True, row_map=True),
                S90.CONFIGS[16]._replace(gather=True, epilogue=S90.Epilogue.SWIGLU_BF16),
                S90.CONFIGS[16]._replace(gather=True, epilogue=S90.Epilogue.BF16_ROW_GS, fp8=True, overlap=False)):
        ok, why = GroupedGemmSm90.can_implement(cfg, 4, 256, **lim)
        assert not ok and "gather" in why, cfg


def test_out_rows_sm90_plans_the_row_map_variant(monkeypatch):
    """The sm90 backend plans `out_rows` as the kernel's row-map variant of the plain epilogue and passes the map to
    the launch (recorded here, not executed: CPU tensors made to look like a Hopper device); the plain call does not,
    and W4A8's backend refuses it (its loop's map is not built)."""
    pytest.importorskip("cutlass")
    from dsv4_nvfp4 import runtime as rt
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    monkeypatch.setattr(rt, "_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(GC, "_FAST", {})
    calls = []
    monkeypatch.setattr(S90K, "run_sm90", lambda cfg, *args, row_map=None, **kw: calls.append((cfg, row_map)))
    pw = GC.prepare_weights(Q.quantize_experts(torch.randn(4, 128, 256, generator=gen(9))), device="cpu", backend="sm90")
    a, offs = torch.randn(6, 256).to(torch.bfloat16), torch.tensor([1, 3, 3, 6], dtype=I32)
    to = torch.tensor([5, 4, 3, 2, 1, 0], dtype=I32)
    GC.grouped_gemm_nvfp4(a, pw, offs, out=torch.empty(6, 128, dtype=torch.bfloat16), out_rows=to)
    GC.grouped_gemm_nvfp4(a, pw, offs, out=torch.empty(6, 128, dtype=torch.bfloat16))
    (c1, m1), (c2, m2) = calls
    assert c1.row_map and m1 is to and not c2.row_map and m2 is None
    assert c1._replace(row_map=False) == c2
    ok, why = S90.Sm90Backend().can_implement(GC.Problem(6, 4, 256, 256, epilogue="swiglu_bf16", out_rows=True))
    assert not ok and "plain bf16" in why
    from dsv4_nvfp4.gemm import w4a8 as W8
    assert not W8.Sm90W4A8Backend.stores_rows                        # W4A8's plan drops a caller's row map; the kernel
    p8 = GC.Problem(6, 4, 256, 256, act="fp8", per_row=True)          # refuses the fp8 loop with one
    assert not W8.Sm90W4A8Backend().plan(p8, S90.CONFIGS[16]._replace(row_map=True)).cfg.row_map
    from dsv4_nvfp4.gemm.sm90_kernel import GroupedGemmSm90
    ok, why = GroupedGemmSm90.can_implement(S90.CONFIGS[16]._replace(epilogue=S90.Epilogue.BF16_ROW_GS, fp8=True, overlap=False, row_map=True), 4, 256,
                                            smem_limit=S90.HOPPER_SMEM_PER_BLOCK)
    assert not ok and "fp8" in why


def test_launch_fast_path_keeps_every_check(monkeypatch):
    """After a good call the plain op takes the sm90 backend's fast path; any argument the full checks would refuse
    still gets the full (checked) path and its error (run on CPU tensors made to look like a Hopper device, the launch
    recorded, not executed)."""
    pytest.importorskip("cutlass")
    from dsv4_nvfp4 import runtime as rt
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    monkeypatch.setattr(rt, "_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(GC, "_FAST", {})
    assert GC.backend_for("cpu").name == "sm90"
    calls = []
    monkeypatch.setattr(S90K, "run_sm90", lambda cfg, w_sm90, a, out, offs, gs_w, gs_a, *optional, **kw:
                        calls.append((cfg.tok_tile, a.shape, out.data_ptr())))
    pw = GC.prepare_weights(Q.quantize_experts(torch.randn(4, 128, 256, generator=gen(9))), device="cpu", backend="sm90")
    a = torch.randn(6, 256).to(torch.bfloat16)
    offs = torch.tensor([1, 3, 3, 6], dtype=I32)
    out = torch.empty(6, 128, dtype=torch.bfloat16)
    checked = []
    acts = GC.check_activations
    monkeypatch.setattr(GC, "check_activations", lambda *args, **kw: checked.append(1) or acts(*args, **kw))
    for _ in range(3): GC.grouped_gemm_nvfp4(a, pw, offs, out=out)
    assert len(calls) == 3 and len(checked) == 1, "the 2nd and 3rd calls take the fast path"
    assert calls[1:] == calls[:1] * 2
    GC.grouped_gemm_nvfp4(torch.randn(7, 256).to(torch.bfloat16), pw, torch.tensor([1, 3, 3, 7], dtype=I32),
                          out=torch.empty(7, 128, dtype=torch.bfloat16))
    assert len(calls) == 4 and len(checked) == 2, "a new row count is planned on the checked path first"

    def refused(exc, match, *args, **kw):
        n = len(checked)
        with pytest.raises(exc, match=match):
            GC.grouped_gemm_nvfp4(*args, **kw)
        assert len(checked) == n + 1, f"{match}: the fast path did not hand the call to the checked path"
    refused(ValueError, "activations must be contiguous", torch.empty(64, 300).to(torch.bfloat16)[:6, :256], pw, offs, out=out)
    refused(ValueError, "contiguous", a, pw, offs, out=torch.empty(6, 256, dtype=torch.bfloat16)[:, :128])
    refused(TypeError, "int32", a, pw, offs.long(), out=out)
    refused(ValueError, r"\(E,\)", a, pw, offs[:3], out=out)
    refused(ValueError, "out must have shape", a, pw, offs, out=torch.empty(6, 136, dtype=torch.bfloat16))
    refused(TypeError, "out must be bfloat16", a, pw, offs, out=out.float())
    refused(ValueError, "K mismatch", torch.randn(6, 128).to(torch.bfloat16), pw, offs, out=out)
    refused(TypeError, "bf16", a.half(), pw, offs, out=out)
    refused(ValueError, "the activations are on meta", a.to("meta"), pw, offs.to("meta"), out=out.to("meta"))
    refused(ValueError, "offsets.* is on meta", a, pw, offs.to("meta"), out=out)
    assert len(calls) == 4
    # a misaligned `out` is not launched by the fast path either (the checked path refuses it on a CUDA device:
    # check_operand's alignment check is for CUDA tensors, see test_bad_input_gpu; on these CPU tensors it launches)
    n = len(checked)
    GC.grouped_gemm_nvfp4(a, pw, offs, out=torch.empty(6 * 128 + 1, dtype=torch.bfloat16)[1:].view(6, 128))
    assert len(checked) == n + 1 and len(calls) == 5
    GC.grouped_gemm_nvfp4(a, pw, offs, out=out)                           # and the good call is fast again
    assert len(checked) == n + 1 and len(calls) == 6


def test_checked_path_refuses_strided_activations(monkeypatch):
    "Strided bf16 activations are refused before any launch (the sm90 kernel's TMA reads rows as contiguous)."
    pytest.importorskip("cutlass")
    from dsv4_nvfp4 import runtime as rt
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    monkeypatch.setattr(rt, "_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(GC, "_FAST", {})
    calls = []
    monkeypatch.setattr(S90K, "run_sm90", lambda *args, **kw: calls.append(1))
    pw = GC.prepare_weights(Q.quantize_experts(torch.randn(4, 128, 256, generator=gen(9))), device="cpu", backend="sm90")
    with pytest.raises(ValueError, match="contiguous"):
        GC.grouped_gemm_nvfp4(torch.empty(64, 300).to(torch.bfloat16)[:6, :256], pw, torch.tensor([1, 3, 3, 6], dtype=I32))
    assert not calls


@pytest.mark.parametrize("tok_tile", sorted(S90.CONFIGS))
def test_sm90_variants_no_spills_and_no_serialized_wgmma(tok_tile, tmp_path, monkeypatch):
    """ptxas (when installed: the GPU host has it) on the PTX of the plain kernel and of its heaviest epilogue (SwiGLU
    with the NVFP4 quantization of h): no register spills, and no warning that the WGMMAs are serialized (C7511 /
    C7512, for lack of registers, which would put a full wait after every WGMMA)."""
    import re, shutil, subprocess
    ptxas = shutil.which("ptxas")
    if ptxas is None: pytest.skip("ptxas is not installed")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    pytest.importorskip("cutlass")
    base = S90.CONFIGS[tok_tile]
    from dsv4_nvfp4.gemm import sm90_kernel as S90K
    for n, cfg in enumerate([base, base._replace(epilogue=S90.Epilogue.SWIGLU_NVFP4)]):
        d = tmp_path / str(n); d.mkdir()
        (ptx := d / "k.ptx").write_bytes(S90K.kernel_artifact(cfg, "ptx"))
        rep = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(d / "k.cubin")], capture_output=True, text=True)
        assert rep.returncode == 0, rep.stderr[-2000:]
        assert "serialized" not in rep.stderr, f"{cfg}: ptxas serialized the WGMMAs: {rep.stderr[-600:]}"
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", rep.stderr)]
        assert spills and max(spills) == 0, f"{cfg}: spills {spills}"


def test_sms_free_is_checked():
    "The SMs a launch leaves free are an argument, a non-negative int: anything else is refused by name."
    for bad in (-1, 1.5, True, "4", None):
        with pytest.raises(ValueError, match="sms_free must be an int >= 0"): GC.check_sms_free(bad, "grouped_gemm_nvfp4")
    for ok in (0, 8, 132): GC.check_sms_free(ok, "grouped_gemm_nvfp4")


# ================================================================================================================
# The seam: a backend is one class and one registry line; the ops, the expert MLP and the MoE layer run on whichever
# backend the weights were prepared for; the reference backend is the spec; weights of one backend are refused by
# another; plans are chosen once per problem.
from dataclasses import dataclass
from typing import ClassVar

from dsv4_nvfp4 import moe as M
from dsv4_nvfp4 import swiglu as S


@dataclass(eq=False, repr=False)
class ToyWeights(GC.ExpertWeights):
    backend: ClassVar[str] = "toy"
    w: torch.Tensor = None                      # float64 (E, N, K): e2m1 * s (ml_dtypes' decode), cropped to K


class ToyBackend(GC.Backend):
    """A backend written against the seam's contract only: float64 matmuls of its own decode, the plain bf16 and the
    SwiGLU-bf16 epilogues (its own de-interleave and clamp), bf16 activations only."""
    weights_type = ToyWeights

    def __init__(self): self.launches = []
    def supports(self, device): return torch.device(device).type == "cpu"
    def prepare(self, experts, a_gs):
        K = experts.shape[2]
        return ToyWeights(tuple(experts.shape), experts.global_scale.float().contiguous(), a_gs,
                          torch.from_numpy(e2m1_times_s(experts.data, experts.scale)[..., :K]))
    def can_implement(self, p):
        if p.act != "bf16" or p.epilogue not in ("bf16", "swiglu_bf16"):
            return False, "the toy runs bf16 activations with the plain or the SwiGLU-bf16 epilogue"
        return True, ""
    def plan(self, p, config=None): return p
    def run(self, plan, a, w, offsets, out, epi, workspace=None):
        self.launches.append(plan.epilogue)
        R = a.shape[0]
        c = torch.zeros(R, w.shape[1], dtype=torch.float64)
        start = 0
        for e, end in enumerate(offsets.tolist()):
            c[start:end] = a[start:end].double() @ w.w[e].T * w.w_gs[e].double()
            start = end
        if plan.epilogue == "bf16": return out.copy_(c)
        rs = epi.row_scales.double()
        gu = (c * rs[:, :1]).view(R, -1, 2, 8)                  # rows [g0..7, u0..7, g8..15, ...]
        g, u = gu[:, :, 0].reshape(R, -1), gu[:, :, 1].reshape(R, -1)
        L = plan.swiglu_limit
        h = torch.nn.functional.silu(g.clamp(max=L)) * u.clamp(-L, L) * rs[:, 1:]
        return out.copy_(h.float())


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


SEAM_CFG = M.MoEConfig(hidden=64, inter=32, num_experts=4, top_k=2, routed_scaling_factor=1.5)


def test_a_registered_backend_runs_the_ops_the_mlp_and_the_moe_layer(monkeypatch):
    "A backend added by `register_backend` runs grouped_gemm_nvfp4, expert_mlp_nvfp4 and DSV4MoE.forward on the CPU."
    monkeypatch.setattr(GC, "_FAST", {})
    toy = ToyBackend()
    GC.register_backend("toy", toy)
    try:
        assert GC.backend_names()[-1] == "toy" and GC.get_backend("toy") is toy and toy.name == "toy"
        assert GC.backend_for("cpu").name == "reference"                    # appended: the device's choice is unchanged
        g = gen(11)
        E, N, K = 3, 48, 80
        we = Q.quantize_experts(torch.randn(E, N, K, generator=g))
        pt = GC.prepare_weights(we, device="cpu", backend="toy")
        assert type(pt) is ToyWeights and pt.backend == "toy"
        a = torch.randn(9, K, generator=g).to(torch.bfloat16)
        offs = torch.tensor([4, 4, 9], dtype=I32)
        y = GC.grouped_gemm_nvfp4(a, pt, offs)
        assert toy.launches == ["bf16"] and y.dtype == torch.bfloat16 and y.shape == (9, N)
        assert rel_err(y, GR.ref_grouped_gemm_nvfp4(a, we, offs)) < 4e-3            # bf16 rounding of the output
        with pytest.raises(ValueError, match="the toy backend cannot run this problem"):
            GC.grouped_gemm_nvfp4(ref_quantize_nvfp4(a.float()), pt, offs)
        # the expert MLP: the fused L1 (SwiGLU epilogue) and the L2, both through the toy
        H, I = 64, 32
        w13e = S.interleave_experts(Q.quantize_experts(torch.randn(E, I, H, generator=g)),
                                    Q.quantize_experts(torch.randn(E, I, H, generator=g)), unify=True)
        w2e = Q.quantize_experts(torch.randn(E, H, I, generator=g))
        p13, p2 = (GC.prepare_weights(w, device="cpu", backend="toy") for w in (w13e, w2e))
        x = torch.randn(9, H, generator=g).to(torch.bfloat16)
        p = torch.rand(9, generator=g)
        toy.launches.clear()
        y = S.expert_mlp_nvfp4(x, p13, p2, offs, route_weight=p)
        assert toy.launches == ["swiglu_bf16", "bf16"]
        assert rel_err(y, S.ref_expert_mlp(x, w13e, w2e, offs, route_weight=p)) < 1e-2
        with pytest.raises(ValueError, match="the toy backend cannot run this problem"):
            S.expert_mlp_nvfp4(ref_quantize_nvfp4(x.float(), per_row=True), p13, p2, offs, act="w4a4",
                               route_weight=p, a2_scales=torch.ones(E))
        # the MoE layer on the CPU, its expert GEMMs on the toy
        layer = M.DSV4MoE.synthetic(SEAM_CFG, seed=5)
        layer.backend = "toy"
        xt = torch.randn(7, SEAM_CFG.hidden, generator=g).to(torch.bfloat16)
        toy.launches.clear()
        y = layer(xt)
        assert toy.launches == ["swiglu_bf16", "bf16"]
        assert all(type(w) is ToyWeights for w in layer.prepared("cpu"))
        assert y.dtype == torch.bfloat16 and y.shape == xt.shape
        assert rel_err(y, M.ref_moe(xt, layer)) < 1e-2
    finally:
        GC.unregister_backend("toy")
    assert "toy" not in GC.backend_names()
    with pytest.raises(ValueError, match="no GEMM backend 'toy'"):
        GC.grouped_gemm_nvfp4(a, pt, offs)


@pytest.mark.parametrize("act", ["w4a16", "w4a4"])
def test_reference_backend_moe_forward_is_ref_moe_bit_for_bit(act):
    "On the CPU the layer runs through the reference backend: `ref_moe` rounded to bf16, bit for bit, whole or sliced."
    layer = M.DSV4MoE.synthetic(SEAM_CFG, seed=2, act=act)
    x = torch.randn(9, SEAM_CFG.hidden, generator=gen(4)).to(torch.bfloat16)
    y = layer(x)
    assert all(type(w) is GR.ReferenceWeights for w in layer.prepared("cpu"))      # the registry's choice for the CPU
    assert y.dtype == torch.bfloat16 and torch.equal(y, M.ref_moe(x, layer).to(torch.bfloat16))
    layer.backend = "reference"                                                   # named: the same backend, the same bits
    assert torch.equal(layer(x), y)
    for experts, shared in (([0, 2], True), ([1, 3], False)):                     # expert-parallel slices
        part = layer.local(experts, shared)
        assert part.backend == "reference"
        assert torch.equal(part(x), M.ref_moe(x, part).to(torch.bfloat16)), (experts, shared)


def nvfp4_bytes(E, N, K):
    "The NVFP4 matrix itself: codes (1/2 byte), e4m3 block scales (1/16 byte) per weight, one fp32 global scale per expert."
    return E * N * K // 2 + E * N * K // 16 + 4 * E


def test_flash_layer_sm90_weights_hold_the_nvfp4_bytes_only():
    """A DSV4-Flash-shaped layer (H = 4096, I = 2048; 2 routed experts + the shared one) prepared for Hopper holds at
    most 1.05x the NVFP4 bytes of w13 and w2: the slabs are a permutation of the codes and scales, nothing else is kept."""
    cfg = M.FLASH._replace(num_experts=2)
    E, H, I = cfg.num_experts + 1, cfg.hidden, cfg.inter
    g = gen(0)
    def experts(N, K):                              # random codes, every block scale 1: no quantizer run on gigabytes
        return Q.NVFP4Experts(torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g),
                              torch.ones(E, N, K // 16).to(torch.float8_e4m3fn), torch.ones(E), (E, N, K))
    layer = M.DSV4MoE(cfg, experts(2 * I, H), experts(H, I), torch.zeros(cfg.num_experts, H, dtype=torch.bfloat16))
    layer.backend = "sm90"
    w13p, w2p = layer.prepared("cpu")                  # laid out on the CPU (it runs on Hopper only)
    for w, (N, K) in ((w13p, (2 * I, H)), (w2p, (H, I))):
        assert type(w) is S90.Sm90Weights and w.shape == (E, N, K) and sorted(w.tensors()) == ["w_gs", "w_sm90"]
        assert nvfp4_bytes(E, N, K) <= w.nbytes <= 1.05 * nvfp4_bytes(E, N, K), (w.shape, w.nbytes, nvfp4_bytes(E, N, K))
    assert list(layer._prepared) == [(torch.device("cpu"), "sm90")]            # only that backend's layout is held


def test_weights_of_one_backend_are_refused_by_another(monkeypatch):
    "Each op refuses weights prepared for a backend that does not run on the activations' device, naming both backends."
    g = gen(6)
    E, H, I = 2, 64, 32
    w13e = S.interleave_experts(Q.quantize_experts(torch.randn(E, I, H, generator=g)),
                                Q.quantize_experts(torch.randn(E, I, H, generator=g)), unify=True)
    w2e = Q.quantize_experts(torch.randn(E, H, I, generator=g))
    x = torch.randn(5, H, generator=g).to(torch.bfloat16)
    offs = torch.tensor([2, 5], dtype=I32)
    r13, r2 = (GC.prepare_weights(w, device="cpu", backend="reference") for w in (w13e, w2e))
    for other in ("sm90", "sm100"):
        o13, o2 = (GC.prepare_weights(w, device="cpu", backend=other) for w in (w13e, w2e))
        msg = rf"prepared for the {other} backend, which does not run on cpu \(there: reference\)"
        with pytest.raises(ValueError, match=msg):
            GC.grouped_gemm_nvfp4(x, o13, offs)
        with pytest.raises(ValueError, match=msg):
            GC.wo_a_nvfp4(x.view(5, 1, H).expand(5, E, H).contiguous(), o13)
        with pytest.raises(ValueError, match=msg):
            S.grouped_gemm_swiglu_nvfp4(x, o13, offs)
        with pytest.raises(ValueError, match=msg):
            S.expert_mlp_nvfp4(x, o13, o2, offs)
        with pytest.raises(ValueError, match=msg):                            # mixed: L1 on the reference, L2 refused
            S.expert_mlp_nvfp4(x, r13, o2, offs)
    # weights on another device than the activations: both devices named
    with pytest.raises(ValueError, match="prepared for the reference backend on cpu, the activations are on meta"):
        GC.grouped_gemm_nvfp4(x.to("meta"), r13, offs.to("meta"))
    # on a (mocked) Hopper device the registry picks sm90: Blackwell's weights are refused there, naming sm90
    from dsv4_nvfp4 import runtime as rt
    monkeypatch.setattr(rt, "_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert GC.backend_for("cpu").name == "sm90"
    b13 = GC.prepare_weights(w13e, device="cpu", backend="sm100")
    with pytest.raises(ValueError, match=r"prepared for the sm100 backend, which does not run on cpu \(there: sm90\)"):
        GC.grouped_gemm_nvfp4(x, b13, offs)


def test_plan_for_caches_and_verbose_prints_once_per_problem(monkeypatch, capsys):
    "`plan_for` returns the same plan object for the same (backend, problem, config); DSV4_VERBOSE=1 prints it once."
    pytest.importorskip("cutlass")
    monkeypatch.setattr(GC, "_PLANS", {})
    monkeypatch.setenv("DSV4_VERBOSE", "1")
    b = GC.get_backend("sm90")
    p = GC.Problem(777, 256, 4096, 4096)
    first = GC.plan_for(b, p)
    assert isinstance(first, S90.Sm90Plan) and first.cfg == S90.pick_config(777, 256, p.k, p.n)
    assert b.plan(p) is not first                                        # the backend makes a new plan each time ...
    for _ in range(3): assert GC.plan_for(b, GC.Problem(*p)) is first    # ... plan_for hands back the cached one
    second = GC.plan_for(b, p._replace(rows=778))
    forced = GC.plan_for(b, p, S90.CONFIGS[128])
    assert forced.cfg.tok_tile == 128 and GC.plan_for(b, p, S90.CONFIGS[128]) is forced and second is not first
    lines = [l for l in capsys.readouterr().err.splitlines() if "sm90 plan for" in l]
    assert len(lines) == 3 and "rows=777" in lines[0] and "rows=778" in lines[1] and "tok_tile=128" in lines[2], lines
    with pytest.raises(ValueError, match="the sm90 backend cannot run this problem: at most 1024 experts"):
        GC.plan_for(b, p._replace(experts=1025))
    # through an op: the reference backend's plan is printed on the first call of a problem only
    we = Q.quantize_experts(torch.randn(2, 32, 64, generator=gen(1)))
    pr = GC.prepare_weights(we, device="cpu", backend="reference")
    a = torch.randn(3, 64).to(torch.bfloat16)
    for _ in range(3): GC.grouped_gemm_nvfp4(a, pr, torch.tensor([1, 3], dtype=I32))
    assert len([l for l in capsys.readouterr().err.splitlines() if "reference plan for" in l]) == 1
    monkeypatch.setenv("DSV4_VERBOSE", "0")
    GC.plan_for(b, p._replace(rows=779))
    assert "plan for" not in capsys.readouterr().err
