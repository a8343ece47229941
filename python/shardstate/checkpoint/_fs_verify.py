"""Shared CRC verification: a saved record that the ranks' reads cover
together is checked by all of them at once.

When a load at another world size splits a record between ranks, each rank
checksums only the part it reads (a "piece", see ``_fs_read._Reads``) instead
of reading the rest of the record again for its CRC; the coordinator picks
these records in ``prepare_global_plan`` (``shared_chunks``), and after the
reads every rank checks all ranks' pieces (``verify_pieces``), so every rank
reports the same failure. A load at another world size then reads each byte
once.

A piece is a tuple (chunk key, file path, data offset, data length, record
CRC-32, start, count, CRC-32 of [start, start + count), where).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._core import ChecksumError, ShardstateError, crc32_combine


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


def shared_chunks(tensor_reads: Iterable[tuple[int, Any, Any, Any]]) -> set:
    """The saved chunks the ranks' reads cover together (``tensor_reads``:
    ``_Records.tensor_reads`` over every rank's plan): one rank reads the
    whole chunk, or the regions read are pairwise disjoint and add up to
    it. For these a rank reading part of a chunk checksums only its part,
    and every rank checks that the parts combine to the record's CRC-32
    (verify_pieces), instead of each reading the rest of the record again."""
    boxes: dict[Any, set] = {}
    sizes: dict[Any, tuple[int, ...]] = {}
    for _rank, it, k, found in tensor_reads:
        sizes[k] = tuple(int(n) for n in found[1].sizes)
        boxes.setdefault(k, set()).add(
            (tuple(int(o) for o in it.storage_offsets), tuple(int(n) for n in it.lengths)))
    return {k for k, bs in boxes.items() if _covers(bs, sizes[k])}


def verify_pieces(gathered: list[list[tuple]]) -> None:
    """Checks the shared chunks' records from every rank's pieces (what
    each rank's reads left, in rank order): a record some rank read whole
    was verified by that rank; otherwise its pieces must tile its data and
    their CRC-32s combine to the record's. Raises CheckpointException naming
    the ranks that read a bad record (the same on every rank, since every
    rank checks the same pieces)."""
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
