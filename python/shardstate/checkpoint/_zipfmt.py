"""The torch.save zip record that DCP writes for every item, without torch.

Every item in a ``.distcp`` file is one complete ``torch.save`` archive
(docs/FORMAT.md, section 3). This module writes such a record for one
contiguous or dense CPU tensor, byte-identical to what torch 2.13 writes, and
parses one strictly, without unpickling anything.

Writing is split so that the tensor bytes never pass through Python:
``plan_tensor_record`` returns the header (everything before the storage
bytes) and a ``trailer(crc)`` function for everything after them. A writer
emits the header, streams the storage bytes from the tensor's own memory while
computing their CRC-32, then emits ``trailer(crc)``. Only the trailer depends
on the data (through its CRC); every offset depends only on sizes.

A save's records are framed by the C port of this writer
(csrc/core/ss_zipwrite.c, ``_core.RecordPlan``); tests/test_zipwrite.py
holds the two byte-identical. This one serves stream transforms, the
reader's recognition of records and the tests.

Invariants: pure Python, no torch import, no pickle.load anywhere. Every
function is pure and thread-safe. ``parse_record`` raises only
``RecordFormatError`` for any input bytes, however malformed.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._util import contiguous_strides

__all__ = [
    "DTYPES",
    "RecordFormatError",
    "RecordEntry",
    "RecordInfo",
    "TensorRecordPlan",
    "bytes_record",
    "parse_record",
    "plan_tensor_record",
    "tensor_record",
]

BytesLike = bytes | bytearray | memoryview | np.ndarray


class RecordFormatError(ValueError):
    """A record is not a torch.save archive of the shape DCP writes."""


# --------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class DType:
    name: str  # torch's attribute name: torch.<name>
    itemsize: int
    # Legacy typed-storage class (``torch.FloatStorage``) pickled by
    # _rebuild_tensor_v2; None for dtypes torch pickles with
    # _rebuild_tensor_v3 (UntypedStorage plus a trailing ``torch.<dtype>``).
    storage: str | None


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float64", 8, "DoubleStorage"),
        DType("float32", 4, "FloatStorage"),
        DType("float16", 2, "HalfStorage"),
        DType("bfloat16", 2, "BFloat16Storage"),
        DType("int64", 8, "LongStorage"),
        DType("int32", 4, "IntStorage"),
        DType("int16", 2, "ShortStorage"),
        DType("int8", 1, "CharStorage"),
        DType("uint8", 1, "ByteStorage"),
        DType("bool", 1, "BoolStorage"),
        DType("complex64", 8, "ComplexFloatStorage"),
        DType("complex128", 16, "ComplexDoubleStorage"),
        DType("uint16", 2, None),
        DType("uint32", 4, None),
        DType("uint64", 8, None),
        DType("float8_e4m3fn", 1, None),
        DType("float8_e5m2", 1, None),
        DType("float8_e4m3fnuz", 1, None),
        DType("float8_e5m2fnuz", 1, None),
        DType("float8_e8m0fnu", 1, None),
        DType("float4_e2m1fn_x2", 1, None),
        DType("complex32", 4, None),
    )
}
_BY_STORAGE = {d.storage: d for d in DTYPES.values() if d.storage is not None}
_V3_DTYPES = {d.name: d for d in DTYPES.values() if d.storage is None}


def _dtype(name: str) -> DType:
    if name.startswith("torch."):
        name = name[len("torch.") :]
    try:
        return DTYPES[name]
    except KeyError:
        raise RecordFormatError(
            f"unsupported dtype {name!r}; expected one of {sorted(DTYPES)}"
        ) from None


# --------------------------------------------------------------------------
# data.pkl: the protocol-2 pickle torch.save writes for one tensor
# --------------------------------------------------------------------------

_REBUILD_V2 = ("torch._utils", "_rebuild_tensor_v2")
_REBUILD_V3 = ("torch._utils", "_rebuild_tensor_v3")
_ORDERED_DICT = ("collections", "OrderedDict")
_UNTYPED_STORAGE = ("torch.storage", "UntypedStorage")


class _Pickler:
    """Emits exactly the opcodes CPython's protocol-2 Pickler would for the
    objects torch.save pickles for a tensor: ints, strs, tuples, globals, with
    memo puts (BINPUT) where the Pickler memoizes (str, non-empty tuple,
    global, reduce result)."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo = 0

    def put(self) -> None:
        # Fewer than 256 memo entries ever occur here, so always BINPUT.
        self.out += b"q" + bytes((self.memo,))
        self.memo += 1

    def int(self, v: int) -> None:
        if v < 0:
            raise RecordFormatError(f"negative value {v} in tensor geometry")
        if v <= 0xFF:
            self.out += b"K" + bytes((v,))
        elif v <= 0xFFFF:
            self.out += b"M" + struct.pack("<H", v)
        elif v <= 0x7FFFFFFF:
            self.out += b"J" + struct.pack("<i", v)
        else:
            enc = v.to_bytes((v.bit_length() >> 3) + 1, "little", signed=True)
            self.out += b"\x8a" + bytes((len(enc),)) + enc

    def str(self, s: str) -> None:
        b = s.encode("utf-8")
        self.out += b"X" + struct.pack("<I", len(b)) + b
        self.put()

    def glob(self, mod: str, name: str) -> None:
        self.out += b"c" + mod.encode() + b"\n" + name.encode() + b"\n"
        self.put()

    def int_tuple(self, t: Sequence[int]) -> None:
        if not t:
            self.out += b")"
            return
        if len(t) > 3:
            self.out += b"("
        for v in t:
            self.int(v)
        self.out += b"t" if len(t) > 3 else b"\x85\x86\x87"[len(t) - 1 : len(t)]
        self.put()


def _tensor_pickle(
    dt: DType, storage_numel: int, shape: Sequence[int], stride: Sequence[int]
) -> bytes:
    p = _Pickler()
    p.glob(*(_REBUILD_V2 if dt.storage else _REBUILD_V3))
    p.out += b"(("  # args tuple, then the persistent id tuple
    p.str("storage")
    if dt.storage:
        p.glob("torch", dt.storage)
        numel = storage_numel  # legacy typed storage: counted in elements
    else:
        p.glob(*_UNTYPED_STORAGE)
        numel = storage_numel * dt.itemsize  # untyped storage: in bytes
    p.str("0")  # storage key: record data/0
    p.str("cpu")
    p.int(numel)
    p.out += b"t"
    p.put()
    p.out += b"Q"  # BINPERSID
    p.int(0)  # storage_offset
    p.int_tuple(shape)
    p.int_tuple(stride)
    p.out += b"\x89"  # requires_grad=False (DCP saves detached tensors)
    p.glob(*_ORDERED_DICT)
    p.out += b")R"  # OrderedDict() backward hooks
    p.put()
    if not dt.storage:
        p.glob("torch", dt.name)
    p.out += b"t"
    p.put()
    p.out += b"R"
    p.put()
    p.out += b"."
    return bytes(p.out)


# --------------------------------------------------------------------------
# The zip container, as PyTorchStreamWriter + its bundled miniz write it
# --------------------------------------------------------------------------

_ALIGN = 64
_U32 = 0xFFFFFFFF
_LFH = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_CDH = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_Z64_EOCD = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_Z64_LOC = struct.Struct("<IIQI")  # 20 bytes
_SIG_LFH, _SIG_CDH, _SIG_DD = 0x04034B50, 0x02014B50, 0x08074B50
_SIG_EOCD, _SIG_Z64_EOCD, _SIG_Z64_LOC = 0x06054B50, 0x06064B50, 0x07064B50
_FLAGS = 0x0808  # bit 3: sizes/CRC in a data descriptor; bit 11: UTF-8 names
_FLAGS_EMPTY = 0x0800  # miniz writes an empty record without a data descriptor
_ARCHIVE = "archive"  # torch.save to a file object names its folder "archive"
_FORMAT_VERSION = b"1"
_STORAGE_ALIGNMENT = b"64"
_BYTEORDER = b"little"
_VERSION = b"3\n"
_SID_NAME = ".data/serialization_id"
_M64 = (1 << 64) - 1


def _flags(size: int) -> int:
    return _FLAGS if size else _FLAGS_EMPTY


def _zip64_extra(size: int | None, comp: int | None, ofs: int | None) -> bytes:
    body = b"".join(struct.pack("<Q", v) for v in (size, comp, ofs) if v is not None)
    return struct.pack("<HH", 1, len(body)) + body if body else b""


def _local_header(cursor: int, name: bytes, size: int) -> tuple[bytes, bool]:
    """Local file header, name and extra fields of a record starting at
    ``cursor``; the second value says whether it carries a zip64 extra (which
    also makes its data descriptor 64-bit)."""
    big, far = size >= _U32, cursor >= _U32
    # miniz writes this extra before it knows the compressed size, so for a
    # big record the local copy says comp=0 (verified against torch's bytes).
    z64 = _zip64_extra(size if big else None, 0 if big else None, cursor if far else None)
    start = cursor + _LFH.size + len(name) + len(z64) + 4
    pad = -start % _ALIGN
    extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    lfh = _LFH.pack(_SIG_LFH, 0, _flags(size), 0, 0, 0, 0, 0, 0, len(name), len(extra))
    return lfh + name + extra, bool(z64)


def _descriptor(crc: int, size: int, z64: bool) -> bytes:
    if size == 0:
        return b""
    if z64:
        return struct.pack("<IIQQ", _SIG_DD, crc, size, size)
    return struct.pack("<IIII", _SIG_DD, crc, size, size)


def _central_header(name: bytes, crc: int, size: int, ofs: int) -> bytes:
    big, far = size >= _U32, ofs >= _U32
    z64 = _zip64_extra(size if big else None, size if big else None, ofs if far else None)
    s32, o32 = min(size, _U32), min(ofs, _U32)
    h = _CDH.pack(
        _SIG_CDH, 0, 0, _flags(size), 0, 0, 0, crc, s32, s32, len(name), len(z64), 0, 0, 0, 0, o32
    )
    return h + name + z64


def _end_records(n: int, cd_ofs: int, cd_size: int) -> bytes:
    z64_ofs = cd_ofs + cd_size
    return (
        _Z64_EOCD.pack(_SIG_Z64_EOCD, 44, 0x031E, 0x002D, 0, 0, n, n, cd_size, cd_ofs)
        + _Z64_LOC.pack(_SIG_Z64_LOC, 0, z64_ofs, 1)
        + _EOCD.pack(_SIG_EOCD, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                     min(cd_size, _U32), min(cd_ofs, _U32), 0)
    )


def _std_hash(b: bytes) -> int:
    """libstdc++ std::hash<std::string> on 64-bit (std::_Hash_bytes, a
    MurmurHash64A variant with seed 0xc70f6907)."""
    mul = (0xC6A4A793 << 32) + 0x5BD1E995
    n = len(b)
    h = (0xC70F6907 ^ (n * mul)) & _M64
    end = n & ~7
    for i in range(0, end, 8):
        d = (int.from_bytes(b[i : i + 8], "little") * mul) & _M64
        d = ((d ^ (d >> 47)) * mul) & _M64
        h = ((h ^ d) * mul) & _M64
    if n & 7:
        h = ((h ^ int.from_bytes(b[end:], "little")) * mul) & _M64
    h = ((h ^ (h >> 47)) * mul) & _M64
    return h ^ (h >> 47)


def _hash_combine(seed: int, v: int) -> int:
    """c10::hash_combine on 64-bit size_t."""
    return (seed ^ ((v + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _M64)) & _M64


def _serialization_id(names: Sequence[str], crcs: Sequence[int]) -> bytes:
    """PyTorchStreamWriter::writeSerializationId: 20 digits of a hash over the
    record names, then 20 digits of a hash over the records' CRC-32s.

    torch folds the names in its unordered_set's iteration order; for the
    small fixed sets written here that order is the reverse of insertion
    (checked against torch's bytes in tests/test_zipfmt.py)."""
    hn = 0
    for nm in reversed(names):
        hn = _hash_combine(hn, _std_hash(nm.encode()))
    hc = 0
    for c in crcs:
        hc = _hash_combine(hc, c)
    return b"%020d%020d" % (hn, hc)


_Record = tuple[str, bytes | int]  # (name, payload) or (name, size of streamed data)


def _assemble(records: Sequence[_Record], stream_crc: int) -> tuple[list[bytes | None], int]:
    """Lays out the archive. At most one record has an int payload (its size):
    its bytes are streamed by the caller and represented here by a None chunk.
    Returns the chunks and the streamed record's offset in the archive."""
    chunks: list[bytes | None] = []
    cd: list[bytes] = []
    names: list[str] = []
    crcs: list[int] = []
    cursor = 0
    stream_ofs = -1

    def add(name: str, payload: bytes | int) -> None:
        nonlocal cursor, stream_ofs
        full = f"{_ARCHIVE}/{name}".encode()
        size = payload if isinstance(payload, int) else len(payload)
        crc = stream_crc if isinstance(payload, int) else zlib.crc32(payload)
        head, z64 = _local_header(cursor, full, size)
        chunks.append(head)
        if isinstance(payload, int):
            stream_ofs = cursor + len(head)
            chunks.append(None)
        else:
            chunks.append(payload)
        desc = _descriptor(crc, size, z64)
        chunks.append(desc)
        cd.append(_central_header(full, crc, size, cursor))
        cursor += len(head) + size + len(desc)
        names.append(name)
        if size:  # torch hashes the CRCs it sees in data descriptors
            crcs.append(crc)

    for name, payload in records:
        add(name, payload)
    add(_SID_NAME, _serialization_id(names, crcs))
    cd_bytes = b"".join(cd)
    chunks.append(cd_bytes)
    chunks.append(_end_records(len(cd), cursor, len(cd_bytes)))
    return chunks, stream_ofs


def _prefix_records(pickle_bytes: bytes) -> list[_Record]:
    return [
        ("data.pkl", pickle_bytes),
        (".format_version", _FORMAT_VERSION),
        (".storage_alignment", _STORAGE_ALIGNMENT),
        ("byteorder", _BYTEORDER),
    ]


# --------------------------------------------------------------------------
# Writer API
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRecordPlan:
    """A tensor record, minus the storage bytes.

    ``header`` ends where the storage bytes begin, so ``data_offset ==
    len(header)`` (a multiple of 64 inside the record). After the
    ``data_length`` storage bytes comes ``trailer(crc32_of_the_data)``."""

    header: bytes
    data_offset: int
    data_length: int
    _records: tuple[_Record, ...]

    def trailer(self, data_crc32: int) -> bytes:
        if not 0 <= data_crc32 <= _U32:
            raise ValueError(f"data_crc32 must be an unsigned 32-bit value, got {data_crc32}")
        chunks, _ = _assemble(self._records, data_crc32)
        i = chunks.index(None)
        return b"".join(c for c in chunks[i + 1 :] if c is not None)

    @property
    def total_length(self) -> int:
        return self.data_offset + self.data_length + len(self.trailer(0))


def plan_tensor_record(
    dtype: str,
    shape: Sequence[int],
    stride: Sequence[int] | None = None,
    storage_numel: int | None = None,
) -> TensorRecordPlan:
    """Plans the record torch.save writes for a CPU tensor with storage
    offset 0 whose storage holds ``storage_numel`` elements.

    ``stride`` defaults to contiguous. ``storage_numel`` defaults to the span
    the strides reach (numel for a dense tensor), which is what DCP's clone of
    a view produces."""
    dt = _dtype(dtype)
    shape = tuple(int(n) for n in shape)
    stride = contiguous_strides(shape) if stride is None else tuple(int(s) for s in stride)
    if len(stride) != len(shape):
        raise ValueError(f"stride {stride} does not match shape {shape}")
    if any(n < 0 for n in shape) or any(s < 0 for s in stride):
        raise ValueError(f"negative size or stride: shape {shape}, stride {stride}")
    span = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    if storage_numel is None:
        storage_numel = span
    if storage_numel < span:
        raise ValueError(
            f"storage of {storage_numel} elements is too small for shape {shape} stride {stride}"
        )
    nbytes = storage_numel * dt.itemsize
    records = tuple(_prefix_records(_tensor_pickle(dt, storage_numel, shape, stride))) + (
        ("data/0", nbytes),
        ("version", _VERSION),
    )
    chunks, data_ofs = _assemble(records, 0)
    header = b"".join(c for c in chunks[: chunks.index(None)] if c is not None)
    assert len(header) == data_ofs and data_ofs % _ALIGN == 0
    return TensorRecordPlan(header, data_ofs, nbytes, records)


def tensor_record(
    data: BytesLike,
    dtype: str,
    shape: Sequence[int],
    stride: Sequence[int] | None = None,
    storage_numel: int | None = None,
) -> tuple[bytes, int, bytes]:
    """(header, data_offset, trailer) for a tensor whose storage bytes
    (little-endian) are ``data``; the record is header + data + trailer."""
    mv = memoryview(data).cast("B")
    itemsize = _dtype(dtype).itemsize
    if storage_numel is None:
        if len(mv) % itemsize:
            raise ValueError(f"{len(mv)} bytes is not a whole number of {dtype} elements")
        storage_numel = len(mv) // itemsize
    plan = plan_tensor_record(dtype, shape, stride, storage_numel)
    if len(mv) != plan.data_length:
        raise ValueError(f"data has {len(mv)} bytes, the storage needs {plan.data_length}")
    return plan.header, plan.data_offset, plan.trailer(zlib.crc32(mv))


def bytes_record(pickle_bytes: bytes) -> bytes:
    """The record torch.save writes for an object whose protocol-2 pickle
    (with no tensors or storages in it) is ``pickle_bytes``: DCP's BYTE_IO
    items, e.g. ``b"\\x80\\x02K\\x03."`` for the int 3."""
    records = _prefix_records(bytes(pickle_bytes)) + [("version", _VERSION)]
    chunks, _ = _assemble(records, 0)
    return b"".join(c for c in chunks if c is not None)


# --------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordEntry:
    name: str  # without the "<archive>/" prefix
    header_offset: int  # of the local file header, absolute (base_offset added)
    data_offset: int  # absolute
    size: int
    crc32: int


@dataclass(frozen=True)
class RecordInfo:
    archive: str
    entries: tuple[RecordEntry, ...]
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements
    storage_numel: int  # in elements
    requires_grad: bool
    data_offset: int  # absolute offset of the storage bytes
    data_length: int
    data_crc32: int | None  # as stored in the archive; None: it holds no CRC-32s
    conj: bool = False  # the tensor is the conjugate of its storage's values
    neg: bool = False  # ... or their negation (torch's conj/neg view bits)


_MAX_ENTRIES = 64
_MAX_PICKLE = 1 << 20
_MAX_NDIM = 64


def _fail(msg: str) -> RecordFormatError:
    return RecordFormatError(f"not a torch.save tensor record: {msg}")


def _unpack(st: struct.Struct, buf: memoryview, ofs: int, end: int, what: str) -> tuple:
    if ofs < 0 or ofs + st.size > end:
        raise _fail(f"{what} at {ofs} (+{st.size}) runs past {end}")
    return st.unpack_from(buf, ofs)


def _decode_name(raw: memoryview, where: int) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(f"record name at {where} is not UTF-8") from None


def _parse_extra(extra: memoryview, where: int) -> dict[int, memoryview]:
    fields: dict[int, memoryview] = {}
    i = 0
    while i < len(extra):
        if i + 4 > len(extra):
            raise _fail(f"truncated extra field at {where}")
        tag, n = struct.unpack_from("<HH", extra, i)
        if i + 4 + n > len(extra):
            raise _fail(f"extra field 0x{tag:04x} at {where} overruns its header")
        if tag in fields:
            raise _fail(f"duplicate extra field 0x{tag:04x} at {where}")
        fields[tag] = extra[i + 4 : i + 4 + n]
        i += 4 + n
    return fields


def _zip64_values(extra: dict[int, memoryview], wanted: Sequence[bool], where: int) -> list[int]:
    """Reads the zip64 extra's 8-byte values for the fields that are
    saturated (``wanted``), in the order uncomp, comp, offset."""
    z = extra.get(1)
    need = sum(wanted)
    if need == 0:
        return []
    if z is None or len(z) != 8 * need:
        raise _fail(f"zip64 extra at {where} missing or of the wrong length")
    return list(struct.unpack_from(f"<{need}Q", z, 0))


def _parse_zip(buf: memoryview,
               max_entries: int = _MAX_ENTRIES) -> tuple[str, list[RecordEntry]]:
    end = len(buf)
    # The writer adds no archive comment, so the end record is the last 22
    # bytes, preceded by the zip64 locator and the zip64 end record.
    eocd_ofs = end - _EOCD.size
    sig, d0, d1, n_disk, n_all, cd_size32, cd_ofs32, clen = _unpack(
        _EOCD, buf, eocd_ofs, end, "end record"
    )
    if sig != _SIG_EOCD or clen != 0 or d0 or d1 or n_disk != n_all:
        raise _fail("bad end-of-central-directory record")
    loc_ofs = eocd_ofs - _Z64_LOC.size
    sig, disk, z64_ofs, ndisks = _unpack(_Z64_LOC, buf, loc_ofs, end, "zip64 locator")
    if sig != _SIG_Z64_LOC or disk != 0 or ndisks != 1:
        raise _fail("bad zip64 end-of-central-directory locator")
    if z64_ofs != loc_ofs - _Z64_EOCD.size:
        raise _fail(f"zip64 end record offset {z64_ofs} is not {loc_ofs - _Z64_EOCD.size}")
    sig, rsize, _made, _need, d0, d1, n_disk64, n_all64, cd_size, cd_ofs = _unpack(
        _Z64_EOCD, buf, z64_ofs, end, "zip64 end record"
    )
    if sig != _SIG_Z64_EOCD or rsize != 44 or d0 or d1 or n_disk64 != n_all64:
        raise _fail("bad zip64 end-of-central-directory record")
    if n_all64 > max_entries or n_all64 == 0:
        raise _fail(f"{n_all64} entries (expected 1..{max_entries})")
    expect32 = (min(n_all64, 0xFFFF), min(cd_size, _U32), min(cd_ofs, _U32))
    if (n_all, cd_size32, cd_ofs32) != expect32:
        raise _fail("end record disagrees with the zip64 end record")
    if cd_ofs + cd_size != z64_ofs:
        raise _fail(f"central directory [{cd_ofs}, +{cd_size}) does not end at {z64_ofs}")

    entries: list[RecordEntry] = []
    archive = None
    pos = cd_ofs
    for _ in range(n_all64):
        (sig, _mb, _vn, flags, method, _t, _d, crc, csize, usize, nlen, xlen, clen,
         _disk, _ia, _ea, ofs) = _unpack(_CDH, buf, pos, z64_ofs, "central directory header")
        if sig != _SIG_CDH:
            raise _fail(f"bad central directory signature at {pos}")
        if method != 0 or flags & 1:
            raise _fail(f"entry at {pos} is compressed or encrypted")
        var_end = pos + _CDH.size + nlen + xlen + clen
        if var_end > z64_ofs:
            raise _fail(f"central directory entry at {pos} overruns the directory")
        name_raw = buf[pos + _CDH.size : pos + _CDH.size + nlen]
        full = _decode_name(name_raw, pos)
        extra = _parse_extra(buf[pos + _CDH.size + nlen : pos + _CDH.size + nlen + xlen], pos)
        z = _zip64_values(extra, (usize == _U32, csize == _U32, ofs == _U32), pos)
        it = iter(z)
        if usize == _U32:
            usize = next(it)
        if csize == _U32:
            csize = next(it)
        if ofs == _U32:
            ofs = next(it)
        if csize != usize:
            raise _fail(f"stored entry {full!r} has compressed size {csize} != size {usize}")
        folder, sep, name = full.partition("/")
        if not sep or not folder or not name:
            raise _fail(f"record name {full!r} is not '<archive>/<name>'")
        if archive is None:
            archive = folder
        elif folder != archive:
            raise _fail(f"record {full!r} is outside archive folder {archive!r}")
        entries.append(_check_local(buf, ofs, name_raw, flags, crc, usize, cd_ofs, name))
        pos = var_end
    if pos != z64_ofs:
        raise _fail(f"central directory has {z64_ofs - pos} trailing bytes")

    # Records are laid out back to back from offset 0, in directory order.
    cursor = 0
    seen = set()
    for e in entries:
        if e.header_offset != cursor:
            raise _fail(f"record {e.name!r} at {e.header_offset}, expected {cursor}")
        if e.name in seen:
            raise _fail(f"duplicate record {e.name!r}")
        seen.add(e.name)
        cursor = _entry_end(buf, e)
    if cursor != cd_ofs:
        raise _fail(f"records end at {cursor}, central directory starts at {cd_ofs}")
    assert archive is not None
    return archive, entries


def _check_local(
    buf: memoryview,
    ofs: int,
    name_raw: memoryview,
    flags: int,
    crc: int,
    size: int,
    limit: int,
    name: str,
) -> RecordEntry:
    sig, _vn, lflags, method, _t, _d, lcrc, lcsize, lusize, nlen, xlen = _unpack(
        _LFH, buf, ofs, limit, "local file header"
    )
    if sig != _SIG_LFH:
        raise _fail(f"bad local header signature at {ofs}")
    if lflags != flags or method != 0:
        raise _fail(f"local header at {ofs} disagrees with the central directory")
    data = ofs + _LFH.size + nlen + xlen
    if data > limit or bytes(buf[ofs + _LFH.size : ofs + _LFH.size + nlen]) != bytes(name_raw):
        raise _fail(f"local header at {ofs} has a different name or overruns")
    if data + size > limit:
        raise _fail(f"record {name!r} data [{data}, +{size}) runs past {limit}")
    if not flags & 8 and (lcrc != crc or lusize != min(size, _U32) or lcsize != min(size, _U32)):
        raise _fail(f"local header of {name!r} disagrees on CRC or size")
    return RecordEntry(name, ofs, data, size, crc)


def _entry_end(buf: memoryview, e: RecordEntry) -> int:
    end = e.data_offset + e.size
    if not _unpack(_LFH, buf, e.header_offset, len(buf), "local header")[2] & 8:
        return end
    # A data descriptor follows: 32-bit sizes unless the local header carried
    # a zip64 extra, then 64-bit.
    nlen, xlen = _unpack(_LFH, buf, e.header_offset, len(buf), "local header")[9:11]
    xs = e.header_offset + _LFH.size + nlen
    z64 = 1 in _parse_extra(buf[xs : xs + xlen], e.header_offset)
    fmt = struct.Struct("<IIQQ" if z64 else "<IIII")
    sig, crc, cs, us = _unpack(fmt, buf, end, len(buf), f"data descriptor of {e.name!r}")
    if sig != _SIG_DD or crc != e.crc32 or cs != e.size or us != e.size:
        raise _fail(f"data descriptor of {e.name!r} at {end} disagrees with the central directory")
    return end + fmt.size


# ---- data.pkl: a restricted walk over the pickle opcodes, no unpickling ----


@dataclass(frozen=True)
class _Global:
    module: str
    name: str


@dataclass(frozen=True)
class _StorageRef:
    dtype: DType | None  # None for UntypedStorage (v3)
    key: str
    location: str
    numel: int


@dataclass(frozen=True)
class _Tensor:
    dtype: DType
    storage: _StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool
    conj: bool = False  # torch's metadata bits: the value is conj / -1 x the storage's
    neg: bool = False


class _Mark:
    pass


_MARK = _Mark()
_EMPTY_ODICT = object()


def _allowed_global(mod: str, name: str) -> _Global:
    g = _Global(mod, name)
    if (mod, name) in (_REBUILD_V2, _REBUILD_V3, _ORDERED_DICT, _UNTYPED_STORAGE):
        return g
    if mod == "torch" and (name in _BY_STORAGE or name in _V3_DTYPES):
        return g
    raise _fail(f"data.pkl references global {mod}.{name}, which a tensor pickle never uses")


def _int_tuple(v: object, what: str) -> tuple[int, ...]:
    if not isinstance(v, tuple) or len(v) > _MAX_NDIM or not all(
        type(x) is int and x >= 0 for x in v
    ):
        raise _fail(f"{what} is not a tuple of non-negative ints")
    return v


def _reduce(fn: object, args: object) -> object:
    if not isinstance(fn, _Global) or not isinstance(args, tuple):
        raise _fail("REDUCE on something other than an allowed global")
    if (fn.module, fn.name) == _ORDERED_DICT:
        if args != ():
            raise _fail("backward-hooks OrderedDict is not empty")
        return _EMPTY_ODICT
    v3 = (fn.module, fn.name) == _REBUILD_V3
    if (fn.module, fn.name) != _REBUILD_V2 and not v3:
        raise _fail(f"REDUCE calls {fn.module}.{fn.name}")
    bits: dict = {}
    if not v3 and len(args) == 7 and type(args[6]) is dict:
        # torch.save of a conjugate or negative view: the storage holds the
        # base's values, the metadata dict says which view to take of them.
        bits = args[6]
        if not set(bits) <= {"conj", "neg"}:
            raise _fail(f"tensor metadata {sorted(bits)} is not torch's conj/neg bits")
        args = args[:6]
    if len(args) != (7 if v3 else 6):
        raise _fail(
            f"{fn.name} called with {len(args)} arguments; tensor metadata "
            "(conj/neg bits) and other extensions are not supported"
        )
    st, offset, shape, stride, rg, hooks = args[:6]
    if not isinstance(st, _StorageRef) or type(offset) is not int or offset < 0:
        raise _fail(f"{fn.name} arguments are not (storage, offset, ...)")
    if type(rg) is not bool or hooks is not _EMPTY_ODICT:
        raise _fail(f"{fn.name} requires_grad/backward_hooks arguments are malformed")
    if v3:
        g = args[6]
        if st.dtype is not None or not (
            isinstance(g, _Global) and g.module == "torch" and g.name in _V3_DTYPES
        ):
            raise _fail("_rebuild_tensor_v3 needs an UntypedStorage and a torch dtype")
        dt = _V3_DTYPES[g.name]
    else:
        if st.dtype is None:
            raise _fail("_rebuild_tensor_v2 with an UntypedStorage")
        dt = st.dtype
    shape = _int_tuple(shape, "size")
    stride = _int_tuple(stride, "stride")
    if len(shape) != len(stride):
        raise _fail(f"size {shape} and stride {stride} differ in length")
    conj, neg = bool(bits.get("conj", False)), bool(bits.get("neg", False))
    if conj and not dt.name.startswith("complex"):
        raise _fail(f"a conjugate view of a {dt.name} tensor")
    return _Tensor(dt, st, offset, shape, stride, rg, conj, neg)


def _persistent_load(pid: object) -> _StorageRef:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise _fail("persistent id is not ('storage', type, key, location, numel)")
    _, cls, key, loc, numel = pid
    if not isinstance(cls, _Global) or type(key) is not str or type(loc) is not str:
        raise _fail("persistent id fields have the wrong types")
    if type(numel) is not int or numel < 0:
        raise _fail("persistent id storage size is not a non-negative int")
    if (cls.module, cls.name) == _UNTYPED_STORAGE:
        return _StorageRef(None, key, loc, numel)
    if cls.module == "torch" and cls.name in _BY_STORAGE:
        return _StorageRef(_BY_STORAGE[cls.name], key, loc, numel)
    raise _fail(f"persistent id names {cls.module}.{cls.name}, not a storage type")


def _walk_pickle(p: memoryview) -> _Tensor:
    """Interprets the opcodes of torch's tensor pickle over plain values.
    Anything outside that vocabulary raises; nothing is imported or called."""
    if len(p) > _MAX_PICKLE:
        raise _fail(f"data.pkl is {len(p)} bytes, over the {_MAX_PICKLE} limit")
    stack: list[object] = []
    memo: dict[int, object] = {}
    i, n = 0, len(p)

    def take(k: int) -> memoryview:
        nonlocal i
        if i + k > n:
            raise _fail("data.pkl is truncated")
        v = p[i : i + k]
        i += k
        return v

    def pop() -> object:
        if not stack or stack[-1] is _MARK:
            raise _fail("data.pkl pops an empty stack")
        return stack.pop()

    def pop_mark() -> tuple:
        for j in range(len(stack) - 1, -1, -1):
            if stack[j] is _MARK:
                items = tuple(stack[j + 1 :])
                del stack[j:]
                return items
        raise _fail("data.pkl has no MARK to close")

    def line() -> str:
        nonlocal i
        j = i
        while j < n and j - i < 128 and p[j] != 0x0A:
            j += 1
        if j >= n or p[j] != 0x0A:
            raise _fail("unterminated GLOBAL in data.pkl")
        raw = bytes(p[i:j])
        i = j + 1
        if not raw.isascii():
            raise _fail("non-ASCII GLOBAL in data.pkl")
        return raw.decode("ascii")

    if bytes(take(2)) != b"\x80\x02":
        raise _fail("data.pkl is not a protocol-2 pickle")
    while True:
        if len(stack) > 4 * _MAX_NDIM + 32:
            raise _fail("data.pkl stack too deep")
        op = bytes(take(1))
        if op == b".":  # STOP
            if i != n or len(stack) != 1 or not isinstance(stack[0], _Tensor):
                raise _fail("data.pkl does not end with one tensor and STOP")
            return stack[0]
        elif op == b"c":  # GLOBAL
            mod = line()
            stack.append(_allowed_global(mod, line()))
        elif op == b"q":  # BINPUT
            if not stack:
                raise _fail("BINPUT on an empty stack")
            memo[take(1)[0]] = stack[-1]
        elif op == b"r":  # LONG_BINPUT
            if not stack:
                raise _fail("LONG_BINPUT on an empty stack")
            memo[struct.unpack("<I", take(4))[0]] = stack[-1]
        elif op in (b"h", b"j"):  # BINGET, LONG_BINGET
            k = take(1)[0] if op == b"h" else struct.unpack("<I", take(4))[0]
            if k not in memo:
                raise _fail(f"memo key {k} read before it is written")
            stack.append(memo[k])
        elif op == b"(":
            stack.append(_MARK)
        elif op == b")":
            stack.append(())
        elif op == b"t":
            stack.append(pop_mark())
        elif op in (b"\x85", b"\x86", b"\x87"):  # TUPLE1..3
            k = op[0] - 0x84
            items = [pop() for _ in range(k)]
            stack.append(tuple(reversed(items)))
        elif op == b"X":  # BINUNICODE
            k = struct.unpack("<I", take(4))[0]
            if k > 256:
                raise _fail("overlong string in data.pkl")
            try:
                stack.append(bytes(take(k)).decode("utf-8"))
            except UnicodeDecodeError:
                raise _fail("invalid UTF-8 string in data.pkl") from None
        elif op == b"K":
            stack.append(take(1)[0])
        elif op == b"M":
            stack.append(struct.unpack("<H", take(2))[0])
        elif op == b"J":
            stack.append(struct.unpack("<i", take(4))[0])
        elif op == b"\x8a":  # LONG1
            k = take(1)[0]
            if k > 9:
                raise _fail("integer over 64 bits in data.pkl")
            stack.append(int.from_bytes(take(k), "little", signed=True))
        elif op == b"\x88":
            stack.append(True)
        elif op == b"\x89":
            stack.append(False)
        elif op == b"}":  # EMPTY_DICT: only as _rebuild_tensor_v2's metadata
            stack.append({})
        elif op == b"s":  # SETITEM, str -> bool (e.g. {"conj": True})
            v, k = pop(), pop()
            d = stack[-1] if stack else None
            if type(d) is not dict or type(k) is not str or type(v) is not bool or len(d) >= 8:
                raise _fail("SETITEM outside a small str->bool metadata dict")
            d[k] = v
        elif op == b"u":  # SETITEMS: the same, several pairs (conj and neg)
            items = pop_mark()
            d = stack[-1] if stack else None
            if (type(d) is not dict or len(items) % 2 or len(d) + len(items) // 2 > 8
                    or not all(type(k) is str and type(v) is bool
                               for k, v in zip(items[::2], items[1::2]))):
                raise _fail("SETITEMS outside a small str->bool metadata dict")
            d.update(zip(items[::2], items[1::2]))
        elif op == b"Q":  # BINPERSID
            stack.append(_persistent_load(pop()))
        elif op == b"R":  # REDUCE
            args = pop()
            stack.append(_reduce(pop(), args))
        else:
            raise _fail(f"opcode {op!r} at {i - 1} in data.pkl is not used by tensor pickles")


def parse_record(buf: BytesLike, base_offset: int = 0) -> RecordInfo:
    """Parses one torch.save tensor record (one DCP tensor item).

    ``buf`` holds exactly the record (``_StorageInfo.length`` bytes from
    ``_StorageInfo.offset``); offsets in the result are ``base_offset`` plus
    offsets inside ``buf``. Nothing is unpickled. Every entry but the
    storage bytes (``data/<key>``) must match its CRC-32 (unless torch wrote
    none: all 0, and ``data_crc32`` is None); the storage bytes are not read
    or checksummed: compare ``data_crc32`` with a CRC of the bytes you read."""
    try:
        mv = memoryview(buf).cast("B")
    except TypeError as e:
        raise RecordFormatError(f"record buffer is not a contiguous byte buffer: {e}") from None
    archive, entries = _parse_zip(mv)
    by_name = {e.name: e for e in entries}

    def small(name: str) -> bytes | None:
        e = by_name.get(name)
        if e is None:
            return None
        if e.size > 64:
            raise _fail(f"record {name!r} is {e.size} bytes")
        return bytes(mv[e.data_offset : e.data_offset + e.size])

    if "data.pkl" not in by_name:
        raise _fail("no data.pkl record")
    # Every entry but the storage bytes is checked against its CRC-32 (a few
    # hundred bytes): a damaged data.pkl that still parses (a stride of 0, an
    # offset) would otherwise give other values from intact storage bytes.
    # torch.serialization.set_crc32_options(False) writes every CRC as 0.
    has_crc = any(e.crc32 for e in entries)
    if has_crc:
        for e in entries:
            if not e.name.startswith("data/") and \
                    zlib.crc32(mv[e.data_offset : e.data_offset + e.size]) != e.crc32:
                raise _fail(f"record {e.name!r} does not match its CRC-32 {e.crc32:#010x}")
    bo = small("byteorder")
    if bo not in (None, b"little"):
        raise _fail(f"byteorder is {bo!r}; only little-endian records are supported")
    ver = small("version") if "version" in by_name else small(".data/version")
    if ver is None or not ver.strip().isdigit() or not 1 <= int(ver.strip()) <= 20:
        raise _fail(f"missing or bad version record {ver!r}")
    pk = by_name["data.pkl"]
    t = _walk_pickle(mv[pk.data_offset : pk.data_offset + pk.size])
    st = t.storage
    if st.location != "cpu":
        raise _fail(f"storage location is {st.location!r}, expected 'cpu'")
    data = by_name.get(f"data/{st.key}")
    if data is None:
        raise _fail(f"data.pkl names storage {st.key!r} but there is no data/{st.key} record")
    isz = t.dtype.itemsize
    nbytes = st.numel * isz if st.dtype is not None else st.numel
    if data.size != nbytes or nbytes % isz:
        raise _fail(f"data/{st.key} is {data.size} bytes, data.pkl says {nbytes}")
    storage_numel = nbytes // isz
    if 0 not in t.shape:
        span = t.offset + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride))
        if span > storage_numel:
            raise _fail(
                f"size {t.shape} stride {t.stride} offset {t.offset} "
                f"overrun a storage of {storage_numel}"
            )
    # An empty tensor reads no element: torch.save keeps a view's offset even
    # past its (empty) storage (torch.zeros(3, 0)[1:]), and torch.load takes it.
    shifted = tuple(
        RecordEntry(
            e.name, e.header_offset + base_offset, e.data_offset + base_offset, e.size, e.crc32
        )
        for e in entries
    )
    return RecordInfo(
        archive=archive,
        entries=shifted,
        dtype=t.dtype.name,
        shape=t.shape,
        stride=t.stride,
        storage_offset=t.offset,
        storage_numel=storage_numel,
        requires_grad=t.requires_grad,
        data_offset=data.data_offset + base_offset,
        data_length=data.size,
        data_crc32=data.crc32 if has_crc else None,
        conj=t.conj,
        neg=t.neg,
    )

