"""Tests for dsv4_nvfp4.quant: NVFP4 block quantization, NVFP4Tensor, ModelOpt checkpoints.

Expected values come from
* hand arithmetic (written next to each constant), or
* ``ref_quantize`` / ``ref_dequantize`` below: an independent numpy float32 transcription of the
  numerics formulas of nbs/01_quantize.ipynb, with ml_dtypes as the E2M1 / E4M3 rounding oracle.
"""
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4_nvfp4 import checkpoint as CK
from dsv4_nvfp4 import quant as Q

F4 = ml_dtypes.float4_e2m1fn
F8 = ml_dtypes.float8_e4m3fn
E2M1_NP = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
GS_MIN = np.float32(2.0**-110)


# ---------------------------------------------------------------------------------------------
# independent numpy reference (the Math section of nbs/01_quantize.ipynb)


def ref_e2m1(v):
    return np.asarray(v, np.float32).astype(F4).view(np.uint8) & np.uint8(0xF)


def ref_global_scale(amax):
    g = np.asarray(np.asarray(amax, np.float32) / np.float32(2688.0), np.float32)
    return np.where(g == 0, np.float32(1.0), np.maximum(g, GS_MIN)).astype(np.float32)


def ref_quantize(x, gs=None, per_row=False):
    """Returns (codes (..., Kp) uint8, scale bytes (..., Kp/16) uint8, gs float32 array)."""
    x = np.asarray(x, np.float32)
    lead, K = x.shape[:-1], x.shape[-1]
    Kp = -(-K // 16) * 16
    xp = np.zeros(lead + (Kp,), np.float32)
    xp[..., :K] = x
    if gs is None:
        amax = np.abs(x).max(axis=-1) if per_row else np.abs(x).max()
        g = ref_global_scale(amax)
    else:
        g = np.asarray(gs, np.float32)
    gb = g[..., None] if g.ndim else g
    blocks = xp.reshape(lead + (Kp // 16, 16))
    bamax = np.abs(blocks).max(axis=-1)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        u = np.minimum(bamax / (np.float32(6.0) * gb), np.float32(448.0)).astype(np.float32)
        s8 = u.astype(F8)  # RNE into e4m3 (ml_dtypes)
        s = s8.astype(np.float32)
        r = (np.float32(1.0) / (s * gb)).astype(np.float32)
        y = (blocks * r[..., None]).astype(np.float32)
    zero = (s == 0)[..., None]
    y = np.where(zero, np.float32(0.0), y)
    codes = np.where(zero, np.uint8(0), ref_e2m1(y)).astype(np.uint8)
    return codes.reshape(lead + (Kp,)), s8.view(np.uint8), g


def ref_dequantize(codes, sbytes, g, K):
    lead, Kp = codes.shape[:-1], codes.shape[-1]
    s = sbytes.view(F8).astype(np.float32)
    e = E2M1_NP[codes].reshape(lead + (Kp // 16, 16))
    gb = np.asarray(g, np.float32)
    gb = gb[..., None, None] if gb.ndim else gb
    y = ((e * s[..., None]).astype(np.float32) * gb).astype(np.float32)
    return y.reshape(lead + (Kp,))[..., :K]


def np_unpack(data):
    d = np.asarray(data, np.uint8)
    return np.stack([d & 0xF, d >> 4], axis=-1).reshape(d.shape[:-1] + (2 * d.shape[-1],))


def np_pack(codes):
    c = np.asarray(codes, np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def scale_bytes(t):
    assert t.scale.dtype == torch.float8_e4m3fn
    return t.scale.view(torch.uint8).numpy()


def bits32(a):
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def check_against_ref(t, x_np, gs=None, per_row=False):
    codes, sb, g = ref_quantize(x_np, gs, per_row)
    K = x_np.shape[-1]
    Kp = codes.shape[-1]
    lead = x_np.shape[:-1]
    assert isinstance(t, Q.NVFP4Tensor)
    assert tuple(t.shape) == x_np.shape
    assert t.data.dtype == torch.uint8 and tuple(t.data.shape) == lead + (Kp // 2,)
    assert tuple(t.scale.shape) == lead + (Kp // 16,)
    assert t.global_scale.dtype == torch.float32
    assert tuple(t.global_scale.shape) == g.shape
    got_codes = np_unpack(t.data.numpy())
    bad = np.argwhere(got_codes != codes)
    assert bad.size == 0, (
        f"{len(bad)} codes differ, first at {bad[0].tolist()}: got {got_codes[tuple(bad[0])]}, "
        f"want {codes[tuple(bad[0])]}"
    )
    got_sb = scale_bytes(t)
    bad = np.argwhere(got_sb != sb)
    assert bad.size == 0, (
        f"{len(bad)} scale bytes differ, first at {bad[0].tolist()}: got {got_sb[tuple(bad[0])]:#x}, "
        f"want {sb[tuple(bad[0])]:#x}"
    )
    assert np.array_equal(bits32(t.global_scale.numpy()), bits32(g))
    # dequantize: (e2m1 * s) * gs in fp32, cropped to K
    deq = t.dequantize()
    assert deq.dtype == torch.float32 and tuple(deq.shape) == x_np.shape
    assert np.array_equal(bits32(deq.numpy()), bits32(ref_dequantize(codes, sb, g, K)))
    return codes, sb, g


def T(a, dtype=torch.float32):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(a, np.float32))).to(dtype)


# ---------------------------------------------------------------------------------------------
# the reference itself agrees with hand arithmetic (guards against a wrong reference)


def test_reference_sanity():
    x = np.array([[6, 0.25, 2.5, 5, -0.25, -2.5, -5, 0.75, 1.25, 1.75, 3.5, -3.5, 0, -0.0, 0.1, -0.1]],
                 np.float32)
    c, sb, g = ref_quantize(x, 1.0)
    assert c.tolist() == [[7, 0, 4, 6, 8, 12, 14, 2, 2, 4, 6, 14, 0, 8, 0, 8]]
    assert sb.tolist() == [[0x38]]  # e4m3 1.0 = 0 0111 000


# ---------------------------------------------------------------------------------------------
# global_scale_from_amax


def test_global_scale_from_amax_values():
    f = Q.global_scale_from_amax
    assert f(torch.tensor(2688.0)).item() == 1.0  # 2688 / 2688
    assert f(torch.tensor(5376.0)).item() == 2.0
    assert f(torch.tensor(0.0)).item() == 1.0  # amax == 0 -> 1
    assert f(torch.tensor(1e-45)).item() == 1.0  # 1.4e-45 / 2688 underflows to 0 -> 1
    assert f(torch.tensor(1e-30)).item() == 2.0**-110  # 3.7e-34 < 2**-110 = 7.7e-34 -> clamp
    out = f(torch.tensor(5.0))
    assert out.dtype == torch.float32
    assert bits32(out.numpy()) == bits32(np.float32(5.0) / np.float32(2688.0))
    v = torch.tensor([0.0, 1.0, 7.5, 1e-30, 3e38])
    got = f(v)
    assert got.dtype == torch.float32 and tuple(got.shape) == (5,)
    assert np.array_equal(bits32(got.numpy()), bits32(ref_global_scale(v.numpy())))


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), float("-inf")])
def test_global_scale_from_amax_bad(bad):
    with pytest.raises(ValueError):
        Q.global_scale_from_amax(torch.tensor(bad))


# ---------------------------------------------------------------------------------------------
# hand-made blocks


def test_ties_block_hand():
    # gs = 1, block amax 6 -> s = e4m3(6 / 6) = 1.0 (byte 0x38), r = 1, so x*r = x exactly.
    # ties: 0.25 -> 0 (code 0), 2.5 -> 2 (code 4), 5 -> 4 (code 6), 0.75 -> 1 (code 2),
    # 1.25 -> 1 (code 2), 1.75 -> 2 (code 4), 3.5 -> 4 (code 6); -0.0 -> 8, -0.1 -> 8
    x = [6, 0.25, 2.5, 5, -0.25, -2.5, -5, 0.75, 1.25, 1.75, 3.5, -3.5, 0, -0.0, 0.1, -0.1]
    want = [7, 0, 4, 6, 8, 12, 14, 2, 2, 4, 6, 14, 0, 8, 0, 8]
    t = Q.ref_quantize_nvfp4(T([x]), 1.0)
    assert np_unpack(t.data.numpy()).tolist() == [want]
    assert scale_bytes(t).tolist() == [[0x38]]
    assert t.global_scale.item() == 1.0 and t.global_scale.dim() == 0
    # dequantize: e2m1 * 1 * 1
    assert t.dequantize().tolist() == [[6, 0, 2, 4, -0.0, -2, -4, 1, 1, 2, 4, -4, 0, -0.0, 0, -0.0]]
    assert np.signbit(t.dequantize().numpy()).tolist() == [[c >= 8 for c in want]]


def test_ties_block_scaled_hand():
    # gs = 1, block amax 12 -> s = e4m3(12/6 = 2) = 2.0 (byte 0x40), r = 1/2: x*r = 0.25, 2.5, 5 ...
    x = [12, 0.5, 5, 10, -0.5, -5, -10, 1.5, 2.5, 3.5, 7, -7, 0, -0.0, 0.2, -0.2]
    want = [7, 0, 4, 6, 8, 12, 14, 2, 2, 4, 6, 14, 0, 8, 0, 8]
    t = Q.ref_quantize_nvfp4(T([x]), 1.0)
    assert np_unpack(t.data.numpy()).tolist() == [want]
    assert scale_bytes(t).tolist() == [[0x40]]


def test_fp32_multiply_by_reciprocal_decides_ties():
    # gs = fp32(1.3). Block amax = fp32(6*gs) -> u = 1 exactly -> s = 1.0 (0x38);
    # r = fp32(1 / (1.0 * gs)) = 0.7692308. The spec says code = e2m1(x * r) with an fp32 multiply:
    #   x = fp32(1.75*gs) = 2.2749999 -> x*r = 1.7499999 (just below the 1.5|2 tie) -> 1.5 (code 3)
    #   x = fp32(3.5*gs)  = 4.5499997 -> x*r = 3.4999998 (just below the 3|4 tie)   -> 3 (code 5)
    #   x = fp32(0.25*gs) = 0.325     -> x*r = 0.25 (tie) -> 0 (code 0)
    #   x = fp32(2.5*gs)  = 3.25      -> x*r = 2.5 (tie)  -> 2 (code 4)
    # (dividing x / (s*gs) instead would give the ties 1.75, 3.5 -> codes 4, 6: not the spec.)
    gs = np.float32(1.3)
    x = np.zeros(16, np.float32)
    x[:6] = [np.float32(6.0) * gs, np.float32(1.75) * gs, np.float32(3.5) * gs,
             -(np.float32(3.5) * gs), np.float32(0.25) * gs, np.float32(2.5) * gs]
    r = np.float32(1.0) / (np.float32(1.0) * gs)
    prod = x * r
    assert prod[1] < 1.75 and prod[2] < 3.5 and prod[4] == 0.25 and prod[5] == 2.5
    t = Q.ref_quantize_nvfp4(T([x]), float(gs))
    assert scale_bytes(t).tolist() == [[0x38]]
    assert np_unpack(t.data.numpy())[0, :6].tolist() == [7, 3, 5, 13, 0, 4]
    check_against_ref(t, x[None], gs)


def test_scale_uses_fp32_product_6_times_gs():
    # DESIGN: s = e4m3(block_amax / (6 * gs)), all in fp32 IEEE ops.
    # gs = fp32 bits 0x40AE1B25 = 5.4408135; fp32(6*gs) = 32.644882;
    # block amax = fp32 bits 0x420ABDA2 = 34.685188; amax / fp32(6*gs) = 1.0625 exactly in fp32:
    # an e4m3 tie between 1.0 (0x38) and 1.125 (0x39) -> even mantissa -> 0x38.
    # (The exact real quotient is slightly above 1.0625, so float64 arithmetic or amax/6/gs would
    # give 0x39.)  r = fp32(1/gs): amax*r = 6.375 -> 6 (code 7); -amax/2*r = -3.19 -> -3 (code 13).
    gs = np.array([0x40AE1B25], np.uint32).view(np.float32)[0]
    amax = np.array([0x420ABDA2], np.uint32).view(np.float32)[0]
    assert amax / (np.float32(6.0) * gs) == np.float32(1.0625)
    x = np.zeros((1, 16), np.float32)
    x[0, 0] = amax
    x[0, 1] = -amax * np.float32(0.5)
    t = Q.ref_quantize_nvfp4(T(x), float(gs))
    assert scale_bytes(t).tolist() == [[0x38]]
    assert np_unpack(t.data.numpy())[0, :2].tolist() == [7, 13]
    check_against_ref(t, x, gs)


def test_scale_saturates_at_448():
    # gs = 1, block amax 6000 -> u = 1000 > 448 -> s = 448 (byte 0x7E); r = fp32(1/448) = 0.002232143
    # 6000*r = 13.39 -> 6 (code 7); 1000*r = 2.232 -> 2 (code 4); -3000*r = -6.70 -> code 15
    x = [6000, 1000, -3000] + [0] * 13
    t = Q.ref_quantize_nvfp4(T([x]), 1.0)
    assert scale_bytes(t).tolist() == [[0x7E]]
    assert np_unpack(t.data.numpy())[0, :3].tolist() == [7, 4, 15]


def test_scale_rounds_down_and_codes_saturate():
    # gs = 1, block amax 6.375 -> u = 1.0625 = tie between e4m3 1.0 (0x38) and 1.125 (0x39) -> even
    # -> s = 1.0, r = 1, 6.375 -> saturates at 6 (code 7)
    t = Q.ref_quantize_nvfp4(T([[6.375, -6.375] + [0] * 14]), 1.0)
    assert scale_bytes(t).tolist() == [[0x38]]
    assert np_unpack(t.data.numpy())[0, :2].tolist() == [7, 15]
    # block amax 7.125 -> u = 1.1875 = tie between 1.125 (0x39) and 1.25 (0x3A) -> 1.25 (even)
    # r = 0.8, 7.125*0.8 = 5.7 -> 6 (code 7); 2*0.8 = 1.6 -> 1.5 (code 3)
    t = Q.ref_quantize_nvfp4(T([[7.125, 2.0] + [0] * 14]), 1.0)
    assert scale_bytes(t).tolist() == [[0x3A]]
    assert np_unpack(t.data.numpy())[0, :2].tolist() == [7, 3]


def test_all_zero_blocks():
    x = torch.zeros(3, 48)
    t = Q.ref_quantize_nvfp4(x)
    assert t.global_scale.item() == 1.0  # amax == 0 -> gs = 1
    assert t.data.eq(0).all() and scale_bytes(t).tolist() == [[0, 0, 0]] * 3
    assert t.dequantize().eq(0).all()
    # mixed: a zero block next to a non-zero block, given gs
    x = torch.zeros(1, 32)
    x[0, 16] = 3.0
    t = Q.ref_quantize_nvfp4(x, 1.0)
    # block 1: u = 3/6 = 0.5 -> s = 0.5 (0x30), r = 2, 3*2 = 6 -> code 7
    assert scale_bytes(t).tolist() == [[0x00, 0x30]]
    assert np_unpack(t.data.numpy()).tolist() == [[0] * 16 + [7] + [0] * 15]


def test_underflowing_block_gets_zero_codes():
    # gs = 1 from amax 2688 (block 0). Block 1 amax = 6*2**-11 -> u = 2**-11 < 2**-10 (half the
    # smallest e4m3 subnormal 2**-9) -> s = 0 -> all codes 0, also for negative inputs (not 8).
    x = np.zeros((1, 48), np.float32)
    x[0, 0] = 2688.0
    x[0, 16:32] = -6 * 2.0**-11
    x[0, 16] = 6 * 2.0**-11
    # block 2: amax = 6*2**-10 -> u = 2**-10 exactly: tie between 0 and 2**-9 -> RNE -> 0
    x[0, 32:48] = -6 * 2.0**-10
    t = Q.ref_quantize_nvfp4(T(x))
    assert t.global_scale.item() == 1.0
    sb = scale_bytes(t)[0].tolist()
    assert sb[1] == 0 and sb[2] == 0
    assert np_unpack(t.data.numpy())[0, 16:].tolist() == [0] * 32
    deq = t.dequantize().numpy()
    assert np.all(deq[0, 16:] == 0) and not np.any(np.signbit(deq[0, 16:]))
    # a block slightly above the tie gets the smallest subnormal scale 2**-9 (byte 0x01)
    y = np.zeros((1, 16), np.float32)
    y[0, 0] = np.nextafter(np.float32(6 * 2.0**-10), np.float32(1))
    t = Q.ref_quantize_nvfp4(T(y), 1.0)
    assert scale_bytes(t).tolist() == [[0x01]]
    # r = 2**9, x*r = 3.0000002 -> 3 (code 5)
    assert np_unpack(t.data.numpy())[0, 0] == 5
    check_against_ref(t, y, 1.0)


def test_negative_zeros():
    # in a non-zero block -0.0 keeps its sign (code 8) and dequantizes to -0.0
    x = np.array([[1.5, -0.0, 0.0, -0.0] + [0.0] * 12], np.float32)
    t = Q.ref_quantize_nvfp4(T(x), 1.0)
    # u = 1.5/6 = 0.25 -> s = 0.25, r = 4: 1.5*4 = 6 -> code 7
    assert np_unpack(t.data.numpy())[0, :4].tolist() == [7, 8, 0, 8]
    d = t.dequantize().numpy()
    assert np.signbit(d[0, :4]).tolist() == [False, True, False, True]
    # an all-(-0.0) block has s = 0 -> all codes 0 (+0)
    t = Q.ref_quantize_nvfp4(T(np.full((2, 16), -0.0, np.float32)))
    assert t.data.eq(0).all() and t.scale.view(torch.uint8).eq(0).all()
    assert not np.any(np.signbit(t.dequantize().numpy()))


def test_per_row_given_global_scale_hand():
    # same row values, gs = [1, 2]: row 0 s = 6/6 = 1 (0x38); row 1 s = 6/12 = 0.5 (0x30);
    # both r = 1 -> identical codes
    row = [6, 3, -1.5, 0.5] + [0] * 12
    x = T([row, row])
    gs = torch.tensor([1.0, 2.0])
    t = Q.ref_quantize_nvfp4(x, gs)
    assert t.per_row
    assert t.global_scale.tolist() == [1.0, 2.0]
    assert scale_bytes(t).tolist() == [[0x38], [0x30]]
    assert np_unpack(t.data.numpy()).tolist() == [[7, 5, 11, 1] + [0] * 12] * 2
    assert t.dequantize().tolist() == [row, row]


def test_given_scalar_global_scale():
    x = np.random.default_rng(0).normal(0, 1, (4, 64)).astype(np.float32)
    for gs in [0.0137, 1.0, 2.0**-110, 1e3]:
        t = Q.ref_quantize_nvfp4(T(x), gs)
        assert not t.per_row and t.global_scale.dim() == 0
        check_against_ref(t, x, gs)
        t2 = Q.ref_quantize_nvfp4(T(x), torch.tensor(gs, dtype=torch.float32))
        check_against_ref(t2, x, gs)


def test_computed_global_scale_hand():
    # amax 5376 -> gs = 5376 / 2688 = 2; block amax 5376 -> u = 5376/12 = 448 -> s = 448 (0x7E),
    # r = fp32(1/896); 5376*r = 6 -> code 7, -2688*r = -3 -> code 13, 1344*r = 1.5 -> code 3
    x = T([[5376, -2688, 1344] + [0] * 13])
    t = Q.ref_quantize_nvfp4(x)
    assert t.global_scale.item() == 2.0 and not t.per_row
    assert scale_bytes(t).tolist() == [[0x7E]]
    assert np_unpack(t.data.numpy())[0, :3].tolist() == [7, 13, 3]
    assert t.dequantize()[0, :3].tolist() == [5376, -2688, 1344]


def test_computed_per_row_global_scale_hand():
    x = T([[2688] + [0] * 15, [5376] + [0] * 15, [0] * 16, [1e-30] + [0] * 15])
    t = Q.ref_quantize_nvfp4(x, per_row=True)
    assert t.per_row and tuple(t.global_scale.shape) == (4,)
    # 2688/2688 = 1, 5376/2688 = 2, all-zero row -> 1, 1e-30/2688 < 2**-110 -> 2**-110
    assert t.global_scale.tolist() == [1.0, 2.0, 1.0, 2.0**-110]
    check_against_ref(t, x.numpy(), per_row=True)


def test_k_not_multiple_of_16():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 2, (3, 20)).astype(np.float32)
    t = Q.ref_quantize_nvfp4(T(x))
    assert tuple(t.shape) == (3, 20)
    assert tuple(t.data.shape) == (3, 16) and tuple(t.scale.shape) == (3, 2)
    codes, _, _ = check_against_ref(t, x)
    assert np.all(codes[:, 20:] == 0)  # zero padding -> code 0
    assert tuple(Q.ref_dequantize_nvfp4(t).shape) == (3, 20)
    for K in [1, 15, 17, 33]:
        x = rng.normal(0, 1, (2, K)).astype(np.float32)
        check_against_ref(Q.ref_quantize_nvfp4(T(x)), x)


def test_leading_batch_dims():
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1, (2, 3, 48)).astype(np.float32)
    t = Q.ref_quantize_nvfp4(T(x))
    check_against_ref(t, x)
    tr = Q.ref_quantize_nvfp4(T(x), per_row=True)
    assert tuple(tr.global_scale.shape) == (2, 3)
    check_against_ref(tr, x, per_row=True)
    gs = (rng.uniform(0.5, 2.0, (2, 3))).astype(np.float32)
    tg = Q.ref_quantize_nvfp4(T(x), torch.from_numpy(gs))
    assert tg.per_row
    check_against_ref(tg, x, gs)


def test_non_contiguous_input():
    rng = np.random.default_rng(3)
    base = T(rng.normal(0, 1, (64, 8)).astype(np.float32))
    x = base.t()  # (8, 64), not contiguous
    assert not x.is_contiguous()
    a = Q.ref_quantize_nvfp4(x)
    b = Q.ref_quantize_nvfp4(x.contiguous())
    assert torch.equal(a.data, b.data)
    assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    assert torch.equal(a.global_scale, b.global_scale)
    check_against_ref(a, x.contiguous().numpy())
    sl = T(rng.normal(0, 1, (4, 100)).astype(np.float32))[:, 3:67]  # offset, strided rows
    check_against_ref(Q.ref_quantize_nvfp4(sl), sl.contiguous().numpy())


@pytest.mark.parametrize("shape", [(0, 32), (4, 0), (2, 0, 16), (0,)])
def test_empty_input(shape):
    x = torch.zeros(shape)
    t = Q.ref_quantize_nvfp4(x)
    assert isinstance(t, Q.NVFP4Tensor)
    K = shape[-1]
    Kp = -(-K // 16) * 16
    assert tuple(t.shape) == shape
    assert tuple(t.data.shape) == shape[:-1] + (Kp // 2,)
    assert tuple(t.scale.shape) == shape[:-1] + (Kp // 16,)
    assert t.data.numel() == 0 and t.scale.numel() == 0


@pytest.mark.parametrize("shape", [(0, 32), (4, 0), (2, 0, 16), (0,)])
def test_empty_dequantize(shape):
    # API: ref_dequantize_nvfp4 -> tensor of the logical shape; an empty NVFP4Tensor is legal
    t = Q.ref_quantize_nvfp4(torch.zeros(shape))
    for d in (t.dequantize(), Q.ref_dequantize_nvfp4(t), t.dequantize(torch.bfloat16)):
        assert tuple(d.shape) == shape and d.numel() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    rng = np.random.default_rng(4)
    x = T(rng.normal(0, 3, (8, 64)).astype(np.float32), dtype)
    exact = x.to(torch.float32).numpy()
    check_against_ref(Q.ref_quantize_nvfp4(x), exact)
    check_against_ref(Q.ref_quantize_nvfp4(x, per_row=True), exact, per_row=True)


def _random_cases():
    rng = np.random.default_rng(2024)
    cases = []
    # Gaussian with per-block magnitudes over 8 decades (exercises subnormal e4m3 scales and
    # underflowing blocks), zero blocks and sprinkled negative zeros; K not a multiple of 16.
    x = rng.standard_normal((48, 1000)).astype(np.float32)
    mag = (10.0 ** rng.uniform(-6, 2, (48, 63))).astype(np.float32)
    mag[rng.random((48, 63)) < 0.08] = 0
    x *= np.repeat(mag, 16, axis=1)[:, :1000]
    x[rng.random(x.shape) < 0.01] = -0.0
    cases.append(x)
    # heavy tails (Student t, 2 dof) and uniform, with leading dims
    cases.append(rng.standard_t(2, (3, 5, 160)).astype(np.float32))
    cases.append(rng.uniform(-1e-3, 1e-3, (7, 48)).astype(np.float32))
    # rows that hit the gs guards: all zero, tiny (clamped to 2**-110), fp32-subnormal
    y = rng.standard_normal((4, 64)).astype(np.float32)
    y[1] = 0
    y[2] *= np.float32(1e-32)
    y[3] = np.float32(1e-44) * np.sign(y[3])
    cases.append(y)
    return cases


@pytest.mark.parametrize("mode", ["tensor", "row", "given", "given_row"])
def test_bitwise_vs_reference_random(mode):
    rng = np.random.default_rng(99)
    for x in _random_cases():
        if mode == "tensor":
            check_against_ref(Q.ref_quantize_nvfp4(T(x)), x)
        elif mode == "row":
            check_against_ref(Q.ref_quantize_nvfp4(T(x), per_row=True), x, per_row=True)
        elif mode == "given":
            check_against_ref(Q.ref_quantize_nvfp4(T(x), 0.0137), x, 0.0137)
        else:
            gs = (10.0 ** rng.uniform(-4, 1, x.shape[:-1])).astype(np.float32)
            check_against_ref(Q.ref_quantize_nvfp4(T(x), torch.from_numpy(gs)), x, gs)


def test_codes_method_and_dequantize_dtype():
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, (4, 40)).astype(np.float32)
    t = Q.ref_quantize_nvfp4(T(x))
    codes, sb, g = ref_quantize(x)
    c = t.codes()
    assert c.dtype == torch.uint8 and tuple(c.shape) == (4, 48)
    assert np.array_equal(c.numpy(), codes)
    ref32 = torch.from_numpy(ref_dequantize(codes, sb, g, 40))
    for dt in [torch.bfloat16, torch.float16]:
        for d in (t.dequantize(dt), Q.ref_dequantize_nvfp4(t, dt), Q.ref_dequantize_nvfp4(t, dtype=dt)):
            assert d.dtype == dt and tuple(d.shape) == (4, 40)
            assert torch.equal(d, ref32.to(dt))


# ---------------------------------------------------------------------------------------------
# idempotence


def _is_normal_or_zero(sb):
    sb = np.asarray(sb)
    return np.all(((sb & 0x78) != 0) | ((sb & 0x7F) == 0))


@pytest.mark.parametrize("gs_mode", ["computed", "given", "row"])
def test_idempotent_for_fixed_gs_when_scales_normal(gs_mode):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((32, 256)).astype(np.float32)
    x *= np.repeat((10.0 ** rng.uniform(-1.5, 1, (32, 16))).astype(np.float32), 16, axis=1)
    x[:, 32:48] = 0  # zero blocks (s = 0) are allowed
    if gs_mode == "computed":
        q = Q.ref_quantize_nvfp4(T(x))
    elif gs_mode == "given":
        q = Q.ref_quantize_nvfp4(T(x), 0.01)
    else:
        q = Q.ref_quantize_nvfp4(T(x), per_row=True)
    sb = scale_bytes(q)
    assert _is_normal_or_zero(sb), "test precondition: all block scales normal or zero"
    assert np.any(sb == 0)
    q2 = Q.ref_quantize_nvfp4(q.dequantize(), q.global_scale)
    assert torch.equal(q2.data, q.data)
    assert torch.equal(q2.scale.view(torch.uint8), q.scale.view(torch.uint8))
    assert torch.equal(q2.global_scale, q.global_scale)


def test_idempotence_exception_subnormal_scale():
    """The documented exception exists: a block with a subnormal e4m3 scale can change."""
    # gs = 1, x0 = 0.01875: u = 0.003125 = 1.6 * 2**-9 -> s = 2 * 2**-9 = 2**-8 (byte 0x02, subnormal)
    # r = 256, x0*r = 4.8 -> 4 (code 6). dequantize -> 4 * 2**-8 = 0.015625.
    # re-quantize: u = 0.015625/6 = 1.33 * 2**-9 -> s = 2**-9 (byte 0x01), r = 512,
    # 0.015625*512 = 8 -> saturates to 6 (code 7). Bytes change.
    x = torch.zeros(1, 16)
    x[0, 0] = 0.01875
    q = Q.ref_quantize_nvfp4(x, 1.0)
    assert scale_bytes(q).tolist() == [[0x02]]
    assert np_unpack(q.data.numpy())[0, 0] == 6
    d = q.dequantize()
    assert d[0, 0].item() == 0.015625
    q2 = Q.ref_quantize_nvfp4(d, q.global_scale)
    assert scale_bytes(q2).tolist() == [[0x01]]
    assert np_unpack(q2.data.numpy())[0, 0] == 7
    assert not torch.equal(q2.data, q.data)
    # second construction: the scale collapses to 0.
    # x0 = 6 * 0.55 * 2**-9: u = 0.55 * 2**-9 -> s = 2**-9 (0x01), x0*r = 3.3 -> 3 (code 5);
    # dequantize 3 * 2**-9, re-quantize u = 0.5 * 2**-9 -> tie -> s = 0 -> codes all 0.
    x = torch.zeros(1, 16)
    x[0, 0] = 6 * 0.55 * 2.0**-9
    q = Q.ref_quantize_nvfp4(x, 1.0)
    assert scale_bytes(q).tolist() == [[0x01]] and np_unpack(q.data.numpy())[0, 0] == 5
    q2 = Q.ref_quantize_nvfp4(q.dequantize(), q.global_scale)
    assert scale_bytes(q2).tolist() == [[0x00]] and q2.data.eq(0).all()


# ---------------------------------------------------------------------------------------------
# NVFP4Tensor


def test_nvfp4tensor_properties():
    x = T(np.random.default_rng(7).normal(0, 1, (4, 64)).astype(np.float32))
    t = Q.ref_quantize_nvfp4(x)
    # data 4*32 + scale 4*4 + gs 4 bytes
    assert t.nbytes == 128 + 16 + 4
    assert t.per_row is False
    v = t.data.view(torch.float4_e2m1fn_x2)
    assert v.dtype == torch.float4_e2m1fn_x2 and tuple(v.shape) == (4, 32)
    tr = Q.ref_quantize_nvfp4(x, per_row=True)
    assert tr.per_row is True
    assert tr.nbytes == 128 + 16 + 4 * 4
    t3 = Q.ref_quantize_nvfp4(T(np.ones((2, 3, 20), np.float32)))
    assert t3.nbytes == 2 * 3 * 16 + 2 * 3 * 2 + 4  # Kp = 32
    moved = t.to("cpu")
    assert isinstance(moved, Q.NVFP4Tensor)
    assert torch.equal(moved.data, t.data) and torch.equal(moved.global_scale, t.global_scale)
    assert torch.equal(moved.scale.view(torch.uint8), t.scale.view(torch.uint8))
    assert tuple(moved.shape) == (4, 64)


def _hand_tensor_parts():
    # row 0: byte 0x72 -> element 0 code 2 (1.0), element 1 code 7 (6.0); byte 0xF9 -> -0.5, -6
    data = torch.zeros(2, 16, dtype=torch.uint8)
    data[0, 0] = 0x72
    data[0, 1] = 0xF9
    data[1, 8] = 0x3B  # element 16: code 0xB = -1.5, element 17: code 3 = 1.5
    scale = torch.tensor([[0x40, 0x38], [0x38, 0x30]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    return data, scale


def test_nvfp4tensor_constructor_and_dequantize_hand():
    data, scale = _hand_tensor_parts()
    t = Q.NVFP4Tensor(data=data, scale=scale, global_scale=torch.tensor(0.5), shape=torch.Size([2, 32]))
    d = t.dequantize()
    want = np.zeros((2, 32), np.float32)
    # (e2m1 * s) * gs: s = 2 (0x40), gs = 0.5
    want[0, :4] = [1.0, 6.0, -0.5, -6.0]
    # row 1 block 1: s = 0.5 (0x30): -1.5*0.5*0.5 = -0.375, 0.375
    want[1, 16:18] = [-0.375, 0.375]
    assert np.array_equal(d.numpy(), want)
    assert torch.equal(Q.ref_dequantize_nvfp4(t), d)
    # logical K = 20 crops
    t20 = Q.NVFP4Tensor(data=data, scale=scale, global_scale=torch.tensor(0.5), shape=torch.Size([2, 20]))
    assert np.array_equal(t20.dequantize().numpy(), want[:, :20])
    # per-row gs
    tr = Q.NVFP4Tensor(data=data, scale=scale, global_scale=torch.tensor([0.5, 4.0]),
                       shape=torch.Size([2, 32]))
    assert tr.per_row
    want_r = want.copy()
    want_r[1] *= 8
    assert np.array_equal(tr.dequantize().numpy(), want_r)


@pytest.mark.parametrize("case", ["data_dtype", "scale_dtype", "scale_shape", "shape_k", "shape_lead",
                                  "gs_shape", "data_lead"])
def test_nvfp4tensor_constructor_validation(case):
    data, scale = _hand_tensor_parts()
    gs = torch.tensor(0.5)
    shape = torch.Size([2, 32])
    if case == "data_dtype":
        data = data.to(torch.float32)
    elif case == "scale_dtype":
        scale = scale.to(torch.float32)
    elif case == "scale_shape":
        scale = torch.zeros(2, 3, dtype=torch.float8_e4m3fn)  # Kp/16 = 2, not 3
    elif case == "shape_k":
        shape = torch.Size([2, 40])  # Kp would be 48, data holds 32
    elif case == "shape_lead":
        shape = torch.Size([3, 32])
    elif case == "gs_shape":
        gs = torch.ones(3)  # per row must be (2,)
    elif case == "data_lead":
        data = torch.zeros(3, 16, dtype=torch.uint8)
    with pytest.raises((TypeError, ValueError)):
        Q.NVFP4Tensor(data=data, scale=scale, global_scale=gs, shape=shape)


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.uint8])
def test_quantize_bad_dtype(dtype):
    with pytest.raises(TypeError):
        Q.ref_quantize_nvfp4(torch.ones(2, 16, dtype=dtype))


def test_quantize_nan_inf():
    x = torch.ones(2, 32)
    x[1, 5] = float("nan")
    with pytest.raises(ValueError, match="(?i)nan"):
        Q.ref_quantize_nvfp4(x)
    with pytest.raises(ValueError, match="(?i)nan"):
        Q.ref_quantize_nvfp4(x.to(torch.bfloat16), 1.0)
    for v in [float("inf"), float("-inf")]:
        x = torch.ones(2, 32)
        x[0, 31] = v
        with pytest.raises(ValueError, match="(?i)inf"):
            Q.ref_quantize_nvfp4(x)
        with pytest.raises(ValueError, match="(?i)inf"):
            Q.ref_quantize_nvfp4(x, 1.0)
    # padding position: K = 20, inf in the last logical element
    x = torch.ones(1, 20)
    x[0, 19] = float("inf")
    with pytest.raises(ValueError, match="(?i)inf"):
        Q.ref_quantize_nvfp4(x, per_row=True)


@pytest.mark.parametrize("gs", [0.0, -1.0, float("nan"), float("inf"), float("-inf"), 2.0**-111, 1e-40])
def test_quantize_bad_global_scale(gs):
    x = torch.ones(2, 16)
    with pytest.raises(ValueError):
        Q.ref_quantize_nvfp4(x, gs)
    with pytest.raises(ValueError):
        Q.ref_quantize_nvfp4(x, torch.tensor(gs, dtype=torch.float32))


def test_quantize_gs_min_accepted():
    x = np.ones((1, 16), np.float32)
    check_against_ref(Q.ref_quantize_nvfp4(T(x), 2.0**-110), x, 2.0**-110)


def test_quantize_bad_block_size():
    x = torch.ones(2, 32)
    with pytest.raises(ValueError):
        Q.ref_quantize_nvfp4(x, block_size=32)
    with pytest.raises(ValueError):
        Q.ref_quantize_nvfp4(x, block_size=8)
    t = Q.ref_quantize_nvfp4(x, block_size=16)
    assert tuple(t.scale.shape) == (2, 2)


def test_quantize_bad_per_row_gs():
    x = torch.ones(4, 32)
    with pytest.raises(ValueError):
        Q.ref_quantize_nvfp4(x, torch.ones(3))
    with pytest.raises(ValueError):
        Q.ref_quantize_nvfp4(x, torch.ones(4, 2))
    with pytest.raises(ValueError):
        Q.ref_quantize_nvfp4(x, torch.tensor([1.0, 1.0, 0.0, 1.0]))
    with pytest.raises(ValueError):
        Q.ref_quantize_nvfp4(x, torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    with pytest.raises(ValueError):
        Q.ref_quantize_nvfp4(torch.ones(2, 3, 32), torch.ones(3, 2))


# ---------------------------------------------------------------------------------------------
# SQNR


def test_sqnr_db_hand():
    # 10*log10((1+1) / (0+1)) = 3.0103 dB
    assert Q.sqnr_db(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == pytest.approx(
        10 * math.log10(2.0), abs=1e-6)
    # 10*log10(25 / 0.25) = 20 dB
    assert Q.sqnr_db(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])) == pytest.approx(20.0, abs=1e-6)


def test_sqnr_gaussian_band_and_beats_mxfp4():
    # Our numpy reference gives 20.41-20.45 dB for NVFP4 and ~18.8 dB for MXFP4 on N(0,1)
    # data of this size (seeds 0-2), i.e. the band below is +-1 dB around the reference value.
    x = T(np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32))
    nv = Q.sqnr_db(x, Q.ref_quantize_nvfp4(x).dequantize())
    nv_row = Q.sqnr_db(x, Q.ref_quantize_nvfp4(x, per_row=True).dequantize())
    mx = Q.sqnr_db(x, Q.ref_mxfp4_roundtrip(x))
    assert 19.4 < nv < 21.4, nv
    assert 19.4 < nv_row < 21.4, nv_row
    assert 17.8 < mx < 19.8, mx
    assert nv > mx + 1.0, (nv, mx)


def _ref_mxfp4_np(x, bs=32):
    x = np.asarray(x, np.float32)
    b = x.reshape(-1, bs)
    sc = np.exp2(np.floor(np.log2(np.abs(b).max(-1))) - 2).astype(np.float32)
    return (E2M1_NP[ref_e2m1(b / sc[:, None])] * sc[:, None]).reshape(x.shape)


def test_ref_mxfp4_roundtrip_hand_and_random():
    x = np.zeros((2, 32), np.float32)
    # block 0: amax 7 -> floor(log2 7) = 2 -> scale 2**0 = 1: 7 -> 6 (saturate), 2.6 -> 3,
    # -0.3 -> -0.5, 1.1 -> 1
    x[0, :4] = [7.0, 2.6, -0.3, 1.1]
    # block 1: amax 0.7 -> floor(log2 0.7) = -1 -> scale 2**-3: 0.7/0.125 = 5.6 -> 6 -> 0.75;
    # 0.3/0.125 = 2.4 -> 2 -> 0.25; -0.2/0.125 = -1.6 -> -1.5 -> -0.1875
    x[1, :3] = [0.7, 0.3, -0.2]
    y = Q.ref_mxfp4_roundtrip(T(x))
    assert y.dtype == torch.float32 and tuple(y.shape) == (2, 32)
    assert y[0, :4].tolist() == [6.0, 3.0, -0.5, 1.0]
    assert y[1, :3].tolist() == [0.75, 0.25, -0.1875]
    assert y[:, 4:].eq(0).all()
    g = np.random.default_rng(8).standard_normal((16, 256)).astype(np.float32)
    assert np.array_equal(Q.ref_mxfp4_roundtrip(T(g)).numpy(), _ref_mxfp4_np(g))


# ---------------------------------------------------------------------------------------------
# ModelOpt safetensors checkpoints


def _quantized_weights():
    rng = np.random.default_rng(9)
    w1 = rng.normal(0, 0.02, (8, 64)).astype(np.float32)
    w2 = rng.normal(0, 1.0, (16, 32)).astype(np.float32)
    return {"layers.0.mlp.gate_proj": Q.ref_quantize_nvfp4(T(w1)),
            "layers.0.mlp.down_proj": Q.ref_quantize_nvfp4(T(w2), 0.37)}


def test_modelopt_save_load_round_trip(tmp_path):
    path = str(tmp_path / "ckpt.safetensors")
    weights = _quantized_weights()
    CK.save_modelopt_nvfp4(path, weights, {"layers.0.mlp.gate_proj": 0.3})
    # the file itself follows the ModelOpt convention
    raw = load_file(path)
    for name, t in weights.items():
        N, K = t.shape
        assert raw[f"{name}.weight"].dtype == torch.uint8
        assert tuple(raw[f"{name}.weight"].shape) == (N, K // 2)
        assert raw[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn
        assert tuple(raw[f"{name}.weight_scale"].shape) == (N, K // 16)
        assert raw[f"{name}.weight_scale_2"].dtype == torch.float32
        assert raw[f"{name}.weight_scale_2"].dim() == 0
        assert torch.equal(raw[f"{name}.weight"], t.data)
        assert torch.equal(raw[f"{name}.weight_scale"].view(torch.uint8), t.scale.view(torch.uint8))
        assert torch.equal(raw[f"{name}.weight_scale_2"], t.global_scale)
    assert raw["layers.0.mlp.gate_proj.input_scale"].dtype == torch.float32
    assert raw["layers.0.mlp.gate_proj.input_scale"].dim() == 0
    assert "layers.0.mlp.down_proj.input_scale" not in raw
    loaded = CK.load_modelopt_nvfp4(path)
    assert set(loaded) == set(weights)
    for name, t in weights.items():
        lt = loaded[name].weight
        assert isinstance(lt, Q.NVFP4Tensor)
        assert tuple(lt.shape) == tuple(t.shape)
        assert torch.equal(lt.data, t.data)
        assert torch.equal(lt.scale.view(torch.uint8), t.scale.view(torch.uint8))
        assert lt.global_scale.dtype == torch.float32 and lt.per_row is False
        assert np.array_equal(bits32(lt.global_scale.reshape(()).numpy()), bits32(t.global_scale.numpy()))
        assert torch.equal(lt.dequantize(), t.dequantize())
    assert loaded["layers.0.mlp.gate_proj"].input_scale == float(np.float32(0.3))
    assert loaded["layers.0.mlp.down_proj"].input_scale is None


def _modelopt_tensors(prefix, N=4, K=32, gs=0.37, input_scale=0.05, seed=10):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (N, K)).astype(np.uint8)
    sb = rng.integers(0x08, 0x77, (N, K // 16)).astype(np.uint8)  # normal, finite e4m3
    d = {
        f"{prefix}.weight": torch.from_numpy(np_pack(codes)),
        f"{prefix}.weight_scale": torch.from_numpy(sb).view(torch.float8_e4m3fn),
        f"{prefix}.weight_scale_2": torch.tensor(gs, dtype=torch.float32),
    }
    if input_scale is not None:
        d[f"{prefix}.input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
    return d, codes, sb


def test_modelopt_load_handwritten_file(tmp_path):
    path = str(tmp_path / "hand.safetensors")
    p = "model.layers.3.mlp.experts.7.up_proj"
    d, codes, sb = _modelopt_tensors(p)
    d2, codes2, sb2 = _modelopt_tensors("model.layers.3.mlp.experts.7.down_proj", N=2, K=64, gs=2.0,
                                        input_scale=None, seed=11)
    d.update(d2)
    # non-NVFP4 tensors are ignored
    d["model.norm.weight"] = torch.ones(32, dtype=torch.bfloat16)
    d["lm_head.weight"] = torch.ones(8, 32, dtype=torch.bfloat16)
    save_file(d, path)
    loaded = CK.load_modelopt_nvfp4(path)
    assert set(loaded) == {p, "model.layers.3.mlp.experts.7.down_proj"}
    w = loaded[p].weight
    assert tuple(w.shape) == (4, 32) and not w.per_row
    assert np.array_equal(np_unpack(w.data.numpy()), codes)
    assert np.array_equal(scale_bytes(w), sb)
    assert w.global_scale.numel() == 1 and w.global_scale.item() == float(np.float32(0.37))
    assert loaded[p].input_scale == float(np.float32(0.05))
    want = ref_dequantize(codes, sb, np.float32(0.37), 32)
    assert np.array_equal(bits32(w.dequantize().numpy()), bits32(want))
    w2 = loaded["model.layers.3.mlp.experts.7.down_proj"]
    assert w2.input_scale is None
    assert tuple(w2.weight.shape) == (2, 64)
    assert np.array_equal(bits32(w2.weight.dequantize().numpy()),
                          bits32(ref_dequantize(codes2, sb2, np.float32(2.0), 64)))


def test_modelopt_load_weight_scale_2_shape_1(tmp_path):
    # numel == 1 is the rule (API: numel != 1 -> ValueError), so shape (1,) is accepted
    path = str(tmp_path / "s1.safetensors")
    d, codes, sb = _modelopt_tensors("a")
    d["a.weight_scale_2"] = torch.tensor([0.37], dtype=torch.float32)
    save_file(d, path)
    w = CK.load_modelopt_nvfp4(path)["a"].weight
    assert w.global_scale.numel() == 1 and w.global_scale.item() == float(np.float32(0.37))


def test_modelopt_no_nvfp4_weights_is_an_error_naming_the_contents(tmp_path):
    "A file with no NVFP4 layer is refused (not an empty dict a caller would take for a loaded checkpoint)."
    path = str(tmp_path / "dense.safetensors")
    save_file({"w.weight": torch.ones(4, 4, dtype=torch.bfloat16), "b.weight": torch.ones(4, 4)}, path)
    with pytest.raises(ValueError, match=r"no NVFP4 weights among its 2 tensor\(s\) \(b.weight, w.weight\)"):
        CK.load_modelopt_nvfp4(path)


def test_modelopt_fp8_layers_are_not_nvfp4(tmp_path):
    # API: "A prefix counts as NVFP4 when f"{p}.weight" is uint8 and f"{p}.weight_scale" exists."
    # A ModelOpt FP8 layer (weight float8_e4m3fn + fp32 weight_scale) is therefore not NVFP4.
    fp8 = {
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 32, dtype=torch.float8_e4m3fn),
        "model.layers.0.self_attn.q_proj.weight_scale": torch.tensor(0.01, dtype=torch.float32),
        "model.layers.0.self_attn.q_proj.input_scale": torch.tensor(0.02, dtype=torch.float32),
    }
    path = str(tmp_path / "fp8.safetensors")
    save_file(fp8, path)
    with pytest.raises(ValueError, match="no NVFP4 weights"):       # its only layer is FP8
        CK.load_modelopt_nvfp4(path)
    mixed, codes, sb = _modelopt_tensors("model.layers.0.mlp.experts.0.up_proj")
    mixed.update(fp8)
    path = str(tmp_path / "mixed.safetensors")
    save_file(mixed, path)
    loaded = CK.load_modelopt_nvfp4(path)
    assert set(loaded) == {"model.layers.0.mlp.experts.0.up_proj"}
    assert np.array_equal(np_unpack(loaded["model.layers.0.mlp.experts.0.up_proj"].weight.data.numpy()), codes)


def _write_bad(tmp_path, mutate):
    d, _, _ = _modelopt_tensors("layer0")
    mutate(d)
    path = str(tmp_path / "bad.safetensors")
    save_file(d, path)
    return path


def test_modelopt_load_missing_weight_scale_2(tmp_path):
    path = _write_bad(tmp_path, lambda d: d.pop("layer0.weight_scale_2"))
    with pytest.raises(ValueError, match="weight_scale_2"):
        CK.load_modelopt_nvfp4(path)


@pytest.mark.parametrize("case", ["scale_shape_cols", "scale_shape_rows", "scale_dtype", "gs_dtype",
                                  "gs_two", "scale_int32"])
def test_modelopt_load_bad_files(tmp_path, case):
    def mutate(d):
        if case == "scale_shape_cols":
            d["layer0.weight_scale"] = torch.zeros(4, 3, dtype=torch.float8_e4m3fn)  # want (4, 2)
        elif case == "scale_shape_rows":
            d["layer0.weight_scale"] = torch.zeros(5, 2, dtype=torch.float8_e4m3fn)
        elif case == "scale_dtype":
            d["layer0.weight_scale"] = torch.ones(4, 2, dtype=torch.float32)
        elif case == "gs_dtype":
            d["layer0.weight_scale_2"] = torch.tensor(0.37, dtype=torch.bfloat16)
        elif case == "gs_two":
            d["layer0.weight_scale_2"] = torch.tensor([0.37, 0.5], dtype=torch.float32)
        elif case == "scale_int32":
            d["layer0.weight_scale"] = torch.ones(4, 2, dtype=torch.int32)
    path = _write_bad(tmp_path, mutate)
    with pytest.raises(ValueError):
        CK.load_modelopt_nvfp4(path)


def test_modelopt_save_bad(tmp_path):
    path = str(tmp_path / "out.safetensors")
    x = T(np.random.default_rng(12).normal(0, 1, (4, 32)).astype(np.float32))
    with pytest.raises(ValueError):
        CK.save_modelopt_nvfp4(path, {"a": Q.ref_quantize_nvfp4(x, per_row=True)})
    with pytest.raises(ValueError):
        CK.save_modelopt_nvfp4(path, {"a": Q.ref_quantize_nvfp4(x[:, :20])})  # K = 20
    with pytest.raises(ValueError):
        CK.save_modelopt_nvfp4(path, {"a": Q.ref_quantize_nvfp4(x.reshape(2, 2, 32))})  # 3-D


def test_modelopt_load_of_a_folder_without_checkpoint_says_so(tmp_path, monkeypatch):
    "`load_modelopt_nvfp4('.')` in a folder with no checkpoint: what is missing, not an OS error about a device."
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="is a folder with no .safetensors file and no model.safetensors.index.json"):
        CK.load_modelopt_nvfp4(".")
