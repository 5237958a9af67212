"""The package's import graph, read from the source with `ast` (module-level and function-level imports alike):

* no cycle between dsv4_nvfp4 modules;
* no module imports another module's `_private` name, or reaches one through a module alias (`rt._x`);
* imports point down the module map (the order below, which is the notebook order of nbs/): a module imports only
  modules listed before it. The one declared exception is the grouped GEMM's dispatcher, which calls its
  per-architecture kernels. Sub-package modules are named by their dotted path (`bench.gemm`); each stage's
  benchmark sits right after its stage, so it imports ops above it and nothing below imports it;
* no library module imports the benchmarks: only `bench.*` and the CLI do.
"""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "dsv4_nvfp4"
ORDER = ["formats", "quant", "checkpoint", "layout", "bench.core", "runtime", "quantize_cuda", "norm", "bench.kernels",
         "routing", "sm90_layout", "grouped_gemm", "gemm_sm90", "gemm_sm100", "bench.gemm", "swiglu", "bench.mlp", "kv",
         "gather", "bench.kv", "moe", "ep", "bench.moe", "cli"]
PACKAGES = {"bench"}                                                          # sub-packages (folders with __init__.py)
DISPATCH = {("grouped_gemm", "gemm_sm90"), ("grouped_gemm", "gemm_sm100")}   # a dispatcher calls its backends


def module_imports(path: Path, name: str = ""):
    """(imported dsv4_nvfp4 modules, private names taken from them) of one source file, the module `name` (dotted,
    relative to the package: `bench.gemm`), which anchors its relative imports.
    Private names: `from dsv4_nvfp4.m import _x`, and `alias._x` where `alias` is a dsv4_nvfp4 module."""
    tree = ast.parse(path.read_text())
    mods, private, aliases = set(), [], {}
    here = name.split(".")[:-1]                                             # the package the module sits in
    def target(node):                                                       # the dsv4_nvfp4 module it names ("" the root), or None
        base = node.module or ""
        if node.level:
            up = here[:len(here) - (node.level - 1)] if node.level > 1 else here
            return ".".join(up + ([base] if base else []))
        if base == "dsv4_nvfp4": return ""
        return base.split(".", 1)[1] if base.startswith("dsv4_nvfp4.") else None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            sub = target(node)
            if sub is None: continue
            if sub and sub not in PACKAGES:
                mods.add(sub)
                private += [f"{sub}.{a.name}" for a in node.names if a.name.startswith("_")]
            else:                                   # from dsv4_nvfp4 import runtime as rt / from . import runtime / from .bench import core
                for a in node.names:
                    if a.name.startswith("__"): continue    # the package's own attributes (__version__)
                    m = f"{sub}.{a.name}" if sub else a.name
                    mods.add(m); aliases[a.asname or a.name] = m
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dsv4_nvfp4."):
                    m = a.name.split(".", 1)[1]
                    mods.add(m)
                    if a.asname: aliases[a.asname] = m
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            private.append(f"{aliases[node.value.id]}.{node.attr}")
    return mods, private


def graph():
    "{module: (imports, private names)} of every module of the package, sub-packages included (`bench.gemm`)."
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).with_suffix("")
        if rel.name in ("__init__", "_modidx") or "__pycache__" in rel.parts: continue
        name = ".".join(rel.parts)
        out[name] = module_imports(p, name)
    return out


def find_cycle(edges: dict):
    "A cycle [a, b, ..., a] in {node: set(nodes)}, or None."
    state, stack = {}, []
    def visit(n):
        state[n] = 1; stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1: return stack[stack.index(m):] + [m]
            if m not in state:
                c = visit(m)
                if c: return c
        state[n] = 2; stack.pop()
        return None
    for n in sorted(edges):
        if n not in state:
            c = visit(n)
            if c: return c
    return None


def test_the_checks_catch_what_they_look_for(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    f = tmp_path / "m.py"
    f.write_text("from dsv4_nvfp4 import runtime as rt, __version__\nfrom .quant import _hidden, BLOCK\n"
                 "def g():\n    from dsv4_nvfp4.layout import swizzle_scales\n    return rt._secret\n")
    mods, private = module_imports(f, "m")
    assert mods == {"runtime", "quant", "layout"}
    assert sorted(private) == ["quant._hidden", "runtime._secret"]
    b = tmp_path / "b.py"                                  # a module of a sub-package: relative imports one and two up
    b.write_text("from .core import Timer\nfrom ..grouped_gemm import _hidden\nfrom .. import runtime as rt\n"
                 "from dsv4_nvfp4.bench import core as bc\nimport dsv4_nvfp4.bench.kv as bk\ndef g(): return bc._x, bk._y\n")
    mods, private = module_imports(b, "bench.b")
    assert mods == {"bench.core", "grouped_gemm", "runtime", "bench.kv"}
    assert sorted(private) == ["bench.core._x", "bench.kv._y", "grouped_gemm._hidden"]


def test_every_module_is_in_the_map():
    assert sorted(graph()) == sorted(ORDER), "add the new module to ORDER (the module map) in this test"


def test_no_import_cycle():
    g = graph()
    assert find_cycle({m: mods for m, (mods, _) in g.items()}) is None


def test_no_private_names_across_modules():
    bad = {m: priv for m, (_, priv) in graph().items() if priv}
    assert not bad, f"modules use other modules' private names: {bad}"


@pytest.mark.parametrize("mod", ORDER)
def test_imports_point_down_the_module_map(mod):
    mods, _ = graph()[mod]
    up = [m for m in mods if m != mod and ORDER.index(m) > ORDER.index(mod) and (mod, m) not in DISPATCH]
    assert not up, f"{mod} imports {up}, which come after it in the module map"


def test_library_modules_do_not_import_the_benchmarks():
    "Ops, layers and the rest hold no benchmark: only the bench sub-package itself and the CLI import it."
    bad = {m: sorted(x for x in mods if x.split(".")[0] == "bench")
           for m, (mods, _) in graph().items() if not m.startswith("bench.") and m != "cli"}
    assert not {m: v for m, v in bad.items() if v}, f"library modules import bench: {bad}"

