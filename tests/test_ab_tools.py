"""CPU tests of the GPU tools' host-side logic (tests/ab_trees.py's comparison of two checkouts' runs, tests/moe_timeline.py's
grouping of a profiler trace) and of the kernels of tests/qgmma_ceiling.py (the FP8 tensor-pipe microbenchmark: compiled here for sm_90a, no GPU)."""
import pytest

from ab_trees import compare


def _run(t_plain, t_ov, sha_ov, T=8192):
    return {"rows": [dict(problem="Flash L1", T=T, plain_us=t_plain, ov_us=t_ov, plain_sha="p0", ov_sha=sha_ov)]}


def test_compare_takes_the_best_time_of_every_run_and_checks_every_digest():
    a = [_run([10.0, 12.0], [8.0, 9.0], "o0"), _run([11.0, 9.5], [8.5, 8.2], "o0")]
    b = [_run([10.0, 10.0], [6.0, 7.0], "o0"), _run([9.0, 10.0], [6.5, 6.4], "o0")]
    (row,) = compare(a, b)
    assert row["plain_us"] == dict(a=9.5, b=9.0, a_over_b=round(9.5 / 9.0, 3))
    assert row["ov_us"] == dict(a=8.0, b=6.0, a_over_b=round(8.0 / 6.0, 3))
    assert row["same_bits"] is True
    b[1]["rows"][0]["ov_sha"] = "o1"                       # one run of B with other bits
    assert compare(a, b)[0]["same_bits"] is False
    a[1]["rows"][0]["plain_sha"] = "p1"                    # or a run of A that disagrees with A's first
    b[1]["rows"][0]["ov_sha"] = "o0"
    assert compare(a, b)[0]["same_bits"] is False


def test_timeline_keys_kernels_by_stream_not_by_place():
    "Two streams' kernels start in either order from replay to replay: each keeps its own duration, stream and start."
    from moe_timeline import per_kernel
    ev, t = [], 0.0
    for i in range(4):
        ev.append(dict(name="reduce_kernel (the flush)", stream=7, ts=t, dur=60.0)); t += 70.0
        a, b = (t, t + 1.0) if i % 2 == 0 else (t + 1.0, t)         # A (stream 9) first in two replays, B (stream 7) in two
        ev += [dict(name="A", stream=9, ts=a, dur=10.0), dict(name="B", stream=7, ts=b, dur=2.0),
               dict(name="C", stream=7, ts=t + 12.0, dur=3.0)]
        t += 100.0
    got = per_kernel(ev[::-1])                                       # given in any order
    by = {k["name"]: k for k in got["kernels"]}
    assert (by["A"]["dur_us"], by["B"]["dur_us"], by["C"]["dur_us"]) == (10.0, 2.0, 3.0)   # by place: medians of 10 and 2
    assert (by["A"]["stream"], by["B"]["stream"], by["C"]["stream"]) == (9, 7, 7)
    assert by["C"]["start_us"] == 12.0 and got["span_us"] == 15.0 and got["replays"] == 4
    assert [k["name"] for k in got["kernels"]][-1] == "C"
    assert by["C"]["gap_us"] == 1.5             # A and B tie at a median start of 0.5, B first (its stream's id): C's gap
                                                # is from A's end (10 or 11 after the first start) to its start at 12
    odd = [dict(name="reduce_kernel", stream=7, ts=-200.0, dur=60.0), dict(name="A", stream=20, ts=-130.0, dur=1.0),
           dict(name="B", stream=20, ts=-120.0, dur=1.0), dict(name="C", stream=20, ts=-110.0, dur=1.0)]
    got = per_kernel(odd + ev)                                     # a first replay on another stream is the one left out
    assert got["replays"] == 4 and {k["name"]: k["stream"] for k in got["kernels"]} == {"A": 9, "B": 7, "C": 7}
    assert per_kernel([]) == dict(kernels=[], span_us=0.0, replays=0)


def test_compare_skips_rows_b_did_not_run():
    a = [{"rows": _run([1.0], [1.0], "x")["rows"] + _run([2.0], [2.0], "y", T=2048)["rows"]}]
    b = [_run([1.0], [0.5], "x")]
    assert [(r["T"], r["ov_us"]["a_over_b"]) for r in compare(a, b)] == [(8192, 2.0)]


@pytest.mark.parametrize("rs", [True, False])
@pytest.mark.parametrize("N", [64, 128, 192, 256])
def test_qgmma_ceiling_kernels_are_the_shapes_they_time(N, rs):
    """tests/qgmma_ceiling.py (the tensor-pipe ceiling per FP8 WGMMA shape, measured/qgmma_ceiling_s41_h200.json): each
    kernel compiles for sm_90a and its loop is what the record claims, 4 QGMMA.64xNx32 E4M3 per WARPGROUP.ARRIVE with A from
    registers (RS) or a descriptor (SS), one wait a trip leaving a group in flight (ptxas added no full wait: the only one
    is after the loop), no spill."""
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    import re
    import qgmma_ceiling as Q
    try:
        from dsv4_nvfp4.gemm.sm90_kernel import _nvdisasm, cubin_sass, _unpredicated
        _nvdisasm()
    except (ImportError, FileNotFoundError):
        pytest.skip("nvdisasm or CuTeDSL is not installed (the [dev] and [gpu] extras have them)")
    from cuda.core import Program, ProgramOptions
    try:                                                      # NVRTC itself (CI installs it, so there this never skips)
        Program("__global__ void k() {}", code_type="c++", options=ProgramOptions(arch="sm_90a")).compile("cubin")
    except (ImportError, OSError, RuntimeError) as e:
        pytest.skip(f"NVRTC not usable here: {e}")
    mod = Q.compile_cubin(N, rs)                              # a compile error of the benchmark itself fails the test
    ops = [_unpredicated(o) for o in cubin_sass(mod.code)]
    assert not any(o.split()[0].startswith(("LDL", "STL")) for o in ops)
    mma = [o for o in ops if "GMMA" in o]
    assert mma and all(o.startswith(f"QGMMA.64x{N}x32.F32.E4M3.E4M3") for o in mma), mma[:2]
    form = r"QGMMA\S+ R\d+, R\d+, gdesc\[UR\d+\]" if rs else r"QGMMA\S+ R\d+, gdesc\[UR\d+\]"
    assert all(re.match(form, o) for o in mma), mma[:2]
    arrive = [i for i, o in enumerate(ops) if o.startswith("WARPGROUP.ARRIVE")]
    assert len(mma) == 4 * len(arrive)                        # (the trip loop may be unrolled: 4 per fence either way)
    waits = [o.split()[-1] for o in ops if o.startswith("WARPGROUP.DEPBAR")]
    assert waits.count("0x0") == 1 and waits.count("0x1") == len(arrive), waits   # one wait per trip; the full one once, after


@pytest.mark.parametrize("variant", ["full", "no_decode", "no_epilogue", "neither", "no_promote", "bare"])
def test_w4a8_ablation_variants_take_out_what_they_claim(variant):
    """tests/w4a8_ablation.py times the plan's prefill W4A8 kernel beside subclasses without the decode, the epilogue
    and/or the promotion: compiled here for sm_90a, each keeps both K loops' WGMMAs (16 a loop of 4 tiles; 8 a loop of 2
    tiles without the promotion), and the decode (F2FP, HMUL2, the table's PRMTs and the code words' 16-byte loads), the
    staged epilogue (8 stmatrix, 8 16-byte stores) and the promotion (64 FADDs a loop) are there exactly where the variant
    keeps them."""
    pytest.importorskip("cutlass", reason="CuTeDSL is not installed (the [gpu] extra has it)")
    import collections
    import w4a8_ablation as A
    from dsv4_nvfp4.gemm import sm90 as S90, sm90_kernel as K, w4a8 as W
    try:
        K._nvdisasm()
    except FileNotFoundError:
        pytest.skip("nvdisasm is not installed (the [dev] extra has it)")
    cfg = W.W4A8_OV_CONFIG._replace(epilogue=S90.Epilogue.BF16_ROW_GS, table=True)
    ops = collections.Counter(K._unpredicated(s).split()[0] for s in A.variant_sass(variant, cfg))
    decode = variant in ("full", "no_epilogue", "no_promote")
    epilogue = variant in ("full", "no_decode", "no_promote")
    promote = variant not in ("no_promote", "bare")
    assert ops["QGMMA.64x128x32.F32.E4M3.E4M3"] == (32 if promote else 16) and not ops["LDL"] and not ops["STL"], ops
    assert ops["FADD"] - (0 if epilogue else 64) == (128 if promote else 0), ops     # (no epilogue: one 64-term sum a thread)
    assert (ops["F2FP.F16.E4M3.UNPACK_B"] > 0) == decode and (ops["HMUL2"] > 0) == decode, ops   # the F2FP loop's decode
    assert (ops["PRMT"] >= 48) == decode, ops             # the table decode's 32 or more on top of the 28 the rest has
    assert (ops["LDS.128"] >= 24) == decode and (ops["LDS.128"] <= 8) == (not decode), ops   # the code words' loads
    assert (ops["STSM.16.MT88.4"], ops["STG.E.128"], ops["STG.E.U16"]) == ((8, 8, 0) if epilogue else (0, 0, 1)), ops
