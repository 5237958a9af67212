"""GPU tests of the NVFP4 CUDA kernels (dsv4_nvfp4.kernels launchers over kernels_cu/*.cu), against CPU references.

Every test is marked ``gpu`` (conftest.py skips them where ``torch.cuda.is_available()`` is False). Run on a GPU box:
``python -m pytest tests/test_kernels_gpu.py -m gpu -q``. References always run on CPU tensors (on CUDA, torch
divides by a Python scalar through a reciprocal multiply, which is not the IEEE division of the spec); inputs
are built on the CPU from seeded generators (tests/_gpu_helpers.py) and copied to the GPU.

What is proved, and how:

* quantize_nvfp4_cuda is **bit-exact** with ``dsv4_nvfp4.quant.quantize_nvfp4`` (codes, e4m3 scale bytes and
  fp32 global scale compared byte for byte) for bf16 / fp16 / fp32 inputs; random rows spread over 60 decades,
  LLM-like heavy-tailed rows with outlier channels, adversarial rows (ties at every E2M1 midpoint under an exact
  gs = 1, E2M1 and E4M3 saturation, zero / all -0 / mixed +-0 blocks, underflowing scales, dtype subnormals, one
  ulp around each midpoint) and rows whose blocks underflow; per-tensor and per-row computed gs (the one-CTA row
  kernel and, for K > 16384, the two-pass path), a given scalar gs and a given per-row gs; plain scales, and
  swizzled scales compared with ``dsv4_nvfp4.layout.swizzle_scales`` of the reference (padding included);
  3-D input, empty input (gs = 1). NaN input gives a NaN gs (per tensor, and only in the NaN's row per row, on
  both per-row paths); Inf gives an Inf gs.
* dequantize_nvfp4_cuda (bf16 / fp32, plain or swizzled scales), gather_dequant_nvfp4 and dequant_rows_nvfp4 are
  bit-exact with ``ref_dequantize_nvfp4`` of the same NVFP4 data; -1 indices and out-of-range indices give zero rows;
  in checked mode the device counter grows by exactly the number of out-of-range (not -1) indices; a strided
  destination slice is written without touching the columns around it. The gather's decode (codes through the
  hardware E4M3 conversion) is checked on every code with every scale byte (NaN, subnormals, +-0) under four global
  scales, down into the subnormals.
* rmsnorm_quantize_nvfp4 / mhc_rmsnorm_quantize_nvfp4 against ``ref_rmsnorm_quantize_nvfp4`` /
  ``ref_mhc_rmsnorm_quantize_nvfp4`` (same fp32 operation order, except the sum of squares, an fp32 tree on the GPU):
  (1) inv_rms relative error <= 1e-6 and computed gs relative error <= 2e-6;
  (2) given the kernel's own inv_rms, the reference reproduces codes, scales and gs **bit for bit**;
  (3) codes (and scales) equal those of the reference's own output except where that output sits within one ulp
      of a rounding boundary, made precise as: a code may differ only where |y_ref * r| lies within a relative
      distance ``tol`` of an E2M1 midpoint, or its block's bamax / (6 gs) within ``tol`` of an E4M3 rounding
      boundary; tol = 2^-19 (~8 fp32 ulps) for fp32 y and 2^-7 (one bf16 ulp at the bottom of a binade) with
      round_to_bf16=True. Why 2^-19 bounds it: with a computed per-row gs, a relative change of inv_rms scales y,
      the row amax and gs alike and cancels in y*r = y / (s*gs) and in bamax / (6 gs), leaving the ~7 fp32
      roundings on each side (< 2^-20 in all); with a given gs, y*r and bamax / (6 gs) move with y, i.e. by
      <= 1e-6 + a few roundings < 2^-19. With round_to_bf16, one fp32 ulp before rounding can move the bf16
      value by one bf16 ulp, hence 2^-7. (Checked on CPU by perturbing an emulated kernel's inv_rms: +-8 fp32
      ulps pass, +-400 ulps are caught by (3) and (4).)
  (4) at most 1e-4 of all codes differ at all, so the tolerance cannot hide a systematic error.
  Also: swizzled scales, a given scalar / per-row / Python-float gs, n_hc = 1..4, 3-D input, zero rows.
* Bad inputs raise TypeError / ValueError naming the launcher, **before any launch** (runtime.launch is spied on).
* ``out=`` buffers are written in place (same storage returned), including every byte of a swizzled scale buffer
  pre-filled with garbage (the kernels write the padding).
* A CUDA graph capturing quantize (fused per-tensor gs, swizzled), dequantize, gather and rmsnorm_quantize
  replays correctly on new data written into its static inputs (checked against the references each replay);
  launches on a side stream are correct.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gpu_helpers import (GS_RTOL, INV_RMS_RTOL, MAX_DIFF_FRACTION, TOL_BF16, TOL_FP32,  # noqa: E402
                          assert_bits_equal, make_input, near_rounding_boundary, rand_rows, unpack_codes)

from dsv4_nvfp4 import norm as NM  # noqa: E402
from dsv4_nvfp4 import quantize_cuda as QC  # noqa: E402
from dsv4_nvfp4 import runtime as rt  # noqa: E402
from dsv4_nvfp4.layout import swizzle_scales, unswizzle_scales  # noqa: E402
from dsv4_nvfp4.quant import NVFP4Tensor, ref_dequantize_nvfp4, global_scale_from_amax, ref_quantize_nvfp4  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def sync():
    torch.cuda.synchronize()


# ================================================================================================================
# quantize: bit-exact with ref_quantize_nvfp4
QSHAPES = [(1, 16), (3, 48), (130, 256), (257, 4096), (64, 7168), (5, 16400)]  # 16400: K > 16384 (two-pass per row)
QGENS = ["random", "realistic", "adversarial", "underflow"]
QMODES = ["tensor-gs", "row-gs", "given-1", "given-rowgs"]
QCASES = [pytest.param(dt, M, Kd, gen, mode, swz, id=f"{dt}-{M}x{Kd}-{gen}-{mode}-{'swz' if swz else 'plain'}")
          for dt in DTYPES for (M, Kd) in QSHAPES for gen in QGENS for mode in QMODES for swz in (False, True)]

_qref_cache: dict = {}


def quant_case(dt, M, Kd, gen, mode):
    "(x CPU, gs for the launcher (None / float / CPU tensor), per_row, reference NVFP4Tensor), cached per case."
    key = (dt, M, Kd, gen, mode)
    if key not in _qref_cache:
        if len(_qref_cache) > 8: _qref_cache.clear()
        x = make_input(gen, M, Kd, DTYPES[dt], M * 7 + Kd)
        if mode == "tensor-gs": gs, per_row = None, False
        elif mode == "row-gs": gs, per_row = None, True
        elif mode == "given-1": gs, per_row = 1.0, False
        else:  # a given per-row gs, 0.75x the computed one: forces e4m3 saturation in some blocks
            gs = (global_scale_from_amax(x.float().abs().amax(-1)) * 0.75).clamp(min=2.0 ** -110)
            per_row = False
        ref = ref_quantize_nvfp4(x, gs, per_row=per_row)
        _qref_cache[key] = (x, gs, per_row, ref)
    return _qref_cache[key]


@pytest.mark.parametrize("dt,M,Kd,gen,mode,swz", QCASES)
def test_quantize_bit_exact(dt, M, Kd, gen, mode, swz):
    x, gs, per_row, ref = quant_case(dt, M, Kd, gen, mode)
    gsg = gs.to(DEV) if isinstance(gs, torch.Tensor) else gs
    xd = x.to(DEV)
    q = QC.quantize_nvfp4_cuda(xd, gsg, per_row=per_row, swizzle=swz)
    sync()
    assert isinstance(q, QC.SwizzledNVFP4 if swz else NVFP4Tensor)
    assert tuple(q.shape) == (M, Kd)
    assert q.data.device == q.scale.device == q.global_scale.device == xd.device
    assert_bits_equal(q.data, ref.data, "packed codes")
    assert_bits_equal(q.scale, swizzle_scales(ref.scale) if swz else ref.scale,
                      "swizzled scales (padding included)" if swz else "scales")
    assert_bits_equal(q.global_scale.reshape(ref.global_scale.shape), ref.global_scale, "global scale")
    if mode in ("row-gs", "given-rowgs"):
        assert tuple(q.global_scale.shape) == (M,)
    elif mode == "tensor-gs":
        assert q.global_scale.dim() == 0


def test_adversarial_inputs_reach_the_edge_cases():
    "The adversarial rows really produce ties, saturated scales, zero blocks, -0 and saturated codes (gs = 1)."
    x = make_input("adversarial", 130, 256, torch.float32, 130 * 7 + 256)
    ref = ref_quantize_nvfp4(x, 1.0)
    sb = ref.scale.view(torch.uint8)
    codes = unpack_codes(ref.data)
    assert (sb == 0x7E).any(), "no block scale saturates at 448"
    assert (sb == 0).any(), "no block scale underflows to 0"
    assert ((codes & 7) == 7).any(), "no code saturates at 6"
    assert (codes == 8).any(), "no -0 code"
    xb = x.reshape(130, 16, 16)
    r = 1.0 / (ref.scale.float() * 1.0)
    v = (xb * r[..., None]).abs()
    assert any(bool((v == m).any()) for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)), "no exact E2M1 tie"


@pytest.mark.parametrize("dt", DTYPES)
def test_quantize_3d_per_row(dt):
    x = rand_rows(6, 64, DTYPES[dt], 5).reshape(2, 3, 64)
    ref = ref_quantize_nvfp4(x, None, per_row=True)
    q = QC.quantize_nvfp4_cuda(x.to(DEV), per_row=True)
    sync()
    assert tuple(q.global_scale.shape) == (2, 3) and tuple(q.data.shape) == (2, 3, 32)
    assert_bits_equal(q.data, ref.data, "codes")
    assert_bits_equal(q.scale, ref.scale, "scales")
    assert_bits_equal(q.global_scale, ref.global_scale, "gs")


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("swz", [False, True])
def test_quantize_empty_input(per_row, swz):
    x = torch.empty(0, 32, dtype=torch.bfloat16)
    ref = ref_quantize_nvfp4(x, per_row=per_row)
    q = QC.quantize_nvfp4_cuda(x.to(DEV), per_row=per_row, swizzle=swz)
    sync()
    assert tuple(q.data.shape) == (0, 16)
    assert tuple(q.global_scale.shape) == tuple(ref.global_scale.shape)
    if not per_row:
        assert float(q.global_scale) == 1.0 == float(ref.global_scale)  # amax of nothing is 0 -> gs 1


@pytest.mark.parametrize("dt", DTYPES)
def test_nan_input_gives_nan_global_scale(dt):
    x = rand_rows(4, 64, DTYPES[dt], 1, spread=False).to(DEV)
    x[2, 17] = float("nan")
    g = QC.quantize_nvfp4_cuda(x).global_scale
    gr = QC.quantize_nvfp4_cuda(x, per_row=True).global_scale                                   # one-CTA row kernel
    long = x.repeat(1, 1100)[:, :17600].contiguous()                                           # K > 16384: 2 passes
    gr2 = QC.quantize_nvfp4_cuda(long, per_row=True).global_scale
    sync()
    assert bool(torch.isnan(g)), f"per-tensor gs {float(g)} is not NaN"
    assert torch.isnan(gr).tolist() == [False, False, True, False], gr.tolist()
    assert torch.isnan(gr2).tolist() == [False, False, True, False], gr2.tolist()
    assert bool(torch.isfinite(gr[[0, 1, 3]]).all()) and bool(torch.isfinite(gr2[[0, 1, 3]]).all())


@pytest.mark.parametrize("dt", DTYPES)
def test_inf_input_gives_inf_global_scale(dt):
    x = rand_rows(4, 64, DTYPES[dt], 1, spread=False).to(DEV)
    x[2, 17] = float("-inf")
    g = QC.quantize_nvfp4_cuda(x).global_scale
    gr = QC.quantize_nvfp4_cuda(x, per_row=True).global_scale
    sync()
    assert bool(torch.isinf(g)) and float(g) > 0
    assert torch.isinf(gr).tolist() == [False, False, True, False], gr.tolist()


# ================================================================================================================
# dequantize / gather / dense rows: bit-exact with ref_dequantize_nvfp4
DG_SHAPES = [(1, 16), (130, 256), (300, 512), (1000, 4096)]
_dg_cache: dict = {}


def dg_case(M, Kd, per_row):
    "(reference NVFP4Tensor on CPU, the same on the GPU, ref_dequantize_nvfp4(ref, bf16)), cached."
    key = (M, Kd, per_row)
    if key not in _dg_cache:
        x = (make_input("adversarial", M, Kd, torch.float32, 3) if M < 200
             else make_input("random", M, Kd, torch.float32, 3))
        ref = ref_quantize_nvfp4(x, None, per_row=per_row)
        _dg_cache[key] = (ref, ref.to(DEV), ref_dequantize_nvfp4(ref, torch.bfloat16))
    return _dg_cache[key]


def gather_index(M):
    "T = 2M+5 indices: random valid rows, -1 at every 7th position, 3 out-of-range values (M, -5, 2^31-1)."
    g = torch.Generator().manual_seed(M)
    T = 2 * M + 5
    idx = torch.randint(0, M, (T,), generator=g, dtype=torch.int32)
    idx[::7] = -1
    for p, v in zip((1, T - 2, T - 1), (M, -5, 2 ** 31 - 1)):  # distinct, none at a multiple of 7
        idx[p] = v
    return idx


def gather_expected(idx, rows_bf16):
    "Independent construction: zero rows, then valid source rows copied in."
    want = torch.zeros(len(idx), rows_bf16.shape[1], dtype=torch.bfloat16)
    ok = (idx >= 0) & (idx < rows_bf16.shape[0])
    want[ok] = rows_bf16[idx[ok].long()]
    return want


DG_PARAMS = [pytest.param(M, Kd, pr, id=f"{M}x{Kd}-{'rowgs' if pr else 'tensorgs'}") for (M, Kd) in DG_SHAPES
             for pr in (False, True)]


@pytest.mark.parametrize("M,Kd,per_row", DG_PARAMS)
@pytest.mark.parametrize("dt", ["bf16", "f32"])
def test_dequantize_bit_exact(M, Kd, per_row, dt):
    ref, qg, _ = dg_case(M, Kd, per_row)
    want = ref_dequantize_nvfp4(ref, DTYPES[dt])
    got = QC.dequantize_nvfp4_cuda(qg, dtype=DTYPES[dt])
    sync()
    assert_bits_equal(got, want, f"dequantize -> {dt}")


@pytest.mark.parametrize("M,Kd,per_row", DG_PARAMS)
def test_dequantize_swizzled_scales(M, Kd, per_row):
    ref, qg, want = dg_case(M, Kd, per_row)
    sfz = swizzle_scales(qg.scale)
    got = QC.dequantize_nvfp4_cuda(qg.data, sfz, qg.global_scale, swizzled=True)
    got32 = QC.dequantize_nvfp4_cuda(QC.SwizzledNVFP4(qg.data, sfz, qg.global_scale, torch.Size((M, Kd))),
                                    dtype=torch.float32)  # swizzled inferred from the type
    sync()
    assert_bits_equal(got, want, "dequantize (swizzled scales) -> bf16")
    assert_bits_equal(got32, ref_dequantize_nvfp4(ref, torch.float32), "dequantize (SwizzledNVFP4) -> f32")


@pytest.mark.parametrize("M,Kd,per_row", DG_PARAMS)
def test_gather_checked_counts_out_of_range(M, Kd, per_row):
    ref, qg, rows = dg_case(M, Kd, per_row)
    idx = gather_index(M)
    want = gather_expected(idx, rows)
    cnt = torch.full((1,), 10, dtype=torch.int32, device=DEV)  # the kernel adds to it
    got = QC.gather_dequant_nvfp4(qg, idx.to(DEV), bad_count=cnt)
    sync()
    assert_bits_equal(got, want, "gathered rows")
    assert int(cnt) == 13, f"bad_count {int(cnt)}: want 10 + 3 out-of-range indices (-1 is padding, not counted)"


@pytest.mark.parametrize("M,Kd,per_row", DG_PARAMS)
def test_gather_unchecked(M, Kd, per_row):
    ref, qg, rows = dg_case(M, Kd, per_row)
    idx = gather_index(M)
    got = QC.gather_dequant_nvfp4(qg, idx.to(DEV))
    sync()
    assert_bits_equal(got, gather_expected(idx, rows), "gathered rows (unchecked)")


@pytest.mark.parametrize("M,Kd,per_row", DG_PARAMS)
def test_gather_into_strided_slice(M, Kd, per_row):
    ref, qg, rows = dg_case(M, Kd, per_row)
    idx = gather_index(M)
    big = torch.full((len(idx), Kd + 64), 7.0, dtype=torch.bfloat16, device=DEV)
    ret = QC.gather_dequant_nvfp4(qg, idx.to(DEV), out=big[:, 32:32 + Kd])
    sync()
    assert ret.data_ptr() == big[:, 32:].data_ptr()
    assert_bits_equal(big[:, 32:32 + Kd].contiguous(), gather_expected(idx, rows), "gathered rows (strided out)")
    assert bool((big[:, :32] == 7).all()) and bool((big[:, 32 + Kd:] == 7).all()), "wrote outside the slice"


@pytest.mark.parametrize("M,Kd,per_row", DG_PARAMS)
def test_gather_swizzled_scales(M, Kd, per_row):
    ref, qg, rows = dg_case(M, Kd, per_row)
    idx = gather_index(M)
    t = QC.SwizzledNVFP4(qg.data, swizzle_scales(qg.scale), qg.global_scale, torch.Size((M, Kd)))
    cnt = torch.zeros(1, dtype=torch.int32, device=DEV)
    got = QC.gather_dequant_nvfp4(t, idx.to(DEV), bad_count=cnt)
    sync()
    assert_bits_equal(got, gather_expected(idx, rows), "gathered rows (swizzled scales)")
    assert int(cnt) == 3


def every_code_and_scale():
    """1024 rows of K = 512: row r carries the E4M3 scale byte r % 256 in all its blocks (+-0, subnormals, 448, both
    NaNs) and all 256 code bytes (every pair of E2M1 codes), with a per-row gs of 1, 0.0037, 2^-135 (products
    down in the fp32 and bf16 subnormals) or 3e30 by row // 256."""
    n, K = 1024, 512
    data = torch.stack([torch.roll(torch.arange(256, dtype=torch.int32), r) for r in range(n)]).to(torch.uint8)
    scale = (torch.arange(n) % 256).to(torch.uint8)[:, None].repeat(1, K // 16).view(torch.float8_e4m3fn)
    gs = torch.tensor([1.0, 0.0037, 2.0 ** -135, 3e30]).repeat_interleave(256)
    return NVFP4Tensor(data, scale, gs, torch.Size((n, K)))


def assert_bits_equal_nan(got, want, what):
    "The same bits wherever the reference is a number, and NaN wherever it is NaN (the NaN payload is not compared)."
    got = got.cpu()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN in {int((got.isnan() != nan).sum())} other places"
    assert_bits_equal(torch.where(nan, 0, got), torch.where(nan, 0, want), what)


def test_gather_decodes_every_code_with_every_scale():
    "The gather's E2M1 decode (through the hardware E4M3 conversion) is the reference's."
    t = every_code_and_scale()
    want = ref_dequantize_nvfp4(t, torch.bfloat16)
    assert int(want.isnan().sum()) == 2 * 4 * 512 and int((want == 0).sum()) > 0   # the two NaN scale bytes, all gs
    tg = t.to(DEV)
    n = t.shape[0]
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    assert_bits_equal_nan(QC.gather_dequant_nvfp4(tg, idx.to(DEV)), want[idx.long()], "gather")
    assert_bits_equal_nan(QC.dequant_rows_nvfp4(tg, 0, n), want, "dense rows")
    sz = QC.SwizzledNVFP4(tg.data, swizzle_scales(tg.scale), tg.global_scale, t.shape)
    assert_bits_equal_nan(QC.gather_dequant_nvfp4(sz, idx.to(DEV)), want[idx.long()], "gather, swizzled scales")


@pytest.mark.parametrize("M,Kd,per_row", DG_PARAMS)
def test_dequant_rows(M, Kd, per_row):
    ref, qg, rows = dg_case(M, Kd, per_row)
    lo, n = M // 3, M - M // 3
    got = QC.dequant_rows_nvfp4(qg, lo, n)
    t = QC.SwizzledNVFP4(qg.data, swizzle_scales(qg.scale), qg.global_scale, torch.Size((M, Kd)))
    got_swz = QC.dequant_rows_nvfp4(t, lo, n)
    empty = QC.dequant_rows_nvfp4(qg, M, 0)
    sync()
    assert_bits_equal(got, rows[lo:lo + n], f"rows [{lo}, {lo + n})")
    assert_bits_equal(got_swz, rows[lo:lo + n], f"rows [{lo}, {lo + n}) (swizzled scales)")
    assert tuple(empty.shape) == (0, Kd)


# ================================================================================================================
# fused RMSNorm / mHC + quantize
def fused_inputs(fused, dt, M, N, n_hc=4, seed=None):
    g = torch.Generator().manual_seed(M + N if seed is None else seed)
    x = torch.randn(M, n_hc, N, generator=g) if fused == "mhc" else torch.randn(M, N, generator=g)
    x = (x * 3 + 0.5).to(DTYPES[dt])
    w = (torch.rand(N, generator=g) + 0.5).float()
    a = torch.rand(M, n_hc, generator=g).float() if fused == "mhc" else None
    return x, a, w


def run_fused(fused, x, a, w, eps, **kw):
    "(kernel result, kernel inv_rms, ref q, ref inv_rms, ref y, ref q given the kernel's inv_rms)."
    if fused == "mhc":
        q, inv = NM.mhc_rmsnorm_quantize_nvfp4(x.to(DEV), a.to(DEV), w.to(DEV), eps, **kw)
        sync()
        kw.pop("swizzle", None)
        refq, rinv, y = NM.ref_mhc_rmsnorm_quantize_nvfp4(x, a, w, eps, **kw)
        exq, _, _ = NM.ref_mhc_rmsnorm_quantize_nvfp4(x, a, w, eps, inv_rms=inv.cpu(), **kw)
    else:
        q, inv = NM.rmsnorm_quantize_nvfp4(x.to(DEV), w.to(DEV), eps, **kw)
        sync()
        kw.pop("swizzle", None)
        refq, rinv, y = NM.ref_rmsnorm_quantize_nvfp4(x, w, eps, **kw)
        exq, _, _ = NM.ref_rmsnorm_quantize_nvfp4(x, w, eps, inv_rms=inv.cpu(), **kw)
    return q, inv, refq, rinv, y, exq


def check_fused(q, inv, refq, rinv, y, exq, *, round_to_bf16, given_gs=None, swizzled=False):
    lead = tuple(rinv.shape)
    N = q.shape[-1]
    # (1) inv_rms and gs within the stated relative errors
    inv_c = inv.detach().cpu()
    assert inv.dtype == torch.float32 and tuple(inv_c.shape) == lead
    assert bool(torch.isfinite(inv_c).all())
    rel = ((inv_c.double() - rinv.double()).abs() / rinv.double()).max().item() if inv_c.numel() else 0.0
    assert rel <= INV_RMS_RTOL, f"inv_rms relative error {rel:.3g} > {INV_RMS_RTOL:g}"
    gs = q.global_scale.detach().cpu()
    if given_gs is None:
        assert tuple(gs.shape) == lead
        relg = ((gs.double() - refq.global_scale.double()).abs() / refq.global_scale.double()).max().item()
        assert relg <= GS_RTOL, f"gs relative error {relg:.3g} > {GS_RTOL:g}"
    else:
        gref = torch.as_tensor(given_gs, dtype=torch.float32).cpu()
        assert_bits_equal(gs.reshape(gref.shape), gref, "given gs returned unchanged")
    # (2) bit for bit, given the kernel's own inv_rms
    sf_kernel = q.scale.detach().cpu()
    if swizzled:
        M = math.prod(lead)
        assert_bits_equal(sf_kernel, swizzle_scales(exq.scale.reshape(M, N // 16)),
                          "swizzled scales vs reference given the kernel's inv_rms (padding included)")
        sf_kernel = unswizzle_scales(sf_kernel, M, N // 16).reshape(exq.scale.shape)
    else:
        assert_bits_equal(sf_kernel, exq.scale, "scales vs reference given the kernel's inv_rms")
    assert_bits_equal(q.data, exq.data, "codes vs reference given the kernel's inv_rms")
    assert_bits_equal(gs.reshape(exq.global_scale.shape), exq.global_scale,
                      "gs vs reference given the kernel's inv_rms")
    # (3) against the reference's own output: differences only near rounding boundaries
    tol = TOL_BF16 if round_to_bf16 else TOL_FP32
    code_ok, scale_ok = near_rounding_boundary(refq, y, tol)
    cg, cr = unpack_codes(q.data), unpack_codes(refq.data)
    diff = cg != cr
    far = diff & ~code_ok
    assert not bool(far.any()), (f"{int(far.sum())} codes differ from the reference away from any rounding boundary "
                                 f"(tol {tol:g}); first at {far.nonzero()[0].tolist()}")
    sdiff = sf_kernel.view(torch.uint8) != refq.scale.view(torch.uint8)
    sfar = sdiff & ~scale_ok
    assert not bool(sfar.any()), f"{int(sfar.sum())} block scales differ away from an E4M3 rounding boundary"
    # (4) and few of them at all
    assert int(diff.sum()) <= MAX_DIFF_FRACTION * diff.numel(), (
        f"{int(diff.sum())} of {diff.numel()} codes differ from the reference (> {MAX_DIFF_FRACTION:g})")


FUSED_SHAPES = [(1, 16), (7, 256), (130, 4096), (96, 7168), (64, 16384)]
FUSED_CASES = [pytest.param(f, dt, M, N, rb, id=f"{f}-{dt}-{M}x{N}-{'rbf16' if rb else 'fp32y'}")
               for f in ("rmsnorm", "mhc") for dt in ("bf16", "f32") for (M, N) in FUSED_SHAPES
               for rb in (False, True)]
FUSED_CASES += [pytest.param(f, "f16", M, N, rb, id=f"{f}-f16-{M}x{N}-{'rbf16' if rb else 'fp32y'}")
                for f in ("rmsnorm", "mhc") for (M, N) in [(7, 256), (130, 4096)] for rb in (False, True)]


@pytest.mark.parametrize("fused,dt,M,N,rb", FUSED_CASES)
def test_fused_rmsnorm_quantize(fused, dt, M, N, rb):
    x, a, w = fused_inputs(fused, dt, M, N)
    res = run_fused(fused, x, a, w, 1e-6, round_to_bf16=rb)
    check_fused(*res, round_to_bf16=rb)


@pytest.mark.parametrize("fused", ["rmsnorm", "mhc"])
def test_fused_zero_rows(fused):
    x, a, w = fused_inputs(fused, "bf16", 9, 512)
    x[0] = 0
    x[5] = 0
    q, inv, refq, rinv, y, exq = res = run_fused(fused, x, a, w, 1e-5)
    check_fused(*res, round_to_bf16=False)
    gs = q.global_scale.cpu()
    assert gs[0].item() == 1.0 and gs[5].item() == 1.0   # amax 0 -> gs 1
    assert not bool(q.data.cpu()[[0, 5]].any()) and not bool(q.scale.cpu().view(torch.uint8)[[0, 5]].any())
    assert abs(inv[0].item() - 1e-5 ** -0.5) <= 1e-6 * 1e-5 ** -0.5


@pytest.mark.parametrize("fused", ["rmsnorm", "mhc"])
@pytest.mark.parametrize("rb", [False, True])
def test_fused_swizzled(fused, rb):
    x, a, w = fused_inputs(fused, "bf16", 200, 1024, seed=11)
    res = run_fused(fused, x, a, w, 1e-5, round_to_bf16=rb, swizzle=True)
    assert isinstance(res[0], QC.SwizzledNVFP4)
    assert tuple(res[0].scale.shape) == (256, 64)
    check_fused(*res, round_to_bf16=rb, swizzled=True)


@pytest.mark.parametrize("fused", ["rmsnorm", "mhc"])
@pytest.mark.parametrize("gs_kind", ["scalar-tensor", "per-row-tensor", "python-float"])
def test_fused_given_global_scale(fused, gs_kind):
    M, N = 200, 1024
    x, a, w = fused_inputs(fused, "bf16", M, N, seed=12)
    if gs_kind == "scalar-tensor":
        gs_cpu = torch.tensor(0.01)
    elif gs_kind == "per-row-tensor":
        gs_cpu = (torch.rand(M, generator=torch.Generator().manual_seed(1)) * 0.02 + 0.001).float()
    else:
        gs_cpu = 0.01
    gs_dev = gs_cpu.to(DEV) if isinstance(gs_cpu, torch.Tensor) else gs_cpu
    if fused == "mhc":
        q, inv = NM.mhc_rmsnorm_quantize_nvfp4(x.to(DEV), a.to(DEV), w.to(DEV), 1e-5, global_scale=gs_dev)
        sync()
        refq, rinv, y = NM.ref_mhc_rmsnorm_quantize_nvfp4(x, a, w, 1e-5, global_scale=gs_cpu)
        exq, _, _ = NM.ref_mhc_rmsnorm_quantize_nvfp4(x, a, w, 1e-5, global_scale=gs_cpu, inv_rms=inv.cpu())
    else:
        q, inv = NM.rmsnorm_quantize_nvfp4(x.to(DEV), w.to(DEV), 1e-5, global_scale=gs_dev)
        sync()
        refq, rinv, y = NM.ref_rmsnorm_quantize_nvfp4(x, w, 1e-5, global_scale=gs_cpu)
        exq, _, _ = NM.ref_rmsnorm_quantize_nvfp4(x, w, 1e-5, global_scale=gs_cpu, inv_rms=inv.cpu())
    if gs_kind == "per-row-tensor":
        assert tuple(q.global_scale.shape) == (M,)
    else:
        assert q.global_scale.dim() == 0
    check_fused(q, inv, refq, rinv, y, exq, round_to_bf16=False, given_gs=gs_cpu)


@pytest.mark.parametrize("n_hc", [1, 2, 3, 4])
def test_mhc_n_hc(n_hc):
    x, a, w = fused_inputs("mhc", "bf16", 33, 768, n_hc=n_hc, seed=n_hc)
    res = run_fused("mhc", x, a, w, 1e-6)
    check_fused(*res, round_to_bf16=False)


def test_rmsnorm_3d_input():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 3, 512, generator=g) * 2).bfloat16()
    w = torch.rand(512, generator=g) + 0.5
    res = run_fused("rmsnorm", x, None, w, 1e-6)
    q, inv = res[0], res[1]
    assert tuple(inv.shape) == (2, 3) and tuple(q.global_scale.shape) == (2, 3) and tuple(q.data.shape) == (2, 3, 256)
    check_fused(*res, round_to_bf16=False)


# ================================================================================================================
# Bad inputs: a clear TypeError / ValueError before any launch
def _c(*shape, dtype=torch.float32):
    return torch.zeros(tuple(shape), dtype=dtype, device=DEV)


BAD_INPUTS = [
    # name, expected exception, launcher name in the message, fn(x, q)
    ("float64 x", TypeError, "quantize_nvfp4_cuda", lambda x, q: QC.quantize_nvfp4_cuda(x.double())),
    ("int x", TypeError, "quantize_nvfp4_cuda", lambda x, q: QC.quantize_nvfp4_cuda(x.int())),
    ("numpy x", TypeError, "quantize_nvfp4_cuda", lambda x, q: QC.quantize_nvfp4_cuda(x.float().cpu().numpy())),
    ("CPU x", ValueError, "quantize_nvfp4_cuda", lambda x, q: QC.quantize_nvfp4_cuda(x.cpu())),
    ("K % 16", ValueError, "quantize_nvfp4_cuda", lambda x, q: QC.quantize_nvfp4_cuda(x[:, :24].contiguous())),
    ("non-contiguous", ValueError, "quantize_nvfp4_cuda", lambda x, q: QC.quantize_nvfp4_cuda(x.t())),
    ("0-d", ValueError, "quantize_nvfp4_cuda", lambda x, q: QC.quantize_nvfp4_cuda(x[0, 0])),
    ("swizzle 3-D", ValueError, "quantize_nvfp4_cuda",
     lambda x, q: QC.quantize_nvfp4_cuda(x.reshape(2, 2, 32), swizzle=True)),
    ("gs NaN float", ValueError, "quantize_nvfp4_cuda", lambda x, q: QC.quantize_nvfp4_cuda(x, float("nan"))),
    ("gs inf float", ValueError, "quantize_nvfp4_cuda", lambda x, q: QC.quantize_nvfp4_cuda(x, float("inf"))),
    ("gs 0", ValueError, "quantize_nvfp4_cuda", lambda x, q: QC.quantize_nvfp4_cuda(x, 0.0)),
    ("gs CPU tensor", ValueError, "quantize_nvfp4_cuda", lambda x, q: QC.quantize_nvfp4_cuda(x, torch.tensor(1.0))),
    ("gs float64", TypeError, "quantize_nvfp4_cuda",
     lambda x, q: QC.quantize_nvfp4_cuda(x, torch.tensor(1.0, dtype=torch.float64, device=DEV))),
    ("gs wrong shape", ValueError, "quantize_nvfp4_cuda", lambda x, q: QC.quantize_nvfp4_cuda(x, _c(3) + 1)),
    ("per_row with scalar gs", ValueError, "quantize_nvfp4_cuda",
     lambda x, q: QC.quantize_nvfp4_cuda(x, 1.0, per_row=True)),
    ("out_gs with a given gs", ValueError, "quantize_nvfp4_cuda",
     lambda x, q: QC.quantize_nvfp4_cuda(x, 1.0, out_gs=_c())),
    ("out_data shape", ValueError, "quantize_nvfp4_cuda",
     lambda x, q: QC.quantize_nvfp4_cuda(x, out_data=_c(4, 15, dtype=torch.uint8))),
    ("out_data dtype", TypeError, "quantize_nvfp4_cuda",
     lambda x, q: QC.quantize_nvfp4_cuda(x, out_data=_c(4, 16, dtype=torch.int8))),
    ("out_scale shape (swz)", ValueError, "quantize_nvfp4_cuda",
     lambda x, q: QC.quantize_nvfp4_cuda(x, swizzle=True, out_scale=_c(4, 2, dtype=torch.uint8))),
    ("misaligned x", ValueError, "quantize_nvfp4_cuda",
     lambda x, q: QC.quantize_nvfp4_cuda(x.reshape(-1)[1:113].reshape(7, 16))),
    ("dequant data int8", TypeError, "dequantize_nvfp4_cuda",
     lambda x, q: QC.dequantize_nvfp4_cuda(q.data.view(torch.int8), q.scale, q.global_scale)),
    ("dequant missing scale", TypeError, "dequantize_nvfp4_cuda", lambda x, q: QC.dequantize_nvfp4_cuda(q.data)),
    ("dequant swizzled scale shape", ValueError, "dequantize_nvfp4_cuda",
     lambda x, q: QC.dequantize_nvfp4_cuda(q.data, q.scale, q.global_scale, swizzled=True)),
    ("dequant dtype fp16", TypeError, "dequantize_nvfp4_cuda",
     lambda x, q: QC.dequantize_nvfp4_cuda(q, dtype=torch.float16)),
    ("dequant out shape", ValueError, "dequantize_nvfp4_cuda",
     lambda x, q: QC.dequantize_nvfp4_cuda(q, out=_c(4, 48, dtype=torch.bfloat16))),
    ("index int64", TypeError, "gather_dequant_nvfp4",
     lambda x, q: QC.gather_dequant_nvfp4(q, _c(3, dtype=torch.int64))),
    ("index CPU", ValueError, "gather_dequant_nvfp4",
     lambda x, q: QC.gather_dequant_nvfp4(q, torch.zeros(3, dtype=torch.int32))),
    ("index 2-D", ValueError, "gather_dequant_nvfp4",
     lambda x, q: QC.gather_dequant_nvfp4(q, _c(3, 1, dtype=torch.int32))),
    ("index non-contiguous", ValueError, "gather_dequant_nvfp4",
     lambda x, q: QC.gather_dequant_nvfp4(q, _c(6, dtype=torch.int32)[::2])),
    ("bad_count int64", TypeError, "gather_dequant_nvfp4",
     lambda x, q: QC.gather_dequant_nvfp4(q, _c(3, dtype=torch.int32), bad_count=_c(1, dtype=torch.int64))),
    ("bad_count empty", ValueError, "gather_dequant_nvfp4",
     lambda x, q: QC.gather_dequant_nvfp4(q, _c(3, dtype=torch.int32), bad_count=_c(0, dtype=torch.int32))),
    ("gather out dtype", TypeError, "gather_dequant_nvfp4",
     lambda x, q: QC.gather_dequant_nvfp4(q, _c(3, dtype=torch.int32), out=_c(3, 32))),
    ("gather out shape", ValueError, "gather_dequant_nvfp4",
     lambda x, q: QC.gather_dequant_nvfp4(q, _c(3, dtype=torch.int32), out=_c(3, 48, dtype=torch.bfloat16))),
    ("gather out row stride % 8", ValueError, "gather_dequant_nvfp4",
     lambda x, q: QC.gather_dequant_nvfp4(q, _c(3, dtype=torch.int32), out=_c(3, 36, dtype=torch.bfloat16)[:, :32])),
    ("dense rows out of range", ValueError, "dequant_rows_nvfp4", lambda x, q: QC.dequant_rows_nvfp4(q, 2, 3)),
    ("dense rows negative start", ValueError, "dequant_rows_nvfp4", lambda x, q: QC.dequant_rows_nvfp4(q, -1, 2)),
    ("rmsnorm weight dtype", TypeError, "rmsnorm_quantize_nvfp4",
     lambda x, q: NM.rmsnorm_quantize_nvfp4(x, _c(32, dtype=torch.bfloat16) + 1)),
    ("rmsnorm weight shape", ValueError, "rmsnorm_quantize_nvfp4",
     lambda x, q: NM.rmsnorm_quantize_nvfp4(x, _c(48) + 1)),
    ("rmsnorm weight CPU", ValueError, "rmsnorm_quantize_nvfp4",
     lambda x, q: NM.rmsnorm_quantize_nvfp4(x, torch.ones(32))),
    ("rmsnorm eps negative", ValueError, "rmsnorm_quantize_nvfp4",
     lambda x, q: NM.rmsnorm_quantize_nvfp4(x, _c(32) + 1, -1e-6)),
    ("rmsnorm eps NaN", ValueError, "rmsnorm_quantize_nvfp4",
     lambda x, q: NM.rmsnorm_quantize_nvfp4(x, _c(32) + 1, float("nan"))),
    ("rmsnorm N % 16", ValueError, "rmsnorm_quantize_nvfp4",
     lambda x, q: NM.rmsnorm_quantize_nvfp4(x[:, :24].contiguous(), _c(24) + 1)),
    ("rmsnorm N too large", ValueError, "rmsnorm_quantize_nvfp4",
     lambda x, q: NM.rmsnorm_quantize_nvfp4(_c(1, 16400), _c(16400) + 1)),
    ("rmsnorm swizzle 3-D", ValueError, "rmsnorm_quantize_nvfp4",
     lambda x, q: NM.rmsnorm_quantize_nvfp4(x.reshape(2, 2, 32), _c(32) + 1, swizzle=True)),
    ("mhc x 2-D", ValueError, "mhc_rmsnorm_quantize_nvfp4",
     lambda x, q: NM.mhc_rmsnorm_quantize_nvfp4(_c(2, 32), _c(2, 1), _c(32) + 1)),
    ("mhc n_hc 5", ValueError, "mhc_rmsnorm_quantize_nvfp4",
     lambda x, q: NM.mhc_rmsnorm_quantize_nvfp4(_c(2, 5, 32), _c(2, 5), _c(32) + 1)),
    ("mhc a shape", ValueError, "mhc_rmsnorm_quantize_nvfp4",
     lambda x, q: NM.mhc_rmsnorm_quantize_nvfp4(_c(2, 4, 32), _c(2, 3), _c(32) + 1)),
    ("mhc a dtype", TypeError, "mhc_rmsnorm_quantize_nvfp4",
     lambda x, q: NM.mhc_rmsnorm_quantize_nvfp4(_c(2, 4, 32), _c(2, 4, dtype=torch.bfloat16), _c(32) + 1)),
]


@pytest.mark.parametrize("name,exc,what,fn", [pytest.param(*c, id=c[0]) for c in BAD_INPUTS])
def test_bad_input_raises_before_launch(monkeypatch, name, exc, what, fn):
    x = torch.randn(4, 32, device=DEV, dtype=torch.bfloat16)
    q = QC.quantize_nvfp4_cuda(x)
    sync()
    launches = []
    real_launch = rt.launch
    monkeypatch.setattr(rt, "launch", lambda *a, **k: (launches.append(a[:2]), real_launch(*a, **k))[1])
    with pytest.raises(exc) as ei:
        fn(x, q)
    sync()
    assert what in str(ei.value), f"the error does not name the launcher: {ei.value}"
    assert not launches, f"launched {launches} before raising"


def test_launch_spy_sees_launches(monkeypatch):
    "The spy used above does see the launchers' kernel launches (so 'no launch' is not vacuous)."
    launches = []
    real_launch = rt.launch
    monkeypatch.setattr(rt, "launch", lambda *a, **k: (launches.append(a[:2]), real_launch(*a, **k))[1])
    QC.quantize_nvfp4_cuda(torch.randn(4, 32, device=DEV, dtype=torch.bfloat16), 1.0)
    sync()
    assert launches and all(f.endswith(".cu") for f, _ in launches), launches


# ================================================================================================================
# out= buffers
def _garbage(*shape, dtype):
    return torch.full(shape, 0xAB, dtype=torch.uint8, device=DEV).view(dtype) if dtype.itemsize == 1 else \
        torch.full(shape, float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("swz", [False, True])
@pytest.mark.parametrize("sf_dtype", [torch.float8_e4m3fn, torch.uint8])
def test_quantize_out_buffers(swz, sf_dtype):
    M, Kd = 130, 256
    x = rand_rows(M, Kd, torch.bfloat16, 21)
    ref = ref_quantize_nvfp4(x)
    od = _garbage(M, Kd // 2, dtype=torch.uint8)
    osf = _garbage(*((256, 16) if swz else (M, Kd // 16)), dtype=sf_dtype)
    og = torch.full((), float("nan"), device=DEV)
    q = QC.quantize_nvfp4_cuda(x.to(DEV), swizzle=swz, out_data=od, out_scale=osf, out_gs=og)
    sync()
    assert q.data.data_ptr() == od.data_ptr() and q.scale.data_ptr() == osf.data_ptr()
    assert q.global_scale.data_ptr() == og.data_ptr()
    want_sf = (swizzle_scales(ref.scale) if swz else ref.scale).view(torch.uint8)
    assert_bits_equal(od, ref.data, "out_data")
    assert_bits_equal(osf.view(torch.uint8), want_sf, "out_scale (every byte, padding included)")
    assert_bits_equal(og, ref.global_scale, "out_gs")


def test_quantize_out_buffers_per_row():
    M, Kd = 64, 512
    x = rand_rows(M, Kd, torch.float32, 22)
    ref = ref_quantize_nvfp4(x, per_row=True)
    od, osf = _garbage(M, Kd // 2, dtype=torch.uint8), _garbage(M, Kd // 16, dtype=torch.float8_e4m3fn)
    og = torch.full((M,), float("nan"), device=DEV)
    q = QC.quantize_nvfp4_cuda(x.to(DEV), per_row=True, out_data=od, out_scale=osf, out_gs=og)
    sync()
    assert q.global_scale.data_ptr() == og.data_ptr()
    assert_bits_equal(od, ref.data, "out_data")
    assert_bits_equal(osf, ref.scale, "out_scale")
    assert_bits_equal(og, ref.global_scale, "out_gs")


@pytest.mark.parametrize("dt", ["bf16", "f32"])
def test_dequantize_out_buffer(dt):
    ref, qg, _ = dg_case(130, 256, False)
    out = torch.full((130, 256), float("nan"), dtype=DTYPES[dt], device=DEV)
    ret = QC.dequantize_nvfp4_cuda(qg, dtype=DTYPES[dt], out=out)
    sync()
    assert ret.data_ptr() == out.data_ptr()
    assert_bits_equal(out, ref_dequantize_nvfp4(ref, DTYPES[dt]), "dequantize out=")


@pytest.mark.parametrize("fused", ["rmsnorm", "mhc"])
@pytest.mark.parametrize("swz", [False, True])
def test_fused_out_buffers(fused, swz):
    M, N = 130, 512
    x, a, w = fused_inputs(fused, "bf16", M, N, seed=23)
    od = _garbage(M, N // 2, dtype=torch.uint8)
    osf = _garbage(*((256, 32) if swz else (M, N // 16)), dtype=torch.float8_e4m3fn)
    og, oinv = torch.full((M,), float("nan"), device=DEV), torch.full((M,), float("nan"), device=DEV)
    outs = dict(out_data=od, out_scale=osf, out_gs=og, out_inv_rms=oinv, swizzle=swz)
    if fused == "mhc":
        q, inv = NM.mhc_rmsnorm_quantize_nvfp4(x.to(DEV), a.to(DEV), w.to(DEV), 1e-6, **outs)
        sync()
        refq, rinv, y = NM.ref_mhc_rmsnorm_quantize_nvfp4(x, a, w, 1e-6)
        exq, _, _ = NM.ref_mhc_rmsnorm_quantize_nvfp4(x, a, w, 1e-6, inv_rms=oinv.cpu())
    else:
        q, inv = NM.rmsnorm_quantize_nvfp4(x.to(DEV), w.to(DEV), 1e-6, **outs)
        sync()
        refq, rinv, y = NM.ref_rmsnorm_quantize_nvfp4(x, w, 1e-6)
        exq, _, _ = NM.ref_rmsnorm_quantize_nvfp4(x, w, 1e-6, inv_rms=oinv.cpu())
    assert inv.data_ptr() == oinv.data_ptr() and q.data.data_ptr() == od.data_ptr()
    assert q.scale.data_ptr() == osf.data_ptr() and q.global_scale.data_ptr() == og.data_ptr()
    check_fused(q, inv, refq, rinv, y, exq, round_to_bf16=False, swizzled=swz)


# ================================================================================================================
# Streams and CUDA graphs
def test_side_stream():
    x = rand_rows(257, 1024, torch.bfloat16, 31)
    ref = ref_quantize_nvfp4(x, per_row=True)
    s = torch.cuda.Stream()
    xd = x.to(DEV)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        q = QC.quantize_nvfp4_cuda(xd, per_row=True)
        deq = QC.dequantize_nvfp4_cuda(q)
    s.synchronize()
    assert_bits_equal(q.data, ref.data, "codes (side stream)")
    assert_bits_equal(q.global_scale, ref.global_scale, "gs (side stream)")
    assert_bits_equal(deq, ref_dequantize_nvfp4(ref, torch.bfloat16), "dequantize (side stream)")


def test_copy_d2d_copies_the_bytes_on_the_current_stream():
    "runtime.copy_d2d: every byte of a bf16 tensor, after a write queued on the same side stream; and inside a capture."
    src = torch.randn(3, 4096, device=DEV).to(torch.bfloat16)
    dst = torch.full_like(src, float("nan"))
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)                   # s busy for a while: a copy on another stream would run first
        late = src * 2                                   # queued on s just before: the copy must come after it
        assert rt.copy_d2d(dst, late) is dst
    s.synchronize()
    assert torch.equal(dst.view(torch.int16), (src * 2).view(torch.int16))
    assert rt.copy_d2d(dst, dst) is dst and torch.equal(dst.view(torch.int16), (src * 2).view(torch.int16)), "onto itself"
    col = src.t().contiguous().t()                           # the same values, column-major: the Tensor.copy_ path
    assert not col.is_contiguous() and torch.equal(rt.copy_d2d(dst, col), src)
    g, a, b = torch.cuda.CUDAGraph(), torch.zeros(5, device=DEV), torch.arange(5.0, device=DEV)
    with torch.cuda.graph(g): rt.copy_d2d(a, b)
    b += 10; g.replay(); torch.cuda.synchronize()
    assert torch.equal(a, torch.arange(5.0, device=DEV) + 10)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_copy_d2d_on_another_devices_default_stream():
    "copy_d2d of tensors on cuda:1 while cuda:0 is current: ordered after cuda:1's default-stream work, not on cuda:0's."
    d1 = torch.device("cuda", 1)
    src = torch.randn(2, 4096, device=d1)
    dst = torch.full_like(src, float("nan"))
    with torch.cuda.device(0):
        with torch.cuda.device(1): torch.cuda._sleep(100_000_000)   # cuda:1's default stream busy
        late = src * 3                                               # queued behind it on cuda:1's default stream
        rt.copy_d2d(dst, late)
    torch.cuda.synchronize(d1)
    assert torch.equal(dst, src * 3)


def test_cuda_graph_capture_and_replay_on_new_data():
    "Capture quantize (fused per-tensor gs, swizzled), dequantize, gather, rmsnorm_quantize; replay on new inputs."
    M, N, T = 256, 1024, 300
    x = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(N, device=DEV) + 0.5
    idx = torch.randint(-1, M, (T,), device=DEV, dtype=torch.int32)
    d = torch.empty(M, N // 2, dtype=torch.uint8, device=DEV)
    sfs = torch.empty(256, N // 16, dtype=torch.float8_e4m3fn, device=DEV)
    gs = torch.empty((), dtype=torch.float32, device=DEV)
    deq = torch.empty(M, N, dtype=torch.bfloat16, device=DEV)
    gat = torch.empty(T, N, dtype=torch.bfloat16, device=DEV)
    rd = torch.empty(M, N // 2, dtype=torch.uint8, device=DEV)
    rsf = torch.empty(M, N // 16, dtype=torch.float8_e4m3fn, device=DEV)
    rgs, rinv = torch.empty(M, device=DEV), torch.empty(M, device=DEV)
    q0 = QC.quantize_nvfp4_cuda(x)  # static NVFP4 input of dequantize / gather

    def body():
        QC.quantize_nvfp4_cuda(x, swizzle=True, out_data=d, out_scale=sfs, out_gs=gs)
        QC.dequantize_nvfp4_cuda(q0, out=deq)
        QC.gather_dequant_nvfp4(q0, idx, out=gat)
        NM.rmsnorm_quantize_nvfp4(x, w, 1e-6, out_data=rd, out_scale=rsf, out_gs=rgs, out_inv_rms=rinv)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            body()  # warm-up outside capture: compiles and loads the modules
    torch.cuda.current_stream().wait_stream(s)
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        body()
    w_cpu = w.cpu()
    for it in range(3):
        x.copy_(torch.randn(M, N, device=DEV, dtype=torch.bfloat16) * (10.0 ** (it - 1)))
        nq = QC.quantize_nvfp4_cuda(x)
        q0.data.copy_(nq.data); q0.scale.copy_(nq.scale); q0.global_scale.copy_(nq.global_scale)
        idx.copy_(torch.randint(-1, M, (T,), device=DEV, dtype=torch.int32))
        for t in (d, sfs.view(torch.uint8), rd, rsf.view(torch.uint8)):
            t.fill_(0xAB)  # stale outputs must not survive a replay
        for t in (gs, deq, gat, rgs, rinv):
            t.fill_(float("nan"))
        graph.replay()
        sync()
        xc = x.cpu()
        ref = ref_quantize_nvfp4(xc)
        deq_ref = ref_dequantize_nvfp4(ref, torch.bfloat16)
        tag = f"replay {it}"
        assert_bits_equal(d, ref.data, f"{tag}: quantize codes")
        assert_bits_equal(sfs, swizzle_scales(ref.scale), f"{tag}: quantize swizzled scales")
        assert_bits_equal(gs, ref.global_scale, f"{tag}: fused per-tensor gs")
        assert_bits_equal(deq, deq_ref, f"{tag}: dequantize")
        assert_bits_equal(gat, gather_expected(idx.cpu(), deq_ref), f"{tag}: gather")
        rq, rref_inv, _ = NM.ref_rmsnorm_quantize_nvfp4(xc, w_cpu, 1e-6)
        exq, _, _ = NM.ref_rmsnorm_quantize_nvfp4(xc, w_cpu, 1e-6, inv_rms=rinv.cpu())
        rel = ((rinv.cpu().double() - rref_inv.double()).abs() / rref_inv.double()).max().item()
        assert rel <= INV_RMS_RTOL, f"{tag}: rmsnorm inv_rms relative error {rel:.3g}"
        assert_bits_equal(rd, exq.data, f"{tag}: rmsnorm codes (given the kernel's inv_rms)")
        assert_bits_equal(rsf, exq.scale, f"{tag}: rmsnorm scales (given the kernel's inv_rms)")
        assert_bits_equal(rgs, exq.global_scale, f"{tag}: rmsnorm gs (given the kernel's inv_rms)")


# ================================================================================================================
# Runtime on the GPU
def test_device_arch(monkeypatch):
    monkeypatch.delenv("DSV4_NVFP4_ARCH", raising=False)
    major, minor = torch.cuda.get_device_capability()
    arch = rt.device_arch()
    assert arch == f"sm_{major}{minor}" + ("a" if major >= 9 else "")
    if (major, minor) == (9, 0):
        assert arch == "sm_90a"


def test_get_kernel_unknown_name():
    with pytest.raises(rt.KernelLaunchError) as ei:
        rt.get_kernel("nvfp4_gather.cu", "nvfp4_no_such_kernel")
    assert "nvfp4_no_such_kernel" in str(ei.value) and "nvfp4_gather_dequant_bf16" in str(ei.value)


# ================================================================================================================
# The public quantize_nvfp4 / dequantize_nvfp4: the kernel on a GPU tensor, bit-identical to the same call on the CPU
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("kw", [dict(), dict(per_row=True), dict(global_scale=0.02), dict(swizzle=True)],
                         ids=["tensor_gs", "row_gs", "given_gs", "swizzled"])
def test_public_quantize_gpu_equals_cpu(dt, kw, monkeypatch, capsys):
    x = rand_rows(200, 512, DTYPES[dt], seed=7)
    monkeypatch.setenv("DSV4_VERBOSE", "1")
    cpu, gpu = QC.quantize_nvfp4(x, **kw), QC.quantize_nvfp4(x.to(DEV), **kw)
    err = capsys.readouterr().err
    assert "quantize_nvfp4: CPU reference" in err and "quantize_nvfp4: CUDA kernel" in err
    assert type(cpu) is type(gpu)
    for a, b in zip((cpu.data, cpu.scale, cpu.global_scale), (gpu.data, gpu.scale, gpu.global_scale)):
        assert a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))
    if not kw.get("swizzle"):
        for odt in (torch.float32, torch.bfloat16):
            want = QC.dequantize_nvfp4(cpu, odt)
            assert torch.equal(QC.dequantize_nvfp4(gpu, odt).cpu().view(torch.uint8), want.view(torch.uint8))
