"""The package's import graph, read from the source with `ast` (module-level and function-level imports alike):

* no cycle between dsv4_nvfp4 modules;
* no module imports another module's `_private` name, or reaches one through a module alias (`rt._x`);
* imports point down the module map (the order below, which is the notebook order of nbs/): a module imports only
  modules listed before it. The one declared exception is the grouped GEMM's dispatcher, which calls its
  per-architecture kernels.
"""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "dsv4_nvfp4"
ORDER = ["formats", "quant", "checkpoint", "layout", "bench", "runtime", "quantize_cuda", "norm", "routing",
         "sm90_layout", "grouped_gemm", "gemm_sm90", "gemm_sm100", "swiglu", "kv", "gather", "moe", "ep.transport", "ep.layer",
         "ep.capture", "ep_bench", "cli"]
DISPATCH = {("grouped_gemm", "gemm_sm90"), ("grouped_gemm", "gemm_sm100")}   # a dispatcher calls its backends


def module_name(path: Path) -> str:
    "A source file's module under dsv4_nvfp4, dotted: ep/layer.py -> ep.layer."
    return ".".join(path.relative_to(PKG).with_suffix("").parts)


def module_imports(path: Path, pkg: tuple = ()):
    """(imported dsv4_nvfp4 modules, private names taken from them) of one source file in sub-package `pkg` (the parts
    under dsv4_nvfp4: () for a top-level module, ("ep",) for ep/layer.py): module names dotted (ep.transport).
    Private names: `from dsv4_nvfp4.m import _x`, and `alias._x` where `alias` is a dsv4_nvfp4 module."""
    tree = ast.parse(path.read_text())
    mods, private, aliases = set(), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                              # relative: from the file's package up level - 1 packages
                up = list(pkg[:len(pkg) - (node.level - 1)]) if node.level - 1 <= len(pkg) else []
                base = ".".join(["dsv4_nvfp4"] + up + ([base] if base else []))
            if base == "dsv4_nvfp4" or base.startswith("dsv4_nvfp4."):
                sub = base.split(".", 1)[1] if base.startswith("dsv4_nvfp4.") else ""
                if sub:
                    mods.add(sub)
                    private += [f"{sub}.{a.name}" for a in node.names if a.name.startswith("_")]
                else:                                   # from dsv4_nvfp4 import runtime as rt / from . import runtime
                    for a in node.names:
                        if a.name.startswith("__"): continue    # the package's own attributes (__version__)
                        mods.add(a.name); aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dsv4_nvfp4."):
                    mods.add(a.name.split(".", 1)[1])
                    if a.asname: aliases[a.asname] = a.name.split(".", 1)[1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            private.append(f"{aliases[node.value.id]}.{node.attr}")
    return mods, private


def graph():
    return {module_name(p): module_imports(p, p.relative_to(PKG).parts[:-1]) for p in sorted(PKG.rglob("*.py"))
            if p.stem not in ("__init__", "_modidx")}


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
    mods, private = module_imports(f)
    assert mods == {"runtime", "quant", "layout"}
    assert sorted(private) == ["quant._hidden", "runtime._secret"]
    f.write_text("from ..moe import DSV4MoE\nfrom .transport import _x, PAYLOADS\nimport dsv4_nvfp4.ep.layer as L\nL._y\n")
    mods, private = module_imports(f, ("ep",))                  # a module of the sub-package ep: relative imports resolved
    assert mods == {"moe", "ep.transport", "ep.layer"} and sorted(private) == ["ep.layer._y", "ep.transport._x"]


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
