"""Shared helpers for tests/test_kernels_gpu.py: input generators (CPU tensors), bit comparisons, and the
near-rounding-boundary masks that define the fused kernels' tolerance.

Inputs are built on the CPU with seeded generators (every value exactly representable in the requested dtype), so
the CPU references (dsv4_nvfp4.quant, dsv4_nvfp4.kernels.ref_*) always run on CPU tensors: on CUDA, torch divides
by a Python scalar through a reciprocal multiply, which is not the IEEE division of the spec.
"""
from __future__ import annotations

import functools

import torch

from dsv4_nvfp4.gemm.w4a8 import mixed_w4a8_experts   # noqa: F401 (W4A8 tests' experts: tests/test_w4a8_gpu.py, gemm_sanitize.py)

E2M1_MID = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)   # rounding boundaries between E2M1 magnitudes

# Tolerances of the fused RMSNorm / mHC kernels (see the module docstring of test_kernels_gpu.py)
INV_RMS_RTOL = 1e-6          # measured on H200: <= 1.6e-7
GS_RTOL = 2e-6
TOL_FP32 = 2.0 ** -19        # y in fp32: ~8 fp32 ulps, bounds |y_kernel - y_ref| / |y| given INV_RMS_RTOL
TOL_BF16 = 2.0 ** -7         # y rounded to bf16: one bf16 ulp at the bottom of a binade
MAX_DIFF_FRACTION = 1e-4     # at most this fraction of codes may differ at all (no systematic error hides)


# ================================================================================================================
# Inputs (CPU, fp32 values exactly representable in `dtype`)
def rand_rows(M, K, dtype, seed, spread=True):
    "Normal data with per-row magnitudes spread over many decades (exercises per-row scales)."
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    if spread:
        lim = {torch.float16: (-6, 4), torch.bfloat16: (-30, 30), torch.float32: (-30, 30)}[dtype]
        e = torch.randint(lim[0], lim[1] + 1, (M, 1), generator=g).float()
        x = x * torch.pow(10.0, e)
    return x.to(dtype)


def realistic_rows(M, K, dtype, seed):
    """LLM-activation-like data: heavy-tailed values (normal times a log-normal), a few outlier channels 30-300x
    larger than the rest, and a row-wise magnitude drift of a few binades (kept inside the fp16 range)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).clamp(-5, 5) * torch.exp(0.7 * torch.randn(M, K, generator=g).clamp(-4, 4))
    n_out = max(1, K // 512)
    cols = torch.randperm(K, generator=g)[:n_out]
    x[:, cols] *= 30.0 + 270.0 * torch.rand(n_out, generator=g)          # |x| <= 5 * e^2.8 * 300 < 2.5e4
    lo, hi = (-6, 0) if dtype == torch.float16 else (-4, 4)
    x = x * torch.pow(2.0, torch.randint(lo, hi + 1, (M, 1), generator=g).float())
    return x.to(dtype)


def adversarial(M, K, dtype, seed):
    """Rows of hand-made 16-blocks: ties at every E2M1 midpoint, saturation, zero and underflowing blocks, +-0,
    fp32/bf16/fp16 subnormals, values one ulp around midpoints. With gs = 1 (given) the ties are exact."""
    assert K % 16 == 0
    g = torch.Generator().manual_seed(seed)
    fin = torch.finfo(dtype)
    blocks = []
    mids = torch.tensor(E2M1_MID)
    for p in (1.0, 0.5, 2.0, 0.25, 4.0, 2.0 ** -3, 8.0):    # power-of-two scales: exact ties under gs = 1
        b = torch.zeros(16)
        b[:7] = mids * p; b[7:14] = -mids * p; b[14] = 6 * p; b[15] = -0.0
        blocks.append(b)
    blocks.append(torch.tensor(E2M1_MID * 2 + (6.0, 6.0)))                       # amax 6 -> s = 1 under gs=1
    blocks.append(torch.full((16,), 1e4))                                         # saturating scale under gs=1
    blocks.append(torch.tensor([1e4] + [7.0] * 15))                               # e2m1 saturation inside a block
    blocks.append(torch.zeros(16))                                                # zero block
    blocks.append(-torch.zeros(16))                                               # all -0 -> codes 0
    blocks.append(torch.tensor([-0.0, 0.0] * 8))
    blocks.append(torch.full((16,), fin.tiny))                                    # smallest normal of dtype
    blocks.append(torch.full((16,), fin.tiny * 0.5))                              # a subnormal of dtype
    blocks.append(torch.tensor([fin.tiny * 2.0 ** -k for k in range(16)]))        # down into (and past) subnormals
    blocks.append(torch.full((16,), 2.0 ** -10 * 6))                              # e4m3 scale tie 2^-10 -> 0 (gs=1)
    blocks.append(torch.full((16,), 2.0 ** -10 * 6 * 1.0001))
    blocks.append(torch.full((16,), 2.0 ** -9 * 6 * 1.5))                         # e4m3 subnormal tie
    blocks.append(torch.full((16,), 448 * 6 * 0.99))
    for sgn in (1.0, -1.0):  # one fp32 ulp around each midpoint (may collapse after the dtype cast: still fine)
        v = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), torch.tensor([6.0, 6.0])])
        blocks.append(sgn * v)
    base = torch.stack(blocks)                                                    # (nb, 16)
    nb_row = K // 16
    rows = []
    for r in range(M):
        idx = torch.randint(0, base.shape[0], (nb_row,), generator=g)
        row = base[idx].reshape(-1)
        if r % 4 == 1: row = row * 2.0 ** int(torch.randint(-20, 20, (1,), generator=g))  # spread under computed gs
        if r % 4 == 2: row = row * 1e-30 if dtype != torch.float16 else row * 1e-3
        rows.append(row)
    x = torch.stack(rows)
    x = x.clamp(-fin.max, fin.max)
    return x.to(dtype)


def underflow_rows(M, K, dtype, seed):
    "One huge element per row, the rest tiny: most blocks' scales underflow to 0 (all-zero codes)."
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * (1e-6 if dtype == torch.float16 else 1e-12)
    x[:, 0] = 1e3 if dtype == torch.float16 else 1e20
    return x.to(dtype)


GENERATORS = {"random": rand_rows, "realistic": realistic_rows, "adversarial": adversarial,
              "underflow": underflow_rows}


@functools.lru_cache(maxsize=64)
def make_input(gen: str, M: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    "Cached CPU input (callers must not modify it)."
    return GENERATORS[gen](M, K, dtype, seed)


# ================================================================================================================
# Comparisons
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def ndiff(a: torch.Tensor, b: torch.Tensor) -> int:
    "Number of differing bytes (-1 when the shapes differ)."
    if tuple(a.shape) != tuple(b.shape): return -1
    return int((_bytes(a) != _bytes(b)).sum())


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str):
    "Same shape, same dtype, same bytes; on failure say how many bytes differ and where the first one is."
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    gb, wb = _bytes(got), _bytes(want)
    bad = (gb != wb).nonzero().reshape(-1)
    if bad.numel():
        i = int(bad[0])
        item = i // max(1, got.element_size())
        raise AssertionError(f"{what}: {bad.numel()} of {gb.numel()} bytes differ; first at byte {i} (flat element "
                             f"{item}): got {got.detach().cpu().reshape(-1)[item]!r}, "
                             f"want {want.detach().cpu().reshape(-1)[item]!r}")


def unpack_codes(data: torch.Tensor) -> torch.Tensor:
    "(..., K/2) packed uint8 -> (..., K) codes, element 2i in the low nibble (independent of dsv4_nvfp4.formats)."
    d = data.detach().cpu().view(torch.uint8)
    return torch.stack([d & 15, d >> 4], dim=-1).reshape(*d.shape[:-1], d.shape[-1] * 2)


# ================================================================================================================
# Rounding-boundary masks (the fused kernels' tolerance)
def _near_any(vals: torch.Tensor, points: torch.Tensor, tol: float) -> torch.Tensor:
    "vals within a relative distance tol of any of the sorted positive `points` (float64)."
    idx = torch.searchsorted(points, vals.contiguous())
    lo = points[(idx - 1).clamp(0, len(points) - 1)]
    hi = points[idx.clamp(0, len(points) - 1)]
    return ((vals - lo).abs() <= tol * lo) | ((vals - hi).abs() <= tol * hi)


def near_rounding_boundary(ref_q, y_ref: torch.Tensor, tol: float):
    """Where a code may legitimately differ from the reference's, given y within a relative `tol` of y_ref.

    Returns (codes_mask (..., N) bool, scales_mask (..., N/16) bool): codes_mask is True for elements whose
    |y_ref * r| (r = 1/(s*gs) of the reference) lies within a relative distance tol of an E2M1 midpoint, and for
    every element of a block flagged in scales_mask: blocks whose bamax / (6 gs) lies within tol of an E4M3
    rounding boundary (midpoints of consecutive finite e4m3 values, 0 .. 448)."""
    from dsv4_nvfp4.formats import E4M3_VALUES
    y = y_ref.detach().cpu().double()
    lead, N = y.shape[:-1], y.shape[-1]
    yb = y.reshape(*lead, N // 16, 16)
    g = ref_q.global_scale.detach().cpu().double()
    g = g[..., None] if g.dim() else g
    s = ref_q.scale.detach().cpu().float().double()
    r = torch.where(s == 0, torch.zeros_like(s), 1.0 / (s * g))
    v = (yb * r[..., None]).abs()
    mids = torch.tensor(E2M1_MID, dtype=torch.float64)
    near_code = _near_any(v, mids, tol)                                          # (..., N/16, 16)
    fin = E4M3_VALUES[:127].double()                                             # finite e4m3 values 0 .. 448
    assert float(fin[0]) == 0.0 and float(fin[-1]) == 448.0 and bool((fin[1:] > fin[:-1]).all())
    emids = (fin[1:] + fin[:-1]) / 2
    qs = yb.abs().amax(-1) / (6.0 * g)
    near_scale = _near_any(qs, emids, tol)                                       # (..., N/16)
    return (near_code | near_scale[..., None]).reshape(*lead, N), near_scale


# ================================================================================================================
# The grouped GEMM (tests/test_gemm_gpu.py, tests/test_mxfp4_gpu.py)
def hopper():
    "Whether the current GPU is a Hopper (sm_90), which the sm_90a kernel needs."
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def ref_grouped(a64, w64, offs):
    "float64 grouped GEMM: rows [offs[e-1], offs[e]) of a64 times w64[e]^T, on a64's device (offs: cumulative ends)."
    out = torch.zeros(a64.shape[0], w64.shape[1], dtype=torch.float64, device=a64.device)
    o = [0] + offs.tolist()
    for e in range(w64.shape[0]):
        if o[e + 1] > o[e]: out[o[e]:o[e + 1]] = a64[o[e]:o[e + 1]] @ w64[e].T
    return out


def assert_gemm_close(got, want, what):
    "The GEMM issue's tolerance: relative Frobenius <= 2e-3 and >= 99% of the outputs within 1 bf16 ulp of float64."
    assert got.dtype == torch.bfloat16 and bool(torch.isfinite(got).all()), what
    d = (got.double() - want).abs()
    fro = (d.norm() / want.norm()).item()
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    within = (d <= ulp).double().mean().item()
    assert fro <= 2e-3 and within >= 0.99, f"{what}: Frobenius {fro:.2e}, within 1 ulp {100 * within:.3f}%"
