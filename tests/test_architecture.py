"""The module graph stays one-way (design.md) and packaging lists every package folder."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "exl3tool"
# lower number = lower layer; a module may import only from layers <= its own
LAYERS = {
    "version": 0, "errors": 0, "format": 1, "selection": 1, "io": 2, "reference": 3, "synthetic": 4,
    "checkpoint": 4, "kernels": 5, "prepared": 5, "inspection": 6, "ops": 6, "verify": 7, "bench": 7, "cli": 8,
    "__main__": 9, "__init__": 9,
}


def _modules():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        yield rel.parts[0].removesuffix(".py"), path
    for path in (ROOT / "kernels").rglob("*.py"):  # installed as exl3tool.kernels
        yield "kernels", path


def _imports(path: Path):
    """Every module `path` imports, as a dotted name. `from exl3tool import X` imports exl3tool.X when X is a
    module, else the package's public API (`exl3tool.__init__`)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "exl3tool" and node.level == 0:
            for alias in node.names:
                yield f"exl3tool.{alias.name}" if alias.name in LAYERS else "exl3tool.__init__"
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_no_upward_imports():
    bad = []
    for top, path in _modules():
        for name in _imports(path):
            if not name.startswith("exl3tool."):
                continue
            target = name.split(".")[1]
            if target in LAYERS and top in LAYERS and LAYERS[target] > LAYERS[top]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []


def test_importing_the_package_api_counts_as_an_import_of_init(tmp_path):
    """`from exl3tool import __version__` in a low module reaches the top of the graph: the check must see it."""
    low = tmp_path / "low.py"
    low.write_text("from exl3tool import __version__\nfrom exl3tool import errors\n")
    assert list(_imports(low)) == ["exl3tool.__init__", "exl3tool.errors"]


def test_only_cli_imports_typer_and_rich():
    bad = [f"{path.relative_to(ROOT)} imports {name}" for top, path in _modules() for name in _imports(path)
           if name.split(".")[0] in ("typer", "rich", "click") and top != "cli"]
    assert bad == []
    clicks = [str(p) for _, p in _modules() for name in _imports(p) if name.split(".")[0] == "click"]
    assert clicks == []  # only Typer's public API


def test_pyproject_lists_every_package():
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(exl3tool(?:\.[a-z_]+)*)"', text.split("packages = [")[1].split("]")[0]))
    found = {"exl3tool." + ".".join(p.parent.relative_to(PACKAGE).parts) if p.parent != PACKAGE else "exl3tool"
             for p in PACKAGE.rglob("__init__.py")}
    found |= {"exl3tool.kernels" + "".join("." + part for part in p.parent.relative_to(ROOT / "kernels").parts)
              for p in (ROOT / "kernels").rglob("__init__.py")}
    assert found <= listed, found - listed
