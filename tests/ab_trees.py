"""A/B of two checkouts of this package on one GPU, in one call: a timing script (one that writes {"rows": [...]} with
`*_us` times and `*_sha` output digests per row, as tests/ab_w4a8_ov.py does) is run with each checkout first on the
path, alternating A, B, A, B (`--rounds`), each run in its own process; then, per row and timed configuration, the
best time of each checkout and their ratio, and whether every output digest of B equals A's (a change that must keep
the bits).

    python tests/ab_trees.py OUT_DIR A_DIR B_DIR [--rounds 2] -- SCRIPT [ARGS ...]

SCRIPT is run from B_DIR/tests (both checkouts use B's harness; only the package comes from A_DIR or B_DIR) as
`python SCRIPT OUT_DIR/<A|B><round>.json ARGS`. Writes OUT_DIR/ab_trees.json and prints the table."""
import json, os, subprocess, sys
from pathlib import Path


def best(v):
    return min(v) if isinstance(v, list) else v


def compare(a_runs: list[dict], b_runs: list[dict]) -> list[dict]:
    """Per (problem, T) row and `*_us` key: the best over runs of A and of B, and A / B (> 1: B faster); `same_bits`: every
    `*_sha` digest of every run of B equals A's first run's."""
    key = lambda r: (r.get("problem"), r.get("T"))
    ref = {key(r): r for r in a_runs[0]["rows"]}
    out = []
    for k, ra in ref.items():
        rows_a = [next(r for r in run["rows"] if key(r) == k) for run in a_runs if any(key(r) == k for r in run["rows"])]
        rows_b = [next(r for r in run["rows"] if key(r) == k) for run in b_runs if any(key(r) == k for r in run["rows"])]
        if not rows_b: continue
        row = dict(problem=k[0], T=k[1])
        for f in (f for f in ra if f.endswith("_us")):
            ta = min(best(r[f]) for r in rows_a if f in r)
            tb = min(best(r[f]) for r in rows_b if f in r)
            row[f] = dict(a=ta, b=tb, a_over_b=round(ta / tb, 3))
        shas = [f for f in ra if f.endswith("_sha")]
        row["same_bits"] = all(r.get(f) == ra[f] for r in rows_a + rows_b for f in shas) if shas else None
        out.append(row)
    return out


def main():
    argv = sys.argv[1:]
    if "--" not in argv: raise SystemExit(__doc__)
    i = argv.index("--")
    head, script = argv[:i], argv[i + 1:]
    rounds = 2
    if "--rounds" in head:
        j = head.index("--rounds"); rounds = int(head[j + 1]); del head[j:j + 2]
    out, a_dir, b_dir = (Path(p).resolve() for p in head)
    out.mkdir(parents=True, exist_ok=True)
    runs = {"A": [], "B": []}
    for r in range(rounds):
        for label, tree in (("A", a_dir), ("B", b_dir)):
            dst = out / f"{label}{r}.json"
            env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{b_dir / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
            subprocess.run([sys.executable, script[0], str(dst), *script[1:]], cwd=b_dir / "tests", env=env, check=True)
            runs[label].append(json.load(open(dst)))
    res = compare(runs["A"], runs["B"])
    json.dump(dict(a=str(a_dir), b=str(b_dir), rounds=rounds, rows=res), open(out / "ab_trees.json", "w"), indent=1)
    for row in res:
        times = "  ".join(f"{f[:-3]} {v['a']:.1f}/{v['b']:.1f} ({v['a_over_b']:.3f})" for f, v in row.items() if f.endswith("_us"))
        print(f"{row['problem']} T={row['T']}: {times}  same bits: {row['same_bits']}", flush=True)


if __name__ == "__main__":
    main()
