"""The module map, checked on the source (ast, no imports executed):

* no cycle between dsv4_nvfp4 modules;
* no module imports another module's `_private` name, or reaches one through a module alias (`rt._x`);
* imports point down the module map (the order below, which is the notebook order of nbs/): a module imports only
  modules listed before it. Sub-package modules are named by their dotted path (`bench.gemm`, `ep.layer`); a
  package's `__init__` is the package's own name (`gemm`: the GEMM seam). The one declared exception is the sm90
  backend of the seam (gemm.sm90), which imports its CuTeDSL kernel (gemm.sm90_kernel) inside a function, on the first
  launch: never at module level; likewise the reference backend (gemm.reference) imports the W4A8 reference
  (gemm.w4a8, which builds on gemm.reference) on its first W4A8 launch. The seam's registry (gemm) names its backends as "module:class" strings imported
  through importlib, which `ast` does not see as imports (and which is allowed: the seam does not depend on them);
* every dsv4_nvfp4 module a module imports exists;
* no library module imports the benchmarks: only `bench.*` and the CLI do.
"""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "dsv4_nvfp4"
ORDER = ["formats", "quant", "checkpoint", "layout", "bench.core", "runtime", "quantize_cuda", "norm", "bench.kernels",
         "routing", "gemm", "gemm.sm90", "gemm.reference", "gemm.sm90_kernel", "gemm.sm100", "gemm.w4a8", "bench.gemm", "swiglu",
         "bench.mlp", "kv", "gather", "attention", "bench.kv", "bench.attn", "moe", "ep.transport", "ep.layer", "ep.capture", "bench.ep", "bench.moe",
         "cli"]
LAZY = {("gemm.sm90", "gemm.sm90_kernel"),    # a backend imports its kernel on first launch (function level only)
        ("gemm.reference", "gemm.w4a8")}       # the reference backend's W4A8 path (gemm.w4a8 imports gemm.reference)


def module_name(path: Path, root: Path = PKG) -> str:
    "A source file's module under dsv4_nvfp4, dotted: ep/layer.py -> ep.layer, gemm/__init__.py -> gemm."
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, pkg: tuple = (), top_level: bool = False, root: Path = PKG):
    """(imported dsv4_nvfp4 modules, private names taken from them) of one source file in sub-package `pkg` (the parts
    under dsv4_nvfp4: () for a top-level module, ("ep",) for ep/layer.py and for ep/__init__.py): module names dotted.
    Private names: `from dsv4_nvfp4.m import _x`, and `alias._x` where `alias` is a dsv4_nvfp4 module. A name taken from
    a package is its submodule where one of that name exists (`from dsv4_nvfp4.gemm import sm90_kernel`), else the
    package itself (`from dsv4_nvfp4.gemm import Backend`: the module gemm). With `top_level`, only the imports that run
    when the module is imported (not inside a function)."""
    tree = ast.parse(path.read_text())
    mods, private, aliases = set(), [], {}
    is_sub = lambda dotted: (root / dotted.replace(".", "/")).is_dir() or (root / (dotted.replace(".", "/") + ".py")).is_file()
    nodes = ast.walk(tree)
    if top_level:                                       # module level, including under if / try, not inside a def
        def outside_defs(n):
            yield n
            for c in ast.iter_child_nodes(n):
                if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)): yield from outside_defs(c)
        nodes = outside_defs(tree)
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                              # relative: from the file's package up level - 1 packages
                up = list(pkg[:len(pkg) - (node.level - 1)]) if node.level - 1 <= len(pkg) else []
                base = ".".join(["dsv4_nvfp4"] + up + ([base] if base else []))
            if base != "dsv4_nvfp4" and not base.startswith("dsv4_nvfp4."): continue
            sub = base.split(".", 1)[1] if base.startswith("dsv4_nvfp4.") else ""
            if sub and not (root / sub.replace(".", "/")).is_dir():          # a plain module: from dsv4_nvfp4.quant import X
                mods.add(sub)
                private += [f"{sub}.{a.name}" for a in node.names if a.name.startswith("_")]
                continue
            for a in node.names:                        # from a package (the root, gemm, bench, ep): submodules or its own names
                if a.name.startswith("__"): continue    # the package's own attributes (__version__)
                m = f"{sub}.{a.name}" if sub else a.name
                if is_sub(m): mods.add(m); aliases[a.asname or a.name] = m
                else:
                    mods.add(sub)
                    if a.name.startswith("_"): private.append(f"{sub}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dsv4_nvfp4."):
                    mods.add(a.name.split(".", 1)[1])
                    if a.asname: aliases[a.asname] = a.name.split(".", 1)[1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            private.append(f"{aliases[node.value.id]}.{node.attr}")
    mods.discard("")
    return mods, private


def graph(top_level: bool = False, root: Path = PKG):
    "{module: (imports, private names)} of every module of the package, sub-packages and their __init__ included."
    out = {}
    for p in sorted(root.rglob("*.py")):
        if p.stem == "_modidx" or "__pycache__" in p.parts or p.parent == root and p.stem == "__init__": continue
        if p.stem == "__init__" and not p.read_text().strip(): continue      # an empty package marker
        parts = p.relative_to(root).parts[:-1]
        out[module_name(p, root)] = module_imports(p, parts, top_level, root)
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
    (tmp_path / "quant.py").write_text("")
    (tmp_path / "runtime.py").write_text("")
    f = tmp_path / "m.py"
    f.write_text("from dsv4_nvfp4 import runtime as rt, __version__\nfrom .quant import _hidden, BLOCK\n"
                 "def g():\n    from dsv4_nvfp4.layout import swizzle_scales\n    return rt._secret\n")
    mods, private = module_imports(f, root=tmp_path)
    assert mods == {"runtime", "quant", "layout"}
    assert sorted(private) == ["quant._hidden", "runtime._secret"]
    (tmp_path / "ep").mkdir(); (tmp_path / "ep" / "layer.py").write_text(""); (tmp_path / "ep" / "transport.py").write_text("")
    f.write_text("from ..moe import DSV4MoE\nfrom .transport import _x, PAYLOADS\nimport dsv4_nvfp4.ep.layer as L\nL._y\n")
    mods, private = module_imports(f, ("ep",), root=tmp_path)   # a module of the sub-package ep: relative imports resolved
    assert mods == {"moe", "ep.transport", "ep.layer"} and sorted(private) == ["ep.layer._y", "ep.transport._x"]
    (tmp_path / "gemm").mkdir(); (tmp_path / "gemm" / "sm90.py").write_text(""); (tmp_path / "gemm" / "sm90_kernel.py").write_text("")
    f.write_text("from . import Backend, _PLANS\nfrom .. import quant\ntry:\n    import dsv4_nvfp4.gemm.sm90 as S\nexcept ImportError: pass\n"
                 "def g():\n    from dsv4_nvfp4.gemm import sm90_kernel\n    return sm90_kernel._K\n")
    mods, private = module_imports(f, ("gemm",), root=tmp_path)   # the package's own names are the package (gemm)
    assert mods == {"gemm", "quant", "gemm.sm90", "gemm.sm90_kernel"}
    assert sorted(private) == ["gemm._PLANS", "gemm.sm90_kernel._K"]
    assert module_imports(f, ("gemm",), top_level=True, root=tmp_path)[0] == {"gemm", "quant", "gemm.sm90"}
    (tmp_path / "gemm" / "__init__.py").write_text("from ..quant import X\n")
    assert graph(root=tmp_path)["gemm"][0] == {"quant"}              # a package's __init__ is the package's module


def test_every_module_is_in_the_map():
    assert sorted(graph()) == sorted(ORDER), "add the new module to ORDER (the module map) in this test"


def test_no_import_cycle():
    "No cycle, with the declared lazy kernel imports left out (an import inside a function runs after both modules load)."
    g = graph()
    assert find_cycle({m: {i for i in mods if (m, i) not in LAZY} for m, (mods, _) in g.items()}) is None
    top = graph(top_level=True)
    assert find_cycle({m: mods for m, (mods, _) in top.items()}) is None


def test_lazy_imports_are_function_level_only():
    "The declared upward imports never run at module import: `import dsv4_nvfp4.gemm.sm90` does not import CuTeDSL."
    top = graph(top_level=True)
    for mod, kernel in LAZY:
        assert kernel in graph()[mod][0], f"{mod} no longer imports {kernel}: drop it from LAZY"
        assert kernel not in top[mod][0], f"{mod} imports {kernel} at module level"


def test_every_imported_module_exists():
    missing = {m: sorted(i for i in mods if i not in ORDER) for m, (mods, _) in graph().items()}
    assert not {m: v for m, v in missing.items() if v}, f"imports of modules that do not exist: {missing}"


def test_no_private_names_across_modules():
    bad = {m: priv for m, (_, priv) in graph().items() if priv}
    assert not bad, f"modules use other modules' private names: {bad}"


@pytest.mark.parametrize("mod", ORDER)
def test_imports_point_down_the_module_map(mod):
    mods, _ = graph()[mod]
    up = [m for m in mods if m in ORDER and m != mod and ORDER.index(m) > ORDER.index(mod) and (mod, m) not in LAZY]
    assert not up, f"{mod} imports {up}, which come after it in the module map"


def test_library_modules_do_not_import_the_benchmarks():
    "Ops, layers and the rest hold no benchmark: only the bench sub-package itself and the CLI import it."
    bad = {m: sorted(x for x in mods if x.split(".")[0] == "bench")
           for m, (mods, _) in graph().items() if not m.startswith("bench.") and m != "cli"}
    assert not {m: v for m, v in bad.items() if v}, f"library modules import bench: {bad}"
