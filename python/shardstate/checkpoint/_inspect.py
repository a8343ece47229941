"""What a checkpoint holds, whether it is sound, and how two differ: the
work behind ``shardstate inspect``, ``verify`` and ``diff`` (``shardstate.cli``).

* :func:`describe`: every item's dtype, global shape, chunks and where each
  is stored (file, offset, length, the rank that wrote the file);
* :func:`verify`: every metadata reference (each chunk inside its tensor,
  the chunks' volumes adding up to the tensor's, each storage entry inside a
  regular file under the checkpoint directory), every record recognised and
  of its chunk's dtype and shape, and every record's data CRC-32 checked by
  the C engine (``shardstate.io.read_records``: range rows of zero bytes,
  the whole record read into engine scratch and checked, in parallel);
  bytes items and items written through stream transforms are read as a
  load reads them (restricted unpickler, bounded transforms). It goes on
  past a bad item and reports them all;
* :func:`diff`: keys, dtypes, shapes and values of two checkpoints, one
  batch of keys in memory at a time.

Everything reads through ``FileSystemReader`` and the load path's record
code, so what verify passes, a load reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .. import ShardstateError
from .. import io as ssio
from .._core import ChecksumError
from ._fs_read import _CudaDest, _Reads
from ._records import StorageFormatError, _index_key, transforms
from ._setup import _tool_reader
from ._steps import is_url
from .filesystem import FileSystemReader

__all__ = ["CheckpointUnreadable", "VerifyReport", "describe", "diff", "verify"]

_RANK_FILE = re.compile(r"__([0-9]+)_[0-9]+\.distcp")
# bytes of record data checked per engine call (progress is reported between)
_VERIFY_BATCH = 1 << 30
# bytes of tensors diff holds per checkpoint at a time (a larger tensor alone)
_DIFF_BATCH = 256 << 20


class CheckpointUnreadable(ShardstateError):
    """No checkpoint at the path, or its metadata cannot be read."""


# called with the bytes done since the last call, and the total when known
Progress = Callable[..., None]


def _open(path: str | os.PathLike) -> tuple[FileSystemReader, Any]:
    """The reader of the checkpoint at ``path`` (a directory, or an fsspec
    URL: its options from fsspec's configuration, e.g. the environment's
    ``FSSPEC_S3_ENDPOINT_URL``), set up, and its metadata."""
    if not is_url(path) and not Path(path).is_dir():
        raise CheckpointUnreadable(f"{path}: no such checkpoint directory")
    try:
        reader: FileSystemReader = _tool_reader(path)
    except (ValueError, ImportError, OSError) as e:  # no fsspec, or a bad URL
        raise CheckpointUnreadable(f"{path}: {e}") from None
    try:
        md = reader.read_metadata()
    except (FileNotFoundError, StorageFormatError, OSError, ShardstateError) as e:
        raise CheckpointUnreadable(f"{path}: {e}") from None
    try:
        reader.set_up_storage_reader(md, True)
    except StorageFormatError as e:
        raise CheckpointUnreadable(f"{path}: {e}") from None
    return reader, md


def _mirror(reader: FileSystemReader) -> Any:
    """An fsspec reader's local copies of its objects (None on disk)."""
    return getattr(reader._records, "mirror", None)


@contextlib.contextmanager
def _staged(reader: FileSystemReader, reqs: list[Any]) -> Iterator[None]:
    """The records of ``reqs`` where the engine reads them for the block:
    on disk they are; from an object store they are fetched (whole) into
    the reader's local copies, and freed after."""
    mirror = _mirror(reader)
    if mirror is None:
        yield
        return
    try:
        mirror.fetch(reqs)
        yield
    except Exception as e:
        mirror.rename_in(e)
        raise
    finally:
        mirror.drop()


def _file_size(reader: FileSystemReader, path: str | os.PathLike, rel: str) -> int | None:
    mirror = _mirror(reader)
    try:
        if mirror is not None:  # from the objects' listing; no local copy made
            from ._fs_remote import check_relative

            check_relative(path, rel)
            return mirror.size(rel)
        return os.stat(Path(path) / rel).st_size
    except (OSError, StorageFormatError):
        return None


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _is_tensor(tmd: Any) -> bool:
    return hasattr(tmd, "chunks")


def _rank_of(rel: str) -> int | None:
    m = _RANK_FILE.fullmatch(os.path.basename(rel))
    return int(m.group(1)) if m else None


def _where(info: Any) -> dict[str, Any]:
    if info is None:
        return {"file": None, "offset": None, "length": None, "rank": None}
    rel = info.relative_path
    return {"file": rel, "offset": info.offset, "length": info.length,
            "rank": _rank_of(rel) if isinstance(rel, str) else None}


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint at ``path`` as plain data (what ``inspect --json``
    prints): its items in the metadata's order, each tensor with its
    chunks and where they are stored, each bytes item with its entry, and
    the data files with their sizes."""
    reader, md = _open(path)
    sd = reader.storage_data
    items: list[dict[str, Any]] = []
    files: dict[str, int | None] = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if _is_tensor(tmd):
            chunks = []
            for c in tmd.chunks:
                w = _where(sd.get((fqn, tuple(c.offsets))))
                chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes), **w})
            items.append({"key": fqn, "kind": "tensor",
                          "dtype": _dtype_name(tmd.properties.dtype),
                          "shape": list(tmd.size), "chunks": chunks,
                          "stored_bytes": sum(c["length"] or 0 for c in chunks)})
        else:
            w = _where(sd.get((fqn, None)))
            items.append({"key": fqn, "kind": "bytes", **w, "stored_bytes": w["length"] or 0})
    for it in items:
        for loc in it["chunks"] if it["kind"] == "tensor" else [it]:
            rel = loc["file"]
            if isinstance(rel, str) and rel not in files:
                files[rel] = _file_size(reader, path, rel)
    ranks = sorted({r for r in (_rank_of(f) for f in files) if r is not None})
    return {
        "path": os.fspath(path),
        "version": getattr(md, "version", None),
        "items": items,
        "files": [{"file": f, "size": s, "rank": _rank_of(f)} for f, s in sorted(files.items())],
        "ranks": ranks,
        "total_bytes": sum(s or 0 for s in files.values()),
    }


@dataclasses.dataclass
class VerifyReport:
    """What :func:`verify` found: ``problems`` (the checkpoint is damaged
    when any), ``warnings`` (sound, but worth knowing), and what it
    checked."""

    path: str
    problems: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    items: int = 0
    records: int = 0
    checked_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


class _Discard:
    """A planner that takes whatever a verification read gives and drops it:
    tensors into scratch of the chunk's shape, bytes items unread further
    (the reader has checked them before handing them over)."""

    def __init__(self, dtypes: dict[str, Any]) -> None:
        self.dtypes = dtypes

    def resolve_tensor(self, item: Any) -> Any:
        import torch

        return torch.empty(tuple(item.lengths), dtype=self.dtypes[item.dest_index.fqn])

    def commit_tensor(self, item: Any, tensor: Any) -> None:
        pass

    def load_bytes(self, item: Any, value: Any) -> None:
        pass


def _whole_read(fqn: str, chunk: tuple[int, tuple, tuple] | None = None,
                dest: tuple[int, ...] | None = None) -> Any:
    """The read item of bytes item ``fqn`` (``chunk`` None), or of the
    whole saved chunk ``(index, offsets, sizes)`` of tensor ``fqn`` into a
    destination at ``dest`` (default: the chunk's own buffer, at 0)."""
    from .metadata import MetadataIndex
    from .planner import LoadItemType, ReadItem

    if chunk is None:
        idx = MetadataIndex(fqn)
        return ReadItem(type=LoadItemType.BYTE_IO, dest_index=idx, dest_offsets=(),
                        storage_index=idx, storage_offsets=(), lengths=())
    i, offs, sizes = chunk
    zero = (0,) * len(offs)
    idx = MetadataIndex(fqn, offs, i)
    return ReadItem(type=LoadItemType.TENSOR, dest_index=idx,
                    dest_offsets=zero if dest is None else dest, storage_index=idx,
                    storage_offsets=zero, lengths=sizes)


def _read_items(md: Any) -> tuple[list[Any], list[str]]:
    """A whole-chunk read item for every chunk and bytes item, and the
    problems of the metadata itself (chunks outside their tensor, volumes
    that do not add up)."""
    items, problems = [], []
    for fqn, tmd in md.state_dict_metadata.items():
        if not _is_tensor(tmd):
            items.append(_whole_read(fqn))
            continue
        size = tuple(tmd.size)
        volume = 0
        for i, c in enumerate(tmd.chunks):
            offs, sizes = tuple(c.offsets), tuple(c.sizes)
            if len(offs) != len(size) or len(sizes) != len(size) or any(
                    o < 0 or n < 0 or o + n > s for o, n, s in zip(offs, sizes, size)):
                problems.append(f"{fqn!r}: chunk {i} at {list(offs)} of {list(sizes)} lies "
                                f"outside the tensor's shape {list(size)}")
                continue
            volume += math.prod(sizes)
            if math.prod(sizes):  # an empty chunk has nothing stored to check
                items.append(_whole_read(fqn, (i, offs, sizes)))
        if volume != math.prod(size):
            problems.append(f"{fqn!r}: its chunks hold {volume} elements, its shape "
                            f"{list(size)} {math.prod(size)} (missing or overlapping chunks)")
    return items, problems


_BAD = (StorageFormatError, OSError, ShardstateError)


def _each(fn: Callable[[list[Any]], list[Any]], xs: list[Any],
          problems: list[str]) -> list[Any]:
    """``fn(xs)``, or where it fails, ``fn`` of each one alone: the ones
    it fails on become problems (the whole list first, one by one only
    when one fails)."""
    try:
        return fn(xs)
    except _BAD:
        pass
    out = []
    for x in xs:
        try:
            out += fn([x])
        except _BAD as e:
            problems.append(str(e))
    return out


def _batches(reqs: list[Any], budget: int) -> Iterable[list[Any]]:
    out: list[Any] = []
    used = 0
    for r in reqs:
        if out and used + r.info.length > budget:
            yield out
            out, used = [], 0
        out.append(r)
        used += r.info.length
    if out:
        yield out


def verify(path: str | os.PathLike, progress: Progress | None = None) -> VerifyReport:
    """Checks the checkpoint at ``path`` through and through (see the
    module's text). ``progress`` is called with the record bytes checked
    since its last call and the bytes there are to check. Raises
    CheckpointUnreadable when there is no metadata to start from; every
    other finding is in the report."""
    reader, md = _open(path)
    report = VerifyReport(os.fspath(path))
    items, report.problems = _read_items(md)
    report.items = len(md.state_dict_metadata)
    want = {(it.storage_index.fqn, None if it.storage_index.offset is None
             else tuple(it.storage_index.offset)) for it in items}
    sd = md.storage_data
    extra = sum(1 for k in sd.keys() if _index_key(k) not in want) if len(sd) != len(want) else 0
    if extra:
        report.warnings.append(f"{extra} storage entries name no item of the metadata")
    reqs = _each(reader._records.requests, items, report.problems)
    dtypes = {fqn: tmd.properties.dtype for fqn, tmd in md.state_dict_metadata.items()
              if _is_tensor(tmd)}
    plain = [r for r in reqs if r.item.type.name != "BYTE_IO" and not transforms(r.info)]
    other = [r for r in reqs if r.item.type.name == "BYTE_IO" or transforms(r.info)]
    unchecked = 0
    total = sum(r.info.length for r in reqs)
    for batch in _batches(plain, _VERIFY_BATCH):
        try:
            with _staged(reader, batch):
                unchecked += _check_batch(reader, batch, dtypes, report)
        except _BAD as e:  # the batch could not be fetched
            report.problems.append(str(e))
        done = sum(r.info.length for r in batch)
        report.checked_bytes += done
        if progress is not None:
            progress(done, total)
    for r in other:
        reads = _Reads(reader._records, True, False, _CudaDest(), transforms=reader._transforms)
        try:
            with _staged(reader, [r]):
                reads.local([r], _Discard(dtypes))
        except (OSError, ShardstateError, StorageFormatError, ValueError) as e:
            report.problems.append(str(e))
        report.records += 1
        report.checked_bytes += r.info.length
        if progress is not None:
            progress(r.info.length, total)
    if unchecked:
        report.warnings.append(
            f"{unchecked} records carry no CRC-32 (torch.serialization.set_crc32_options(False) "
            "when they were saved): their data could not be checked")
    mirror = _mirror(reader)
    if mirror is not None:  # the objects' URLs, not their local copies' paths
        report.problems = [mirror.rename(p) for p in report.problems]
    return report


def _check_batch(reader: FileSystemReader, batch: list[Any], dtypes: dict[str, Any],
                 report: VerifyReport) -> int:
    """One batch of plain records recognised, matched against their chunks,
    and their CRC-32s checked; the number that carry no CRC."""
    recs = _each(lambda rs: list(zip(rs, reader._records.parse(rs))), batch, report.problems)
    rows, files, named = [], {}, []
    unchecked = 0
    for r, rec in recs:
        want_shape = tuple(r.item.lengths)
        if tuple(rec.shape) != want_shape or f"torch.{rec.dtype}" != str(dtypes[r.key]):
            report.problems.append(
                f"{r.where()}: the record holds {rec.dtype} {list(rec.shape)}, the "
                f"metadata says {_dtype_name(dtypes[r.key])} {list(want_shape)}")
            continue
        if not rec.checked:
            unchecked += 1
            continue
        f = files.setdefault(r.file.path, len(files))
        rows.append((f, ssio.REC_RANGE, rec.data_offset, rec.data_length, rec.data_crc32,
                     1, 0, 0, 0, 0, 0, 0, 0, 0))
        named.append(r)
    report.records += len(recs)
    _check_rows(list(files), rows, named, report.problems)
    return unchecked


def _check_rows(paths: list[str], rows: list[tuple], named: list[Any],
                problems: list[str]) -> None:
    """Every row's record read and its CRC-32 checked by the engine, going
    on past each mismatch."""
    table = np.array(rows, np.int64).reshape(-1, len(ssio.REC_COLUMNS))
    start = 0
    while start < len(table):
        try:
            ssio.read_records(paths, table[start:], np.zeros(0, np.int64), verify=True,
                              checksum=False)
            return
        except ChecksumError as e:
            k = getattr(e, "job", None)
            if not isinstance(k, int) or not 0 <= k < len(table) - start:
                problems.append(str(e))
                return
            r = named[start + k]
            problems.append(f"CRC-32 mismatch in {r.where()}: its data does not match the CRC "
                            f"{int(table[start + k, 4]):08x} stored in its record")
            start += k + 1
        except (OSError, ShardstateError) as e:
            problems.append(str(e))
            return


# --------------------------------------------------------------------------
# diff
# --------------------------------------------------------------------------


class _Into:
    """A planner that reads every chunk of the keys asked for into one
    whole tensor per key, and keeps bytes items' stored bytes."""

    def __init__(self, full: dict[str, Any]) -> None:
        self.full = full
        self.raw: dict[str, bytes] = {}

    def resolve_tensor(self, item: Any) -> Any:
        t = self.full[item.dest_index.fqn]
        for d, (o, n) in enumerate(zip(item.dest_offsets, item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, item: Any, tensor: Any) -> None:
        pass

    def load_bytes(self, item: Any, value: Any) -> None:
        self.raw[item.dest_index.fqn] = value.read()


def _load_keys(reader: FileSystemReader, md: Any, keys: list[str]) -> _Into:
    import torch

    full, items = {}, []
    for fqn in keys:
        tmd = md.state_dict_metadata[fqn]
        if not _is_tensor(tmd):
            items.append(_whole_read(fqn))
            continue
        full[fqn] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
        for i, c in enumerate(tmd.chunks):
            offs = tuple(c.offsets)
            if math.prod(c.sizes):
                items.append(_whole_read(fqn, (i, offs, tuple(c.sizes)), dest=offs))
    planner = _Into(full)
    reads = _Reads(reader._records, True, False, _CudaDest(), transforms=reader._transforms)
    reqs = reader._records.requests(items)
    with _staged(reader, reqs):
        reads.local(reqs, planner)
    return planner


def _same_bytes_item(a: bytes, b: bytes) -> bool:
    if a == b:
        return True
    import io

    import torch

    try:  # the same object pickled differently (weights_only: no code runs)
        x = torch.load(io.BytesIO(a), weights_only=True)
        y = torch.load(io.BytesIO(b), weights_only=True)
        return bool(x == y) if not isinstance(x, torch.Tensor) else torch.equal(x, y)
    except Exception:
        return False


def _value_diff(key: str, x: Any, y: Any, rtol: float, atol: float) -> str | None:
    import torch

    if rtol == 0 and atol == 0:
        if torch.equal(x, y) or (x.is_floating_point() and torch.equal(x.isnan(), y.isnan())
                                 and torch.equal(x.nan_to_num(), y.nan_to_num())):
            return None
    elif torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
        return None
    if x.is_complex() or x.is_floating_point():
        d = (x.to(torch.complex128 if x.is_complex() else torch.float64)
             - y.to(torch.complex128 if y.is_complex() else torch.float64)).abs()
        d = d.nan_to_num(nan=math.inf)
    else:
        d = (x.to(torch.int64) - y.to(torch.int64)).abs() if x.dtype != torch.bool else (x ^ y)
    n = int((d != 0).sum())
    return f"{key}: values differ in {n} of {x.numel()} elements (max abs difference " \
           f"{float(d.max()):.6g})"


def diff(a: str | os.PathLike, b: str | os.PathLike, *, rtol: float = 0.0,
         atol: float = 0.0, progress: Progress | None = None) -> list[str]:
    """The differences between checkpoints ``a`` and ``b``, one line each
    (none: the same keys, dtypes, shapes and values, within ``rtol`` /
    ``atol`` for tensors; NaNs equal NaNs). Sharding does not matter: each
    tensor is compared whole. ``progress`` is called with the tensor bytes
    compared since its last call and the bytes there are to compare."""
    ra, ma = _open(a)
    rb, mb = _open(b)
    out: list[str] = []
    ka, kb = ma.state_dict_metadata, mb.state_dict_metadata
    out += [f"{k}: only in {a}" for k in ka if k not in kb]
    out += [f"{k}: only in {b}" for k in kb if k not in ka]
    common = []
    for k in ka:
        if k not in kb:
            continue
        x, y = ka[k], kb[k]
        if _is_tensor(x) != _is_tensor(y):
            out.append(f"{k}: a {'tensor' if _is_tensor(x) else 'bytes item'} in {a}, a "
                       f"{'tensor' if _is_tensor(y) else 'bytes item'} in {b}")
        elif _is_tensor(x) and (x.properties.dtype != y.properties.dtype
                                or tuple(x.size) != tuple(y.size)):
            out.append(f"{k}: {_dtype_name(x.properties.dtype)} {list(x.size)} in {a}, "
                       f"{_dtype_name(y.properties.dtype)} {list(y.size)} in {b}")
        else:
            common.append(k)
    size = {k: math.prod(ka[k].size) * _itemsize(ka[k].properties.dtype)
            if _is_tensor(ka[k]) else 0 for k in common}
    total = sum(size.values())  # tensor bytes of one side to compare
    batch: list[str] = []
    used = 0

    def flush() -> None:
        pa, pb = _load_keys(ra, ma, batch), _load_keys(rb, mb, batch)
        for k in batch:
            if k in pa.full:
                line = _value_diff(k, pa.full[k], pb.full[k], rtol, atol)
                if line:
                    out.append(line)
            elif not _same_bytes_item(pa.raw[k], pb.raw[k]):
                out.append(f"{k}: bytes items differ")
        if progress is not None:
            progress(used, total)

    for k in common:
        n = size[k]
        if batch and used + n > _DIFF_BATCH:
            flush()
            batch, used = [], 0
        batch.append(k)
        used += n
    if batch:
        flush()
    return out


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()
