"""docs/architecture.md is the map: it names every module of the package and
every C source file, and names nothing that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def _python_modules() -> list[str]:
    top = ROOT / "python" / "shardstate"
    out = []
    for p in sorted(top.rglob("*.py")):
        rel = p.relative_to(top)
        if rel.name == "__init__.py" and rel.parent != Path("."):
            out.append(f"{rel.parent.as_posix()}/")  # a package is named by its folder
        out.append(rel.as_posix())
    return out


def test_every_python_module_is_on_the_map() -> None:
    missing = []
    for rel in _python_modules():
        name = rel.rsplit("/", 1)[-1] if not rel.endswith("/") else \
            rel.rstrip("/").rsplit("/", 1)[-1] + "/"
        if name == "__init__.py":
            continue
        # named by its file name (e.g. "_fs_read.py") or its path from shardstate/
        if name not in DOC and rel not in DOC:
            missing.append(rel)
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_every_c_file_is_on_the_map() -> None:
    missing = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "csrc").rglob("*.c"))
               if p.stem not in DOC]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_map_names_no_missing_python_file() -> None:
    names = {p.name for d in ("python", "scripts", "benchmarks", "tests")
             for p in (ROOT / d).rglob("*.py*")} | {"setup.py"}
    named = set(re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*\.pyi?)\b", DOC))
    gone = sorted(n for n in named if n not in names)
    assert not gone, f"docs/architecture.md names files that do not exist: {gone}"
