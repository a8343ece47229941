"""The fsspec side of ``_fsspec_filesystem``: in-memory files the local
engine writes and reads, and the transfers between them and the store.

* ``MemFiles``: a save's data files as anonymous in-memory files
  (``memfd_create``; an unlinked temporary file where there is none),
  named to the engine by ``/proc/self/fd/N``; ``body`` hands one to fsspec
  as a read-only view of its mapping (``Body``), without copying it.
* ``upload``: a rank's files all at once (an async filesystem's ``pipe``,
  big objects in parallel parts where the backend has them; else threads).
* ``publish``: ``.metadata``, one put (a rename into place on a local
  filesystem).
* ``Mirror``: a load's sparse in-memory copies of the objects it reads,
  the size of the objects, holding only the byte ranges of this rank's
  records, fetched in parallel pieces (``cat_ranges``).

Thread safety: each object serves one save or load.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import io
import mmap
import os
import posixpath
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec.asyn

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
# An object is uploaded in at most UPLOAD_CONCURRENCY parts of at least
# UPLOAD_PART bytes, all at once (where the backend has multipart uploads:
# s3fs's chunksize / max_concurrency); few big parts are what an S3 server
# handles fastest (moto: 4 MiB/part-count dependent; 400 MB in 50 MB parts
# took 3x as long as in 4 parts).
UPLOAD_CONCURRENCY = 8
UPLOAD_PART = 64 << 20
# Objects written at once on a filesystem without an async API.
UPLOAD_THREADS = 8


# Mappings are made with their pages (one call, not a fault per page).
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _memfd(name: str) -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create(f"shardstate:{name}"[:249], os.MFD_CLOEXEC)
    with tempfile.TemporaryFile() as f:  # unlinked; the dup outlives the object
        return os.dup(f.fileno())


def _fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


class Body(io.RawIOBase):
    """A read-only file over a buffer, for an upload's body: botocore and
    aiohttp take a file object (not a memoryview), and s3fs slices the body
    into parts (``body[a:b]``, another view: no copy)."""

    def __init__(self, view: Any) -> None:
        super().__init__()
        self._view = memoryview(view).cast("B")
        self._pos = 0

    def __len__(self) -> int:
        return self._view.nbytes

    def __getitem__(self, s: slice) -> Body:
        return Body(self._view[s])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = (0, self._pos, self._view.nbytes)[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._view.nbytes - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def view(self) -> memoryview:
        return self._view

    def close(self) -> None:
        # The view stays: s3fs's retries and aiohttp may close a body and
        # read it again; the mapping goes with MemFiles.
        super().close()


class MemFiles:
    """A save's data files in memory, by name."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._maps: list[mmap.mmap] = []

    def __enter__(self) -> MemFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self, name: str) -> str:
        """A new empty in-memory file for ``name``: the path the engine opens."""
        fd = self._fds[name] = _memfd(name)
        return _fd_path(fd)

    def body(self, name: str) -> Body:
        """The file's bytes as written, as an upload body (a mapping)."""
        fd = self._fds[name]
        size = os.fstat(fd).st_size
        if not size:
            return Body(b"")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
        self._maps.append(mm)
        return Body(mm)

    def close(self) -> None:
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a body still referenced: unmapped when collected
                pass
        self._maps.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _put(fs: Any, url: str, body: Body) -> None:
    with fs.open(url, "wb") as f:
        f.write(body.view())


def upload(fs: Any, bodies: dict[str, Body]) -> None:
    """Writes each URL's body, all at once: an async filesystem's ``pipe``
    (one request per object, big ones in parallel parts), else a thread per
    object (at most ``UPLOAD_THREADS``). Raises the first failure, after
    which no ``.metadata`` is written."""
    if not bodies:
        return
    if getattr(fs, "async_impl", False):
        params = inspect.signature(fs._pipe_file).parameters

        def kwargs(n: int) -> dict[str, int]:
            kw = {}
            if "max_concurrency" in params:
                kw["max_concurrency"] = UPLOAD_CONCURRENCY
            if "chunksize" in params:
                kw["chunksize"] = max(UPLOAD_PART, -(-n // UPLOAD_CONCURRENCY))
            return kw

        async def put_all() -> None:
            await asyncio.gather(*[fs._pipe_file(url, b, **kwargs(len(b)))
                                   for url, b in bodies.items()])

        fsspec.asyn.sync(fs.loop, put_all)
        return
    if len(bodies) == 1:
        _put(fs, *next(iter(bodies.items())))
        return
    with ThreadPoolExecutor(min(UPLOAD_THREADS, len(bodies)), "shardstate-upload") as pool:
        for fut in [pool.submit(_put, fs, url, b) for url, b in bodies.items()]:
            fut.result()


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

    def _size(self, rel: str) -> int:
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
            size = self._size(rel)
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
                os.pwrite(self._fds[rel], data, s)
            del got, batch
            i = j

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
