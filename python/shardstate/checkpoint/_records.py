"""Where a checkpoint's records are, and what they hold.

A tensor record is a ``torch.save`` zip (docs/FORMAT.md). A save frames
its records in C (``ss_zipwrite``, through ``_fs_write._plan``); the Python
plans here (``_record_plan``: the header, which depends only on dtype and
shape, and ``_Trailer``, the trailer for a CRC) serve the stream-transform
writer and the reader's comparison with the dense record. The reader
finds an item through ``storage_data`` (``_Records.requests``: paths confined
to the checkpoint directory, every offset and length checked against the
file) and then recognises its record (``_Records.parse``): in C (``ss_zipread``,
through ``_core.parse_tensor_record``); a record it refuses is compared
with the dense record we would write for the chunk the metadata describes,
and any other is parsed strictly by the reference
(``_zipfmt.parse_record``), which decides. Both work through a
read-only mapping of the file that touches only the header and trailer pages,
or (``parse_buffer``) on a record held in memory, which is how an item stored
through stream transforms (its ``transform_descriptors``) is seen once they
are undone; ``record_limit`` bounds what they may produce.

Thread safety: a ``_Records`` serves one load at a time; the plan cache is
an ``lru_cache`` (safe to share).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import _core
from .. import io as ssio
from .._core import ShardstateError
from .._util import contiguous_strides
from . import _mdlazy
from ._zipfmt import (
    RecordFormatError,
    TensorRecordPlan,
    _hash_combine,
    parse_record,
    plan_tensor_record,
)


class StorageFormatError(ShardstateError, ValueError):
    """A checkpoint's files or storage data are malformed or unsafe (a path
    outside the directory, an item past the end of its file, a bad record)."""


# Its public home (shardstate.checkpoint.filesystem re-exports it).
StorageFormatError.__module__ = "shardstate.checkpoint.filesystem"


# A tensor record may be this much larger than the dense record of its chunk
# (a strided record's pickle names its strides): the bound on what an item's
# stream transforms may produce (record_limit).
RECORD_SLACK = 64 << 10


# The CRC-32 of a tensor record's data, as the writer computed it, kept in
# the record's storage entry in the metadata (an attribute torch's
# _StorageInfo does not declare: torch's reader carries it along unused,
# shardstate's reader checks it against the record's own CRC). Data files
# stay byte for byte torch's, so this is what binds a metadata file to the
# data it was written with: over the data of another save (two saves mixed
# in one directory, a file copied in) the CRCs disagree and the load is
# refused. Metadata written by torch has none: nothing to check.
DATA_CRC_ATTR = "shardstate_crc32"


def _check_crc(r: _Req, rec: _Rec) -> _Rec:
    want = getattr(r.info, DATA_CRC_ATTR, None)
    if want is not None and want != rec.data_crc32:
        raise StorageFormatError(
            f"{r.where()}: the record's data CRC-32 is {rec.data_crc32:#010x} but the metadata "
            f"says {want:#010x}: this metadata was not written with this data file (two saves "
            "mixed in one directory?); refused")
    return rec


def transforms(info: Any) -> Any:
    """An item's ``transform_descriptors`` (None or empty: stored as it is)."""
    return getattr(info, "transform_descriptors", None)


def _index_key(index: Any) -> tuple[str, tuple[int, ...] | None]:
    """A MetadataIndex (torch's or ours) as a plain hashable key."""
    off = index.offset
    return (index.fqn, None if off is None else tuple(off))


_CODES = _core.error_codes()


def _kind(path: str | os.PathLike) -> str:
    """What the non-regular file at ``path`` is, for a refusal's text."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "not a plain file"
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a plain file")


@contextlib.contextmanager
def file_errors(path: str | os.PathLike, what: str) -> Iterator[None]:
    """The core's refusals of a file a load reads, in a load's terms: a
    missing file is FileNotFoundError, one that is not a regular file (a
    FIFO, a device, a directory: opened without blocking, then refused), of
    a size out of bounds or changing while read is StorageFormatError.
    System failures stay ShardstateIOError (an OSError)."""
    try:
        yield
    except ShardstateError as e:
        code = getattr(e, "code", None)
        if isinstance(e, OSError) and e.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, f"{what} {os.fspath(path)} is missing",
                                    os.fspath(path)) from None
        if code == _CODES["SS_ENOTREG"]:
            raise StorageFormatError(
                f"{what} {os.fspath(path)} is {_kind(path)}, not a regular file") from None
        if code in (_CODES["SS_ERANGE"], _CODES["SS_ESHORT"]):
            raise StorageFormatError(f"{what} {os.fspath(path)}: {e}") from None
        raise


# --------------------------------------------------------------------------
# Record plans (writer and recognition)
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Locating and recognising records (reader)
# --------------------------------------------------------------------------


def _dense_plan_of(dtype: str, sizes: tuple[Any, ...]) -> tuple[
        str, tuple[int, ...], TensorRecordPlan, _Trailer, tuple[int, ...]] | None:
    shape = tuple(int(n) for n in sizes)
    numel = 1
    for n in shape:
        numel *= n
    try:
        plan, trailer = _record_plan(dtype, shape, None, numel)
    except (RecordFormatError, ValueError):
        return None
    return dtype, shape, plan, trailer, contiguous_strides(shape)


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
    # torch's conj/neg view bits: the values are conj / -1 x the bytes'
    # (such records always go through _copy_out, which applies them)
    conj: bool = False
    neg: bool = False
    # known dense row-major (recognised as the record we would write): a
    # hint for _slab, not part of what the record is
    dense: bool = field(default=False, compare=False)
    # False: torch wrote the record without CRC-32s
    # (torch.serialization.set_crc32_options(False)); data_crc32 is 0 and
    # there is nothing to check its data against
    checked: bool = True


@dataclass
class _File:
    rel: str
    path: str
    size: int


@dataclass
class _Req:
    """A read item, located: its storage entry and its file."""

    item: Any
    info: Any  # _StorageInfo (ours or torch's)
    file: _File

    @property
    def key(self) -> str:
        return str(self.item.dest_index.fqn)

    def where(self) -> str:
        return f"item {self.key!r} in {self.file.path} at offset {self.info.offset}"


def _c_record(mm: Any, off: int, length: int) -> _Rec | None:
    """The record at ``mm[off : off + length]`` recognised by the C parser
    (``ss_zipread``: microseconds, touching only the zip structures and the
    small entries), or None when it refuses it (the caller then asks
    ``expected`` and the reference ``_parsed``, which decide: the C parser
    accepts a subset of what the reference does, with the same results)."""
    view = memoryview(mm)[off : off + length]
    try:
        c = _core.parse_tensor_record(view)
    finally:
        view.release()
    if c is None:
        return None
    dtype, shape, stride, soff, _numel, _rg, doff, dlen, crc, conj, neg, dense = c
    return _Rec(dtype, shape, stride, soff, doff + off, dlen, crc or 0, conj, neg, dense,
                crc is not None)


def _parsed(mm: Any, r: _Req, off: int | None = None, length: int | None = None) -> _Rec:
    """The record at ``mm[off : off + length]`` (by default where
    ``r.info`` says), parsed strictly by the reference parser."""
    if off is None:
        off, length = r.info.offset, r.info.length
    view = memoryview(mm)[off : off + length]
    try:
        p = parse_record(view, base_offset=off)
    except RecordFormatError as e:
        raise StorageFormatError(f"{r.where()}: {e}") from None
    finally:
        view.release()
    return _Rec(p.dtype, p.shape, p.stride, p.storage_offset, p.data_offset, p.data_length,
                p.data_crc32 or 0, p.conj, p.neg, checked=p.data_crc32 is not None)


class _Records:
    """One checkpoint's records as a load sees them: its directory, its
    ``storage_data`` (keyed by ``_index_key``) and its metadata (None before
    ``set_up_storage_reader``)."""

    def __init__(self, path: Path, storage_data: dict[Any, Any], metadata: Any = None) -> None:
        self.path = path
        self.storage_data = storage_data
        self.metadata = metadata
        self._chunk_maps: dict[Any, dict[tuple[int, ...], Any]] = {}
        # (dtype, sizes) -> _dense_plan's answer: many chunks share one shape
        self._dense: dict[tuple[Any, tuple[int, ...]], Any] = {}

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
        with file_errors(full, "checkpoint data file"):
            size = ssio.file_size(full)
        f = files[rel] = _File(rel, full, size)
        return f

    def display(self, text: str) -> str:
        """``text`` naming files as users know them (the files' own paths
        here; an object store's URLs where the files are local copies)."""
        return text

    def requests(self, items: Iterable[Any]) -> list[_Req]:
        """The read items located in their files, in file and offset order."""
        files: dict[str, _File] = {}
        reqs = []
        for item in items:
            try:
                info = self.storage_data[_index_key(item.storage_index)]
            except KeyError:
                raise StorageFormatError(
                    f"{self.path}: no storage entry for {item.storage_index}"
                ) from None
            td = transforms(info)
            if td and (type(td) not in (list, tuple) or not all(type(d) is str for d in td)):
                raise StorageFormatError(
                    f"{self.path}: item {item.storage_index.fqn!r} has transform descriptors "
                    f"{td!r}, expected a list of str"
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

    def chunk(self, index: Any) -> Any:
        """The saved chunk a storage index names, as (tensor metadata,
        chunk), or None."""
        md = self.metadata
        tmd = None if md is None else md.state_dict_metadata.get(index.fqn)
        chunks = getattr(tmd, "chunks", None)
        if not chunks or index.offset is None:
            return None
        want = tuple(index.offset)
        i = index.index
        arrays = _mdlazy.arrays_of(chunks)
        if arrays is not None:  # the reader's compact form: no list made
            offs = arrays[0]
            if not (isinstance(i, int) and 0 <= i < len(offs) and tuple(offs[i].tolist()) == want):
                key = (index.fqn, "index")  # offsets -> position (the last, as below)
                at = self._chunk_maps.get(key)
                if at is None:
                    at = self._chunk_maps[key] = {tuple(o): k for k, o in enumerate(offs.tolist())}
                i = at.get(want)
                if i is None:
                    return None
            return tmd, chunks.make_chunk(i)
        if isinstance(i, int) and 0 <= i < len(chunks) and tuple(chunks[i].offsets) == want:
            return tmd, chunks[i]
        by_offset = self._chunk_maps.get(index.fqn)
        if by_offset is None:
            by_offset = self._chunk_maps[index.fqn] = {tuple(c.offsets): c for c in chunks}
        c = by_offset.get(want)
        return None if c is None else (tmd, c)

    def tensor_reads(self, plans: list[Any]) -> Iterator[tuple[int, Any, Any, Any]]:
        """(rank, read item, chunk key, (metadata, chunk)) for every tensor
        read of every rank's plan whose saved chunk is known and whose
        record is stored as it is (not through stream transforms)."""
        for rank, p in enumerate(plans):
            for it in p.items:
                if it.type.name == "BYTE_IO":
                    continue
                info = self.storage_data.get(_index_key(it.storage_index))
                if info is not None and transforms(info):
                    continue  # each rank reads and checks it whole (_fs_read)
                found = self.chunk(it.storage_index)
                if found is not None:
                    yield rank, it, _index_key(it.storage_index), found

    def _dense_plan(self, r: _Req) -> tuple[str, tuple[int, ...], TensorRecordPlan,
                                             _Trailer, tuple[int, ...]] | None:
        """(dtype, shape, plan, trailer, strides) of the contiguous record
        the metadata predicts for the chunk ``r`` reads, or None."""
        found = self.chunk(r.item.storage_index)
        if found is None:
            return None
        tmd, chunk = found
        key = (tmd.properties.dtype, tuple(chunk.sizes))
        dense = self._dense.get(key, False)
        if dense is False:
            dense = self._dense[key] = _dense_plan_of(str(key[0]), key[1])
        return dense

    def record_limit(self, r: _Req) -> tuple[int, int]:
        """(limit, expected size) of the record a tensor item's stream
        transforms may produce: the dense record of the chunk the metadata
        describes, plus ``RECORD_SLACK`` (a strided record's pickle is a
        little longer). Raises StorageFormatError when the chunk is unknown."""
        dense = self._dense_plan(r)
        if dense is None:
            raise StorageFormatError(
                f"{r.where()}: the metadata describes no chunk of a known dtype for this "
                "item, so the size its stream transforms may produce is unknown; refused")
        plan, trailer = dense[2], dense[3]
        size = plan.data_offset + plan.data_length + len(trailer.template)
        return size + RECORD_SLACK, size

    def expected(self, mm: Any, r: _Req, off: int | None = None,
                 length: int | None = None) -> _Rec | None:
        """The record, if it is byte for byte the contiguous record the
        metadata predicts (what torch and we write for a dense tensor):
        checked by comparing its header and trailer with our own, which is
        stricter than parsing and costs microseconds. None otherwise. The
        record is ``mm[off : off + length]`` (by default where ``r.info``
        says)."""
        dense = self._dense_plan(r)
        if dense is None:
            return None
        dtype, shape, plan, trailer, strides = dense
        if off is None:
            off = r.info.offset
        if length is None:
            length = r.info.length
        dofs, dlen = plan.data_offset, plan.data_length
        if dofs + dlen + len(trailer.template) != length:
            return None
        if mm[off : off + dofs] != plan.header:
            return None
        tail = mm[off + dofs + dlen : off + length]
        crc = struct.unpack_from("<I", tail, 4)[0] if dlen else 0
        if tail != trailer(crc):
            return None
        return _Rec(dtype.removeprefix("torch."), shape, strides, 0, off + dofs, dlen, crc,
                    dense=True)

    def parse_buffer(self, buf: bytearray, r: _Req) -> _Rec:
        """The tensor record held whole in ``buf`` (what an item's stream
        transforms gave), recognised as ``parse`` does; its data offset is
        an offset in ``buf``."""
        rec = _c_record(buf, 0, len(buf)) or self.expected(buf, r, 0, len(buf))
        return _check_crc(r, rec if rec is not None else _parsed(buf, r, 0, len(buf)))

    def parse(self, reqs: list[_Req]) -> list[_Rec]:
        """Locates each tensor record's data through a read-only mapping of
        its file (only the pages holding headers and trailers are touched)."""
        infos: list[_Rec] = []
        i = 0
        while i < len(reqs):
            f = reqs[i].file
            j = i
            while j < len(reqs) and reqs[j].file is f:
                j += 1
            with file_errors(f.path, "checkpoint data file"):
                mapped = ssio.map_file(f.path)
            if len(mapped) < f.size:
                mapped.close()
                raise StorageFormatError(f"{f.path} shrank while being read")
            mm = memoryview(mapped)
            try:
                for r in reqs[i:j]:
                    rec = _c_record(mm, r.info.offset, r.info.length) or self.expected(mm, r)
                    if rec is None:
                        rec = _parsed(mm, r)
                    infos.append(_check_crc(r, rec))
            finally:
                mm.release()
                try:
                    mapped.close()
                except BufferError:  # a traceback still holds a view; GC unmaps it
                    pass
            i = j
        return infos
