"""Hugging Face safetensors files on the C I/O engine: header build and
strict parse, a rank's files written in one engine call, regions read
straight into their destinations.

A safetensors file is an 8-byte little-endian header length ``n``, ``n``
bytes of a JSON object (``__metadata__``: a str -> str map; every other
key a tensor: ``dtype``, ``shape``, ``data_offsets`` [begin, end) relative
to the data, which starts at ``8 + n``), then the data. The header is
built here, in Python, and parsed in C (``_core.parse_safetensors_header``,
``csrc/core/ss_stheader.c``); the data bytes never pass
through Python: ``write_files`` hands the tensors' own memory to
``shardstate.io.write_records`` (one call per rank, headers included) and
``read_regions`` hands destination addresses to
``shardstate.io.read_records``, reading only the byte ranges a region
needs (a region whose bounding range is much larger than itself is split
along its leading dimensions).

Written files are laid out as the ``safetensors`` package lays them out
(tensors by dtype, widest first, then by name; the header padded with
spaces so the data starts 8-byte aligned); ``__metadata__`` keeps the
caller's order.

Parsing trusts nothing: the header length is bounded (``MAX_HEADER``) and
checked against the file, the JSON is parsed strictly and only from those
bytes (nesting bounded, duplicate keys refused), every tensor's dtype,
shape, offsets and byte length are checked against each other and the file
before use, and the tensors must tile the data exactly (no overlap, no
hole, nothing after the last: the ``safetensors`` package's rule). Each
failure is a ``SafetensorsError`` naming the file and the tensor.

Thread safety: functions only; no shared state.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .. import _core
from .. import io as ssio
from .._util import import_torch
from ._records import StorageFormatError

# safetensors' own limit on the header (its MAX_HEADER_SIZE).
MAX_HEADER = 100_000_000
MAX_NDIM = 64
METADATA_KEY = "__metadata__"

# safetensors dtype name -> (torch dtype attribute, element size). The list
# is safetensors' Dtype enum order: files put wider dtypes first, by this
# order reversed, then names.
_DTYPES: list[tuple[str, str, int]] = [
    ("BOOL", "bool", 1),
    ("U8", "uint8", 1),
    ("I8", "int8", 1),
    ("F8_E5M2", "float8_e5m2", 1),
    ("F8_E4M3", "float8_e4m3fn", 1),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz", 1),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz", 1),
    ("F8_E8M0", "float8_e8m0fnu", 1),
    ("I16", "int16", 2),
    ("U16", "uint16", 2),
    ("F16", "float16", 2),
    ("BF16", "bfloat16", 2),
    ("I32", "int32", 4),
    ("U32", "uint32", 4),
    ("F32", "float32", 4),
    ("C64", "complex64", 8),
    ("F64", "float64", 8),
    ("I64", "int64", 8),
    ("U64", "uint64", 8),
]
DTYPE_SIZE = {name: size for name, _t, size in _DTYPES}
_RANK = {name: i for i, (name, _t, _s) in enumerate(_DTYPES)}
_TO_TORCH = {name: t for name, t, _s in _DTYPES}
_FROM_TORCH = {f"torch.{t}": name for name, t, _s in _DTYPES}


class SafetensorsError(StorageFormatError):
    """A safetensors file is malformed or unsafe to read."""


def st_dtype(torch_dtype: Any, what: str = "tensor") -> str:
    """The safetensors name of a torch dtype (ValueError if it has none)."""
    name = _FROM_TORCH.get(str(torch_dtype))
    if name is None:
        raise ValueError(f"{what}: dtype {torch_dtype} cannot be stored in safetensors")
    return name


def torch_dtype(name: str) -> Any:
    return getattr(import_torch(), _TO_TORCH[name])


# --------------------------------------------------------------------------
# Header
# --------------------------------------------------------------------------


class TensorEntry(NamedTuple):
    name: str
    dtype: str  # safetensors name
    shape: tuple[int, ...]
    begin: int  # file offset of the data
    nbytes: int


@dataclass(frozen=True)
class Header:
    path: str
    data_start: int
    file_size: int
    metadata: dict[str, str] | None
    tensors: dict[str, TensorEntry]

    def entry(self, name: str) -> TensorEntry:
        e = self.tensors.get(name)
        if e is None:
            raise SafetensorsError(f"{self.path}: no tensor {name!r} in the file")
        return e


def build_header(tensors: Sequence[tuple[str, str, Sequence[int]]],
                 metadata: dict[str, str] | None = None,
                 *, sort: bool = True, align: bool = True,
                 compact: bool = True) -> tuple[bytes, list[int], list[int]]:
    """The header bytes (length prefix included) for ``tensors`` (name,
    safetensors dtype, shape), and each tensor's data offset from the
    data start and its order in the file. ``sort``: safetensors' order
    (dtype widest first, then name), else as given; ``align``: pad with
    spaces so the data starts 8-byte aligned; ``compact``: no spaces
    between JSON tokens (safetensors'), else ``json.dumps``' default."""
    order = list(range(len(tensors)))
    if sort:
        order.sort(key=lambda i: (-_RANK[tensors[i][1]], tensors[i][0]))
    head: dict[str, Any] = {}
    if metadata is not None:
        head[METADATA_KEY] = metadata
    offsets = [0] * len(tensors)
    cursor = 0
    for i in order:
        name, dtype, shape = tensors[i]
        if name == METADATA_KEY or name in head:
            raise ValueError(f"tensor name {name!r} is reserved or repeated")
        nbytes = math.prod(shape) * DTYPE_SIZE[dtype]
        dims = [int(s) for s in shape]
        head[name] = ({"dtype": dtype, "shape": dims, "data_offsets": [cursor, cursor + nbytes]}
                      if compact else
                      {"shape": dims, "dtype": dtype, "data_offsets": [cursor, cursor + nbytes]})
        offsets[i] = cursor
        cursor += nbytes
    text = json.dumps(head, separators=(",", ":") if compact else None,
                      ensure_ascii=False).encode()
    if align:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets, order


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(path: str, head: bytes | bytearray | memoryview, file_size: int) -> Header:
    """Checks and parses the JSON ``head`` (the header bytes after the
    length prefix) of a file of ``file_size`` bytes, in C
    (``csrc/core/ss_stheader.c``: the rules are in its header)."""
    data_start = 8 + len(head)
    if data_start > file_size:
        raise SafetensorsError(f"{path}: header length {len(head)} reaches past the end of "
                               f"the file ({file_size} bytes)")
    got = _core.parse_safetensors_header(head, file_size - data_start, data_start)
    if isinstance(got, str):
        raise SafetensorsError(f"{path}: {got}")
    metadata, rows = got
    return Header(path, data_start, file_size, metadata,
                  {r[0]: TensorEntry._make(r) for r in rows})


def read_header(path: str | os.PathLike) -> Header:
    """Reads and checks a safetensors file's header (two small reads)."""
    p = os.fspath(path)
    size = ssio.file_size(p)
    if size < 8:
        raise SafetensorsError(f"{p}: {size} bytes, too short for a safetensors file")
    prefix = bytearray(8)
    ssio.read([ssio.ReadJob(p, 0, prefix)], threads=1, checksum=False)
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER:
        raise SafetensorsError(f"{p}: header length {n} exceeds the limit {MAX_HEADER}")
    if 8 + n > size:
        raise SafetensorsError(f"{p}: header length {n} reaches past the end of the file "
                               f"({size} bytes)")
    head = bytearray(n)
    if n:
        ssio.read([ssio.ReadJob(p, 8, head)], threads=1, checksum=False)
    return parse_header(p, head, size)


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


def tensor_bytes(value: Any, what: str) -> tuple[str, tuple[int, ...], Any, Any]:
    """(safetensors dtype, shape, a uint8 view of its C-order bytes, the
    tensor that owns them) for a tensor or ndarray to store."""
    if isinstance(value, np.ndarray):
        from ._tensors import numpy_dtype_name

        arr = np.ascontiguousarray(value) if value.ndim else np.asarray(value, order="C")
        dt = st_dtype(numpy_dtype_name(arr.dtype), what)
        return dt, tuple(arr.shape), arr.reshape(-1).view(np.uint8), arr
    from ._fs_write import _prepare_tensor, _storage_bytes

    t = _prepare_tensor(value)
    if not t.is_contiguous():
        t = t.contiguous()
    dt = st_dtype(t.dtype, what)
    if not t.numel():
        return dt, tuple(t.shape), np.empty(0, np.uint8), t
    start = t.storage_offset() * t.element_size()
    return dt, tuple(t.shape), _storage_bytes(t)[start:start + t.nbytes], t


@dataclass
class FileSpec:
    """One safetensors file to write: its path, the raw bytes written
    before it (torch's writer puts a file's bytes items there), its
    tensors (name, dtype, shape, uint8 bytes) and header metadata."""

    path: str
    prefix: list[Any]
    tensors: list[tuple[str, str, tuple[int, ...], Any]]
    metadata: dict[str, str] | None = None
    sort: bool = True
    align: bool = True
    compact: bool = True


def write_files(specs: Sequence[FileSpec], *, fsync: bool = True) -> list[list[int]]:
    """Writes every file in one engine call (headers, bytes and tensor data
    straight from memory, in parallel). Returns, per file, each tensor's
    data offset in the file."""
    paths: list[str] = []
    rows: list[int] = []
    buffers: list[Any] = []
    where: list[list[int]] = []
    for f, spec in enumerate(specs):
        paths.append(spec.path)
        cursor = 0
        for buf in spec.prefix:
            rows += (f, cursor, len(buffers), -1, 0)
            buffers.append(buf)
            cursor += memoryview(buf).nbytes
        header, offs, _order = build_header(
            [(n, d, s) for n, d, s, _b in spec.tensors], spec.metadata, sort=spec.sort,
            align=spec.align, compact=spec.compact)
        rows += (f, cursor, len(buffers), -1, 0)
        buffers.append(header)
        data = cursor + len(header)
        mine = []
        for (_n, _d, _s, buf), off in zip(spec.tensors, offs):
            mine.append(data + off)
            if len(buf):
                rows += (f, data + off, len(buffers), -1, 0)
                buffers.append(buf)
        where.append(mine)
    if paths:
        ssio.write_records(paths, np.array(rows, np.int64).reshape(-1, 5), buffers, [],
                           fsync=fsync, checksum=False, writeback=fsync)
    return where


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------

# A region is read as one range when that range is at most this many times
# the bytes it needs (plus _SLACK); else it is split along its leading dims.
_WASTE = 2
_SLACK = 4096
_SCRATCH = 256 << 20


def _c_strides(shape: Sequence[int], isz: int) -> list[int]:
    out = [0] * len(shape)
    acc = isz
    for d in range(len(shape) - 1, -1, -1):
        out[d] = acc
        acc *= shape[d]
    return out


def _region_rows(f: int, e: TensorEntry, offs: Sequence[int], lens: Sequence[int],
                 addr: int, dst_len: int, dst_strides: Sequence[int],
                 rows: list[tuple[int, ...]], geom: list[int]) -> int:
    """Appends the engine rows reading region offs/lens of tensor ``e``
    into host memory at ``addr`` (byte strides ``dst_strides``; ``dst_len``
    bytes reachable from addr). Returns the bytes the rows read."""
    isz = DTYPE_SIZE[e.dtype]
    need = math.prod(lens) * isz
    if not need:
        return 0
    src = _c_strides(e.shape, isz)
    first = sum(o * s for o, s in zip(offs, src))
    last = sum((o + n - 1) * s for o, n, s in zip(offs, lens, src)) + isz
    span = last - first
    nd = len(lens)
    # a contiguous destination taking one contiguous range: a plain read
    if span == need and list(dst_strides) == _c_strides(lens, isz):
        rows.append((f, ssio.REC_RANGE, e.begin + first, span, 0, 0, addr, dst_len, 0, span,
                     0, 0, 0, 0))
        return span
    if span <= _WASTE * need + _SLACK or nd == 1:
        rows.append((f, ssio.REC_SCATTER, e.begin + first, span, 0, 0, addr, dst_len, 0, 0,
                     nd, isz, 0, len(geom)))
        geom += lens
        geom += src
        geom += dst_strides
        return span
    # split along the first dimension: one sub-region per index
    total = 0
    sub_e = TensorEntry(e.name, e.dtype, e.shape[1:], 0, 0)
    for i in range(lens[0]):
        row_e = TensorEntry(e.name, e.dtype, sub_e.shape, e.begin + (offs[0] + i) * src[0], 0)
        total += _region_rows(f, row_e, offs[1:], lens[1:], addr + i * dst_strides[0],
                              dst_len - i * dst_strides[0], dst_strides[1:], rows, geom)
    return total


@dataclass
class Region:
    """Read region ``offs``/``lens`` of tensor ``entry`` of file ``path``
    into ``dest`` (a CPU tensor or ndarray of that shape)."""

    path: str
    entry: TensorEntry
    offs: tuple[int, ...]
    lens: tuple[int, ...]
    dest: Any


def _layout(dest: Any) -> tuple[int, int, list[int]]:
    """(address, bytes reachable from it, byte strides) of a host destination."""
    if isinstance(dest, np.ndarray):
        reach = (dest.itemsize + sum((n - 1) * s for n, s in zip(dest.shape, dest.strides))
                 if dest.size else 0)
        return dest.ctypes.data, reach, list(dest.strides)
    isz = dest.element_size()
    reach = dest.untyped_storage().nbytes() - dest.storage_offset() * isz
    return dest.data_ptr(), reach, [s * isz for s in dest.stride()]


def _same_dtype(dest: Any, entry: TensorEntry) -> bool:
    if isinstance(dest, np.ndarray):
        from ._tensors import numpy_dtype_name

        return (dest.dtype.byteorder in "=|" and all(s >= 0 for s in dest.strides)
                and _FROM_TORCH.get(str(numpy_dtype_name(dest.dtype))) == entry.dtype)
    return (dest.device.type == "cpu" and _FROM_TORCH.get(str(dest.dtype)) == entry.dtype
            and all(s >= 0 for s in dest.stride()))


def read_regions(regions: Sequence[Region], threads: int | None = None) -> int:
    """Reads every region into its destination in one engine call: same
    dtype host destinations directly, others through a temporary of the
    file's dtype, then converted by torch's ``copy_``. Returns the bytes
    read from storage."""
    files: dict[str, int] = {}
    rows: list[tuple[int, ...]] = []
    geom: list[int] = []
    later: list[tuple[Any, Any]] = []  # (destination, temporary)
    read = 0
    for r in regions:
        e = r.entry
        if len(r.offs) != len(e.shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(r.offs, r.lens, e.shape)):
            raise SafetensorsError(
                f"{r.path}: tensor {e.name!r}: region offsets {list(r.offs)} lengths "
                f"{list(r.lens)} fall outside its shape {list(e.shape)}")
        if tuple(r.dest.shape) != tuple(r.lens):
            raise SafetensorsError(
                f"{r.path}: tensor {e.name!r}: destination has shape {tuple(r.dest.shape)}, "
                f"the read needs {tuple(r.lens)}")
        dest = r.dest
        if not _same_dtype(dest, e):
            torch = import_torch()
            tmp = torch.empty(r.lens, dtype=torch_dtype(e.dtype))
            later.append((dest, tmp))
            dest = tmp
        f = files.setdefault(r.path, len(files))
        addr, reach, strides = _layout(dest)
        read += _region_rows(f, e, r.offs, r.lens, addr, reach, strides, rows, geom)
    if rows:
        ssio.read_records(list(files), np.array(rows, np.int64).reshape(-1, 14),
                          np.array(geom, np.int64), verify=False, checksum=False,
                          scratch=_SCRATCH, threads=threads)
    for dest, tmp in later:
        if isinstance(dest, np.ndarray):
            dest[...] = tmp.numpy()
        else:
            dest.copy_(tmp)
    return read


# --------------------------------------------------------------------------
# A rank's DCP write items as safetensors files
# --------------------------------------------------------------------------


def write_items(root: Any, files: Sequence[tuple[str, list[Any]]], planner: Any,
                sync_files: bool,
                alongside: Callable[[list[tuple[Any, Any]]], None] | None = None) -> list[Any]:
    """Writes a rank's files (name in ``root``, its write items) as torch
    2.13's writer does with ``SerializationFormat.SAFETENSORS``: a file's
    bytes items first, raw, then one safetensors blob of its tensors whose
    ``__metadata__`` holds the DCP sharding info (each tensor's chunk
    offsets), the DCP version and the format. Returns torch's write
    results: a tensor's storage data is (file name, the blob's offset in
    the file, its data's byte length), as torch records them.
    ``alongside``, when given, runs in a second thread while the files are
    written, on every (tensor item, its bytes) pair (another engine call:
    the two overlap)."""
    from ._fs_write import _is_bytes_item, _result
    from ._hf_utils import (
        CUSTOM_METADATA_KEY,
        DCP_VERSION_KEY,
        FORMAT_KEY,
        FORMAT_VALUE,
        HF_DCP_VERSION,
        SAVED_OFFSETS_KEY,
    )

    specs: list[FileSpec] = []
    results: list[Any] = []
    owners: list[Any] = []  # tensors owning the bytes, alive through the write
    pairs: list[tuple[Any, Any]] = []
    for name, items in files:
        prefix: list[Any] = []
        cursor = 0
        for item in items:
            if _is_bytes_item(item):
                data = planner.resolve_data(item)
                buf = data.getbuffer() if hasattr(data, "getbuffer") else memoryview(data)
                prefix.append(buf)
                results.append(_result(item, name, cursor, buf.nbytes))
                cursor += buf.nbytes
        tensors = []
        sharding: dict[str, Any] = {}
        for item in items:
            if _is_bytes_item(item):
                continue
            fqn = item.index.fqn
            if fqn in sharding:
                raise ValueError(f"{name}: two chunks of {fqn!r} in one safetensors file "
                                 "(save_distributed=True gives each rank its own files)")
            dt, shape, buf, owner = tensor_bytes(planner.resolve_data(item), fqn)
            owners.append(owner)
            pairs.append((item, buf))
            tensors.append((fqn, dt, shape, buf))
            sharding[fqn] = {SAVED_OFFSETS_KEY: [int(o) for o in item.tensor_data.chunk.offsets]}
            results.append(_result(item, name, cursor, len(buf)))
        metadata = {CUSTOM_METADATA_KEY: json.dumps(sharding),
                    DCP_VERSION_KEY: str(HF_DCP_VERSION), FORMAT_KEY: FORMAT_VALUE}
        specs.append(FileSpec(os.path.join(os.fspath(root), name), prefix, tensors, metadata))
    if alongside is None:
        write_files(specs, fsync=sync_files)
    else:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            side = ex.submit(alongside, pairs)
            try:
                write_files(specs, fsync=sync_files)
            finally:
                side.result()
    del owners, pairs
    return results
