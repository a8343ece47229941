"""Parallel file I/O: batches of writes and reads with per-job CRC-32.

A thin layer over ``shardstate._core``: it groups the jobs' paths into a
file table, picks a thread pool, and calls one C entry point that runs the
whole batch with the GIL released. Buffers are used in place (no copies):
``write`` reads each ``WriteJob.data``, ``read`` fills each ``ReadJob.out``.

Each job's CRC-32 equals ``zlib.crc32`` of its bytes. Big jobs are split
into pieces so several threads share them.

Every other file operation of a save and a load (the ``.metadata`` read,
record headers mapped for parsing, trailers patched, files created,
removed and fsynced, directories made) is here too, on the core's OS
table, so one :class:`FaultInjector` reaches all of them: pass it as
``_faults=`` to one call, or install it for every call of this process
with :func:`inject_faults` (tests of whole saves and loads).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from . import _core
from ._core import FaultInjector, MappedFile, Stage, ThreadPool

if TYPE_CHECKING:
    from collections.abc import Buffer  # Python 3.12+
else:
    Buffer = Any

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

__all__ = [
    "FaultInjector", "MappedFile", "ReadJob", "Stage", "WriteJob", "atomic_publish", "file_size",
    "fsync_dir", "inject_faults", "makedirs", "map_file", "read", "read_file", "read_records",
    "unlink", "write", "write_records",
]


@dataclass(frozen=True)
class WriteJob:
    """Write ``data`` (any C-contiguous buffer) at ``offset`` of ``path``.
    With ``device``, ``data`` is device memory of the batch's ``stage``
    backend and is staged through its buffers."""

    path: PathLike
    offset: int
    data: Buffer
    device: bool = False


@dataclass(frozen=True)
class ReadJob:
    """Read ``len(memoryview(out).cast('B'))`` bytes at ``offset`` of ``path``
    into ``out`` (a writable C-contiguous buffer); check them against ``crc``
    when it is given."""

    path: PathLike
    offset: int
    out: Buffer
    crc: int | None = None
    device: bool = False


# The injector every call of this process uses when it is given none
# (inject_faults); None: plain system calls.
_injected: FaultInjector | None = None


@contextlib.contextmanager
def inject_faults(faults: FaultInjector) -> Iterator[FaultInjector]:
    """Route every file operation of this process that is not given its own
    ``_faults`` through ``faults`` while the block runs (every thread: a
    save's or a load's helper threads too). For tests; not reentrant."""
    global _injected
    if not isinstance(faults, FaultInjector):
        raise TypeError(f"faults must be a FaultInjector, got {type(faults).__name__}")
    if _injected is not None:
        raise RuntimeError("a FaultInjector is already installed")
    _injected = faults
    try:
        yield faults
    finally:
        _injected = None


def _faults_of(faults: FaultInjector | None) -> FaultInjector | None:
    return faults if faults is not None else _injected


_pools: dict[int, ThreadPool] = {}
_pools_lock = threading.Lock()


def _default_threads() -> int:
    """The CPUs this process may use, shared with the other ranks on this
    node (torchrun's LOCAL_WORLD_SIZE), at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(8, cpus // local))


def _pool_for(pool: ThreadPool | None, threads: int | None) -> ThreadPool | None:
    """The pool a batch runs on. ``threads`` counts every thread doing I/O,
    the calling one included, so threads=1 runs serially."""
    if pool is not None:
        if threads is not None:
            raise ValueError("pass either pool= or threads=, not both")
        if not isinstance(pool, ThreadPool):
            raise TypeError(f"pool must be a shardstate.ThreadPool, got {type(pool).__name__}")
        return pool
    n = _default_threads() if threads is None else threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    if n == 1:
        return None
    with _pools_lock:
        p = _pools.get(n)
        if p is None:
            p = _pools[n] = ThreadPool(n - 1)
        return p


def _file_table(paths: Iterable[PathLike], files: Iterable[PathLike] = ()
                ) -> tuple[list[str | bytes], list[int]]:
    """Distinct paths in first-seen order (``files`` first), and each job's
    index into them."""
    table: list[str | bytes] = []
    index: dict[str | bytes, int] = {}
    idx: list[int] = []
    for p in files:
        key = os.fspath(p)
        if key not in index:
            index[key] = len(table)
            table.append(key)
    for p in paths:
        key = os.fspath(p)
        i = index.get(key)
        if i is None:
            i = index[key] = len(table)
            table.append(key)
        idx.append(i)
    return table, idx


def _offsets(jobs: Sequence[WriteJob] | Sequence[ReadJob]) -> list[int]:
    out = []
    for j, job in enumerate(jobs):
        off = job.offset
        if isinstance(off, bool) or not hasattr(off, "__index__") or off < 0:
            raise ValueError(f"jobs[{j}].offset must be an int >= 0, got {off!r}")
        out.append(off)
    return out


def write(
    jobs: Sequence[WriteJob],
    *,
    pool: ThreadPool | None = None,
    threads: int | None = None,
    fsync: bool = False,
    checksum: bool = True,
    writeback: bool = False,
    stage: Stage | None = None,
    stream: int | None = None,
    files: Iterable[PathLike] = (),
    patch: bool = False,
    _piece: int = 0,
    _faults: FaultInjector | None = None,
) -> list[int]:
    """Write every job; return each job's CRC-32 (0s when ``checksum`` is
    false). Every file named by the jobs or in ``files`` is created or
    truncated first (O_CREAT|O_TRUNC), then sized to its last job's end
    (a file in ``files`` with no job is left empty); gaps read as zeros.
    With ``patch`` the files must exist: they are written in place and keep
    their size (with no job, a file is only fsynced, with ``fsync``).
    With ``fsync`` every file is fsynced before the call returns. With
    ``writeback`` each piece's writeback to disk starts as soon as it is
    written (Linux sync_file_range), overlapping the disk with the rest of
    the batch so a later fsync has little left to wait for. Jobs in one
    file must not overlap. Jobs marked ``device`` go through ``stage``: their
    pieces are copied into its buffers (copies running ahead of the writes)
    and written from there; on a CUDA stage the copies start after the work
    queued so far on ``stream`` (an int handle such as
    ``torch.cuda.current_stream().cuda_stream``; None: the default stream),
    and a device job's ``data`` is any object with
    ``__cuda_array_interface__`` (a CUDA tensor). Raises ShardstateIOError (an OSError with errno
    and filename) on a system failure; the files are then left in an
    unspecified state."""
    jobs = list(jobs)
    paths, idx = _file_table((job.path for job in jobs), files)
    return _core.write_batch(
        paths,
        idx,
        _offsets(jobs),
        [job.data for job in jobs],
        _pool_for(pool, threads),
        bool(fsync),
        bool(checksum),
        _piece,
        _faults_of(_faults),
        bool(writeback),
        stage,
        _device_flags(jobs),
        stream,
        bool(patch),
    )


def write_records(
    paths: Sequence[PathLike],
    table: Any,
    buffers: Sequence[Buffer],
    plans: Sequence[_core.RecordPlan],
    *,
    pool: ThreadPool | None = None,
    threads: int | None = None,
    fsync: bool = False,
    checksum: bool = True,
    writeback: bool = False,
    stage: Stage | None = None,
    stream: int | None = None,
    _piece: int = 0,
    _pack_run: int = 0,
    _faults: FaultInjector | None = None,
) -> list[int]:
    """Write a rank's torch.save records in one engine call
    (csrc/core/ss_recwrite.h). ``table`` is an int64 array of shape (n, 5),
    one row per item: index into ``paths``, offset in that file, index into
    ``buffers``, index into ``plans`` (a ``RecordPlan``: the row is a tensor
    record, header + the buffer's bytes + the trailer holding their CRC-32)
    or -1 (a plain job: the buffer's bytes as they are), and 1 for a device
    buffer (staged through ``stage``, as in :func:`write`) else 0. Every
    path is created or truncated first (one with no row stays empty) and,
    with ``fsync``, fsynced before the call returns. Returns each row's data
    CRC-32 (a plain row's only with ``checksum``). A bad row raises
    ValueError before anything is written; a system failure
    ShardstateIOError, leaving the files in an unspecified state."""
    return _core.write_records(
        [os.fspath(p) for p in paths], table, buffers, plans, _pool_for(pool, threads),
        bool(fsync), bool(checksum), bool(writeback), stage, stream, _faults_of(_faults),
        _piece, _pack_run)


def read(
    jobs: Sequence[ReadJob],
    *,
    pool: ThreadPool | None = None,
    threads: int | None = None,
    verify: bool = True,
    checksum: bool = True,
    stage: Stage | None = None,
    _piece: int = 0,
    _faults: FaultInjector | None = None,
) -> list[int]:
    """Read every job straight into its ``out`` buffer; return each job's
    CRC-32. With ``verify``, a job whose ``crc`` is set and differs raises
    ChecksumError (with ``path``, ``offset`` and ``job`` attributes). With
    ``checksum=False`` only verified jobs are checksummed; the others report
    0. A job reaching past the end of its file, or reading anything but a
    regular file (a FIFO, a device, a directory: opened without blocking,
    then refused), raises ShardstateError before anything is read. Jobs
    marked ``device`` are read into ``stage``'s buffers, checked there, and
    copied to their ``out``; the call returns once every copy is done."""
    jobs = list(jobs)
    paths, idx = _file_table(job.path for job in jobs)
    crcs = [job.crc for job in jobs]
    return _core.read_batch(
        paths,
        idx,
        _offsets(jobs),
        [job.out for job in jobs],
        None if all(c is None for c in crcs) else crcs,
        _pool_for(pool, threads),
        bool(verify),
        bool(checksum),
        _piece,
        _faults_of(_faults),
        stage,
        _device_flags(jobs),
    )


# read_records' table: one row per item, these columns (int64).
REC_COLUMNS = ("file", "kind", "offset", "len", "crc", "whole", "addr", "dst_len", "start",
               "count", "ndim", "elsize", "src_off", "geom")
REC_RANGE, REC_SCATTER = 0, 1


def read_records(
    paths: Sequence[PathLike],
    table: Any,
    geom: Any,
    *,
    pool: ThreadPool | None = None,
    threads: int | None = None,
    verify: bool = True,
    checksum: bool = True,
    scratch: int = 256 << 20,
    _faults: FaultInjector | None = None,
) -> Any:
    """A load's record reads as one engine call (GIL released): ``table``
    is an int64 array with one row of ``REC_COLUMNS`` per item: the
    record's data (``file`` index into ``paths``, ``offset``, ``len``, its
    ``crc``) and, by ``kind``, either REC_RANGE (read bytes [start, start +
    count) of the data to ``addr``; with ``whole`` and ``verify`` the rest
    is read into engine scratch and the whole data's CRC checked) or
    REC_SCATTER (read the data into scratch, checked, then copy the region
    of ``ndim`` dims from byte ``src_off`` of it to ``addr``: sizes, source
    and destination byte strides at ``geom[g : g + 3 * ndim]``, ``g`` the
    row's ``geom``; ``elsize`` bytes an element). ``addr`` is a host
    address the caller keeps valid for the call, with ``dst_len`` bytes
    there; every region is checked against it and against the record
    before anything is read. Returns each row's CRC-32 (uint32 array) of
    the bytes it read into its destination (0s unless ``verify`` or
    ``checksum``). A mismatch raises ChecksumError with ``job`` = the row."""
    import numpy as np

    table = np.ascontiguousarray(table, dtype=np.int64)
    geom = np.ascontiguousarray(geom, dtype=np.int64)
    crcs = np.zeros(len(table), np.uint32)
    _core.read_records([os.fspath(p) for p in paths], table, geom, crcs,
                       _pool_for(pool, threads), bool(verify), bool(checksum),
                       _faults_of(_faults), int(scratch))
    return crcs


def _device_flags(jobs: Sequence[WriteJob] | Sequence[ReadJob]) -> list[bool] | None:
    flags = [bool(job.device) for job in jobs]
    return flags if any(flags) else None


def atomic_publish(
    path: PathLike,
    data: Buffer,
    *,
    fsync: bool = True,
    _faults: FaultInjector | None = None,
) -> None:
    """Replace ``path`` with ``data`` atomically: readers see the old file or
    the new one, never a mix. Writes a temp file in the same directory,
    fsyncs it, renames it over ``path`` and fsyncs the directory (the
    fsyncs are skipped with ``fsync=False``). On failure the temp file is
    removed and the old file is left as it was (unless only the final
    directory fsync failed: then the new file is in place, not yet durable)."""
    _core.publish(path, data, bool(fsync), _faults_of(_faults))


def read_file(path: PathLike, max_bytes: int, *,
              _faults: FaultInjector | None = None) -> bytes:
    """The whole regular file at ``path`` (1..``max_bytes`` bytes). Opened
    without blocking and refused unless a regular file (a FIFO, a device or
    a directory raises ShardstateError); one that is empty or larger, or
    that changes size while read, raises ShardstateError; a system failure
    ShardstateIOError (errno ENOENT when missing)."""
    return _core.read_file(path, max_bytes, _faults_of(_faults))


def file_size(path: PathLike, *, _faults: FaultInjector | None = None) -> int:
    """The size of the regular file at ``path`` (refused as read_file)."""
    return _core.file_size(path, _faults_of(_faults))


def map_file(path: PathLike, *, _faults: FaultInjector | None = None) -> MappedFile:
    """The regular file at ``path`` mapped read-only: a buffer (use
    ``memoryview``), to ``close()`` when done (or use ``with``)."""
    return _core.map_file(path, _faults_of(_faults))


def unlink(path: PathLike, *, missing_ok: bool = True,
           _faults: FaultInjector | None = None) -> bool:
    """Remove ``path``; True if it was removed, False if it was missing."""
    return _core.unlink(path, bool(missing_ok), _faults_of(_faults))


def fsync_dir(path: PathLike, *, _faults: FaultInjector | None = None) -> None:
    """fsync the directory ``path`` (its renames and removals are durable)."""
    _core.fsync_dir(path, _faults_of(_faults))


def makedirs(path: PathLike, *, _faults: FaultInjector | None = None) -> None:
    """Create directory ``path`` and its missing parents; an existing
    directory is fine, anything else in the way raises ShardstateIOError."""
    _core.mkdirs(path, _faults_of(_faults))
