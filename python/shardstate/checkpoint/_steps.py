"""A root of step checkpoints: ``ROOT/<step>/`` (Orbax's layout: the step
number as the directory's name; ``step_<n>`` and ``step-<n>``, as
torchtitan and others name them, are read too), in a local directory or
at an fsspec URL (``s3://bucket/run1``, ``memory://run1``, ...).

A step is *committed* when its ``.metadata`` is published and the commit
marker ``.shardstate-commit`` is written after it (what shardstate's
checkpoint manager does), *complete* when it has a ``.metadata`` and
neither marker (a plain DCP save, torch's or ours: ``.metadata`` is written
last), and *incomplete* otherwise: no ``.metadata``, or the manager's
pending marker ``.shardstate-pending`` still there (a save that is running
or that crashed).

``Store`` is the little a root needs from its storage (list, read, publish,
remove), on a local filesystem through the C engine's calls and elsewhere
through fsspec: a step is its ``.metadata``'s and marker's objects on an
object store, which has no directories to make or find empty.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import shutil
from pathlib import Path
from typing import Any

from .. import io as ssio

__all__ = ["COMMIT_MARKER", "PENDING_MARKER", "Step", "Store", "is_url", "list_steps",
           "remove_step"]

COMMIT_MARKER = ".shardstate-commit"
PENDING_MARKER = ".shardstate-pending"
_MARKERS = (_METADATA := ".metadata", COMMIT_MARKER, PENDING_MARKER)
_STEP_NAME = re.compile(r"(?:step[_-]?)?([0-9]+)")
# a marker is a few hundred bytes of JSON: anything bigger is not ours
_MAX_MARKER_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Step:
    step: int
    path: Path | str  # a Path in a local root, a URL in an fsspec root
    state: str  # "committed", "complete" or "incomplete"
    size: int  # bytes of the files in the step's directory

    @property
    def loadable(self) -> bool:
        return self.state != "incomplete"


def is_url(root: str | os.PathLike) -> bool:
    """Whether ``root`` names fsspec storage (``proto://...``) rather than a
    local path."""
    return isinstance(root, str) and "://" in root


def _state(names: set[str]) -> str:
    """A step's state from which of ``_MARKERS`` it holds."""
    if _METADATA not in names:
        return "incomplete"
    if COMMIT_MARKER in names:
        return "committed"
    return "incomplete" if PENDING_MARKER in names else "complete"


class Store:
    """A root's storage: a local directory, or fsspec at a URL
    (``storage_options`` go to ``fsspec.core.url_to_fs``, as
    ``FsspecWriter``'s keyword arguments do)."""

    def __init__(self, root: str | os.PathLike, storage_options: dict[str, Any] | None = None):
        self.storage_options = dict(storage_options or {})
        self.remote = is_url(root)
        if self.remote:
            from fsspec.core import url_to_fs

            self.root: Path | str = str(root).rstrip("/")
            self.fs, self._base = url_to_fs(self.root, **self.storage_options)
        else:
            self.root = Path(root)

    def join(self, path: Path | str, *names: str) -> Path | str:
        if self.remote:
            return posixpath.join(str(path), *names)
        return Path(path).joinpath(*names)

    def step_path(self, step: int) -> Path | str:
        return self.join(self.root, str(step))

    def exists(self, path: Path | str) -> bool:
        if self.remote:
            self.fs.invalidate_cache(str(path))
            return bool(self.fs.exists(str(path)))
        return os.path.lexists(path)

    def read(self, path: Path | str, limit: int = _MAX_MARKER_BYTES) -> bytes:
        """A small file whole; FileNotFoundError when missing, ValueError
        when over ``limit``."""
        if self.remote:
            from ._fs_remote import fetch_bounded

            try:
                return fetch_bounded(self.fs, str(path), limit, "file")
            except ssio.ShardstateError as e:
                raise ValueError(str(e)) from None
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"{path}: more than {limit} bytes")
        return data

    def publish(self, path: Path | str, data: bytes) -> None:
        """Writes a small file atomically (readers see it whole or not)."""
        if self.remote:
            from ._fs_remote import publish

            publish(self.fs, str(path), data)
        else:
            ssio.atomic_publish(path, data)

    def unlink(self, path: Path | str) -> None:
        if not self.remote:
            ssio.unlink(path, missing_ok=True)
            return
        try:
            self.fs.rm_file(str(path))
        except FileNotFoundError:
            pass

    def makedirs(self, path: Path | str) -> None:
        if self.remote:
            self.fs.makedirs(str(path), exist_ok=True)
        else:
            ssio.makedirs(path)

    def is_root(self) -> bool:
        if self.remote:
            self.fs.invalidate_cache(self._base)
            return bool(self.fs.isdir(self._base))
        return Path(self.root).is_dir()

    def steps(self, sizes: bool = True) -> list[Step]:
        """The steps under the root, ascending (none when it is missing).
        ``sizes=False``: a local root's steps are not walked for their
        sizes (0); an object store's listing has them anyway."""
        if self.remote:
            found = self._remote_scan()
        else:
            found = self._local_scan(sizes)
        out = [Step(int(m.group(1)), self.join(self.root, name), _state(names), size)
               for name, (m, names, size) in found.items()]
        out.sort(key=lambda s: (s.step, os.fspath(s.path)))
        return out

    def _local_scan(self, sizes: bool) -> dict[str, tuple[Any, set[str], int]]:
        found = {}
        try:
            entries = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        for entry in entries:
            m = _STEP_NAME.fullmatch(entry.name)
            if m is None or not entry.is_dir(follow_symlinks=False):
                continue
            size = 0
            for dirpath, _dirs, files in os.walk(entry.path) if sizes else ():
                for f in files:
                    try:
                        size += os.lstat(os.path.join(dirpath, f)).st_size
                    except OSError:
                        pass
            names = {n for n in _MARKERS if os.path.isfile(os.path.join(entry.path, n))}
            found[entry.name] = (m, names, size)
        return found

    def _remote_scan(self) -> dict[str, tuple[Any, set[str], int]]:
        """One listing of every object under the root (paginated by the
        store), grouped by step."""
        base = self._base.rstrip("/")
        self.fs.invalidate_cache(base)
        try:
            objects = self.fs.find(base, detail=True, withdirs=True)
        except FileNotFoundError:
            return {}
        found: dict[str, tuple[Any, set[str], int]] = {}
        for path, info in objects.items():
            rel = str(path)[len(base):].lstrip("/") if str(path).startswith(base) else ""
            name, _, rest = rel.partition("/")
            m = _STEP_NAME.fullmatch(name)
            if m is None:
                continue
            _m, names, size = found.get(name, (m, set(), 0))
            if info.get("type", "file") != "directory":
                size += int(info.get("size") or 0)
                if rest in _MARKERS:
                    names.add(rest)
            elif not rest:  # the step's own directory entry
                pass
            found[name] = (m, names, size)
        return found

    def remove(self, step: Step) -> None:
        """Removes a step; its marker and ``.metadata`` first, so a step half
        removed reads as incomplete, never as a loadable checkpoint with
        missing files."""
        for name in (COMMIT_MARKER, _METADATA):
            self.unlink(self.join(step.path, name))
        if not self.remote:
            shutil.rmtree(step.path)
            return
        try:
            self.fs.rm(str(step.path), recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self._base)


def list_steps(root: str | os.PathLike,
               storage_options: dict[str, Any] | None = None) -> list[Step]:
    """The steps under ``root`` (a directory or an fsspec URL), ascending.
    Raises FileNotFoundError when ``root`` does not exist."""
    store = Store(root, storage_options)
    if not store.is_root():
        raise FileNotFoundError(f"{root}: no such directory")
    return store.steps()


def remove_step(step: Step, storage_options: dict[str, Any] | None = None) -> None:
    """Removes ``step`` (see ``Store.remove``)."""
    Store(step.path, storage_options).remove(step)
