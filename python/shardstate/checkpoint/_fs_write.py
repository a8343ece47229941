"""A rank's data files for ``FileSystemWriter.write_data``.

The files are those torch 2.13's writer makes for the same plan: a rank's
items bucketed as torch buckets them (``_split_by_size_and_type``), in the
same order, each a ``torch.save`` zip record. ``write_files`` lays every
item out as one row of an int64 table (file, offset, buffer, plan,
device): a tensor's row names its storage bytes (a view of the tensor's
own memory, or of CUDA memory for the staging pipeline) and its record
framing (``_plan``: a ``_core.RecordPlan``, csrc/core/ss_zipwrite.c), a
bytes item's row its bytes. One ``shardstate.io.write_records`` call then
does the rest in C with the GIL released (csrc/core/ss_recwrite.h): small
records packed into run buffers, headers, data and bytes items written
while their CRC-32s are computed, each big record's trailer patched for
its data's CRC and written in place, files with no item created empty,
every file fsynced. A writer with stream transforms (``_extensions``)
builds each record in memory instead, through the transforms
(``_fs_transform``, framing from ``_zipfmt``), and the engine writes the
transformed bytes (``_write_transformed``).

Known limit: CUDA tensors of a second device are copied to the CPU, all of
a rank's at once, before the write batch.

Thread safety: ``_cuda_stages`` is per process, filled on first use (a save
or load at a time, as in torch).
"""

from __future__ import annotations

import array
import collections
import concurrent.futures
import functools
import io
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .. import _core
from .. import io as ssio
from .._core import ShardstateError, crc32
from .._util import import_torch
from ._fs_transform import Encoded, WriterTransforms
from ._records import DATA_CRC_ATTR, _record_plan
from .metadata import _StorageInfo
from .planner import element_size
from .storage import WriteResult


def _item_size(item: Any) -> int:
    td = item.tensor_data
    n = 1
    for s in td.size:
        n *= int(s)
    return n * element_size(td.properties.dtype)


def _is_bytes_item(item: Any) -> bool:
    return item.type.name == "BYTE_IO"


def _file_order(items: list[Any], reorder: bool) -> tuple[list[Any], list[Any]]:
    """One file's items in the order torch writes them: its bytes items,
    then its tensors (smallest first when ``reorder``)."""
    byte_items = [w for w in items if _is_bytes_item(w)]
    tensor_items = [w for w in items if not _is_bytes_item(w)]
    if reorder:
        tensor_items.sort(key=_item_size)
    return byte_items, tensor_items


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


# --------------------------------------------------------------------------
# The bytes of a tensor item
# --------------------------------------------------------------------------


# dtypes Tensor.numpy() takes (names, so no torch import here)
_NUMPY_DTYPES = frozenset(
    f"torch.{n}" for n in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                           "float32", "float64", "complex64", "complex128"))


def _storage_bytes(t: Any) -> np.ndarray:
    """A zero-copy uint8 view of a detached CPU tensor's whole storage:
    through ``numpy()`` when the tensor is its whole storage in order (a
    quarter of the time, a few microseconds a tensor), else through a uint8
    tensor set on the storage (any dtype)."""
    torch = import_torch()
    st = t.untyped_storage()
    if (st.nbytes() == t.nbytes and not t.storage_offset() and t.is_contiguous()
            and str(t.dtype) in _NUMPY_DTYPES):
        return t.numpy().reshape(-1).view(np.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)).numpy()


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


# Transformed bytes written per engine call (_write_transformed): what a
# save through stream transforms holds in memory at once, beyond one item.
_TRANSFORM_BATCH = 256 << 20

# CUDA tensors are saved through a pipeline of pinned buffers (one Stage per
# device and process, made on first use): the d2h copy of piece k+1 runs
# while piece k is written, with no host copy of the tensor made in Python.
# The reader reads into CUDA destinations through the same Stage.
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


# --------------------------------------------------------------------------
# One engine call per rank
# --------------------------------------------------------------------------


# Records of at most this many data bytes (ss_recwrite.h SS_IO_PACK_RECORD)
# are laid out whole in memory by the engine, next to their neighbours, in
# runs of about _PACK_SEGMENT bytes (0: the engine's default, 16 MiB), each
# one write job: 20,000 small tensors otherwise cost 60,000 jobs and 20,000
# trailers, most of a save's time, where the copy costs a microsecond each.
_PACK_SEGMENT = 0


@functools.lru_cache(maxsize=4096)
def _plan(dtype: str, shape: tuple[int, ...], stride: tuple[int, ...],
          numel: int) -> Any:
    """A tensor record's framing (C, ss_zipwrite.h), cached: optimizer
    states repeat the parameters' shapes."""
    return _core.RecordPlan(dtype, shape, stride, numel)


def _result(item: Any, name: str, offset: int, length: int,
            descriptors: list[str] | None = None) -> WriteResult:
    return WriteResult(index=item.index, size_in_bytes=length,
                       storage_data=_StorageInfo(name, offset, length,
                                                 transform_descriptors=descriptors))


_EMPTY = np.empty(0, np.uint8)


def write_files(root: Path, files: list[tuple[str, list[Any]]], planner: Any,
                reorder: bool, sync_files: bool,
                transforms: WriterTransforms | None = None,
                locate: dict[str, str] | None = None,
                engine: Callable[..., list[int]] | None = None) -> list[WriteResult]:
    """Writes a rank's files, each (name in ``root``, its items in order;
    ``locate``, if given, maps each name to the local path written instead:
    the fsspec writer's in-memory files, with ``transforms``; ``engine``, if
    given, is called in place of ``write_records`` with the table, buffers,
    plans, stage and stream, the table's file column indexing ``files``, and
    returns the rows' CRCs: the fsspec writer's windowed uploads),
    the whole rank in one engine call; with ``reorder``, each file's tensors
    smallest first (torch's overlapping loader). With ``transforms`` (the
    writer's extensions) every item goes through them instead
    (``_write_transformed``). Returns the write results.

    The call gets one row per item in an int64 table (file, offset, buffer,
    plan, device; ``shardstate.io.write_records``), the items' buffers (a
    list that keeps them alive through the call) and the distinct record
    plans; the engine writes headers, data, bytes items and trailers, packs
    small records, creates the files with no items and fsyncs."""
    if transforms is not None:
        return _write_transformed(root, files, planner, reorder, sync_files, transforms, locate)
    paths: list[str] = []
    rows = array.array("q")
    buffers: list[Any] = []  # the items' bytes, alive until the call returns
    plans: list[Any] = []
    plan_index: dict[Any, int] = {}
    results: list[WriteResult] = []
    crc_rows: list[tuple[Any, int]] = []  # (a tensor's storage info, its row)
    stage, stage_device = None, None  # for the CUDA tensors of one device
    for name, items in files:
        f = len(paths)
        paths.append(locate[name] if locate is not None and engine is None
                     else os.fspath(root / name))
        byte_items, tensor_items = _file_order(items, reorder)
        cursor = 0
        for item in byte_items:
            data = planner.resolve_data(item)
            buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
            rows.extend((f, cursor, len(buffers), -1, 0))
            buffers.append(buf)
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
            plan = _plan(dtype, shape, stride, numel)
            p = plan_index.get(plan)
            if p is None:
                p = plan_index[plan] = len(plans)
                plans.append(plan)
            length = plan.total_length
            dev = on_device and data.numel() > 0
            if on_device and not dev:
                data = _EMPTY  # no bytes to stage
            rows.extend((f, cursor, len(buffers), p, dev))
            buffers.append(data)
            results.append(_result(item, name, cursor, length))
            if plan.data_length:
                crc_rows.append((results[-1].storage_data, len(rows) // 5 - 1))
            cursor += length
    stream = None
    if stage is not None:
        # the d2h copies start after the kernels queued so far
        stream = import_torch().cuda.current_stream(stage_device).cuda_stream
    # With sync_files, each piece's writeback starts as soon as it is
    # written: the disk works while the rest is copied, and the final
    # fsync waits only for the tail.
    table = np.frombuffer(rows, np.int64).reshape(-1, 5)
    if engine is not None:
        crcs = engine(table, buffers, plans, stage, stream)
    else:
        crcs = ssio.write_records(
            paths, table, buffers, plans,
            fsync=sync_files, writeback=sync_files, stage=stage, stream=stream,
            _pack_run=_PACK_SEGMENT) if paths else []
    del buffers
    for info, k in crc_rows:
        setattr(info, DATA_CRC_ATTR, crcs[k])
    return results


def _write_transformed(root: Path, files: list[tuple[str, list[Any]]], planner: Any,
                       reorder: bool, sync_files: bool,
                       transforms: WriterTransforms,
                       locate: dict[str, str] | None = None) -> list[WriteResult]:
    """``write_files`` through stream transforms: the files torch's writer
    makes with these extensions (``_fs_transform``). Each item's record is
    built and transformed in memory (a CUDA tensor copied to the CPU
    first), by ``transforms.threads`` threads at once when that is more
    than one (torch's writer also transforms with ``thread_count``
    threads), and the transformed bytes are written by the engine, in order,
    in batches of about ``_TRANSFORM_BATCH`` bytes."""
    jobs: list[ssio.WriteJob] = []
    pending = 0
    results: list[WriteResult] = []
    cursors: dict[str, int] = {}  # where each file ends so far
    # Every file is created (empty) first; the batches then write into them
    # in place, so a file spanning two batches keeps what the first wrote.
    def where(name: str) -> str:
        return locate[name] if locate is not None else os.fspath(root / name)

    paths = [where(name) for name, _items in files]
    if paths:
        ssio.write([], files=paths)

    def flush() -> None:
        nonlocal pending
        if jobs:
            ssio.write(jobs, fsync=False, checksum=False, writeback=sync_files, patch=True)
        jobs.clear()
        pending = 0

    def tasks() -> Iterator[tuple[str, str, Any, Callable[[], Encoded]]]:
        """(path, file name, item, what encodes it), in torch's order; the
        planner's data is resolved here, in this thread."""
        for name, items in files:
            path = where(name)
            byte_items, tensor_items = _file_order(items, reorder)
            for item in byte_items:
                data = planner.resolve_data(item)
                buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                yield path, name, item, functools.partial(transforms.encode_bytes, buf)
            for item in tensor_items:
                src = _record_source(planner.resolve_data(item), item)
                yield path, name, item, functools.partial(_encode_tensor, transforms, src)

    for path, name, item, out in _in_order(tasks(), transforms.threads):
        cursor = cursors.get(path, 0)
        for buf in out.buffers:
            jobs.append(ssio.WriteJob(path, cursor, buf))
            cursor += len(buf)
        results.append(_result(item, name, cursors.get(path, 0), out.nbytes, out.descriptors))
        cursors[path] = cursor
        pending += out.nbytes
        if pending >= _TRANSFORM_BATCH:
            flush()
    flush()
    if sync_files and paths:
        ssio.write([], files=paths, patch=True, fsync=True, checksum=False)
    return results


def _encode_tensor(transforms: WriterTransforms, src: tuple) -> Encoded:
    dtype, shape, stride, numel, data = src
    rec, _trailer = _record_plan(dtype, shape, stride, numel)
    crc = crc32(data) if rec.data_length else 0
    return transforms.encode_record(rec, data, crc)


def _in_order(tasks: Iterator[tuple], threads: int) -> Iterator[tuple]:
    """Each task ``(*head, fn)`` as ``(*head, fn())``, in order; with
    ``threads`` > 1 that many run at once, at most twice as many ahead."""
    if threads <= 1:
        for *head, fn in tasks:
            yield (*head, fn())
        return
    with concurrent.futures.ThreadPoolExecutor(threads, "shardstate-transform") as pool:
        window: collections.deque = collections.deque()
        for *head, fn in tasks:
            window.append((head, pool.submit(fn)))
            if len(window) >= 2 * threads:
                done, fut = window.popleft()
                yield (*done, fut.result())
        while window:
            done, fut = window.popleft()
            yield (*done, fut.result())
