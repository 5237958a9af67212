"""Tests for dsv4_nvfp4.formats: E2M1 / E4M3 tables, exact E2M1 codec, nibble packing.

Oracles are independent of the implementation:
* ``ml_dtypes.float4_e2m1fn`` for fp32 -> E2M1 (RNE, saturating); its uint8 view holds the
  4-bit code in the low nibble (checked in ``test_oracle_sanity``);
* ``ml_dtypes.float8_e4m3fn`` and torch's own ``float8_e4m3fn`` bit views for E4M3;
* hand-written constants for E2M1 values and nibble order.
"""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from dsv4_nvfp4 import formats as F

# Hand-written E2M1 magnitudes (bits 0-2 index) per DESIGN "Numerics".
MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
HAND_E2M1 = MAGS + [-m for m in MAGS]  # code 8 is -0.0


def oracle_codes(x) -> np.ndarray:
    """Independent fp32 -> E2M1 code oracle (ml_dtypes)."""
    a = np.asarray(x, dtype=np.float32)
    return a.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & np.uint8(0xF)


def enc(x_np: np.ndarray, dtype=torch.float32) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x_np, dtype=np.float32)).to(dtype)
    out = F.e2m1_encode(t)
    assert out.dtype == torch.uint8
    assert tuple(out.shape) == tuple(t.shape)
    return out.numpy()


def assert_codes_equal(x, got, want):
    x = np.asarray(x, np.float32).reshape(-1)
    got = np.asarray(got).reshape(-1)
    want = np.asarray(want).reshape(-1)
    bad = np.nonzero(got != want)[0]
    if bad.size:
        i = bad[:10]
        raise AssertionError(
            f"{bad.size} of {x.size} codes differ; first inputs {x[i].tolist()} "
            f"(bits {[hex(b) for b in x[i].view(np.uint32).tolist()]}): got {got[i].tolist()}, "
            f"want {want[i].tolist()}"
        )


# ---------------------------------------------------------------------------------------------
# the oracle itself


def test_oracle_sanity():
    """ml_dtypes gives the codes we derive by hand (RNE, ties to even code, sign bit kept)."""
    x = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -6.0]
    assert oracle_codes(x).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15]
    # ties: 0.25 -> 0 (code 0 even), 0.75 -> 1 (code 2), 1.25 -> 1 (code 2), 1.75 -> 2 (code 4),
    # 2.5 -> 2 (code 4), 3.5 -> 4 (code 6), 5 -> 4 (code 6)
    assert oracle_codes([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert oracle_codes([-0.1, 3e38, -3e38]).tolist() == [8, 7, 15]


# ---------------------------------------------------------------------------------------------
# tables


def test_e2m1_values_exact():
    v = F.E2M1_VALUES
    assert isinstance(v, torch.Tensor)
    assert v.dtype == torch.float32
    assert tuple(v.shape) == (16,)
    assert v.tolist() == HAND_E2M1
    # code 8 is -0.0 and code 0 is +0.0
    assert math.copysign(1.0, v[8].item()) == -1.0
    assert math.copysign(1.0, v[0].item()) == 1.0


def test_e4m3_values_vs_torch_and_ml_dtypes():
    v = F.E4M3_VALUES
    assert isinstance(v, torch.Tensor)
    assert v.dtype == torch.float32
    assert tuple(v.shape) == (256,)
    bytes_ = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want_t = bytes_.view(torch.float8_e4m3fn).to(torch.float32)
    want_m = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = v.numpy()
    nan_got = np.isnan(got)
    assert np.nonzero(nan_got)[0].tolist() == [0x7F, 0xFF]
    assert np.array_equal(nan_got, np.isnan(want_m))
    assert np.array_equal(nan_got, torch.isnan(want_t).numpy())
    ok = ~nan_got
    # bitwise (so -0.0 at 0x80 is checked too)
    assert np.array_equal(got[ok].view(np.uint32), want_m[ok].view(np.uint32))
    assert np.array_equal(got[ok].view(np.uint32), want_t.numpy()[ok].view(np.uint32))
    # a few hand values: 0x7E = 448, 0x01 = 2**-9, 0x08 = 2**-6, 0x38 = 1.0
    assert got[0x7E] == 448.0 and got[0x01] == 2.0**-9 and got[0x08] == 2.0**-6 and got[0x38] == 1.0


# ---------------------------------------------------------------------------------------------
# e2m1_encode


def _boundary_points() -> np.ndarray:
    grid = np.array(MAGS, np.float32)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    pts = np.concatenate([grid, mids, np.array([6.0, 7.0, 8.0, 12.0], np.float32)])
    up = np.nextafter(pts, np.float32(np.inf))
    down = np.nextafter(pts, np.float32(-np.inf))
    up2 = np.nextafter(up, np.float32(np.inf))
    down2 = np.nextafter(down, np.float32(-np.inf))
    allp = np.concatenate([pts, up, down, up2, down2])
    allp = allp[allp >= 0]
    return np.concatenate([allp, -allp]).astype(np.float32)


def test_encode_boundaries_and_neighbours():
    x = _boundary_points()
    assert_codes_equal(x, enc(x), oracle_codes(x))


def test_encode_ties_to_even_hand():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    want = [0, 2, 2, 4, 4, 6, 6]
    assert enc(x).tolist() == want
    assert enc(-x).tolist() == [w | 8 for w in want]


def test_encode_just_off_ties_hand():
    # one fp32 ulp above each midpoint rounds up, one below rounds down
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    above = np.nextafter(mids, np.float32(np.inf))
    below = np.nextafter(mids, np.float32(-np.inf))
    assert enc(above).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert enc(below).tolist() == [0, 1, 2, 3, 4, 5, 6]


def test_encode_signed_zero_and_sign_bit():
    x = np.array([0.0, -0.0, -0.1, 0.1, -1e-45, 1e-45, -0.25, 0.25], np.float32)
    assert enc(x).tolist() == [0, 8, 8, 0, 8, 0, 8, 0]


def test_encode_fp32_subnormals():
    rng = np.random.default_rng(1)
    bits = rng.integers(1, 1 << 23, size=20000, dtype=np.uint32)
    sub = bits.view(np.float32)
    x = np.concatenate([sub, -sub, np.array([1e-45, -1e-45, 1.1754942e-38, -1.1754942e-38], np.float32)])
    assert np.all(np.abs(x) < np.finfo(np.float32).tiny)
    got = enc(x)
    assert_codes_equal(x, got, oracle_codes(x))
    assert np.array_equal(got, np.where(np.signbit(x), 8, 0).astype(np.uint8))


def test_encode_huge_and_inf_saturate():
    x = np.array([3e38, -3e38, np.finfo(np.float32).max, -np.finfo(np.float32).max, 6.0, -6.0,
                  6.5, -6.5, 1e10, -1e10, np.inf, -np.inf], np.float32)
    assert enc(x).tolist() == [7, 15, 7, 15, 7, 15, 7, 15, 7, 15, 7, 15]


def test_encode_nan_raises():
    x = torch.tensor([1.0, float("nan"), 2.0])
    with pytest.raises(ValueError):
        F.e2m1_encode(x)
    with pytest.raises(ValueError):
        F.e2m1_encode(torch.tensor([float("nan")], dtype=torch.bfloat16))


def test_encode_random_million():
    """>= 10^6 random fp32 values from several distributions vs the ml_dtypes oracle."""
    rng = np.random.default_rng(12345)
    n = 350_000
    uni = rng.uniform(-8.0, 8.0, size=n).astype(np.float32)
    # log-uniform magnitudes over (almost) the whole fp32 range, random sign
    wide = (10.0 ** rng.uniform(-45.0, 38.4, size=n)).astype(np.float32)
    wide *= np.where(rng.random(n) < 0.5, -1, 1).astype(np.float32)
    # log-uniform concentrated around the E2M1 range
    narrow = np.exp2(rng.uniform(-4.0, 4.0, size=n)).astype(np.float32)
    narrow *= np.where(rng.random(n) < 0.5, -1, 1).astype(np.float32)
    raw = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    raw = raw[np.isfinite(raw)]
    x = np.concatenate([uni, wide, narrow, raw])
    assert x.size >= 1_000_000
    assert np.all(np.isfinite(x))
    assert_codes_equal(x, enc(x), oracle_codes(x))


def test_encode_keeps_shape_and_leading_dims():
    rng = np.random.default_rng(2)
    for shape in [(0,), (3, 0), (0, 5), (7,), (2, 3, 5), (1, 2, 3, 4)]:
        x = rng.normal(0, 3, size=shape).astype(np.float32)
        got = enc(x)
        assert got.shape == shape
        assert np.array_equal(got, oracle_codes(x))


def test_encode_non_contiguous():
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.normal(0, 3, size=(6, 8)).astype(np.float32)).t()
    assert not x.is_contiguous()
    got = F.e2m1_encode(x)
    assert np.array_equal(got.numpy(), oracle_codes(x.contiguous().numpy()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_encode_half_inputs(dtype):
    rng = np.random.default_rng(4)
    vals = np.concatenate([
        _boundary_points(),
        rng.uniform(-8, 8, 20000).astype(np.float32),
        np.array([0.0, -0.0, 65504.0, -65504.0, 6e-8, -6e-8, 1e-40, -1e-40], np.float32),
    ])
    t = torch.from_numpy(vals).to(dtype)  # the exact values the function sees
    exact = t.to(torch.float32).numpy()
    got = F.e2m1_encode(t)
    assert got.dtype == torch.uint8
    assert_codes_equal(exact, got.numpy(), oracle_codes(exact))
    # infinities in half precision saturate too
    inf = torch.tensor([float("inf"), float("-inf")], dtype=dtype)
    assert F.e2m1_encode(inf).tolist() == [7, 15]


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.uint8, torch.bool])
def test_encode_bad_dtype(dtype):
    x = torch.zeros(4, dtype=dtype)
    with pytest.raises(TypeError):
        F.e2m1_encode(x)


# ---------------------------------------------------------------------------------------------
# e2m1_decode


def test_decode_all_codes():
    codes = torch.arange(16, dtype=torch.int32).to(torch.uint8)
    out = F.e2m1_decode(codes)
    assert out.dtype == torch.float32
    assert out.tolist() == HAND_E2M1
    assert np.array_equal(np.signbit(out.numpy()), np.array([False] * 8 + [True] * 8))


def test_decode_is_inverse_of_encode():
    codes = torch.arange(16, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(F.e2m1_encode(F.e2m1_decode(codes)), codes)


def test_decode_shapes():
    rng = np.random.default_rng(5)
    c = rng.integers(0, 16, size=(2, 3, 7)).astype(np.uint8)
    out = F.e2m1_decode(torch.from_numpy(c))
    assert tuple(out.shape) == (2, 3, 7)
    want = np.array(HAND_E2M1, np.float32)[c]
    assert np.array_equal(out.numpy().view(np.uint32), want.view(np.uint32))
    assert tuple(F.e2m1_decode(torch.zeros(0, 4, dtype=torch.uint8)).shape) == (0, 4)


def test_decode_bad_input():
    with pytest.raises(ValueError):
        F.e2m1_decode(torch.tensor([3, 16], dtype=torch.uint8))
    with pytest.raises(ValueError):
        F.e2m1_decode(torch.tensor([255], dtype=torch.uint8))
    with pytest.raises(TypeError):
        F.e2m1_decode(torch.tensor([1, 2], dtype=torch.int64))
    with pytest.raises(TypeError):
        F.e2m1_decode(torch.tensor([1.0, 2.0]))


# ---------------------------------------------------------------------------------------------
# pack / unpack


def test_pack_nibble_order_hand():
    codes = torch.tensor([[1, 2, 15, 0], [0, 9, 7, 7]], dtype=torch.uint8)
    packed = F.pack_fp4(codes)
    assert packed.dtype == torch.uint8
    # element 2i -> low nibble, 2i+1 -> high nibble
    assert packed.tolist() == [[0x21, 0x0F], [0x90, 0x77]]


def test_unpack_nibble_order_hand():
    packed = torch.tensor([0xA5, 0x0F, 0xF0], dtype=torch.uint8)
    codes = F.unpack_fp4(packed)
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [5, 10, 15, 0, 0, 15]


@pytest.mark.parametrize(
    "shape", [(0,), (2,), (16,), (3, 8), (0, 4), (5, 0), (2, 3, 16), (1, 2, 3, 6), (2, 0, 4)]
)
def test_pack_unpack_round_trip(shape):
    rng = np.random.default_rng(abs(hash(shape)) % 2**32)
    c = rng.integers(0, 16, size=shape).astype(np.uint8)
    packed = F.pack_fp4(torch.from_numpy(c))
    assert tuple(packed.shape) == shape[:-1] + (shape[-1] // 2,)
    # independent expected packing
    want = (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)
    assert np.array_equal(packed.numpy(), want)
    back = F.unpack_fp4(packed)
    assert back.dtype == torch.uint8
    assert np.array_equal(back.numpy(), c)


def test_unpack_all_bytes_and_fp4x2_view():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    want = np.stack([b.numpy() & 0xF, b.numpy() >> 4], axis=-1).reshape(16, 32)
    assert np.array_equal(F.unpack_fp4(b).numpy(), want)
    got_view = F.unpack_fp4(b.view(torch.float4_e2m1fn_x2))
    assert got_view.dtype == torch.uint8
    assert np.array_equal(got_view.numpy(), want)
    assert torch.equal(F.pack_fp4(F.unpack_fp4(b)), b)


def test_pack_non_contiguous():
    rng = np.random.default_rng(6)
    c = torch.from_numpy(rng.integers(0, 16, size=(8, 6)).astype(np.uint8)).t()  # (6, 8), strided
    assert not c.is_contiguous()
    cn = c.contiguous().numpy()
    want = (cn[..., 0::2] | (cn[..., 1::2] << 4)).astype(np.uint8)
    assert np.array_equal(F.pack_fp4(c).numpy(), want)


def test_pack_bad_input():
    with pytest.raises(ValueError):
        F.pack_fp4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError):
        F.pack_fp4(torch.zeros(2, 5, dtype=torch.uint8))
    with pytest.raises(ValueError):
        F.pack_fp4(torch.tensor([1, 16], dtype=torch.uint8))
    with pytest.raises(ValueError):
        F.pack_fp4(torch.tensor([[0, 0], [200, 3]], dtype=torch.uint8))
    with pytest.raises(TypeError):
        F.pack_fp4(torch.tensor([1, 2], dtype=torch.int64))
    with pytest.raises(TypeError):
        F.pack_fp4(torch.tensor([1.0, 2.0]))


def test_unpack_bad_dtype():
    with pytest.raises(TypeError):
        F.unpack_fp4(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(TypeError):
        F.unpack_fp4(torch.tensor([1.0, 2.0]))


# ---------------------------------------------------------------------------------------------
# the old, wrong half-step table quantizer


def _old_quantizer_np(x: np.ndarray) -> np.ndarray:
    """Independent implementation of the OLD half-step table algorithm (nbs/00_formats.ipynb, "Why not the half-step table quantizer")."""
    table = np.array([0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 6, 7, 7], np.uint8)
    idx = np.minimum(np.rint(2.0 * np.abs(x.astype(np.float32))), 12).astype(np.int64)  # rint = RNE
    return (table[idx] | np.where(np.signbit(x), 8, 0)).astype(np.uint8)


def test_halfstep_differs_on_known_values():
    x = torch.tensor([2.6, 3.5, 5.1, -2.6, -3.5, -5.1])
    old = F.ref_halfstep_table_encode(x)
    new = F.e2m1_encode(x)
    assert old.dtype == torch.uint8
    # old: 2.6 -> 2 (code 4), 3.5 -> 3 (code 5), 5.1 -> 4 (code 6); correct: 3, 4, 6
    assert old.tolist() == [4, 5, 6, 12, 13, 14]
    assert new.tolist() == [5, 6, 7, 13, 14, 15]


def test_halfstep_matches_described_algorithm():
    rng = np.random.default_rng(7)
    x = np.concatenate([
        np.linspace(-8, 8, 32001, dtype=np.float32),
        rng.uniform(-10, 10, 20000).astype(np.float32),
        np.array([0.0, -0.0, 100.0, -100.0], np.float32),
    ])
    got = F.ref_halfstep_table_encode(torch.from_numpy(x)).numpy()
    assert_codes_equal(x, got, _old_quantizer_np(x))


def test_halfstep_wrong_fraction_is_12_5_percent():
    x = torch.linspace(0.0, 6.0, 600_001, dtype=torch.float32)
    old = F.ref_halfstep_table_encode(x)
    new = F.e2m1_encode(x)
    # the correct codes are the ml_dtypes ones
    assert np.array_equal(new.numpy(), oracle_codes(x.numpy()))
    frac = (old != new).double().mean().item()
    assert abs(frac - 0.125) <= 0.001, frac
