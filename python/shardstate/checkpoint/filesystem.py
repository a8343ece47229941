"""``FileSystemWriter`` / ``FileSystemReader``: DCP checkpoints in a directory,
with the bulk work done by the C I/O engine.

The files are exactly those torch 2.13's ``FileSystemWriter`` writes for the
same plan (docs/FORMAT.md): ``__{rank}_{n}.distcp`` data files split the same
way (``thread_count`` buckets per rank with ``single_file_per_rank``, one file
per item otherwise, empty files included), items in the same order, each a
``torch.save`` zip record, and ``.metadata`` a pickle of torch's metadata
classes, published last.

Writing: every record of a rank is laid out up front (a record's header
depends only on dtype and shape; plans are cached per shape), then one
``shardstate.io.write`` batch writes all headers, tensor bytes (straight from
the tensors' memory) and bytes items while computing each tensor's CRC-32;
the small trailers, which hold the CRC, are then patched from a template and
written with ``pwrite`` before each file is fsynced. ``finish`` publishes
``.metadata`` atomically, last; with ``overwrite`` the old one is removed in
``prepare_local_plan``, before any data file is touched.

Reading: records are located through ``storage_data`` (paths confined to the
checkpoint directory, every offset and length checked against the file). A
dense record is recognised by comparing its header and trailer with the ones
we would write for the chunk the metadata describes; any other record is
parsed strictly (``_zipfmt.parse_record``), through a read-only mapping of the
file that touches only the header and trailer pages. Tensor bytes are read by
one ``shardstate.io.read`` batch straight into the destination whenever the
requested region is one contiguous range of a dense record and the
destination is a contiguous CPU tensor of the same dtype; otherwise the
record's storage is read into bounded scratch batches and copied. CRC-32s
are checked by the engine as it reads; for a region that is only part of a
record, the rest is read in bounded pieces for its CRC only and the CRCs are
combined, so every record read is checked whole (``verify_checksums=False``
skips all of it).

Shared chunks (``broadcast_shared_reads=True``): the coordinator plans in
``prepare_global_plan`` which rank reads each chunk several ranks need,
balancing read bytes, and in which rounds of bounded size the sources
broadcast them; every rank runs the same rounds (``_exchange``), and a
failure on any rank stops all of them at the next round's check.

Known limits: a data file truncated by someone else while it is mapped can
raise SIGBUS; adjacent small reads are not coalesced (the engine runs them
in parallel); CUDA tensors are copied to the CPU, all of a rank's at once,
before the write batch.

``.metadata`` is written by ``_pickle.dumps_metadata`` (torch's bytes, no
torch needed) and read by ``_pickle.loads_metadata`` (restricted); bytes
items are checked with ``_pickle.loads_object`` before a planner sees them.

Thread safety: one reader or writer instance serves one save or load at a
time, as in torch.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import mmap
import os
import stat
import struct
import sys
import uuid
import warnings
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from .. import io as ssio
from .._core import ChecksumError, ShardstateError, crc32_combine
from .._util import contiguous_strides, import_torch, is_contiguous
from ._pickle import (
    PickleFormatError,
    UnsafePickleError,
    dumps_metadata,
    gc_paused,
    loads_metadata,
    loads_object,
)
from ._tensors import numpy_dtype, numpy_dtype_name
from ._zipfmt import (
    RecordFormatError,
    TensorRecordPlan,
    _hash_combine,
    parse_record,
    plan_tensor_record,
)
from .metadata import StorageMeta, _StorageInfo, to_torch_metadata
from .planner import element_size
from .staging import _FileSystemWriterStager
from .storage import StorageReader, StorageWriter, WriteResult, completed_future

__all__ = [
    "FileSystemReader",
    "FileSystemWriter",
    "SerializationFormat",
    "StorageFormatError",
]

_METADATA_FN = ".metadata"
DEFAULT_SUFFIX = ".distcp"
CURRENT_DCP_VERSION = "1.0.0"

# A .metadata larger than this is refused before it is read.
_MAX_METADATA_BYTES = 4 << 30
# Scratch memory a load may hold at once for items that cannot be read in place.
_SCRATCH_BUDGET = 256 << 20
# Pieces in which the unread rest of a partly read record is checksummed.
_PIECE = 16 << 20
# Bytes broadcast per round when shared reads are broadcast (all sources).
_BCAST_ROUND = 256 << 20
# A chunk at least this big is broadcast on its own (see _plan_broadcast).
_BCAST_ALONE = 8 << 20


class StorageFormatError(ShardstateError, ValueError):
    """A checkpoint's files or storage data are malformed or unsafe (a path
    outside the directory, an item past the end of its file, a bad record)."""


class SerializationFormat(Enum):
    TORCH_SAVE = "torch_save"
    SAFETENSORS = "safetensors"


@dataclass
class _StoragePrefix:
    prefix: str


# --------------------------------------------------------------------------
# .metadata and bytes items: torch-free writer, restricted reader (_pickle)
# --------------------------------------------------------------------------


def _dump_metadata(md: Any) -> bytes:
    """The ``.metadata`` bytes for ``md`` (ours or torch's Metadata), exactly
    as torch's pickle would write them, without needing torch."""
    return dumps_metadata(md)


def _load_metadata(data: bytes, path: str = _METADATA_FN, allow_unsafe: bool = False) -> Any:
    """``.metadata`` through the restricted unpickler: only the metadata
    classes, sizes, dtypes and plain containers are admitted."""
    try:
        return loads_metadata(data, allow_unsafe=allow_unsafe)
    except (UnsafePickleError, PickleFormatError) as e:
        raise StorageFormatError(f"{path}: refused or malformed checkpoint metadata: {e}") from e


def _check_bytes_record(record: bytes, where: str) -> None:
    """Checks a bytes item (a torch.save zip) before any planner sees it:
    every entry's CRC-32, then a restricted load of its pickle (the same
    allowlist our planner's load_bytes uses). Raises ChecksumError or
    StorageFormatError; nothing from a refused item is imported or called."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(record))
        for n in zf.namelist():
            zf.read(n)  # zipfile checks each entry's CRC-32
    except zipfile.BadZipFile as e:
        if "CRC" in str(e):
            raise ChecksumError(f"{where}: CRC-32 mismatch in bytes item ({e})") from None
        raise StorageFormatError(f"{where}: bytes item is not a torch.save record: {e}") from e
    try:
        loads_object(record)
    except (UnsafePickleError, PickleFormatError) as e:
        raise StorageFormatError(
            f"{where}: bytes item refused: {e} (pass unsafe_unpickle=True to "
            "FileSystemReader to load it anyway)") from e


# --------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------


def _item_size(item: Any) -> int:
    td = item.tensor_data
    n = 1
    for s in td.size:
        n *= int(s)
    return n * element_size(td.properties.dtype)


def _is_bytes_item(item: Any) -> bool:
    return item.type.name == "BYTE_IO"


def _split_by_size_and_type(bins: int, items: list[Any]) -> list[list[Any]]:
    """torch's bucketing of a rank's items into ``bins`` files: bytes items
    round-robin, tensors largest first into the lightest bucket."""
    if bins == 1:
        return [items]
    buckets: list[list[Any]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    for i, wi in enumerate(w for w in items if _is_bytes_item(w)):
        buckets[i % bins].append(wi)
    for wi in sorted((w for w in items if not _is_bytes_item(w)), key=_item_size, reverse=True):
        idx = min(range(bins), key=sizes.__getitem__)
        buckets[idx].append(wi)
        sizes[idx] += _item_size(wi)
    return buckets


def _storage_bytes(t: Any) -> np.ndarray:
    """A zero-copy uint8 view of a CPU tensor's whole storage."""
    torch = import_torch()
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)).numpy()


def _region_bytes(t: Any) -> np.ndarray:
    """A writable zero-copy uint8 view of a contiguous CPU tensor's (or
    ndarray's) elements."""
    if isinstance(t, np.ndarray):
        return t.reshape(-1).view(np.uint8)
    return t.reshape(-1).view(import_torch().uint8).numpy()


def _numpy_region(rec: Any, data: np.ndarray, offsets: Any, lengths: Any) -> np.ndarray:
    """The box offsets/lengths of a record's data, as a NumPy view of the
    scratch bytes (for NumPy destinations, without torch)."""
    dt = numpy_dtype(f"torch.{rec.dtype}")
    if dt is None:
        raise StorageFormatError(
            f"a {rec.dtype} tensor cannot be loaded into a NumPy array (NumPy has no such "
            "dtype); load it into a torch tensor")
    if not data.nbytes:
        src = np.empty(rec.shape, dt)
    else:
        src = np.ndarray(rec.shape, dt, buffer=data, offset=rec.storage_offset * dt.itemsize,
                         strides=[st * dt.itemsize for st in rec.stride])
    return src[tuple(slice(int(o), int(o) + int(n)) for o, n in zip(offsets, lengths))]


def _prepare_tensor(t: Any, keep_device: bool = False) -> Any:
    """The tensor torch's DCP writer would torch.save for ``t``: detached, on
    the CPU (or, with keep_device, where it is), cloned when its storage
    holds more than its own bytes (the caller writes a contiguous one's
    elements itself, without the clone)."""
    torch = import_torch()
    t = t.detach()
    if t.layout != torch.strided:
        raise NotImplementedError(f"saving a {t.layout} tensor is not supported")
    if not keep_device:
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        # torch.save would record the bit; we store the resolved values.
        t = t.resolve_conj().resolve_neg()
    if t.untyped_storage().nbytes() != t.nbytes and _dense_as_clone(t):
        return t
    if t.untyped_storage().nbytes() != t.nbytes:
        t = t.clone()
    if t.storage_offset() != 0:  # overlapping strides over an exact storage
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _dense_as_clone(t: Any) -> bool:
    """Whether t's elements fill one range of its storage in the order
    ``t.clone()`` would lay them out (same strides as the clone's, found
    without allocating)."""
    return tuple(t.stride()) == tuple(import_torch().empty_like(t, device="meta").stride())


# CUDA tensors are saved through a pipeline of pinned buffers (one Stage per
# device and process, made on first use): the d2h copy of piece k+1 runs
# while piece k is written, with no host copy of the tensor made in Python.
_CUDA_STAGE_BUFFERS = 4
_CUDA_STAGE_BUFFER_SIZE = 64 << 20
_cuda_stages: dict[int, Any] = {}


def _cuda_stage(device: Any) -> Any:
    """The process's Stage for a CUDA device, or None when the CUDA runtime
    cannot be loaded (the tensor is then copied to the CPU, as torch does)."""
    index = device.index if device.index is not None else import_torch().cuda.current_device()
    if index not in _cuda_stages:
        from .. import cuda as sscuda

        try:
            _cuda_stages[index] = ssio.Stage(
                "cuda", _CUDA_STAGE_BUFFERS, _CUDA_STAGE_BUFFER_SIZE, device=index,
                candidates=list(sscuda.candidates("cudart")))
        except ShardstateError as e:
            warnings.warn(f"shardstate: CUDA tensors are copied to the CPU before writing "
                          f"({e})", stacklevel=3)
            _cuda_stages[index] = None
    return _cuda_stages[index]


def _device_bytes(t: Any, start: int, nbytes: int) -> Any:
    """A uint8 CUDA tensor over bytes [start, start + nbytes) of t's storage."""
    torch = import_torch()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), start, (nbytes,), (1,))


def _record_source(value: Any, item: Any,
                   cuda_ok: bool = False) -> tuple[str, tuple, tuple, int, Any]:
    """(dtype name, shape, stride, storage numel, the bytes to write) for a
    tensor item's value: a torch tensor (prepared as torch's writer would)
    or, for NumPy state without torch, an ndarray written as the contiguous
    tensor of the dtype the planner recorded. With cuda_ok, a CUDA tensor's
    bytes stay on the device (a uint8 CUDA tensor) for the staging pipeline."""
    if isinstance(value, np.ndarray):
        # (not np.ascontiguousarray: it turns a 0-d array into shape (1,))
        arr = np.asarray(value, order="C")
        stride = tuple(s // arr.itemsize for s in arr.strides) if arr.size else \
            tuple(int(np.prod(arr.shape[i + 1:])) for i in range(arr.ndim))
        return (str(item.tensor_data.properties.dtype), arr.shape, stride, arr.size,
                arr.reshape(-1).view(np.uint8))
    on_device = cuda_ok and getattr(value, "is_cuda", False)
    t = _prepare_tensor(value, keep_device=on_device)
    if t.untyped_storage().nbytes() != t.nbytes:
        # A dense view into a larger storage, laid out as its clone would be
        # (a staged tensor, a slice of rows): the clone's record is this
        # range of the storage, so write it in place.
        start = t.storage_offset() * t.element_size()
        data = (_device_bytes(t, start, t.nbytes) if on_device
                else _storage_bytes(t)[start:start + t.nbytes])
        return str(t.dtype), tuple(t.shape), tuple(t.stride()), t.numel(), data
    data = (_device_bytes(t, 0, t.untyped_storage().nbytes()) if on_device
            else _storage_bytes(t))
    return (str(t.dtype), tuple(t.shape), tuple(t.stride()),
            t.untyped_storage().nbytes() // t.element_size(), data)


class _Trailer:
    """``plan.trailer(crc)`` in a few microseconds: the trailer for CRC 0 with
    the five CRC-dependent fields patched (data/0's descriptor and directory
    CRC, the serialization id's CRC hash, and that entry's descriptor and
    directory CRC; docs/FORMAT.md 3.4, 3.7, 3.9). Checked against
    ``plan.trailer`` when built; falls back to it if the layout differs."""

    def __init__(self, plan: TensorRecordPlan) -> None:
        self.plan = plan
        self.template = plan.trailer(0)
        self.fast = False
        if plan.data_length == 0:  # an empty data/0 carries no CRC at all
            self.fast = True
            return
        try:
            self._locate()
            probe = 0x9E3779B9
            self.fast = self._patch(probe) == plan.trailer(probe)
        except (ValueError, IndexError, struct.error):
            self.fast = False

    def _locate(self) -> None:
        t = self.template
        # CRCs folded into the id, in write order; None marks data/0's.
        self.crcs: list[int | None] = []
        for _name, payload in self.plan._records:
            if isinstance(payload, int):
                self.crcs.append(None)
            elif payload:
                self.crcs.append(zlib.crc32(payload))
        half = self._crc_half(0)
        self.sid_at = t.index(half) - 20
        if t.count(half) != 1 or self.sid_at < 0 or t[:4] != b"PK\x07\x08":
            raise ValueError("unexpected trailer layout")
        if t[self.sid_at + 40 : self.sid_at + 44] != b"PK\x07\x08":
            raise ValueError("unexpected serialization id descriptor")
        self.cd_data = t.index(b"archive/data/0") - 46 + 16
        self.cd_sid = t.rindex(b"archive/.data/serialization_id") - 46 + 16

    def _crc_half(self, crc: int) -> bytes:
        """The id's last 20 digits: a hash of the entries' CRCs."""
        hc = 0
        for c in self.crcs:
            hc = _hash_combine(hc, crc if c is None else c)
        return b"%020d" % hc

    def _patch(self, crc: int) -> bytes:
        t = bytearray(self.template)
        struct.pack_into("<I", t, 4, crc)
        struct.pack_into("<I", t, self.cd_data, crc)
        t[self.sid_at + 20 : self.sid_at + 40] = self._crc_half(crc)
        sid_crc = zlib.crc32(t[self.sid_at : self.sid_at + 40])
        struct.pack_into("<I", t, self.sid_at + 44, sid_crc)
        struct.pack_into("<I", t, self.cd_sid, sid_crc)
        return bytes(t)

    def __call__(self, crc: int) -> bytes:
        if self.plan.data_length == 0:
            return self.template
        return self._patch(crc) if self.fast else self.plan.trailer(crc)


@functools.lru_cache(maxsize=4096)
def _record_plan(
    dtype: str, shape: tuple[int, ...], stride: tuple[int, ...] | None, numel: int
) -> tuple[TensorRecordPlan, _Trailer]:
    """A tensor record's plan and its trailer maker, cached: optimizer states
    repeat the parameters' shapes."""
    plan = plan_tensor_record(dtype, shape, stride, numel)
    return plan, _Trailer(plan)


def _uses_overlapping_loader(thread_count: int, copy_ahead: int) -> bool:
    """torch orders a file's tensors by size (its _OverlappingCpuLoader) only
    with one thread, an accelerator present and copy-ahead on."""
    if thread_count != 1 or copy_ahead <= 0:
        return False
    torch = sys.modules.get("torch")
    if torch is None:  # NumPy-only state: no accelerator can hold it
        return False
    if torch.cuda.is_available():
        return True
    name = torch._C._get_privateuse1_backend_name()
    mod = getattr(torch, name, None)
    return bool(mod and mod.is_available())


@dataclass
class _PendingTrailer:
    path: str
    offset: int
    trailer: _Trailer
    job: int  # index of the data job in the batch


class FileSystemWriter(StorageWriter, _FileSystemWriterStager):
    """Writes a DCP checkpoint directory, byte-identical to torch 2.13's
    ``FileSystemWriter`` with the same options.

    ``thread_count`` sets how many files each rank writes (as in torch); the
    I/O itself always runs on the engine's thread pool. ``per_thread_copy_ahead``
    only matters for torch's item order when an accelerator is present, and
    is honoured for that. It is a ``BlockingAsyncStager``, as torch's is:
    ``async_save`` stages through it (``cache_staged_state_dict``: one arena
    kept for this writer, see ``staging``). ``_extensions`` (stream
    transforms) and ``SerializationFormat.SAFETENSORS`` raise
    NotImplementedError.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = SerializationFormat.TORCH_SAVE,
    ) -> None:
        _FileSystemWriterStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be an int >= 1, got {thread_count!r}")
        if _extensions:
            raise NotImplementedError(
                "FileSystemWriter(_extensions=...) stream transforms are not supported"
            )
        if getattr(serialization_format, "value", serialization_format) != "torch_save":
            raise NotImplementedError(
                f"serialization_format={serialization_format!r} is not supported; "
                "only SerializationFormat.TORCH_SAVE"
            )
        self.path = Path(path)
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.overwrite = overwrite
        self.serialization_format = serialization_format
        self.save_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.use_collectives = True
        self.is_coordinator = True

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def _metadata_path(self, rank: int | None = None) -> Path:
        return self.path / (_METADATA_FN if rank is None else f"__{rank}{_METADATA_FN}")

    def _own_metadata_path(self) -> Path:
        if not self.use_collectives and self.rank is not None:
            return self._metadata_path(self.rank)
        return self._metadata_path()

    def prepare_local_plan(self, plan: Any) -> Any:
        self.path.mkdir(parents=True, exist_ok=True)
        probe = self._metadata_path(None if self.use_collectives else 0)
        if probe.exists():
            if not self.overwrite:
                raise RuntimeError(
                    f"Checkpoint already exists in {self.path} ({probe.name}) and overwrite=False."
                )
            warnings.warn(
                f"Detected an existing checkpoint in {self.path}, overwriting since "
                "overwrite=True.",
                stacklevel=2,
            )
        # Remove our old .metadata before any data file is touched, so it never
        # describes new, partial data. Other ranks write only after the global
        # plan, which needs this (the coordinator's) local plan first.
        if self.is_coordinator or not self.use_collectives:
            own = self._own_metadata_path()
            try:
                own.unlink()
            except FileNotFoundError:
                pass
            else:
                _fsync_dir(self.path)
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return [
            dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_"))
            if p.storage_data is None
            else p
            for i, p in enumerate(plans)
        ]

    def _files(self, plan: Any) -> list[tuple[str, list[Any]]]:
        prefix = plan.storage_data.prefix
        if self.single_file_per_rank:
            buckets = _split_by_size_and_type(self.thread_count, list(plan.items))
        else:
            buckets = [[item] for item in plan.items]
        return [(f"{prefix}{n}{DEFAULT_SUFFIX}", b) for n, b in enumerate(buckets)]

    def write_data(self, plan: Any, planner: Any) -> Any:
        reorder = _uses_overlapping_loader(self.thread_count, self.per_thread_copy_ahead)
        jobs: list[ssio.WriteJob] = []
        trailers: list[_PendingTrailer] = []
        results: list[WriteResult] = []
        empty_files: list[str] = []
        keep: list[Any] = []  # tensors whose memory the jobs point into
        stage, stage_device = None, None  # for the CUDA tensors of one device
        for name, items in self._files(plan):
            path = os.fspath(self.path / name)
            byte_items = [w for w in items if _is_bytes_item(w)]
            tensor_items = [w for w in items if not _is_bytes_item(w)]
            if reorder:
                tensor_items.sort(key=_item_size)
            if not items:
                empty_files.append(path)
            cursor = 0
            for item in byte_items:
                data = planner.resolve_data(item)
                buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                jobs.append(ssio.WriteJob(path, cursor, buf))
                results.append(_result(item, name, cursor, buf.nbytes))
                cursor += buf.nbytes
            for item in tensor_items:
                value = planner.resolve_data(item)
                on_device = False
                if getattr(value, "is_cuda", False):
                    if stage_device is None:
                        stage_device = value.device
                        stage = _cuda_stage(value.device)
                    on_device = stage is not None and value.device == stage_device
                dtype, shape, stride, numel, data = _record_source(value, item, on_device)
                keep.append(data)
                rec, trailer = _record_plan(dtype, shape, stride, numel)
                jobs.append(ssio.WriteJob(path, cursor, rec.header))
                jobs.append(ssio.WriteJob(path, cursor + rec.data_offset, data,
                                          device=on_device and data.numel() > 0))
                trailers.append(
                    _PendingTrailer(path, cursor + rec.data_offset + rec.data_length, trailer,
                                    len(jobs) - 1)
                )
                length = rec.data_offset + rec.data_length + len(trailer.template)
                results.append(_result(item, name, cursor, length))
                cursor += length
        # With sync_files, each piece's writeback starts as soon as it is
        # written: the disk works while the rest is copied, and the fsync
        # in _finish_files waits only for the tail.
        stream = None
        if stage is not None:
            # the d2h copies start after the kernels queued so far
            stream = import_torch().cuda.current_stream(stage_device).cuda_stream
        crcs = ssio.write(jobs, fsync=False, checksum=True, writeback=self.sync_files,
                          stage=stage, stream=stream) if jobs else []
        del keep
        written = list(dict.fromkeys(os.fspath(j.path) for j in jobs))
        self._finish_files(written, trailers, crcs, empty_files)
        return completed_future(results)

    def _finish_files(
        self,
        written: list[str],
        trailers: list[_PendingTrailer],
        crcs: list[int],
        empty_files: list[str],
    ) -> None:
        """Writes each tensor record's trailer (it holds the data's CRC),
        creates the empty files torch creates, and fsyncs every file."""
        by_path: dict[str, list[_PendingTrailer]] = {p: [] for p in written}
        for tr in trailers:
            by_path[tr.path].append(tr)
        for path in empty_files:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            try:
                if self.sync_files:
                    os.fsync(fd)
            finally:
                os.close(fd)
        for path, trs in by_path.items():
            if not trs and not self.sync_files:
                continue
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                for tr in trs:
                    data = tr.trailer(crcs[tr.job])
                    n = os.pwrite(fd, data, tr.offset)
                    while n < len(data):
                        n += os.pwrite(fd, data[n:], tr.offset + n)
                if self.sync_files:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        data = _dump_metadata(metadata)
        ssio.atomic_publish(self._own_metadata_path(), data, fsync=self.sync_files)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _validate_checkpoint_id(checkpoint_id)


def _index_key(index: Any) -> tuple[str, tuple[int, ...] | None]:
    """A MetadataIndex (torch's or ours) as a plain hashable key."""
    off = index.offset
    return (index.fqn, None if off is None else tuple(off))


def _result(item: Any, name: str, offset: int, length: int) -> WriteResult:
    return WriteResult(index=item.index, size_in_bytes=length,
                       storage_data=_StorageInfo(name, offset, length))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _validate_checkpoint_id(checkpoint_id: str | os.PathLike) -> bool:
    if isinstance(checkpoint_id, Path):
        return True
    if "://" in str(checkpoint_id):
        return False
    return any(p.exists() and os.access(p, os.W_OK) for p in Path(checkpoint_id).parents)


# --------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rec:
    """Where a tensor record's storage bytes are, and how to view them."""

    dtype: str  # torch attribute name, e.g. "float32"
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    data_offset: int  # absolute, in the file
    data_length: int
    data_crc32: int


def _parsed(mm: mmap.mmap, r: _Req) -> _Rec:
    view = memoryview(mm)[r.info.offset : r.info.offset + r.info.length]
    try:
        p = parse_record(view, base_offset=r.info.offset)
    except RecordFormatError as e:
        raise StorageFormatError(f"{r.where()}: {e}") from None
    finally:
        view.release()
    return _Rec(p.dtype, p.shape, p.stride, p.storage_offset, p.data_offset, p.data_length,
                p.data_crc32)


@dataclass
class _File:
    rel: str
    path: str
    size: int


@dataclass
class _Req:
    item: Any
    info: Any  # _StorageInfo (ours or torch's)
    file: _File

    @property
    def key(self) -> str:
        return str(self.item.dest_index.fqn)

    def where(self) -> str:
        return f"item {self.key!r} in {self.file.path} at offset {self.info.offset}"


class FileSystemReader(StorageReader):
    """Reads a DCP checkpoint directory written by torch 2.13 or by us.

    Every tensor record's CRC-32 is checked as it is read
    (``verify_checksums=False`` turns that off). Bytes items are handed to
    ``planner.load_bytes`` only after their entries' CRC-32s and their
    pickle's globals (an allowlist: builtin containers, tensors, storages,
    dtypes, sizes, NumPy arrays) have been checked, unless
    ``unsafe_unpickle=True`` (torch's own reader loads them with
    ``weights_only=False``, which runs any code they hold). ``_extension_registry`` is accepted for
    compatibility; records written with stream transforms raise
    NotImplementedError.

    ``broadcast_shared_reads``: under shardstate's ``load`` with a process
    group, a saved chunk that several ranks need (a Replicate() target, a
    plain tensor every rank loads, overlapping reshard regions) is read from
    storage by one rank and broadcast over the group, so storage reads do
    not grow with the replication factor (``_plan_broadcast``). True turns
    it on; None (auto) and False leave it off: over gloo on one host each
    rank reading the page cache is as fast. The coordinator's option
    decides for the load. ``read_stats`` holds, after each ``read_data``,
    the bytes this rank read from storage and sent and received in
    broadcasts.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        _extension_registry: Any | None = None,
        *,
        verify_checksums: bool = True,
        unsafe_unpickle: bool = False,
        broadcast_shared_reads: bool | None = None,
    ) -> None:
        super().__init__()
        if broadcast_shared_reads not in (None, True, False):
            raise TypeError("broadcast_shared_reads must be None, True or False, got "
                            f"{broadcast_shared_reads!r}")
        self.broadcast_shared_reads = broadcast_shared_reads
        self.path = Path(path)
        self.storage_data: dict[Any, Any] = {}
        self.load_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.use_collectives = True
        self.verify_checksums = verify_checksums
        self.unsafe_unpickle = unsafe_unpickle
        # Shared verification (see _Coverage): off unless the loader that
        # drives this reader gathers the pieces and calls verify_pieces.
        self._shared_verify = False
        self._shared_keys: frozenset = frozenset()
        self._pieces: list[tuple] = []
        # Load once, broadcast (see _plan_broadcast): the loader's
        # coordinator, set by shardstate's load; None under torch's load.
        self._coord: Any = None
        self._armed: Any = None
        self.read_stats: dict[str, int] = _new_stats()
        # CUDA destinations read through the staging pipeline: (device,
        # Stage or None), fixed by the load's first CUDA destination
        self._cuda: tuple[Any, Any] | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        self._coord = None  # set again by shardstate's load, after reset
        self._cuda = None  # each load picks its staging device afresh
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def _metadata_path(self, rank: int | None = None) -> Path:
        return self.path / (_METADATA_FN if rank is None else f"__{rank}{_METADATA_FN}")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._metadata_path(kwargs.get("rank"))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no checkpoint metadata at {path} (incomplete or missing checkpoint)"
            ) from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise StorageFormatError(f"{path} is not a regular file")
            if not 0 < st.st_size <= _MAX_METADATA_BYTES:
                raise StorageFormatError(
                    f"{path} is {st.st_size} bytes, expected 1..{_MAX_METADATA_BYTES}"
                )
            data = f.read(st.st_size + 1)
        if len(data) != st.st_size:
            raise StorageFormatError(f"{path} changed size while being read")
        md = _load_metadata(data, os.fspath(path), self.unsafe_unpickle)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        # torch's planners check metadata classes with isinstance; ours
        # accept either, so hand out torch's whenever torch's DCP is loaded
        # (only then can a torch planner be in use; importing it costs more
        # than a whole small load).
        if "torch.distributed.checkpoint" not in sys.modules:
            return md
        with gc_paused():
            return to_torch_metadata(md)

    def set_up_storage_reader(
        self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise StorageFormatError(f"{self.path}: metadata has no storage_data")
        # Keyed by (fqn, offset) so plans made with torch's MetadataIndex and
        # with ours find the same entries (the two classes never compare equal).
        self.storage_data = {_index_key(k): v for k, v in metadata.storage_data.items()}
        self._metadata = metadata
        self._chunk_maps: dict[str, dict[tuple[int, ...], Any]] = {}
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """On the coordinator: puts in each plan's ``storage_data`` (a
        ``_LoadPlanData``) the saved chunks whose checksum the ranks verify
        together (see ``_shared_chunks``), when the loader has asked for it,
        and the broadcast schedule (``_plan_broadcast``) when broadcasting
        shared reads is on. Every rank gets the same schedule."""
        sched = self._plan_broadcast(plans) if self._broadcast_on() and len(plans) > 1 else None
        shared: set = set()
        if self._shared_verify and self.verify_checksums and len(plans) > 1:
            shared = self._shared_chunks(plans)
            if sched is not None:
                shared -= sched.keys  # read whole, by one rank, which checks it
        if not shared and sched is None:
            return plans
        out = []
        for p in plans:
            mine = frozenset(k for k in (_index_key(it.storage_index) for it in p.items)
                             if k in shared)
            out.append(dataclasses.replace(p, storage_data=_LoadPlanData(mine, sched))
                       if mine or sched is not None else p)
        return out

    def _broadcast_on(self) -> bool:
        """Whether this (the coordinator's) load broadcasts shared reads:
        only under shardstate's load with a group of 2+ ranks. Auto (None)
        is off for now: over gloo on one host, reading from the page cache
        beats sending the bytes over loopback (measured); it is meant to
        turn on with the NCCL transport for CUDA targets (issue 5)."""
        coord = self._coord
        if coord is None or not coord.use_dist or coord.world_size < 2:
            return False
        return bool(self.broadcast_shared_reads)

    def _plan_broadcast(self, plans: list[Any]) -> _Schedule | None:
        """Load once, broadcast: the saved tensor chunks that more than one
        rank reads, and that the ranks would read from storage more than once
        between them (a Replicate() target, a plain tensor every rank loads,
        overlapping reshard regions; not disjoint row slabs, which are read
        once already), are each read whole by one rank that needs them and
        broadcast to the others. Sources are chosen largest chunk first, each
        to the needing rank with the fewest bytes to read so far (its own
        unshared reads included). The chunks are packed in rounds of at most
        ``_BCAST_ROUND`` bytes (a chunk of ``_BCAST_ALONE`` bytes or more gets
        a round of its own), by source rank and file offset; every rank runs
        the same rounds."""
        need: dict[Any, dict[int, list[Any]]] = {}
        meta: dict[Any, tuple[Any, Any]] = {}
        load = [0] * len(plans)
        for rank, it, k, found in self._tensor_reads(plans):
            meta.setdefault(k, found)
            need.setdefault(k, {}).setdefault(rank, []).append(it)
        candidates = sorted(k for k, ranks in need.items() if len(ranks) > 1)
        recs: dict[Any, tuple[_Req, _Rec]] = {}
        if candidates:
            first = [need[k][min(need[k])][0] for k in candidates]
            reqs = self._requests(_Items(first))
            for r, rec in zip(reqs, self._parse(reqs)):
                recs[_index_key(r.item.storage_index)] = (r, rec)
        chosen = []
        for k, ranks in need.items():
            tmd = meta[k][0]
            esize = element_size(tmd.properties.dtype)
            got = recs.get(k)
            if got is not None:
                rec = got[1]
                # Storage bytes the ranks would read without broadcasting: a
                # region is read alone only when it is one range of the record
                # and (as far as the coordinator can tell without the
                # destination) of the destination too: whole rows of the
                # tensor; any other is read with its whole record.
                full = tuple(int(n) for n in tmd.size)[1:]
                alone = 0
                for items in ranks.values():
                    for it in items:
                        offs = tuple(int(o) for o in it.storage_offsets)
                        lens = tuple(int(n) for n in it.lengths)
                        span = _slab(rec, offs, lens, esize) \
                            if len(offs) == len(rec.shape) and lens[1:] == full else None
                        alone += rec.data_length if span is None else span[1]
                if rec.data_length and alone > rec.data_length:
                    chosen.append(k)
                    continue
            for rank, items in ranks.items():
                for it in items:
                    n = esize
                    for ln in it.lengths:
                        n *= int(ln)
                    load[rank] += n
        if not chosen:
            return None
        chosen.sort(key=lambda k: (-recs[k][1].data_length, k))
        src: dict[Any, int] = {}
        for k in chosen:
            s = min(need[k], key=lambda r: (load[r], r))
            src[k] = s
            load[s] += recs[k][1].data_length
        order = sorted(chosen, key=lambda k: (src[k], recs[k][0].file.path,
                                              recs[k][0].info.offset))
        rounds: list[list[tuple[int, list[_Shared]]]] = []
        used = _BCAST_ROUND
        for k in order:
            r, rec = recs[k]
            n = rec.data_length
            if used + n > _BCAST_ROUND or n >= _BCAST_ALONE:
                rounds.append([])
                used = 0
            rnd = rounds[-1]
            if not rnd or rnd[-1][0] != src[k]:
                rnd.append((src[k], []))
            rnd[-1][1].append(_Shared(k, rec, r.where()))
            # a large chunk travels alone: a rank that loads it whole into
            # a contiguous tensor then reads or receives it in place
            used = _BCAST_ROUND if n >= _BCAST_ALONE else used + n
        return _Schedule(frozenset(chosen), rounds)

    def _tensor_reads(self, plans: list[Any]) -> Any:
        """(rank, read item, chunk key, (metadata, chunk)) for every tensor
        read of every rank's plan whose saved chunk is known."""
        for rank, p in enumerate(plans):
            for it in p.items:
                if it.type.name == "BYTE_IO":
                    continue
                found = self._chunk(it.storage_index)
                if found is not None:
                    yield rank, it, _index_key(it.storage_index), found

    def _shared_chunks(self, plans: list[Any]) -> set:
        """The saved chunks the ranks' reads cover together: one rank reads
        the whole chunk, or the regions read are pairwise disjoint and add up
        to it. For these a rank reading part of a chunk checksums only its
        part, and every rank checks that the parts combine to the record's
        CRC-32 (verify_pieces), instead of each reading the rest of the
        record again: a load at another world size then reads each byte
        once."""
        boxes: dict[Any, set] = {}
        sizes: dict[Any, tuple[int, ...]] = {}
        for _rank, it, k, found in self._tensor_reads(plans):
            sizes[k] = tuple(int(n) for n in found[1].sizes)
            boxes.setdefault(k, set()).add(
                (tuple(int(o) for o in it.storage_offsets), tuple(int(n) for n in it.lengths)))
        return {k for k, bs in boxes.items() if _covers(bs, sizes[k])}

    def _enable_broadcast(self, coord: Any) -> None:
        """Called by shardstate's load before planning, with its
        coordinator, whose process group carries the broadcasts (and with
        None when the load is over)."""
        self._coord = coord

    def _arm(self, storage_data: Any) -> None:
        """The loader hands over the central plan's ``storage_data`` before
        ``finish_plan``: the broadcast rounds are run from it even if a
        planner's ``finish_plan`` drops it."""
        self._armed = storage_data

    def _abort_exchange(self) -> None:
        """This rank failed before ``read_data``: it still takes part in the
        exchange (as failed) so no rank waits for its broadcasts."""
        sd, self._armed = self._armed, None
        if isinstance(sd, _LoadPlanData) and sd.bcast is not None:
            self._exchange(sd.bcast, {}, None, failed=True)

    def _enable_shared_verify(self) -> None:
        """Called by shardstate's load before planning: it gathers what
        read_data left in ``_take_pieces`` from every rank and passes it to
        ``verify_pieces``."""
        self._shared_verify = True

    def _take_pieces(self) -> list[tuple]:
        pieces, self._pieces = self._pieces, []
        return pieces

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _validate_checkpoint_id(checkpoint_id)

    # ---- locating records ----

    def _open_file(self, rel: object, files: dict[str, _File]) -> _File:
        if type(rel) is not str:
            raise StorageFormatError(f"{self.path}: storage path {rel!r} is not a string")
        f = files.get(rel)
        if f is not None:
            return f
        parts = rel.replace("\\", "/").split("/")
        if not rel or "\0" in rel or os.path.isabs(rel) or any(p in ("", ".", "..") for p in parts):
            raise StorageFormatError(
                f"{self.path}: storage path {rel!r} is not a plain relative path inside the "
                "checkpoint directory"
            )
        root = os.path.realpath(self.path)
        full = os.path.realpath(os.path.join(root, rel))
        if os.path.commonpath([root, full]) != root:
            raise StorageFormatError(
                f"{self.path}: storage path {rel!r} resolves to {full}, outside the checkpoint"
            )
        try:
            st = os.stat(full)
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint data file {full} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise StorageFormatError(f"checkpoint data file {full} is not a regular file")
        f = files[rel] = _File(rel, full, st.st_size)
        return f

    def _requests(self, plan: Any) -> list[_Req]:
        files: dict[str, _File] = {}
        reqs = []
        for item in plan.items:
            try:
                info = self.storage_data[_index_key(item.storage_index)]
            except KeyError:
                raise StorageFormatError(
                    f"{self.path}: no storage entry for {item.storage_index}"
                ) from None
            if getattr(info, "transform_descriptors", None):
                raise NotImplementedError(
                    f"item {item.storage_index.fqn!r} was written with stream transforms "
                    f"{list(info.transform_descriptors)}, which are not supported"
                )
            f = self._open_file(info.relative_path, files)
            off, n = info.offset, info.length
            if type(off) is not int or type(n) is not int or off < 0 or n <= 0:
                raise StorageFormatError(
                    f"{self.path}: item {item.storage_index.fqn!r} has offset {off!r} and "
                    f"length {n!r} in {f.rel}"
                )
            if off + n > f.size:
                raise StorageFormatError(
                    f"item {item.storage_index.fqn!r}: [{off}, {off + n}) runs past the end of "
                    f"{f.path} ({f.size} bytes)"
                )
            reqs.append(_Req(item, info, f))
        reqs.sort(key=lambda r: (r.file.path, r.info.offset))
        return reqs

    # ---- reading ----

    def read_data(self, plan: Any, planner: Any) -> Any:
        sd, self._armed = (getattr(plan, "storage_data", None) if self._armed is None
                           else self._armed), None
        lp = sd if isinstance(sd, _LoadPlanData) else None
        self._shared_keys = lp.shared if lp is not None and self._shared_verify else frozenset()
        self._pieces = []
        self.read_stats = _new_stats()
        sched = lp.bcast if lp is not None else None
        if sched is None:
            self._read_local(self._requests(plan), planner)
            return completed_future(None)
        # Until the exchange is over, a failure here must not keep this rank
        # from the broadcast rounds the others wait in: it is carried
        # through them and raised after.
        mine: dict[Any, list[tuple[_Req, Any]]] = {}
        local: list[_Req] = []
        error: BaseException | None = None
        try:
            for r in self._requests(plan):
                k = _index_key(r.item.storage_index)
                if k in sched.keys and r.item.type.name != "BYTE_IO":
                    dest = planner.resolve_tensor(r.item)
                    mine.setdefault(k, []).append(
                        (r, dest if isinstance(dest, np.ndarray) else dest.detach()))
                else:
                    local.append(r)
        except BaseException as e:  # noqa: BLE001 - raised after the exchange
            error = e
        if not self._exchange(sched, mine, planner, failed=error is not None):
            return completed_future(None)  # another rank failed; it reports
        if error is not None:
            raise error
        self._read_local(local, planner)
        return completed_future(None)

    def _read_local(self, reqs: list[_Req], planner: Any) -> None:
        byte_reqs = [r for r in reqs if r.item.type.name == "BYTE_IO"]
        tensor_reqs = [r for r in reqs if r.item.type.name != "BYTE_IO"]
        if byte_reqs:
            self._read_bytes(byte_reqs, planner)
        if tensor_reqs:
            self._read_tensors(tensor_reqs, planner)

    def _exchange(self, sched: _Schedule, mine: dict[Any, list[tuple[_Req, Any]]],
                  planner: Any, failed: bool) -> bool:
        """Runs the broadcast rounds. Per round: each source reads its
        chunks whole into one buffer (CRC-32 checked), the ranks agree that
        nobody has failed (one small all-reduce), each source broadcasts its
        buffer in rank order, and each rank copies out the regions it needs.
        A chunk that is a rank's whole, contiguous destination and alone in
        its round is read or received straight into that destination. Every
        rank issues the same collectives in the same order whatever fails
        locally; a local failure is raised after the round it happened in,
        and once any rank has failed all ranks stop at the next round.
        Returns False when another rank's failure stopped the rounds."""
        coord = self._coord
        me = coord.rank
        stats = self.read_stats
        error: BaseException | None = None
        stopped = False
        for rnd in sched.rounds:
            bufs: list[tuple[np.ndarray, bool]] = []
            if not failed and error is None:
                try:
                    bufs = [self._round_buffer(entries, mine, src == me) for src, entries in rnd]
                except BaseException as e:  # noqa: BLE001 - reported below
                    error = e
            if coord.any_failed(failed or error is not None):
                stopped = True
                break
            for (src, entries), (buf, _direct) in zip(rnd, bufs):
                coord.broadcast_bytes(buf, src)
                if src == me:
                    stats["broadcast_sent"] += buf.nbytes
                elif any(e.key in mine for e in entries):
                    stats["broadcast_received"] += buf.nbytes
            try:
                for (_src, entries), (buf, direct) in zip(rnd, bufs):
                    pos = 0
                    for e in entries:
                        n = e.rec.data_length
                        for r, dest in mine.get(e.key, ()):
                            if not direct:
                                whole = _direct_bytes(dest, e.rec, r)
                                if whole is not None:  # one memcpy
                                    whole[...] = buf[pos : pos + n]
                                else:
                                    _copy_out(r, e.rec, buf[pos : pos + n], dest)
                            planner.commit_tensor(r.item, dest)
                        pos += n
            except BaseException as e:  # noqa: BLE001 - the others carry on
                error = e
        if error is not None:
            raise error
        return not stopped or failed

    def _round_buffer(self, entries: list[_Shared], mine: dict[Any, list[tuple[_Req, Any]]],
                      source: bool) -> tuple[np.ndarray, bool]:
        """One source's buffer for a round: all its chunks' storage bytes
        back to back, read from storage (CRC-32 checked) on the source; and
        whether it is this rank's destination itself (nothing to copy)."""
        buf = None
        if len(entries) == 1 and len(mine.get(entries[0].key, ())) == 1:
            r, dest = mine[entries[0].key][0]
            buf = _direct_bytes(dest, entries[0].rec, r)
        direct = buf is not None
        if buf is None:
            buf = np.empty(sum(e.rec.data_length for e in entries), np.uint8)
        if not source:
            return buf, direct
        jobs, reqs, pos = [], [], 0
        for e in entries:
            n = e.rec.data_length
            r = mine[e.key][0][0]
            jobs.append(ssio.ReadJob(r.file.path, e.rec.data_offset, buf[pos : pos + n],
                                     e.rec.data_crc32 if self.verify_checksums else None))
            reqs.append((r, e.rec))
            pos += n
        self._run(jobs, reqs)
        return buf, direct

    def _read_bytes(self, reqs: list[_Req], planner: Any) -> None:
        """Reads every bytes item in one batch, checks each record (CRC-32s,
        allowed globals) and hands it to ``planner.load_bytes``."""
        bufs = [bytearray(r.info.length) for r in reqs]
        self.read_stats["storage_bytes"] += sum(len(b) for b in bufs)
        ssio.read([ssio.ReadJob(r.file.path, r.info.offset, b) for r, b in zip(reqs, bufs)],
                  checksum=False)
        for r, b in zip(reqs, bufs):
            record = bytes(b)
            if not self.unsafe_unpickle:
                _check_bytes_record(record, r.where())
            planner.load_bytes(r.item, io.BytesIO(record))

    def _chunk(self, index: Any) -> Any:
        """The saved chunk a storage index names, or None."""
        md = getattr(self, "_metadata", None)
        tmd = None if md is None else md.state_dict_metadata.get(index.fqn)
        chunks = getattr(tmd, "chunks", None)
        if not chunks or index.offset is None:
            return None
        want = tuple(index.offset)
        i = index.index
        if isinstance(i, int) and 0 <= i < len(chunks) and tuple(chunks[i].offsets) == want:
            return tmd, chunks[i]
        by_offset = self._chunk_maps.get(index.fqn)
        if by_offset is None:
            by_offset = self._chunk_maps[index.fqn] = {tuple(c.offsets): c for c in chunks}
        c = by_offset.get(want)
        return None if c is None else (tmd, c)

    def _expected(self, mm: mmap.mmap, r: _Req) -> _Rec | None:
        """The record, if it is byte for byte the contiguous record the
        metadata predicts (what torch and we write for a dense tensor):
        checked by comparing its header and trailer with our own, which is
        stricter than parsing and costs microseconds. None otherwise."""
        found = self._chunk(r.item.storage_index)
        if found is None:
            return None
        tmd, chunk = found
        shape = tuple(int(n) for n in chunk.sizes)
        numel = 1
        for n in shape:
            numel *= n
        dtype = str(tmd.properties.dtype)
        try:
            plan, trailer = _record_plan(dtype, shape, None, numel)
        except (RecordFormatError, ValueError):
            return None
        off, dofs, dlen = r.info.offset, plan.data_offset, plan.data_length
        if dofs + dlen + len(trailer.template) != r.info.length:
            return None
        if mm[off : off + dofs] != plan.header:
            return None
        tail = mm[off + dofs + dlen : off + r.info.length]
        crc = struct.unpack_from("<I", tail, 4)[0] if dlen else 0
        if tail != trailer(crc):
            return None
        return _Rec(dtype.removeprefix("torch."), shape, contiguous_strides(shape), 0,
                    off + dofs, dlen, crc)

    def _parse(self, reqs: list[_Req]) -> list[_Rec]:
        """Locates each tensor record's data through a read-only mapping of
        its file (only the pages holding headers and trailers are touched)."""
        infos: list[_Rec] = []
        i = 0
        while i < len(reqs):
            f = reqs[i].file
            j = i
            while j < len(reqs) and reqs[j].file is f:
                j += 1
            with open(f.path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size < f.size:
                    raise StorageFormatError(f"{f.path} shrank while being read")
                mm = mmap.mmap(fh.fileno(), f.size, prot=mmap.PROT_READ)
            try:
                for r in reqs[i:j]:
                    rec = self._expected(mm, r)
                    if rec is None:
                        rec = _parsed(mm, r)
                    infos.append(rec)
            finally:
                try:
                    mm.close()
                except BufferError:  # a traceback still holds a view; GC closes it
                    pass
            i = j
        return infos

    def _read_tensors(self, reqs: list[_Req], planner: Any) -> None:
        infos = self._parse(reqs)
        # (req, record, destination, (byte offset, byte count) in the record's
        # data) for regions read straight into their destination.
        direct: list[tuple[_Req, _Rec, Any, tuple[int, int]]] = []
        staged: list[tuple[_Req, _Rec, Any]] = []
        for r, rec in zip(reqs, infos):
            dest = planner.resolve_tensor(r.item)
            if not isinstance(dest, np.ndarray):
                dest = dest.detach()
            lengths = tuple(int(n) for n in r.item.lengths)
            offs = tuple(int(o) for o in r.item.storage_offsets)
            if tuple(dest.shape) != lengths:
                raise StorageFormatError(
                    f"{r.where()}: destination has shape {tuple(dest.shape)}, the read needs "
                    f"{lengths}"
                )
            if len(offs) != len(rec.shape) or any(
                o + n > s for o, n, s in zip(offs, lengths, rec.shape)
            ):
                raise StorageFormatError(
                    f"{r.where()}: region offsets {offs} lengths {lengths} fall outside the "
                    f"saved chunk of shape {rec.shape}"
                )
            span = None
            if isinstance(dest, np.ndarray):
                if (dest.flags.c_contiguous and dest.dtype.byteorder in "=|"
                        and numpy_dtype_name(dest.dtype) == f"torch.{rec.dtype}"):
                    span = _slab(rec, offs, lengths, dest.itemsize)
            elif (
                str(dest.dtype) == f"torch.{rec.dtype}"
                and dest.is_contiguous()
                and (dest.device.type == "cpu" or self._cuda_direct(dest))
            ):
                span = _slab(rec, offs, lengths, dest.element_size())
            if span is None:
                staged.append((r, rec, dest))
            else:
                direct.append((r, rec, dest, span))
        self._read_direct(direct)
        for r, _rec, dest, _span in direct:
            planner.commit_tensor(r.item, dest)
        self._read_staged(staged, planner)

    def _read_direct(self, items: list[tuple[_Req, _Rec, Any, tuple[int, int]]]) -> None:
        """One batch reads every region straight into its destination. A
        whole record's CRC is checked by the engine; for part of a record the
        rest of it is read (in bounded pieces, checksummed only) and the
        pieces' CRCs combined."""
        items = [x for x in items if x[3][1]]
        verify = self.verify_checksums
        jobs, whole = [], []
        for r, rec, dest, (start, count) in items:
            is_whole = count == rec.data_length
            whole.append(is_whole)
            on_device = getattr(dest, "is_cuda", False)
            out = (_device_bytes(dest, dest.storage_offset() * dest.element_size(), dest.nbytes)
                   if on_device else _region_bytes(dest))
            jobs.append(ssio.ReadJob(r.file.path, rec.data_offset + start, out,
                                     rec.data_crc32 if verify and is_whole else None,
                                     device=on_device))
        partial = verify and not all(whole)
        crcs = self._run(jobs, [(r, rec) for r, rec, _d, _s in items], checksum=partial)
        if not verify:
            return
        shared = [self._is_shared(r) for r, _rec, _d, _s in items]
        for i, (r, rec, _d, (start, count)) in enumerate(items):
            if shared[i]:
                self._add_piece(r, rec, start, count, rec.data_crc32 if whole[i] else crcs[i])
        if not partial:
            return
        # The rest of each partly read record (unless the ranks verify it
        # together): (item, start, length) pieces.
        rest: list[tuple[int, int, int]] = []
        for i, (_r, rec, _d, (start, count)) in enumerate(items):
            if whole[i] or shared[i]:
                continue
            for a, b in ((0, start), (start + count, rec.data_length)):
                for p in range(a, b, _PIECE):
                    rest.append((i, p, min(_PIECE, b - p)))
        piece_crc: dict[tuple[int, int], int] = {}
        k = 0
        while k < len(rest):
            n, used = 0, 0
            while k + n < len(rest) and (n == 0 or used + rest[k + n][2] <= _SCRATCH_BUDGET):
                used += rest[k + n][2]
                n += 1
            scratch = np.empty(used, np.uint8)
            batch, pos = [], 0
            for i, p, ln in rest[k : k + n]:
                r, rec = items[i][0], items[i][1]
                batch.append(ssio.ReadJob(r.file.path, rec.data_offset + p,
                                          scratch[pos : pos + ln]))
                pos += ln
            self.read_stats["storage_bytes"] += used
            for (i, p, _ln), c in zip(rest[k : k + n], ssio.read(batch, checksum=True)):
                piece_crc[(i, p)] = c
            k += n
        for i, (r, rec, _d, (start, count)) in enumerate(items):
            if whole[i] or shared[i]:
                continue
            acc = 0
            for p in range(0, start, _PIECE):
                acc = crc32_combine(acc, piece_crc[(i, p)], min(_PIECE, start - p))
            acc = crc32_combine(acc, crcs[i], count)
            end = start + count
            for p in range(end, rec.data_length, _PIECE):
                acc = crc32_combine(acc, piece_crc[(i, p)], min(_PIECE, rec.data_length - p))
            if acc != rec.data_crc32:
                raise ChecksumError(_crc_message(r, rec))

    def _read_staged(self, items: list[tuple[_Req, _Rec, Any]], planner: Any) -> None:
        """Items that need a copy (strided records or destinations, another
        dtype or device): each record's storage is read whole (so its CRC is
        checked) into scratch, in batches of bounded size, then copied."""
        k = 0
        while k < len(items):
            n, used = 0, 0
            while k + n < len(items) and (
                n == 0 or used + items[k + n][1].data_length <= _SCRATCH_BUDGET
            ):
                used += items[k + n][1].data_length
                n += 1
            batch = items[k : k + n]
            scratch = [np.empty(rec.data_length, np.uint8) for _r, rec, _d in batch]
            jobs = [
                ssio.ReadJob(r.file.path, rec.data_offset, s,
                             rec.data_crc32 if self.verify_checksums else None)
                for (r, rec, _d), s in zip(batch, scratch)
                if rec.data_length
            ]
            self._run(jobs, [(r, rec) for r, rec, _d in batch if rec.data_length])
            if self.verify_checksums:
                for r, rec, _d in batch:
                    if rec.data_length and self._is_shared(r):
                        self._add_piece(r, rec, 0, rec.data_length, rec.data_crc32)
            for (r, rec, dest), s in zip(batch, scratch):
                _copy_out(r, rec, s, dest)
                planner.commit_tensor(r.item, dest)
            k += n

    def _is_shared(self, r: _Req) -> bool:
        return bool(self._shared_keys) and _index_key(r.item.storage_index) in self._shared_keys

    def _add_piece(self, r: _Req, rec: _Rec, start: int, count: int, crc: int) -> None:
        """One checksummed range of a shared chunk's record, for verify_pieces."""
        self._pieces.append((_index_key(r.item.storage_index), r.file.path, rec.data_offset,
                             rec.data_length, rec.data_crc32, start, count, crc, r.where()))

    def _cuda_direct(self, dest: Any) -> bool:
        """Whether a CUDA destination is read into through the staging
        pipeline (pinned buffers, then host-to-device copies straight into
        it): yes when the CUDA runtime loads, for the first device seen (the
        rest go through host memory)."""
        if not getattr(dest, "is_cuda", False):
            return False
        if self._cuda is None:
            self._cuda = (dest.device, _cuda_stage(dest.device))
        return self._cuda[1] is not None and dest.device == self._cuda[0]

    def _run(
        self, jobs: list[ssio.ReadJob], reqs: list[tuple[_Req, _Rec]], checksum: bool = False
    ) -> list[int]:
        if not jobs:
            return []
        self.read_stats["storage_bytes"] += sum(
            j.out.nbytes if j.device else memoryview(j.out).nbytes for j in jobs)
        stage = self._cuda[1] if any(j.device for j in jobs) else None
        try:
            return ssio.read(jobs, verify=self.verify_checksums, checksum=checksum,
                             stage=stage)
        except ChecksumError as e:
            k = getattr(e, "job", None)
            if not isinstance(k, int) or not 0 <= k < len(reqs):
                raise
            raise ChecksumError(_crc_message(*reqs[k])) from e


@dataclass(frozen=True)
class _Shared:
    """A saved chunk read by one rank and broadcast (``where`` for errors)."""

    key: tuple
    rec: _Rec
    where: str


@dataclass(frozen=True)
class _Schedule:
    """The broadcast rounds, the same on every rank: per round, (source
    rank, its chunks in buffer order) in increasing source rank."""

    keys: frozenset
    rounds: list[list[tuple[int, list[_Shared]]]]


@dataclass(frozen=True)
class _LoadPlanData:
    """A local load plan's ``storage_data`` from ``prepare_global_plan``:
    this rank's chunks verified together, and the broadcast schedule."""

    shared: frozenset
    bcast: _Schedule | None = None


@dataclass
class _Items:
    items: list[Any]


def _direct_bytes(dest: Any, rec: _Rec, r: _Req) -> np.ndarray | None:
    """``dest``'s own bytes when the region ``r`` reads is the whole record
    and ``dest`` is a contiguous CPU tensor or array of its dtype (the
    chunk can be read or received straight into it); else None."""
    if rec.storage_offset or not is_contiguous(rec.shape, rec.stride) or not rec.data_length:
        return None
    if tuple(int(o) for o in r.item.storage_offsets) != (0,) * len(rec.shape) or \
            tuple(int(n) for n in r.item.lengths) != tuple(rec.shape):
        return None
    if isinstance(dest, np.ndarray):
        ok = (dest.flags.c_contiguous and dest.dtype.byteorder in "=|"
              and numpy_dtype_name(dest.dtype) == f"torch.{rec.dtype}")
    else:
        ok = (dest.device.type == "cpu" and str(dest.dtype) == f"torch.{rec.dtype}"
              and dest.is_contiguous())
    if not ok or dest.nbytes != rec.data_length:
        return None
    return _region_bytes(dest)


def _covers(boxes: set, size: tuple[int, ...]) -> bool:
    """Whether the boxes (offsets, lengths) together cover a chunk of this
    size: one of them is all of it, or they are pairwise disjoint, inside it,
    and their volumes add up to its volume. (Each chunk is read by a few
    ranks; past 64 distinct regions the check is not attempted.)"""
    whole = ((0,) * len(size), size)
    if whole in boxes:
        return True
    if len(boxes) > 64:
        return False
    bs = list(boxes)
    total = 1
    for n in size:
        total *= n
    vol = 0
    for offs, lens in bs:
        if len(offs) != len(size) or any(o < 0 or o + n > s for o, n, s in zip(offs, lens, size)):
            return False
        v = 1
        for n in lens:
            v *= n
        vol += v
    if vol != total:
        return False
    for i in range(len(bs)):
        for j in range(i + 1, len(bs)):
            (oa, la), (ob, lb) = bs[i], bs[j]
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, la, ob, lb)):
                return False
    return True


def verify_pieces(gathered: list[list[tuple]]) -> None:
    """Checks the shared chunks' records from every rank's pieces (what
    ``FileSystemReader._take_pieces`` returned on each rank, in rank order):
    a record some rank read whole was verified by that rank; otherwise its
    pieces must tile its data and their CRC-32s combine to the record's.
    Raises CheckpointException naming the ranks that read a bad record (the
    same on every rank, since every rank checks the same pieces)."""
    from .api import CheckpointException, _wrap_exception

    by_record: dict[tuple, list[tuple]] = {}
    for rank, pieces in enumerate(gathered):
        for p in pieces or ():
            key, path, data_offset = p[0], p[1], p[2]
            by_record.setdefault((key, path, data_offset), []).append((rank,) + tuple(p))
    failures = {}
    for entries in by_record.values():
        length, crc = entries[0][4], entries[0][5]
        if any(e[6] == 0 and e[7] == length for e in entries):
            continue
        spans = sorted({(e[6], e[7], e[8]) for e in entries})
        pos, acc, ok = 0, 0, True
        for start, count, c in spans:
            if start != pos:
                ok = False
                break
            acc = crc32_combine(acc, c, count)
            pos += count
        if ok and pos == length and acc == crc:
            continue
        where = entries[0][9]
        if ok and pos == length:
            err: Exception = ChecksumError(
                f"CRC-32 mismatch in {where}: the tensor data at file offset {entries[0][3]} "
                f"({length} bytes), read in parts by ranks "
                f"{sorted({e[0] for e in entries})}, does not match the CRC {crc:08x} stored "
                "in its record")
        else:
            err = ShardstateError(
                f"{where}: the ranks' reads of this record do not tile its {length} bytes, so "
                "its CRC-32 could not be verified")
        for e in entries:
            failures.setdefault(e[0], _wrap_exception(err))
    if failures:
        raise CheckpointException("read", failures)


def _copy_out(r: _Req, rec: _Rec, data: np.ndarray, dest: Any) -> None:
    """Copies the region ``r`` reads out of a record's storage bytes
    ``data`` into ``dest``: NumPy destinations by NumPy, tensors of the
    record's dtype on the CPU by the C ``copy_region`` (GIL released), any
    other by torch's ``copy_`` (dtype or device conversion)."""
    if isinstance(dest, np.ndarray):
        dest[...] = _numpy_region(rec, data, r.item.storage_offsets, r.item.lengths)
        return
    torch = sys.modules["torch"]  # loaded whenever a destination is a tensor
    dt = getattr(torch, rec.dtype)
    src = torch.from_numpy(data).view(dt) if rec.data_length else torch.empty(0, dtype=dt)
    src = src.as_strided(rec.shape, rec.stride, rec.storage_offset)
    offs = [int(o) for o in r.item.storage_offsets]
    lens = [int(n) for n in r.item.lengths]
    if (dest.device.type == "cpu" and dest.dtype == dt and src.dim() >= 1
            and dest.numel() and all(st >= 0 for st in src.stride())):
        from ..geometry import copy_region

        copy_region(dest, [0] * len(lens), src, offs, lens)
        return
    for d, (o, ln) in enumerate(zip(offs, lens)):
        src = src.narrow(d, o, ln)
    dest.copy_(src)


def _new_stats() -> dict[str, int]:
    return {"storage_bytes": 0, "broadcast_sent": 0, "broadcast_received": 0}


def _crc_message(r: _Req, rec: _Rec) -> str:
    return (
        f"CRC-32 mismatch in {r.where()}: the tensor data at file offset {rec.data_offset} "
        f"({rec.data_length} bytes) does not match the CRC {rec.data_crc32:08x} stored in "
        "its record"
    )


def _slab(
    rec: _Rec, offs: tuple[int, ...], lengths: tuple[int, ...], itemsize: int
) -> tuple[int, int] | None:
    """(byte offset, byte count) of the region ``offs``/``lengths`` inside a
    record's data when the record is dense row-major and the region is one
    contiguous range of it (the whole chunk, or a slab along its first
    non-unit dimension); None otherwise."""
    if rec.storage_offset or not is_contiguous(rec.shape, rec.stride):
        return None
    d = len(rec.shape) - 1
    while d >= 0 and offs[d] == 0 and lengths[d] == rec.shape[d]:
        d -= 1
    if any(lengths[i] != 1 for i in range(d)):
        return None
    stride = contiguous_strides(rec.shape)
    count = 1
    for n in lengths:
        count *= n
    start = sum(o * s for o, s in zip(offs, stride)) * itemsize
    if start + count * itemsize > rec.data_length:
        return None
    return start, count * itemsize
