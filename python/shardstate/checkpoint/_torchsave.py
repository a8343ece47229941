"""Whole torch.save files through the C engine, for ``format_utils``'
``dcp_to_torch_save`` and ``torch_save_to_dcp``.

Writing (:func:`save`): torch's own ``torch.serialization._save`` pickles
the object into a recorder instead of its zip writer, so the pickle, the
storage numbering, shared storages and views are exactly torch.save's. The
zip framing is laid out here (``_zipfmt``'s pieces: miniz's local headers
with the 64-byte alignment padding, data descriptors, the central
directory, the zip64 end records, the serialization id); the storages'
bytes go from their own memory to the file in one engine call
(``io.write_records``), which computes their CRC-32s as it writes; the
framing that depends on those CRCs is written after it, then the file is
fsynced. The file is torch.save's, byte for byte (the serialization id
folds the record names in the order libstdc++'s unordered set holds them,
emulated here).

Reading (:func:`load`): the zip directory is parsed strictly from a
read-only mapping (``_zipfmt._parse_zip``: only its structures are
touched), the pickle is run by torch's restricted unpickler
(``torch.serialization._load`` with the weights-only unpickler, as
``torch.load(weights_only=True)``; never a full unpickler) over an archive
object that hands out empty storages, and every storage is then read into
its memory in one engine call, its CRC-32 checked against the archive.
A file this parser refuses, or whose pickle rebuilds tensors that read
their storages while unpickling (sparse, nested, NumPy-backed, wrapper
subclasses), is read by ``torch.load(weights_only=True)`` instead.

Thread safety: functions only; no shared state.
"""

from __future__ import annotations

import bisect
import mmap
import os
import pickle
import re
import zlib
from typing import Any

import numpy as np

from .. import io as ssio
from .._util import import_torch, pwrite_all
from . import _zipfmt

# The rebuilders that leave a storage's contents alone while unpickling.
# A pickle naming any other (sparse, nested, quantized, NumPy-backed,
# wrapper subclasses: some read the data) is read by torch.load.
_REBUILDERS_NOT_READING = {b"_rebuild_tensor_v2", b"_rebuild_tensor_v3", b"_rebuild_parameter",
                           b"_rebuild_parameter_with_state", b"_rebuild_from_type_v2"}
_GLOBAL_REBUILD = re.compile(rb"\n(_rebuild_[A-Za-z0-9_]*)\n")
# Most records of a file this reader takes (each storage is one).
_MAX_RECORDS = 1 << 22


# libstdc++'s bucket counts (_Prime_rehash_policy::_M_next_bkt): the fast
# table below 14, then these primes (printed by libstdc++ 12; the policy
# has not changed since GCC 5). Past the last one the order is not emulated.
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)
_PRIMES = (
    17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 103, 109, 113,
    127, 137, 139, 149, 157, 167, 179, 193, 199, 211, 227, 241, 257, 277, 293, 313, 337, 359,
    383, 409, 439, 467, 503, 541, 577, 619, 661, 709, 761, 823, 887, 953, 1031, 1109, 1193,
    1289, 1381, 1493, 1613, 1741, 1879, 2029, 2179, 2357, 2549, 2753, 2971, 3209, 3469, 3739,
    4027, 4349, 4703, 5087, 5503, 5953, 6427, 6949, 7517, 8123, 8783, 9497, 10273, 11113,
    12011, 12983, 14033, 15173, 16411, 17749, 19183, 20753, 22447, 24281, 26267, 28411, 30727,
    33223, 35933, 38873, 42043, 45481, 49201, 53201, 57557, 62233, 67307, 72817, 78779, 85229,
    92203, 99733, 107897, 116731, 126271, 136607, 147793, 159871, 172933, 187091, 202409,
    218971, 236897, 256279, 277261, 299951, 324503,
)


def _unordered_set_order(names: list[str]) -> list[str] | None:
    """The iteration order of a libstdc++ ``std::unordered_set<std::string>``
    after inserting ``names`` (distinct) in order: torch folds its record
    names in this order into the serialization id. None past the primes
    above."""
    hashes = {n: _zipfmt._std_hash(n.encode()) for n in names}
    nxt: dict[str | None, str | None] = {None: None}  # None: the list head
    buckets: list[Any] = [False]  # False: empty; else the node before the bucket's first
    nb, next_resize = 1, 0

    def next_bkt(n: int) -> int:
        nonlocal next_resize
        if n < len(_FAST_BUCKETS):
            if n == 0:
                return 1
            next_resize = _FAST_BUCKETS[n]
            return _FAST_BUCKETS[n]
        i = bisect.bisect_left(_PRIMES, n)
        if i == len(_PRIMES):
            raise IndexError
        next_resize = _PRIMES[i]
        return _PRIMES[i]

    try:
        for count, name in enumerate(names):
            if count + 1 > next_resize:  # _M_need_rehash, max load factor 1
                min_bkts = max(count + 1, 0 if next_resize else 11)
                if min_bkts >= nb:
                    n = next_bkt(max(min_bkts + 1, nb * 2))
                    new: list[Any] = [False] * n
                    p, nxt[None], first = nxt[None], None, 0
                    while p is not None:  # _M_rehash_aux for unique keys
                        q, b = nxt[p], hashes[p] % n
                        if new[b] is False:
                            nxt[p], nxt[None], new[b] = nxt[None], p, None
                            if nxt[p] is not None:
                                new[first] = p
                            first = b
                        else:
                            nxt[p], nxt[new[b]] = nxt[new[b]], p
                        p = q
                    buckets, nb = new, n
                else:
                    next_resize = nb
            b = hashes[name] % nb
            if buckets[b] is not False:  # _M_insert_bucket_begin
                nxt[name], nxt[buckets[b]] = nxt[buckets[b]], name
            else:
                nxt[name], nxt[None] = nxt[None], name
                after = nxt[name]
                if after is not None:
                    buckets[hashes[after] % nb] = name
                buckets[b] = None
    except IndexError:
        return None
    out, p = [], nxt[None]
    while p is not None:
        out.append(p)
        p = nxt[p]
    return out


class _Recorder:
    """The part of torch's PyTorchFileWriter that ``_save`` uses."""

    def __init__(self) -> None:
        self.records: list[tuple[str, Any, int]] = []

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if isinstance(data, str):
            data = data.encode()
        elif isinstance(data, (bytes, bytearray, memoryview)):
            data = bytes(data)
        self.records.append((name, data, int(nbytes)))

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        raise RuntimeError("torch.save without data (skip_data) is not supported here")


def _archive_name(path: str) -> str:
    """torch's PyTorchStreamWriter names the folder after the file: its
    base name without the extension."""
    base = os.path.basename(path)
    stem = base[:base.rfind(".")] if "." in base else base
    return stem or "archive"


def _storage_view(storage: Any) -> np.ndarray:
    torch = import_torch()
    n = storage.nbytes()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,), (1,)).numpy()


def save(obj: Any, path: str | os.PathLike, *, archive: str | None = None,
         fsync: bool = True, threads: int | None = None) -> None:
    """``torch.save(obj, path)``, its storages written by the engine.
    With a storage alignment other than 64 set in torch's serialization
    config, torch.save writes the file (into a file object: its folder is
    then "archive")."""
    import torch.serialization as ts

    p = os.fspath(path)
    if ts._get_storage_alignment() != _zipfmt._ALIGN:
        with open(p, "wb") as f:
            ts.save(obj, f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        return
    # torch.serialization.set_crc32_options(False): every CRC-32 written as 0
    crc32 = ts.get_crc32_options()
    rec = _Recorder()
    ts._save(obj, rec, pickle, ts.DEFAULT_PROTOCOL, False)
    records = rec.records + [("version", _zipfmt._VERSION, len(_zipfmt._VERSION))]
    folder = archive if archive is not None else _archive_name(p)
    frames: list[tuple[int, bytes]] = []  # (file offset, bytes)
    rows: list[tuple[int, int, int, int, int]] = []
    buffers: list[Any] = []
    entries: list[list[Any]] = []  # [full name, size, header offset, z64, crc, data end]
    owners: list[Any] = []
    cursor = 0
    for name, payload, size in records:
        full = f"{folder}/{name}".encode()
        head, z64 = _zipfmt._local_header(cursor, full, size)
        frames.append((cursor, head))
        data = cursor + len(head)
        crc: int | None
        if isinstance(payload, bytes):
            frames.append((data, payload))
            crc = zlib.crc32(payload) if crc32 else 0
        else:
            crc = None if size and crc32 else 0
            if size:
                if payload.device.type != "cpu":
                    payload = payload.cpu()
                owners.append(payload)
                rows.append((0, data, len(buffers), -1, 0))
                buffers.append(_storage_view(payload))
        entries.append([full, size, cursor, z64, crc, data + size])
        cursor = data + size + len(_zipfmt._descriptor(0, size, z64))
    crcs = ssio.write_records([p], np.array(rows, np.int64).reshape(-1, 5), buffers, [],
                              fsync=False, checksum=crc32, writeback=fsync, threads=threads)
    it = iter(crcs)
    for e in entries:
        if e[4] is None:
            e[4] = next(it) & 0xFFFFFFFF
    del buffers, owners
    # the serialization id, the central directory and the end records
    names = [r[0] for r in records]
    folded = _unordered_set_order(names)
    # _serialization_id folds the names last to first
    sid = _zipfmt._serialization_id(names if folded is None else folded[::-1],
                                    [e[4] for e in entries if e[1]])
    full = f"{folder}/{_zipfmt._SID_NAME}".encode()
    head, z64 = _zipfmt._local_header(cursor, full, len(sid))
    frames += [(cursor, head), (cursor + len(head), sid)]
    entries.append([full, len(sid), cursor, z64, zlib.crc32(sid) if crc32 else 0,
                    cursor + len(head) + len(sid)])
    cursor += len(head) + len(sid) + len(_zipfmt._descriptor(0, len(sid), z64))
    cd = b"".join(_zipfmt._central_header(e[0], e[4], e[1], e[2]) for e in entries)
    for _full, size, _ofs, z64, crc, end in entries:
        desc = _zipfmt._descriptor(crc, size, z64)
        if desc:
            frames.append((end, desc))
    frames += [(cursor, cd), (cursor + len(cd), _zipfmt._end_records(len(entries), cursor,
                                                                      len(cd)))]
    fd = os.open(p, os.O_WRONLY)
    try:
        for ofs, blob in frames:
            pwrite_all(fd, blob, ofs)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


class _Archive:
    """The part of torch's PyTorchFileReader that ``_load`` uses, over the
    parsed directory: small records from the mapping, storages handed out
    empty and recorded for the engine read."""

    def __init__(self, mv: memoryview, entries: list[Any]) -> None:
        self._mv = mv
        self._by_name = {e.name: e for e in entries}
        self.storages: list[tuple[Any, Any]] = []  # (entry, uint8 tensor)

    def has_record(self, name: str) -> bool:
        return name in self._by_name

    def _entry(self, name: str) -> Any:
        e = self._by_name.get(name)
        if e is None:
            raise RuntimeError(f"the torch.save archive has no record {name!r}")
        return e

    def get_record(self, name: str) -> bytes:
        e = self._entry(name)
        return bytes(self._mv[e.data_offset:e.data_offset + e.size])

    def get_record_offset(self, name: str) -> int:
        return int(self._entry(name).data_offset)

    def get_storage_from_record(self, name: str, nbytes: int, _cls: Any) -> Any:
        torch = import_torch()
        e = self._entry(name)
        if e.size != nbytes:
            raise RuntimeError(f"record {name!r} holds {e.size} bytes, the pickle says {nbytes}")
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.storages.append((e, t))
        return t

    def get_all_records(self) -> list[str]:
        return list(self._by_name)

    def serialization_id(self) -> str:
        e = self._by_name.get(_zipfmt._SID_NAME)
        return self.get_record(e.name).decode("ascii", "replace") if e is not None else ""


def load(path: str | os.PathLike, threads: int | None = None) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``, the
    storages read by the engine (CRC-32s checked)."""
    torch = import_torch()
    import torch.serialization as ts

    p = os.fspath(path)
    arch: _Archive | None = None
    obj: Any = None
    with open(p, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return torch.load(p, map_location="cpu", weights_only=True)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            mv = memoryview(mm)
            try:
                try:
                    entries = _zipfmt._parse_zip(mv, max_entries=_MAX_RECORDS)[1]
                except _zipfmt.RecordFormatError:
                    entries = None
                if entries is not None:
                    arch = _Archive(mv, entries)
                    pkl = arch.get_record("data.pkl") if arch.has_record("data.pkl") else None
                    if (pkl is None or arch.has_record("constants.pkl")
                            or not _REBUILDERS_NOT_READING.issuperset(
                                _GLOBAL_REBUILD.findall(pkl))):
                        arch = None  # torch.load decides
                    else:
                        obj = ts._load(arch, "cpu", torch._weights_only_unpickler,
                                       encoding="utf-8")
            finally:
                if arch is not None:
                    arch._mv = memoryview(b"")
                mv.release()
    if arch is None:
        return torch.load(p, map_location="cpu", weights_only=True)
    checked = any(e.crc32 for e, _t in arch.storages)
    jobs = [ssio.ReadJob(p, e.data_offset, t.numpy(), e.crc32 if checked else None)
            for e, t in arch.storages if e.size]
    if jobs:
        ssio.read(jobs, threads=threads, verify=checked, checksum=checked)
    return obj
