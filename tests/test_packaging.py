"""What a user's install holds: every module of the source tree, the stubs
and py.typed, in the wheel (through setuptools' build_py, the step that
fills it), in the sdist, and in the installed package when the suite runs
against one (``make wheel-test`` sets SHARDSTATE_TEST_INSTALLED=1)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import shardstate

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "python" / "shardstate"
INSTALLED = os.environ.get("SHARDSTATE_TEST_INSTALLED") == "1"


def _package_files(top: Path) -> set[str]:
    """Paths (relative to the package) of what ships: modules, stubs, markers."""
    return {str(p.relative_to(top)) for p in top.rglob("*")
            if p.is_file() and (p.suffix in (".py", ".pyi") or p.name == "py.typed")
            and "__pycache__" not in p.parts}


def _modules(files: set[str]) -> list[str]:
    out = []
    for f in sorted(files):
        if not f.endswith(".py"):
            continue
        parts = f[:-3].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(["shardstate", *parts]))
    return out


def test_source_tree_has_subpackages_and_markers() -> None:
    files = _package_files(SRC)
    assert {"checkpoint/__init__.py", "fsdp/__init__.py", "py.typed", "_core.pyi"} <= files


def test_wheel_build_carries_every_module(tmp_path: Path) -> None:
    # build_py is what puts the Python side into the wheel (bdist_wheel runs
    # it, then adds the built extension).
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _package_files(tmp_path / "shardstate") == _package_files(SRC)


def test_sdist_carries_sources_headers_and_tests(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (archive,) = tmp_path.glob("shardstate-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = {f"python/shardstate/{f}" for f in _package_files(SRC)}
    wanted |= {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.[ch]")}
    wanted |= {"setup.py", "pyproject.toml", "README.md", "tests/conftest.py",
               "tests/c/ss_test.h"}
    assert not wanted - names, sorted(wanted - names)


def test_every_module_imports() -> None:
    # Against the installed package in wheel-test, the tree otherwise: an
    # import error here is a module the other tests may never touch.
    for name in _modules(_package_files(SRC)):
        importlib.import_module(name)


def test_plugin_registered_once(request: pytest.FixtureRequest) -> None:
    import shardstate.testing

    plugins = [p for p in request.config.pluginmanager.get_plugins()
               if p is shardstate.testing]
    assert len(plugins) == 1


def test_runs_against_the_install_it_claims() -> None:
    where = Path(shardstate.__file__).resolve().parent
    if INSTALLED:
        # Nothing from the source tree: not the package, not python/ on the path.
        assert where != SRC, where
        assert str(ROOT / "python") not in [os.path.abspath(p) for p in sys.path]
        assert _package_files(where) == _package_files(SRC)
        from importlib.metadata import entry_points

        eps = [ep for ep in entry_points(group="pytest11") if ep.value == "shardstate.testing"]
        assert len(eps) == 1
    else:
        assert where == SRC, where
