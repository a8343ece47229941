"""The fsspec side of ``_fsspec_filesystem``: in-memory files the local
engine writes and reads, and the transfers between them and the store.

* ``write_objects``: a save's data objects in bounded memory: the engine
  (``write_records``) frames each file window by window (a byte range of
  ``UPLOAD_PART`` bytes; a record crossing a window's end is cut there, its
  data CRC combined across the pieces and its trailer written in the
  window that holds it) into an in-memory file, which is uploaded while the
  next is framed: one part of an S3 multipart upload (several in flight),
  else one write to the object's ``fs.open(url, "wb")`` file, in order. At
  most ``UPLOAD_CONCURRENCY`` windows are in flight; a failure aborts
  every object's upload.
* ``MemFiles``: (stream transforms only) a save's data files as anonymous in-memory files
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
import concurrent.futures
import errno
import inspect
import io
import mmap
import os
import posixpath
import tempfile
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec.asyn
import numpy as np

from .. import io as ssio
from .._core import MemSink, crc32_combine
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
# A save frames a data file into windows of UPLOAD_PART bytes (the last
# one shorter), each uploaded as it is filled: one part of a multipart
# upload on S3, else one write to the object's open file; at most
# UPLOAD_CONCURRENCY windows are in flight, so a save holds at most
# (UPLOAD_CONCURRENCY + 1) x UPLOAD_PART bytes of framed data, whatever the
# size of its files (write_objects).
# Tuned on moto (benchmarks/bench_fsspec.py --ceiling, docs/notes/fsspec.md):
# 16 MiB parts were fastest for its ingest and for our saves (64 MiB x 8:
# 1.4x slower); 4 and 8 in flight were within noise there, and 8 serves a
# real store's per-connection limits better. Bound: 8 x 16 MiB = 128 MiB.
UPLOAD_CONCURRENCY = 8
UPLOAD_PART = 16 << 20
# S3's smallest part (all but the last) and most parts of one upload: an
# object of more than S3_MAX_PARTS x UPLOAD_PART bytes gets bigger parts.
S3_MIN_PART = 5 << 20
S3_MAX_PARTS = 10_000
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


# --------------------------------------------------------------------------
# A save in windows: bounded memory
# --------------------------------------------------------------------------


class _Held:
    """Bytes of framed windows alive at once, and the most seen (for tests
    and the benchmark: the bound a save keeps)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.now += n
            self.peak = max(self.peak, self.now)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.now


held = _Held()


class _Window:
    """Bytes [start, start + size) of a data file, framed by the engine
    into a buffer of the save's pool (``_Pool``), then handed to the store
    as a ``Body``."""

    def __init__(self, pool: _Pool, start: int, size: int) -> None:
        self.pool, self.start, self.size = pool, start, size
        self.buf = pool.get()
        self.view = memoryview(self.buf)[:size]

    def body(self) -> Body:
        return Body(self.view)

    def close(self) -> None:
        if self.buf is not None:
            self.view.release()
            self.pool.put(self.buf)
            self.buf = None


class _Pool:
    """A save's window buffers, reused from window to window (a fresh
    buffer costs its pages' faults: about as much as framing into it);
    at most as many as windows in flight."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[bytearray] = []
        self._lock = threading.Lock()
        self._made = 0

    def get(self) -> bytearray:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._made += 1
        held.add(self.size)
        return bytearray(self.size)

    def put(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)

    def close(self) -> None:
        with self._lock:
            held.add(-self.size * self._made)
            self._made = 0
            self._free.clear()


def _nbytes(buf: Any) -> int:
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else memoryview(buf).nbytes


class _Layout:
    """One data file's rows (``write_files``' table), by offset."""

    def __init__(self, rows: np.ndarray, lengths: np.ndarray) -> None:
        order = np.argsort(rows[:, 1], kind="stable")
        self.rows = rows[order]
        self.index = order  # into the file's rows
        self.starts = self.rows[:, 1]
        self.ends = self.starts + lengths[order]
        self.size = int(self.ends.max()) if len(self.ends) else 0


def _fill(win: _Window, lay: _Layout, buffers: list[Any], plans: list[Any],
          acc: dict[int, tuple[int, int]], stage: Any, stream: Any) -> dict[int, int]:
    """Frames bytes [a, b) of the file into ``win``: the records wholly
    inside through one ``write_records`` call (CRCs of their data), the
    pieces of records crossing its ends as plain rows: header and data
    bytes (the data's piece CRCs combined, in order, into ``acc``: row ->
    (crc so far, bytes so far)), trailer bytes written after the call, for
    the finished CRC. Returns the CRCs of rows finished here (file row
    index -> CRC)."""
    a, b = win.start, win.start + win.size
    i0 = int(np.searchsorted(lay.starts, a, "left"))
    i1 = int(np.searchsorted(lay.ends, b, "right"))
    inside = range(i0, max(i0, i1))
    cross = []
    if i0 > 0 and lay.ends[i0 - 1] > a:
        cross.append(i0 - 1)
    if i1 < len(lay.starts) and lay.starts[i1] < b and i1 not in cross:
        cross.append(i1)
    table = []
    bufs = []
    for i in inside:
        f, off, bi, p, dev = (int(x) for x in lay.rows[i])
        table.append((0, off - a, len(bufs), p, dev))
        bufs.append(buffers[bi])
    pieces = []  # (layout index, data piece row in table, its length)
    trailers = []  # (layout index, plan, trailer start in the file)
    for i in cross:
        _f, off, bi, p, dev = (int(x) for x in lay.rows[i])
        buf = buffers[bi]
        if p >= 0:
            plan = plans[p]
            hl = plan.data_offset
            ds, de = off + hl, off + hl + plan.data_length
            s, e = max(off, a), min(ds, b)
            if s < e:
                table.append((0, s - a, len(bufs), -1, 0))
                bufs.append(plan.header[s - off:e - off])
            trailers.append((i, plan, de))
        else:
            ds, de = off, off + _nbytes(buf)
        s, e = max(ds, a), min(de, b)
        if s < e:
            pieces.append((i, len(table), e - s))
            table.append((0, s - a, len(bufs), -1, dev))
            bufs.append(buf[s - ds:e - ds])
    sink = MemSink([win.view])
    try:
        crcs = ssio.write_records(["mem:0"], np.array(table, np.int64).reshape(-1, 5), bufs,
                                  plans, checksum=True, stage=stage, stream=stream,
                                  _faults=sink)
    finally:
        sink.close()
    done = {int(lay.index[i]): crcs[k] for k, i in enumerate(inside)}
    for i, k, n in pieces:
        crc, got = acc.get(i, (0, 0))
        acc[i] = (crc32_combine(crc, crcs[k], n), got + n)
    for i, plan, ts in trailers:
        s, e = max(ts, a), min(ts + len(plan.template), b)
        if s >= e:
            continue
        crc, got = acc.get(i, (0, 0))
        if got != plan.data_length:
            raise AssertionError(f"window [{a}, {b}): record at {ts} has {got} data bytes "
                                 f"of {plan.data_length} framed")
        win.view[s - a:e - a] = plan.trailer(crc)[s - ts:e - ts]
        done[int(lay.index[i])] = crc
    return done


def _stream_write(f: Any, body: Body) -> None:
    f.write(body.view())


class _Stream:
    """An object written through ``fs.open(url, "wb")``, window after
    window, in order, by one thread (the file object buffers or uploads in
    parts itself)."""

    def __init__(self, fs: Any, url: str, size: int) -> None:
        self.fs, self.url = fs, url
        self.pool = ThreadPoolExecutor(1, "shardstate-upload")
        self.file: Any = None
        self.futures: list[concurrent.futures.Future] = []

    def _put(self, body: Body) -> None:
        if self.file is None:
            self.file = self.fs.open(self.url, "wb")
        _stream_write(self.file, body)

    def put(self, k: int, body: Body) -> concurrent.futures.Future:
        fut = self.pool.submit(self._put, body)
        self.futures.append(fut)
        return fut

    def finish(self) -> None:
        for fut in self.futures:
            fut.result()
        if self.file is None:
            self.fs.pipe_file(self.url, b"")
        else:
            self.file.close()
        self.pool.shutdown()

    def abort(self) -> None:
        concurrent.futures.wait(self.futures)
        self.pool.shutdown()
        if self.file is not None:
            try:
                self.file.discard()  # an S3File's multipart upload aborted
            except Exception:  # noqa: BLE001 - best effort; the first error is raised
                pass
            try:
                self.fs.rm_file(self.url)  # no half object
            except Exception:  # noqa: BLE001
                pass


class _S3:
    """An object written to S3 (s3fs) in windows: one put when it is one
    window, else a multipart upload of one part per window, any number in
    flight (the caller bounds them), completed by ``finish`` and aborted by
    ``abort``."""

    def __init__(self, fs: Any, url: str, size: int, window: int) -> None:
        self.fs, self.url = fs, url
        self.bucket, self.key, _ = fs.split_path(url)
        self.single = size <= window
        self.futures: list[concurrent.futures.Future] = []
        self.parts: dict[int, str] = {}
        self.upload_id: str | None = None

    def _sync(self, method: str, **kw: Any) -> Any:
        return fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, method, Bucket=self.bucket,
                                Key=self.key, **kw)

    async def _part(self, k: int, body: Body) -> None:
        if self.single:
            await self.fs._call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=body)
            return
        out = await self.fs._call_s3("upload_part", Bucket=self.bucket, Key=self.key,
                                     UploadId=self.upload_id, PartNumber=k + 1, Body=body)
        self.parts[k + 1] = out["ETag"]

    def put(self, k: int, body: Body) -> concurrent.futures.Future:
        if not self.single and self.upload_id is None:
            self.upload_id = self._sync("create_multipart_upload")["UploadId"]
        fut = asyncio.run_coroutine_threadsafe(self._part(k, body), self.fs.loop)
        self.futures.append(fut)
        return fut

    def finish(self) -> None:
        for fut in self.futures:
            fut.result()
        if self.single and not self.futures:
            self._sync("put_object", Body=b"")
        elif not self.single:
            parts = [{"PartNumber": n, "ETag": self.parts[n]} for n in sorted(self.parts)]
            self._sync("complete_multipart_upload", UploadId=self.upload_id,
                       MultipartUpload={"Parts": parts})
        self.fs.invalidate_cache(self.url)

    def abort(self) -> None:
        # the parts in flight end first (done or failed: not cancelled, so
        # no part lands after the abort and no window is reused under one)
        concurrent.futures.wait(self.futures)
        if self.upload_id is not None:
            try:
                self._sync("abort_multipart_upload", UploadId=self.upload_id)
            except Exception:  # noqa: BLE001 - best effort; the first error is raised
                pass


def _is_s3(fs: Any) -> bool:
    return (getattr(fs, "async_impl", False) and hasattr(fs, "_call_s3")
            and any(p in ("s3", "s3a") for p in _protocols(fs)))


def write_objects(fs: Any, urls: list[str], table: np.ndarray, buffers: list[Any],
                  plans: list[Any], stage: Any = None, stream: Any = None, *,
                  window: int | None = None, concurrency: int | None = None) -> list[int]:
    """Writes a rank's data objects (``urls[f]``: the rows of ``table``
    whose file is f, ``write_files``' table) window by window: each window
    of ``window`` bytes (``UPLOAD_PART``) framed by the engine into memory
    and uploaded while the next is framed, at most ``concurrency``
    (``UPLOAD_CONCURRENCY``) in flight. Returns each row's data CRC. On any
    failure the objects' uploads are aborted (S3: multipart uploads; other
    filesystems: the object removed) and the error raised."""
    window = window or UPLOAD_PART
    concurrency = concurrency or UPLOAD_CONCURRENCY
    lengths = np.array([plans[p].total_length if p >= 0 else _nbytes(buffers[b])
                        for b, p in zip(table[:, 2].tolist(), table[:, 3].tolist())], np.int64)
    if _is_memory(fs):
        return _write_memory(fs, urls, table, lengths, buffers, plans, stage, stream)
    crcs = [0] * len(table)
    s3 = _is_s3(fs)
    if s3:
        biggest = int((table[:, 1] + lengths).max()) if len(table) else 0
        window = max(window, S3_MIN_PART, -(-biggest // S3_MAX_PARTS))
    slots = threading.BoundedSemaphore(concurrency)
    pool = _Pool(window)
    sinks: list[Any] = []
    failed: list[BaseException] = []

    def done(win: _Window, fut: concurrent.futures.Future) -> None:
        win.close()
        if not fut.cancelled() and fut.exception() is not None:
            failed.append(fut.exception())
        slots.release()

    try:
        for f, url in enumerate(urls):
            mine = np.flatnonzero(table[:, 0] == f)
            lay = _Layout(table[mine], lengths[mine])
            sink = _S3(fs, url, lay.size, window) if s3 else _Stream(fs, url, lay.size)
            sinks.append(sink)
            acc: dict[int, tuple[int, int]] = {}
            for a in range(0, lay.size, window):
                slots.acquire()
                if failed:
                    slots.release()
                    raise failed[0]
                win = _Window(pool, a, min(window, lay.size - a))
                try:
                    for i, crc in _fill(win, lay, buffers, plans, acc, stage, stream).items():
                        crcs[int(mine[i])] = crc
                    fut = sink.put(a // window, win.body())
                except BaseException:
                    win.close()
                    slots.release()
                    raise
                fut.add_done_callback(lambda fut, win=win: done(win, fut))
        for sink in sinks:
            sink.finish()
    except BaseException:
        for sink in sinks:
            sink.abort()
        raise
    finally:
        pool.close()
    return crcs


def _is_memory(fs: Any) -> bool:
    from fsspec.implementations.memory import MemoryFileSystem

    return isinstance(fs, MemoryFileSystem)


def _write_memory(fs: Any, urls: list[str], table: np.ndarray, lengths: np.ndarray,
                  buffers: list[Any], plans: list[Any], stage: Any,
                  stream: Any) -> list[int]:
    """memory://: each object's ``MemoryFile`` sized first, the engine
    framing every record straight into the objects' buffers (one call, no
    window, no second copy), the objects put in the store once complete."""
    from fsspec.implementations.memory import MemoryFile

    files = []
    for f, url in enumerate(urls):
        mine = table[:, 0] == f
        size = int((table[mine, 1] + lengths[mine]).max()) if mine.any() else 0
        mf = MemoryFile(fs, fs._strip_protocol(url))
        if size:
            mf.seek(size - 1)
            mf.write(b"\0")
            mf.seek(0)
        files.append(mf)
    views = [mf.getbuffer() for mf in files]
    sink = MemSink(views)
    try:
        crcs = ssio.write_records([f"mem:{k}" for k in range(len(urls))], table, buffers,
                                  plans, checksum=True, stage=stage, stream=stream,
                                  _faults=sink)
    finally:
        sink.close()
        for v in views:
            v.release()
    for mf in files:
        mf.commit()
    return crcs


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
                os.pwrite(self._fds[rel], data, s)
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
                at = s
                while at < e:
                    at += os.pwrite(self._fds[rel], buf[at:min(e, at + (1 << 30))], at)

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
