"""Render README.md from nbs/index.ipynb without Quarto (which CI machines cannot install).

`nbdev_readme` does the same job through Quarto on a machine that has it. This script keeps README.md in sync
everywhere else: `python .ci/readme.py` writes it, `--check` fails when it is stale, and `--test-command` prints
the README's second command (the one CI runs).
"""
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NB, README = ROOT / "nbs" / "index.ipynb", ROOT / "README.md"
HEADER = "<!-- generated from nbs/index.ipynb: edit the notebook, then run `python .ci/readme.py` (or nbdev_readme) -->\n\n"


def _directives(src: str) -> set:
    return {m.group(1) for m in re.finditer(r"^#\|\s*(\w+)", src, re.M)}


def render() -> str:
    out = []
    for cell in json.loads(NB.read_text())["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            out.append(src.strip())
            continue
        if cell["cell_type"] != "code" or {"hide", "export", "exporti"} & _directives(src):
            continue
        code = "\n".join(l for l in src.splitlines() if not l.startswith("#|")).strip()
        out.append(f"```python\n{code}\n```")
        for o in cell.get("outputs", []):
            data = o.get("data", {})
            if "text/markdown" in data:
                out.append("".join(data["text/markdown"]).strip())
            elif "text/plain" in data or "text" in o:
                text = "".join(data.get("text/plain", o.get("text", ""))).rstrip()
                out.append("    " + text.replace("\n", "\n    "))
    return HEADER + "\n\n".join(out) + "\n"


def test_command() -> str:
    blocks = re.findall(r"```sh\n(.*?)\n```", README.read_text(), re.S)
    return blocks[1].strip()


if __name__ == "__main__":
    if "--test-command" in sys.argv:
        print(test_command())
    elif "--check" in sys.argv:
        if not README.exists() or README.read_text() != render():
            sys.exit("README.md is stale: run `python .ci/readme.py` and commit it")
    else:
        README.write_text(render())
