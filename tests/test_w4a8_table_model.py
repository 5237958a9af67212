"""CPU: the byte-permute table decode that notebook 04e plans for the W4A8 loop, modelled at the bit level before it is
built, and checked against `w4a8_weights` (the E4M3 weights the current loop makes):

  table   lo = 0x3C383000 + k * 0x08080800, hi = 0x4C484440 + k * 0x08080808: the E4M3 bytes of {0, .5, 1, 1.5} and
          {2, 3, 4, 6} times 2^k (k = block exponent - row exponent c); byte 0 of lo (the zero) stays 0
  word    32 bits hold two fragment registers A and B of 4 weights each: nibble i = A's magnitude i, nibble 4 + i = B's;
          A's signs at bits 8i + 7, B's at bits 8i + 3 (the layout step places them: the selectors' bit 3 is free)
  decode  A = PRMT(lo, hi, w & 0x77777777) | (w & 0x80808080)
          B = PRMT(lo, hi, (w >> 16) & 0x7777) | ((w << 4) & 0x80808080)      8 integer instructions for 8 weights
PRMT (default mode): selector nibble j picks byte (nibble & 7) of {lo: bytes 0-3, hi: bytes 4-7}; bit 3 of the nibble
replicates that byte's sign instead, which is why the magnitudes are masked.

What the model shows: the table gives w4a8_weights' bytes exactly when every block scale is a power of two and
k >= -5 (the 0.5 entry stays an E4M3 normal; below, the add borrows across bytes); a non-power-of-two block scale
has no such table. So the fast path is for MXFP4-carried weights (DeepSeek-V4's release), per slab, with today's
loop as the fallback."""
import math

import numpy as np
import torch

from dsv4_nvfp4.gemm.w4a8 import w4a8_weights
from dsv4_nvfp4.quant import MXFP4Tensor, NVFP4Experts, mxfp4_experts_to_nvfp4

LO, HI, STEP_LO, STEP_HI = 0x3C383000, 0x4C484440, 0x08080800, 0x08080808


def prmt(lo: int, hi: int, sel: int) -> int:
    "PTX prmt.b32 (default mode) on Python ints."
    pool = [(lo >> (8 * i)) & 0xFF for i in range(4)] + [(hi >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for j in range(4):
        n = (sel >> (4 * j)) & 0xF
        b = pool[n & 7]
        if n & 8: b = 0xFF if b & 0x80 else 0x00
        out |= b << (8 * j)
    return out


def table(k: int) -> tuple[int, int]:
    return (LO + k * STEP_LO) & 0xFFFFFFFF, (HI + k * STEP_HI) & 0xFFFFFFFF


def pack(a_codes, b_codes) -> int:
    "The word the layout step writes for registers A and B (4 E2M1 codes each, sign in bit 3)."
    w = 0
    a_codes, b_codes = [int(c) for c in a_codes], [int(c) for c in b_codes]
    for i in range(4):
        w |= (a_codes[i] & 7) << (4 * i) | (b_codes[i] & 7) << (4 * (i + 4))
        w |= ((a_codes[i] >> 3) & 1) << (8 * i + 7) | ((b_codes[i] >> 3) & 1) << (8 * i + 3)
    return w


def decode(w: int, k_a: int, k_b: int) -> tuple[int, int]:
    lo, hi = table(k_a)
    a = prmt(lo, hi, w & 0x77777777) | (w & 0x80808080)
    lo, hi = table(k_b)
    b = prmt(lo, hi, (w >> 16) & 0x7777) | ((w << 4) & 0xFFFFFFFF & 0x80808080)
    return a, b


def mxfp4_layer(seed, E=2, N=16, K=256, spread=11):
    "MXFP4 experts whose block exponents lie within `spread` binades of each row's largest, as NVFP4 (same values)."
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    top = torch.randint(118, 124, (E, N, 1), generator=g)
    sc = (top - torch.randint(0, spread + 1, (E, N, K // 32), generator=g)).to(torch.uint8)
    return mxfp4_experts_to_nvfp4(MXFP4Tensor(data, sc, (E, N, K)))[0]


def table_bytes(ex: NVFP4Experts):
    "Every weight of `ex` through the table decode, as uint8 (E, N, K), and each 16-block's k."
    E, N, K = ex.shape
    codes = torch.stack([ex.data & 0xF, ex.data >> 4], -1).view(E, N, K).numpy()
    s = ex.scale.float().numpy()
    _, c, _ = w4a8_weights(ex)
    ks = np.log2(s).astype(np.int64) - c.numpy()[..., None]              # block exponent - row exponent
    assert np.all(np.exp2(np.log2(s)) == s), "power-of-two block scales only"
    out = np.zeros((E, N, K), dtype=np.uint8)
    for e in range(E):
        for n in range(N):
            for kb in range(K // 16):                                   # a 16-block: two words of 8 weights
                k = int(ks[e, n, kb])
                for h in range(2):
                    cs = codes[e, n, 16 * kb + 8 * h: 16 * kb + 8 * h + 8]
                    a, b = decode(pack(cs[:4], cs[4:]), k, k)
                    for i in range(4):
                        out[e, n, 16 * kb + 8 * h + i] = (a >> (8 * i)) & 0xFF
                        out[e, n, 16 * kb + 8 * h + 4 + i] = (b >> (8 * i)) & 0xFF
    return out, ks


def test_the_table_decode_is_w4a8_weights_for_mxfp4_carried_blocks():
    for seed in range(3):
        ex = mxfp4_layer(seed)
        got, ks = table_bytes(ex)
        want = w4a8_weights(ex)[0].view(torch.uint8).numpy()
        assert ks.max() <= 8 and ks.min() >= -5, (ks.min(), ks.max())   # within 11 binades: the fast path's range
        assert np.array_equal(got, want)


def test_the_range_rule():
    """Every code through the table at offset k equals e4m3(code x 2^k) for k in [-5, 6] (6: the row exponent keeps
    the row's largest product <= 448), and not for k = -6 or -7 (the 0.5 entry is no E4M3 normal; the add borrows)."""
    e2m1 = [0, .5, 1, 1.5, 2, 3, 4, 6]
    def exact(k):
        for code in range(16):
            v = math.copysign(e2m1[code & 7] * 2.0 ** k, -1.0 if code & 8 else 1.0)          # code 8 is -0
            want = torch.tensor([v]).to(torch.float8_e4m3fn).view(torch.uint8).item()
            a, _ = decode(pack([code] * 4, [0] * 4), k, 0)
            if (a & 0xFF) != want: return False
        return True
    assert all(exact(k) for k in range(-5, 7))
    assert not exact(-6) and not exact(-7)


def test_a_non_power_of_two_scale_has_no_such_table():
    "NVFP4's own E4M3 block scales (1.25 here): w4a8_weights rounds code x s, which no 2^k table reproduces."
    ex = mxfp4_layer(0, E=1, N=2, K=32)
    ex = NVFP4Experts(ex.data, (ex.scale.float() * 1.25).to(torch.float8_e4m3fn), ex.global_scale, ex.shape)
    want = w4a8_weights(ex)[0].view(torch.uint8).numpy()
    codes = torch.stack([ex.data & 0xF, ex.data >> 4], -1).view(1, 2, 32).numpy()
    best = min(sum(int((decode(pack(codes[0, 0, i:i + 4], [0] * 4), k, 0)[0] >> (8 * j)) & 0xFF) != want[0, 0, i + j]
                   for i in range(0, 16, 4) for j in range(4)) for k in range(-8, 9))
    assert best > 0
