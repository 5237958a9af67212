"""Tests for dsv4_nvfp4.layout: the 32_4_4 scale-factor swizzle (cuBLAS / tcgen05 layout).

The expected layouts are built independently of the implementation:
* ``loop_offsets`` walks the swizzled buffer byte by byte with explicit loops over 128x4 tiles
  (nbs/02_swizzle.ipynb: tiles row-block major, 512 contiguous bytes each, inside a tile element (r, c) at
  byte (r % 32) * 16 + (r // 32) * 4 + c);
* ``np_swizzle`` is the usual reshape/transpose construction
  (rows/128, 4, 32, cols/4, 4) -> (rows/128, cols/4, 32, 4, 4).
"""
import numpy as np
import pytest
import torch

from dsv4_nvfp4 import layout as L


def ru(a, b):
    return -(-a // b) * b


def loop_offsets(rows, cols):
    """dict (r, c) -> byte offset, built by walking the buffer in order with explicit loops."""
    Rp, Cp = ru(rows, 128), ru(cols, 4)
    off = {}
    pos = 0
    for tile_r in range(Rp // 128):  # row-block major
        for tile_c in range(Cp // 4):
            for r32 in range(32):  # byte (r % 32) * 16 + (r // 32) * 4 + c inside the tile
                for rb in range(4):
                    for cc in range(4):
                        r = tile_r * 128 + rb * 32 + r32
                        c = tile_c * 4 + cc
                        off[(r, c)] = pos
                        pos += 1
    assert pos == Rp * Cp
    return off


def np_swizzle(sf):
    """numpy reshape/transpose construction of the swizzled (Rp, Cp) matrix (uint8)."""
    sf = np.asarray(sf)
    rows, cols = sf.shape
    Rp, Cp = ru(rows, 128), ru(cols, 4)
    p = np.zeros((Rp, Cp), sf.dtype)
    p[:rows, :cols] = sf
    return p.reshape(Rp // 128, 4, 32, Cp // 4, 4).transpose(0, 3, 2, 1, 4).reshape(Rp, Cp)


def rand_bytes(shape, seed):
    # values 1..255 so that misplaced padding (0) is detectable
    return np.random.default_rng(seed).integers(1, 256, size=shape).astype(np.uint8)


SHAPES = [(1, 1), (5, 3), (127, 3), (128, 4), (129, 5), (300, 17), (256, 64), (64, 2)]


def test_np_swizzle_matches_loop_construction():
    # cross-check of the two independent references
    for rows, cols in [(1, 1), (129, 5), (300, 17)]:
        sf = rand_bytes((rows, cols), 0)
        flat = np_swizzle(sf).reshape(-1)
        for (r, c), o in loop_offsets(rows, cols).items():
            want = sf[r, c] if (r < rows and c < cols) else 0
            assert flat[o] == want


def test_swizzled_offset_hand_values():
    # (0,0) -> 0; (1,0) -> 16; (32,0) -> 4; (0,1) -> 1; (0,4) -> next tile: 512;
    # (128,0) with cols 8 -> row-block 1: (1 * 2 + 0) * 512 = 1024; (127,3) -> 31*16 + 3*4 + 3 = 511
    assert L.swizzled_offset(0, 0, 8) == 0
    assert L.swizzled_offset(1, 0, 8) == 16
    assert L.swizzled_offset(32, 0, 8) == 4
    assert L.swizzled_offset(0, 1, 8) == 1
    assert L.swizzled_offset(0, 4, 8) == 512
    assert L.swizzled_offset(128, 0, 8) == 1024
    assert L.swizzled_offset(127, 3, 8) == 511
    # cols = 5 pads to 8: (128, 0) -> (1 * 2) * 512
    assert L.swizzled_offset(128, 0, 5) == 1024
    assert isinstance(L.swizzled_offset(3, 2, 5), int)


@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 3), (129, 5), (300, 17), (256, 8)])
def test_swizzled_offset_vs_loops(rows, cols):
    off = loop_offsets(rows, cols)
    for r in range(rows):
        for c in range(cols):
            assert L.swizzled_offset(r, c, cols) == off[(r, c)], (r, c)


def test_swizzled_offset_tensor_inputs():
    rows, cols = 300, 17
    off = loop_offsets(rows, cols)
    rr, cc = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    got = L.swizzled_offset(rr, cc, cols)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int64
    assert tuple(got.shape) == (rows, cols)
    want = np.array([[off[(r, c)] for c in range(cols)] for r in range(rows)], np.int64)
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_swizzle_scales_places_elements(rows, cols, dtype):
    sf_np = rand_bytes((rows, cols), rows * 1000 + cols)
    sf = torch.from_numpy(sf_np).view(dtype) if dtype != torch.uint8 else torch.from_numpy(sf_np)
    out = L.swizzle_scales(sf)
    Rp, Cp = ru(rows, 128), ru(cols, 4)
    assert out.dtype == dtype
    assert tuple(out.shape) == (Rp, Cp)
    flat = out.contiguous().view(torch.uint8).reshape(-1).numpy()
    assert np.array_equal(flat, np_swizzle(sf_np).reshape(-1))
    # every element at its loop-derived offset, every other byte (padding) zero
    off = loop_offsets(rows, cols)
    placed = np.zeros(Rp * Cp, bool)
    for r in range(rows):
        for c in range(cols):
            o = off[(r, c)]
            assert flat[o] == sf_np[r, c]
            placed[o] = True
    assert np.all(flat[~placed] == 0)


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_unswizzle_inverts(rows, cols):
    sf_np = rand_bytes((rows, cols), 7 + rows + cols)
    for dtype in (torch.uint8, torch.float8_e4m3fn):
        sf = torch.from_numpy(sf_np).view(dtype)
        back = L.unswizzle_scales(L.swizzle_scales(sf), rows, cols)
        assert back.dtype == dtype and tuple(back.shape) == (rows, cols)
        assert np.array_equal(back.contiguous().view(torch.uint8).numpy(), sf_np)
    # unswizzle of an independently built buffer
    swz = torch.from_numpy(np.ascontiguousarray(np_swizzle(sf_np)))
    assert np.array_equal(L.unswizzle_scales(swz, rows, cols).numpy(), sf_np)


def test_swizzle_non_contiguous_input():
    base = rand_bytes((17, 300), 3)
    sf = torch.from_numpy(base).t()  # (300, 17), not contiguous
    assert not sf.is_contiguous()
    out = L.swizzle_scales(sf)
    assert np.array_equal(out.contiguous().reshape(-1).numpy(), np_swizzle(base.T).reshape(-1))


def test_swizzle_batched():
    E, rows, cols = 3, 129, 5
    sf_np = rand_bytes((E, rows, cols), 11)
    sf = torch.from_numpy(sf_np).view(torch.float8_e4m3fn)
    out = L.swizzle_scales(sf)
    assert out.dtype == torch.float8_e4m3fn
    assert tuple(out.shape) == (E, 256, 8)
    ob = out.contiguous().view(torch.uint8).numpy()
    for e in range(E):
        assert np.array_equal(ob[e].reshape(-1), np_swizzle(sf_np[e]).reshape(-1))
    back = L.unswizzle_scales(out, rows, cols)
    assert tuple(back.shape) == (E, rows, cols)
    assert np.array_equal(back.contiguous().view(torch.uint8).numpy(), sf_np)
    # two leading dims
    sf4 = rand_bytes((2, 2, 40, 6), 12)
    out4 = L.swizzle_scales(torch.from_numpy(sf4))
    assert tuple(out4.shape) == (2, 2, 128, 8)
    for i in range(2):
        for j in range(2):
            assert np.array_equal(out4[i, j].numpy(), np_swizzle(sf4[i, j]))
    assert np.array_equal(L.unswizzle_scales(out4, 40, 6).numpy(), sf4)


def test_swizzle_bad_rank():
    with pytest.raises(ValueError):
        L.swizzle_scales(torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError):
        L.swizzle_scales(torch.zeros((), dtype=torch.uint8))


def test_assemble_activation_scales_ragged():
    cols = 6
    sizes = [5, 0, 130, 128, 1]
    experts = [rand_bytes((m, cols), 20 + i) for i, m in enumerate(sizes)]
    for dtype in (torch.uint8, torch.float8_e4m3fn):
        out = L.assemble_activation_scales([torch.from_numpy(e).view(dtype) for e in experts])
        assert out.dtype == dtype
        # rows: 128 + 0 + 256 + 128 + 128; cols padded to 8
        assert tuple(out.shape) == (640, 8)
        want = np.concatenate([np_swizzle(e) for e in experts if e.shape[0] > 0], axis=0)
        assert np.array_equal(out.contiguous().view(torch.uint8).numpy(), want)
        # the flat buffer is the concatenation of per-expert swizzled buffers
        assert np.array_equal(out.contiguous().view(torch.uint8).reshape(-1).numpy(), want.reshape(-1))


def test_assemble_activation_scales_mismatched_cols():
    a = torch.zeros(4, 6, dtype=torch.uint8)
    b = torch.zeros(4, 7, dtype=torch.uint8)
    with pytest.raises(ValueError):
        L.assemble_activation_scales([a, b])


def test_assemble_weight_scales_list_and_3d():
    E, N, cols = 4, 200, 9
    w = rand_bytes((E, N, cols), 30)
    want = np.stack([np_swizzle(w[e]) for e in range(E)])
    assert want.shape == (E, 256, 12)
    out_l = L.assemble_weight_scales([torch.from_numpy(w[e]).view(torch.float8_e4m3fn) for e in range(E)])
    assert out_l.dtype == torch.float8_e4m3fn
    assert tuple(out_l.shape) == (E, 256, 12)
    assert np.array_equal(out_l.contiguous().view(torch.uint8).numpy(), want)
    out_t = L.assemble_weight_scales(torch.from_numpy(w))
    assert out_t.dtype == torch.uint8
    assert tuple(out_t.shape) == (E, 256, 12)
    assert np.array_equal(out_t.numpy(), want)
