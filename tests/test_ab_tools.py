"""CPU tests of the GPU A/B tools' host-side logic (tests/ab_trees.py's comparison of two checkouts' runs)."""
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


def test_compare_skips_rows_b_did_not_run():
    a = [{"rows": _run([1.0], [1.0], "x")["rows"] + _run([2.0], [2.0], "y", T=2048)["rows"]}]
    b = [_run([1.0], [0.5], "x")]
    assert [(r["T"], r["ov_us"]["a_over_b"]) for r in compare(a, b)] == [(8192, 2.0)]
