"""CPU: the order argument behind the KV compressor's decode state (kernels_cu/nvfp4_kv_compress.cu), in a model of its
fp32 arithmetic (its fused multiply-adds too; np.exp stands in for expf, the same function in both orders): an entry pooled the prefill's way (per group of slots from empty, CSA's previous window then this
one, groups merged in order) and token by token through running softmaxes (part 0 the entry in progress, CSA's part 1
the next entry's first half, handed over when the window closes) are the same fp32 operations in the same order, so
the same bits. The GPU tests check the kernels themselves (tests/test_kv_gpu.py)."""
import numpy as np
import pytest

f = np.float32
NEG = f(-np.inf)


def fma(a, b, c):
    "fmaf: the fp32 product is exact in float64, the sum rounded to fp32 (double rounding aside, which both orders share)."
    return f(np.float64(a) * np.float64(b) + np.float64(c))


class Chain:
    "Pool4 of the kernel over D channels: the online softmax add and merge, every operation rounded to fp32."
    def __init__(self, D):
        self.m, self.den, self.num = np.full(D, NEG, f), np.zeros(D, f), np.zeros(D, f)

    def copy(self):
        c = Chain(len(self.m)); c.m, c.den, c.num = self.m.copy(), self.den.copy(), self.num.copy(); return c

    def add(self, s, v):
        for k in range(len(self.m)):
            if s[k] == NEG: continue
            mn = s[k] if (s[k] > self.m[k] or s[k] != s[k]) else self.m[k]
            a, b = f(np.exp(f(self.m[k] - mn))), f(np.exp(f(s[k] - mn)))
            self.den[k] = fma(self.den[k], a, b); self.num[k] = fma(self.num[k], a, f(b * v[k])); self.m[k] = mn

    def merge(self, o):
        for k in range(len(self.m)):
            if o.m[k] == NEG: continue
            if self.m[k] == NEG: self.m[k], self.den[k], self.num[k] = o.m[k], o.den[k], o.num[k]; continue
            mn = o.m[k] if (o.m[k] > self.m[k] or o.m[k] != o.m[k]) else self.m[k]
            a, b = f(np.exp(f(self.m[k] - mn))), f(np.exp(f(o.m[k] - mn)))
            self.den[k] = fma(self.den[k], a, f(o.den[k] * b)); self.num[k] = fma(self.num[k], a, f(o.num[k] * b)); self.m[k] = mn

    def entry(self):
        return (self.num / self.den).astype(f)


def prefill_entry(kv, sc, ape, i, r, coff, split, D):
    per, off, parts = r // split, (coff - 1) * D, []
    for g in range(split):
        p = Chain(D)
        for j in range(g * per, (g + 1) * per) if coff == 2 and i > 0 else ():
            t = (i - 1) * r + j; p.add((sc[t, :D] + ape[j, :D]).astype(f), kv[t, :D])
        for j in range(g * per, (g + 1) * per):
            t = i * r + j; p.add((sc[t, off:off + D] + ape[j, off:off + D]).astype(f), kv[t, off:off + D])
        parts.append(p)
    for p in parts[1:]: parts[0].merge(p)
    return parts[0].entry()


def decode_entries(kv, sc, ape, r, coff, split, D):
    per, off, out = r // split, (coff - 1) * D, []
    P, Q = [Chain(D) for _ in range(split)], [Chain(D) for _ in range(split)]
    for t in range(kv.shape[0]):
        k = t % r; g = k // per
        s = (sc[t] + ape[k]).astype(f)
        P[g].add(s[off:off + D], kv[t, off:off + D])
        if coff == 2: Q[g].add(s[:D], kv[t, :D])
        if k == r - 1:
            m = [p.copy() for p in P]
            for p in m[1:]: m[0].merge(p)
            out.append(m[0].entry())
            P = [q.copy() for q in Q] if coff == 2 else [Chain(D) for _ in range(split)]
            Q = [Chain(D) for _ in range(split)]
    return out


@pytest.mark.parametrize("r,coff,split", [(4, 2, 1), (4, 2, 2), (4, 2, 4), (16, 1, 4), (8, 1, 2), (8, 1, 1)])   # CSA is r = 4
def test_running_softmax_state_gives_the_prefill_bits(r, coff, split):
    D, T = 8, 5 * r + 3
    g = np.random.default_rng(r + split)
    kv, sc = g.standard_normal((T, coff * D)).astype(f), (3 * g.standard_normal((T, coff * D))).astype(f)
    ape = (0.5 * g.standard_normal((r, coff * D))).astype(f)
    pre = [prefill_entry(kv, sc, ape, i, r, coff, split, D) for i in range(T // r)]
    dec = decode_entries(kv, sc, ape, r, coff, split, D)
    assert len(dec) == len(pre) == T // r
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(pre, dec))
    # and the order matters: merging HCA's groups in another order changes bits somewhere (the test can fail)
    if split > 1 and coff == 1:
        def rev(i):
            per, off, parts = r // split, (coff - 1) * D, []
            for gg in reversed(range(split)):
                p = Chain(D)
                for j in range(gg * per, (gg + 1) * per):
                    t = i * r + j; p.add((sc[t, off:off + D] + ape[j, off:off + D]).astype(f), kv[t, off:off + D])
                parts.append(p)
            for p in parts[1:]: parts[0].merge(p)
            return parts[0].entry()
        assert any(not np.array_equal(rev(i).view(np.uint32), pre[i].view(np.uint32)) for i in range(1, T // r))
