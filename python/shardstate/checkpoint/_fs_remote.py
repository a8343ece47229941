"""The fsspec side of ``_fsspec_filesystem`` shared by saves and loads,
and the load's half (the save's transfers are ``_fs_upload``'s):

* ``_memfd`` / ``_fd_path``: anonymous in-memory files the local engine
  reaches by path (``/proc/self/fd/N``);
* ``publish``: ``.metadata``, one put (a rename into place on a local
  filesystem);
* ``listing`` / ``fetch_bounded`` / ``check_relative``: what a load knows
  of the objects before it reads them;
* ``Mirror``: a load's sparse in-memory copies of the objects it reads,
  the size of the objects, holding only the byte ranges of this rank's
  records, fetched in parallel pieces (``cat_ranges``).

Thread safety: each object serves one save or load.
"""

from __future__ import annotations

import errno
import mmap
import os
import posixpath
import tempfile
from collections.abc import Iterable
from typing import Any

from .._util import pwrite_all
from ._records import StorageFormatError, _File, _Req

# A fetched range is split into FETCH_PARALLEL pieces of at least
# FETCH_PIECE bytes, fetched at once: a big record comes in parallel
# streams, and an object is not asked for in many small requests (a server
# may pay for each request in proportion to the object: moto does).
FETCH_PIECE = 32 << 20
FETCH_PARALLEL = 8
# Ranges closer than this are fetched as one (fewer requests for runs of
# small records; the gap's bytes are read and dropped).
FETCH_GAP = 64 << 10
# Fetched bytes held at once before they are copied into the mirror.
FETCH_BATCH = 1 << 30


def _memfd(name: str) -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create(f"shardstate:{name}"[:249], os.MFD_CLOEXEC)
    with tempfile.TemporaryFile() as f:  # unlinked; the dup outlives the object
        return os.dup(f.fileno())


def _fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def _is_memory(fs: Any) -> bool:
    from fsspec.implementations.memory import MemoryFileSystem

    return isinstance(fs, MemoryFileSystem)


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def publish(fs: Any, url: str, data: bytes) -> None:
    """Puts ``.metadata`` (the save's last object) whole: an object store's
    put is atomic; on a local filesystem it is written beside and renamed
    into place."""
    if "file" in _protocols(fs) or "local" in _protocols(fs):
        tmp = f"{url}.tmp"
        fs.pipe_file(tmp, data)
        fs.mv(tmp, url)
        return
    fs.pipe_file(url, data)


def listing(fs: Any, root: str, detail: bool = False) -> Any:
    """The names under ``root`` (``detail``: name -> size), read afresh;
    empty when ``root`` does not exist."""
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        entries = []
    out = {posixpath.basename(str(e["name"]).rstrip("/")): e.get("size") for e in entries
           if e.get("type", "file") == "file"}
    return out if detail else set(out)


def fetch_bounded(fs: Any, url: str, limit: int, what: str) -> bytes:
    """A whole object of at most ``limit`` bytes, its size checked before
    it is fetched."""
    fs.invalidate_cache(posixpath.dirname(url))
    try:
        size = fs.size(url)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, f"no {what} at {url} (incomplete or missing checkpoint)", url) from None
    if not isinstance(size, int) or size > limit:
        raise StorageFormatError(f"{what} {url} is {size} bytes, more than the {limit} allowed")
    data = fs.cat_file(url, start=0, end=size) if size else b""
    if len(data) != size:
        raise StorageFormatError(f"{what} {url} changed while being read")
    return bytes(data)


def check_relative(root: Any, rel: object) -> None:
    """Refuses a storage path that is not a plain relative path under the
    checkpoint prefix (the rule ``_Records._open_file`` applies on disk)."""
    if type(rel) is not str:
        raise StorageFormatError(f"{root}: storage path {rel!r} is not a string")
    parts = rel.replace("\\", "/").split("/")
    if (not rel or "\0" in rel or os.path.isabs(rel) or "://" in rel
            or any(p in ("", ".", "..") for p in parts)):
        raise StorageFormatError(
            f"{root}: storage path {rel!r} is not a plain relative path inside the "
            "checkpoint directory")


def _ranges(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) spans merged across gaps up to ``FETCH_GAP``, then each
    cut into at most ``FETCH_PARALLEL`` pieces of at least ``FETCH_PIECE``."""
    merged: list[list[int]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1] + FETCH_GAP:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    out = []
    for s, e in merged:
        piece = max(FETCH_PIECE, -(-(e - s) // FETCH_PARALLEL))
        out += [(p, min(p + piece, e)) for p in range(s, e, piece)]
    return out


class Mirror:
    """A load's in-memory copies of the objects under ``root`` it reads:
    each the object's size, sparse, holding the fetched ranges."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root
        self._sizes: dict[str, Any] | None = None
        self._files: dict[str, _File] = {}
        self._fds: dict[str, int] = {}

    def url(self, rel: str) -> str:
        return posixpath.join(self.root, rel)

    def size(self, rel: str) -> int:
        """Object ``rel``'s size (from one listing of the root)."""
        if self._sizes is None:
            self._sizes = listing(self.fs, self.root, detail=True)
        size = self._sizes.get(rel)
        if size is None:
            try:
                size = self.fs.info(self.url(rel))["size"]
            except FileNotFoundError:
                raise FileNotFoundError(
                    errno.ENOENT, f"checkpoint data file {self.url(rel)} is missing",
                    self.url(rel)) from None
        if not isinstance(size, int) or size < 0:
            raise StorageFormatError(f"checkpoint data file {self.url(rel)}: size {size!r}")
        return size

    def file(self, rel: str) -> _File:
        """The local file standing for object ``rel`` (made empty, the
        object's size, on first use)."""
        f = self._files.get(rel)
        if f is None:
            size = self.size(rel)
            fd = self._fds[rel] = _memfd(rel)
            os.ftruncate(fd, size)
            f = self._files[rel] = _File(rel, _fd_path(fd), size)
        return f

    def fetch(self, reqs: list[_Req]) -> None:
        """Copies in the byte ranges of these (located, checked) reads'
        records, whole, fetched in parallel pieces, ``FETCH_BATCH`` bytes
        at a time."""
        by_file: dict[str, list[tuple[int, int]]] = {}
        for r in reqs:
            by_file.setdefault(r.file.rel, []).append(
                (r.info.offset, r.info.offset + r.info.length))
        pieces = [(rel, s, e) for rel, spans in by_file.items() for s, e in _ranges(spans)]
        if _is_memory(self.fs):
            self._copy_from_store(pieces)
            return
        if not getattr(self.fs, "async_impl", False):
            self._read_into(pieces)
            return
        i = 0
        while i < len(pieces):
            j, total = i, 0
            while j < len(pieces) and (j == i or total + pieces[j][2] - pieces[j][1]
                                       <= FETCH_BATCH):
                total += pieces[j][2] - pieces[j][1]
                j += 1
            batch = pieces[i:j]
            got = self.fs.cat_ranges([self.url(rel) for rel, _s, _e in batch],
                                     [s for _rel, s, _e in batch], [e for _rel, _s, e in batch],
                                     on_error="raise")
            for (rel, s, e), data in zip(batch, got):
                if isinstance(data, BaseException):
                    raise data
                if len(data) != e - s:
                    raise StorageFormatError(
                        f"checkpoint data file {self.url(rel)}: asked for bytes [{s}, {e}), "
                        f"got {len(data)} (the object changed while being read?)")
                pwrite_all(self._fds[rel], data, s)
            del got, batch
            i = j

    def _copy_from_store(self, pieces: list[tuple[str, int, int]]) -> None:
        """memory://: each piece written into the mirror straight from the
        stored object's buffer (``pwrite``: the kernel makes the mirror's
        pages as it copies, without a fault per page, and no ``MemoryFile``
        copy of the object is made)."""
        for rel, s, e in pieces:
            url = self.url(rel)
            try:
                obj = self.fs.store[self.fs._strip_protocol(url)]
            except KeyError:
                raise FileNotFoundError(errno.ENOENT, f"checkpoint data file {url} is missing",
                                        url) from None
            with obj.getbuffer() as buf:
                if buf.nbytes < e:
                    raise StorageFormatError(
                        f"checkpoint data file {url}: asked for bytes [{s}, {e}), the object "
                        f"has {buf.nbytes} (it changed while being read?)")
                pwrite_all(self._fds[rel], buf[s:e], s)

    def _read_into(self, pieces: list[tuple[str, int, int]]) -> None:
        """A filesystem without an async API (memory://, file://): each
        piece read from an open file straight into a mapping of the
        mirror, one copy."""
        for rel in dict.fromkeys(rel for rel, _s, _e in pieces):
            mine = [(s, e) for r, s, e in pieces if r == rel]
            # (not populated: the mirror stays sparse, only the pieces' pages
            # are made)
            mm = mmap.mmap(self._fds[rel], self._files[rel].size)
            view = memoryview(mm)
            try:
                with self.fs.open(self.url(rel), "rb") as f:
                    for s, e in mine:
                        f.seek(s)
                        got = 0
                        while got < e - s:
                            n = f.readinto(view[s + got:e])
                            if not n:
                                raise StorageFormatError(
                                    f"checkpoint data file {self.url(rel)}: asked for bytes "
                                    f"[{s}, {e}), got {got} (the object changed while being "
                                    "read?)")
                            got += n
            finally:
                view.release()
                mm.close()

    def rename(self, text: str) -> str:
        """``text`` with the objects' URLs in place of their local copies'
        paths."""
        # longest first: /proc/self/fd/1 is a prefix of /proc/self/fd/12
        for rel, f in sorted(self._files.items(), key=lambda x: -len(x[1].path)):
            text = text.replace(f.path, self.url(rel))
        return text

    def rename_in(self, e: BaseException) -> None:
        """Puts the objects' URLs in place of their local copies' paths in
        an error's message."""
        if type(e).__str__ is not BaseException.__str__:
            return
        e.args = tuple(self.rename(a) if isinstance(a, str) else a for a in e.args)

    def drop(self) -> None:
        """Frees the fetched bytes, keeping the copies (empty again, their
        objects' sizes) for the next ``fetch``."""
        for rel, fd in self._fds.items():
            os.ftruncate(fd, 0)
            os.ftruncate(fd, self._files[rel].size)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._files.clear()
        self._sizes = None
