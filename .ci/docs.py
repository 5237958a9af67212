"""Check the documentation without Quarto (which CI machines cannot install).

1. nbdev's own docs processing (`nbdev_proc_nbs`): the notebooks as the docs site gets them, with every exported
   function's `show_doc` executed. A cell that fails there would fail `nbdev_docs` for a user who has Quarto.
2. Every public function and class of every module has its `show_doc` entry in the processed notebooks.
3. Each processed notebook rendered to HTML by nbconvert, then loaded in headless Chromium: a page fails on a script
   error or an image that does not load (the converter's own CDN scripts are not ours and are not counted: CI is
   offline).

Run from the repository root: `python .ci/docs.py` (needs the dev extras and `chromium` on PATH). Writes only under
`_proc/` and `_docs_check/` (both git-ignored).
"""
import importlib
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROC, OUT = ROOT / "_proc", ROOT / "_docs_check"
CHECK = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message || (e.target && (e.target.src || e.target.href)))), true);
window.addEventListener('load', () => {
  const bad = [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => (i.src || '').slice(0, 80));
  const d = document.createElement('div'); d.id = 'docs-check';
  d.setAttribute('data-images', document.images.length); d.setAttribute('data-broken', JSON.stringify(bad));
  d.setAttribute('data-errors', JSON.stringify(window.__errors)); document.body.appendChild(d);
});
</script>"""


def fail(msg):
    print(f"docs check: FAILED: {msg}")
    sys.exit(1)


def process():
    r = subprocess.run(["nbdev_proc_nbs", "--force"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        err = [l for l in r.stderr.splitlines() if "Error in notebook" in l or l.startswith(("Exception", "AssertionError"))]
        fail("nbdev's docs processing failed:\n" + "\n".join(err[:10] or r.stderr.splitlines()[-20:]))
    nbs = sorted(PROC.glob("*.ipynb"))
    print(f"docs check: nbdev processed {len(nbs)} notebooks")
    return nbs


def headings(nb_path):
    "Names with a show_doc heading (### / ####) in a processed notebook's markdown outputs."
    found = set()
    for c in json.loads(nb_path.read_text())["cells"]:
        for o in c.get("outputs", []):
            md = "".join(o.get("data", {}).get("text/markdown", ""))
            found |= set(re.findall(r"^#{2,4} ([\w.]+)", md, re.M))
    return found


def check_show_docs(nbs):
    documented = set().union(*(headings(p) for p in nbs))
    missing = []
    for f in sorted((ROOT / "dsv4_nvfp4").rglob("*.py")):          # sub-packages too (dsv4_nvfp4/bench/gemm.py)
        if f.stem.startswith("_"): continue
        modname = ".".join(f.relative_to(ROOT / "dsv4_nvfp4").with_suffix("").parts)
        mod = importlib.import_module(f"dsv4_nvfp4.{modname}")
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name, None)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", "") == mod.__name__:
                if name not in documented and f"{obj.__qualname__}" not in documented: missing.append(f"{mod.__name__}.{name}")
    if missing: fail(f"{len(missing)} public name(s) without a show_doc entry: {', '.join(missing[:20])}")
    print(f"docs check: every public function and class has its show_doc entry ({len(documented)} entries)")


def render(nbs):
    from nbconvert import HTMLExporter
    if OUT.exists(): shutil.rmtree(OUT)
    OUT.mkdir()
    exp = HTMLExporter()
    pages = []
    for p in nbs:
        html, _ = exp.from_filename(str(p))
        html = html.replace("<head>", "<head>\n" + CHECK, 1)
        out = OUT / (p.stem + ".html")
        out.write_text(html)
        pages.append(out)
    for extra in PROC.iterdir():                       # images and files the pages link to, next to them
        if extra.suffix != ".ipynb" and extra.is_dir(): shutil.copytree(extra, OUT / extra.name, dirs_exist_ok=True)
    return pages


def browse(pages, quiet=False) -> list:
    "Problems found loading `pages` in headless Chromium (an empty list: none)."
    chrome = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chrome is None: fail("no chromium on PATH (apt-get install chromium)")
    bad = []
    for page in pages:
        r = subprocess.run([chrome, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
                            "--virtual-time-budget=10000", "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
        m = re.search(r'<div id="docs-check" data-images="(\d+)" data-broken="([^"]*)" data-errors="([^"]*)"', r.stdout)
        if not m:
            bad.append(f"{page.name}: did not finish loading ({r.stderr.strip().splitlines()[-1:] if r.stderr.strip() else 'no output'})")
            continue
        broken = json.loads(m.group(2).replace("&quot;", '"'))
        # the converter's template loads require.js, MathJax and the widget manager from CDNs: offline (CI) those
        # fail, which says nothing about our pages; any other error does
        errors = [e for e in json.loads(m.group(3).replace("&quot;", '"')) if not re.match(r"https?://", e)]
        if broken: bad.append(f"{page.name}: {len(broken)} image(s) did not load: {broken[:3]}")
        if errors: bad.append(f"{page.name}: {len(errors)} script error(s): {errors[:3]}")
        if not quiet: print(f"  {page.name}: {m.group(1)} image(s), {len(broken)} broken, {len(errors)} error(s)")
    return bad


def selftest():
    "The browser check catches what it looks for: a page with a missing image and a throwing script fails, twice."
    OUT.mkdir(exist_ok=True)
    page = OUT / "_selftest.html"
    page.write_text(f"<html><head>{CHECK}</head><body><img src='missing.png'><script>undefined_name();</script></body></html>")
    bad = browse([page], quiet=True)
    page.unlink()
    if len(bad) != 2: fail(f"the browser check missed a broken image or a script error on its test page: {bad}")


if __name__ == "__main__":
    nbs = process() if "--no-process" not in sys.argv else sorted(PROC.glob("*.ipynb"))
    check_show_docs(nbs)
    pages = render(nbs)
    selftest()
    bad = browse(pages)
    if bad: fail("\n".join(bad))
    print(f"docs check: {len(pages)} pages load in headless Chromium with every image and no script error")
