"""Load once, broadcast (``FileSystemReader(broadcast_shared_reads=True)``).

The coordinator plans in ``prepare_global_plan`` (``plan_broadcast``) which
rank reads each saved chunk several ranks need, balancing read bytes, and in
which rounds of bounded size the sources broadcast them; every rank runs the
same rounds (``exchange``) over the load's coordinator (``any_failed``, one
small all-reduce per round, and ``broadcast_bytes``), and a failure on any
rank stops all of them at the next round's check.

Invariant: every rank issues the same collectives in the same order whatever
fails locally, so no rank waits for another's broadcast that never comes.

Thread safety: one load at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import io as ssio
from .._util import is_contiguous
from ._fs_read import _copy_out, _Reads, _region_bytes, _slab
from ._records import _index_key, _Rec, _Records, _Req
from ._tensors import numpy_dtype_name
from .planner import element_size

# Bytes broadcast per round when shared reads are broadcast (all sources).
_BCAST_ROUND = 256 << 20
# A chunk at least this big is broadcast on its own (see plan_broadcast).
_BCAST_ALONE = 8 << 20


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


def plan_broadcast(plans: list[Any], records: _Records) -> _Schedule | None:
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
    for rank, it, k, found in records.tensor_reads(plans):
        meta.setdefault(k, found)
        need.setdefault(k, {}).setdefault(rank, []).append(it)
    candidates = sorted(k for k, ranks in need.items() if len(ranks) > 1)
    recs: dict[Any, tuple[_Req, _Rec]] = {}
    if candidates:
        reqs = records.requests(need[k][min(need[k])][0] for k in candidates)
        for r, rec in zip(reqs, records.parse(reqs)):
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


def read_shared(coord: Any, sched: _Schedule, reads: _Reads, plan: Any, planner: Any) -> None:
    """``read_data`` under a broadcast schedule: the scheduled chunks
    through the rounds, the rest read locally after them."""
    # Until the exchange is over, a failure here must not keep this rank
    # from the broadcast rounds the others wait in: it is carried
    # through them and raised after.
    mine: dict[Any, list[tuple[_Req, Any]]] = {}
    local: list[_Req] = []
    error: BaseException | None = None
    try:
        for r in reads.records.requests(plan.items):
            k = _index_key(r.item.storage_index)
            if k in sched.keys and r.item.type.name != "BYTE_IO":
                dest = planner.resolve_tensor(r.item)
                mine.setdefault(k, []).append(
                    (r, dest if isinstance(dest, np.ndarray) else dest.detach()))
            else:
                local.append(r)
    except BaseException as e:  # noqa: BLE001 - raised after the exchange
        error = e
    if not exchange(coord, sched, mine, planner, reads, failed=error is not None):
        return  # another rank failed; it reports
    if error is not None:
        raise error
    reads.local(local, planner)


def exchange(coord: Any, sched: _Schedule, mine: dict[Any, list[tuple[_Req, Any]]],
             planner: Any, reads: _Reads | None, failed: bool) -> bool:
    """Runs the broadcast rounds. Per round: each source reads its
    chunks whole into one buffer (CRC-32 checked), the ranks agree that
    nobody has failed (one small all-reduce), each source broadcasts its
    buffer in rank order, and each rank copies out the regions it needs.
    A chunk that is a rank's whole, contiguous destination and alone in
    its round is read or received straight into that destination. Every
    rank issues the same collectives in the same order whatever fails
    locally; a local failure is raised after the round it happened in,
    and once any rank has failed all ranks stop at the next round.
    ``failed`` (this rank failed before the rounds; ``reads`` may then be
    None): it only joins the first check. Returns False when another
    rank's failure stopped the rounds."""
    me = coord.rank
    error: BaseException | None = None
    stopped = False
    for rnd in sched.rounds:
        bufs: list[tuple[np.ndarray, bool]] = []
        if not failed and error is None:
            assert reads is not None
            try:
                bufs = [_round_buffer(entries, mine, src == me, reads) for src, entries in rnd]
            except BaseException as e:  # noqa: BLE001 - reported below
                error = e
        if coord.any_failed(failed or error is not None):
            stopped = True
            break
        assert reads is not None
        stats = reads.stats
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


def _round_buffer(entries: list[_Shared], mine: dict[Any, list[tuple[_Req, Any]]],
                  source: bool, reads: _Reads) -> tuple[np.ndarray, bool]:
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
                                 e.rec.data_crc32 if reads.verify and e.rec.checked else None))
        reqs.append((r, e.rec))
        pos += n
    reads.run(jobs, reqs)
    return buf, direct


def _direct_bytes(dest: Any, rec: _Rec, r: _Req) -> np.ndarray | None:
    """``dest``'s own bytes when the region ``r`` reads is the whole record
    and ``dest`` is a contiguous CPU tensor or array of its dtype (the
    chunk can be read or received straight into it); else None."""
    if (rec.storage_offset or rec.conj or rec.neg or not rec.data_length
            or not is_contiguous(rec.shape, rec.stride)):
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
