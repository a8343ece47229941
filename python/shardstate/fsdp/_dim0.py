"""One FSDP unit's flat shards <-> every parameter's dim-0 chunks: the plan and the exchanges.

torch's SHARDED optimizer state holds each parameter's state as
``torch.chunk(state, W, dim=0)[r]`` on rank ``r``; the flat state holds
rank ``r``'s slice of the unit's FlatParameter. Going from one to the other
moves about one shard's worth per rank, never the whole unit:

    dim0_plan            the all-to-all: what each rank sends (segments of its
                         flat shard) and receives (pieces of its chunks)
    dim0_messages        the same plan cut into point-to-point messages
    dim0_chunk_numels    torch.chunk(param, W, dim=0)'s sizes, per parameter and rank
    pack_chunks_into     dim0_plan backwards: dim-0 chunks -> what a sharded load sends
    shard_pieces         ... and where the received pieces go in the flat shard
    shards_to_chunks     save: one all_to_all_single (gloo: p2p messages),
                         every rank's flat shard -> this rank's dim-0 chunks
    chunks_to_shard      load: the inverse (NO_SHARD: one all-gather)

The plan is linear in the parameters and the segments; the copies are
``_flatops`` batches (one C call each). Whether a value is in torch's dim-0
chunk layout, and the ShardedTensors made from our chunks, are ``_sharded``'s.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import comm
from . import _flatops

__all__ = [
    "Dim0Messages",
    "Dim0Plan",
    "chunks_to_shard",
    "dim0_chunk_numels",
    "dim0_messages",
    "dim0_plan",
    "pack_chunks_into",
    "shard_pieces",
    "shards_to_chunks",
]


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Dim0Plan:
    """How one unit's flat shards become every parameter's dim-0 chunks (an all-to-all).

    Rank ``r``'s chunk of parameter ``i`` is ``torch.chunk(param, W, dim=0)[r]``
    (empty where torch.chunk returns fewer than W chunks). This rank sends
    ``send_sizes[d]`` elements to rank ``d``, packed from its flat shard by
    ``send_segments`` ((offset in shard, numel) in order), and receives
    ``recv_sizes[s]`` from rank ``s``; ``recv_segments[i]`` lists where
    parameter ``i``'s chunk lies in the receive buffer, in order.
    """

    send_sizes: tuple[int, ...]
    recv_sizes: tuple[int, ...]
    send_segments: tuple[tuple[int, int], ...]
    recv_segments: tuple[tuple[tuple[int, int], ...], ...]
    chunk_numels: tuple[int, ...]


def _chunk_numel(numel: int, rows: int, world_size: int) -> int:
    """Elements in each of torch.chunk(param, world_size, dim=0) but the last ones."""
    return -(-rows // world_size) * (numel // rows)


def dim0_plan(layout: _flatops.UnitLayout) -> Dim0Plan | None:
    """The all-to-all plan, or None if a parameter has no dim 0 to chunk (0-dim or empty).

    Work is linear in the parameters and the segments: each parameter is
    cut only where a shard boundary or a chunk boundary falls inside it.
    """
    if any(len(s) == 0 or s[0] == 0 for s in layout.shapes):
        return None
    W, me, S = layout.world_size, layout.rank, layout.shard_numel
    mine_lo, mine_hi = me * S, (me + 1) * S
    to_dest: list[list[tuple[int, int]]] = [[] for _ in range(W)]
    from_src: list[list[tuple[int, int]]] = [[] for _ in range(W)]  # (param, numel)
    chunk_numels = []
    for i, (off, n, shape) in enumerate(zip(layout.offsets, layout.numels, layout.shapes)):
        if n == 0:
            chunk_numels.append(0)
            continue
        c = _chunk_numel(n, shape[0], W)
        # Send: my shard's part of parameter i, cut at its chunk boundaries.
        a, b = max(mine_lo, off), min(mine_hi, off + n)
        if a < b:
            for d in range((a - off) // c, (b - 1 - off) // c + 1):
                lo, hi = max(a, off + d * c), min(b, off + (d + 1) * c)
                to_dest[d].append((lo - mine_lo, hi - lo))
        # Receive: my chunk of parameter i, cut at the shard boundaries.
        a, b = off + min(me * c, n), off + min((me + 1) * c, n)
        chunk_numels.append(b - a)
        if a < b:
            for s in range(a // S, (b - 1) // S + 1):
                from_src[s].append((i, min(b, (s + 1) * S) - max(a, s * S)))
    per_param: list[list[tuple[int, int]]] = [[] for _ in range(layout.num_params)]
    recv_sizes = []
    pos = 0
    for segs in from_src:
        start = pos
        for i, k in segs:
            per_param[i].append((pos, k))
            pos += k
        recv_sizes.append(pos - start)
    for i, n in enumerate(chunk_numels):
        if sum(k for _, k in per_param[i]) != n:
            raise AssertionError(f"dim-0 plan: parameter {i}'s chunk is not covered exactly")
    return Dim0Plan(
        send_sizes=tuple(sum(k for _, k in segs) for segs in to_dest),
        recv_sizes=tuple(recv_sizes),
        send_segments=tuple(seg for segs in to_dest for seg in segs),
        recv_segments=tuple(tuple(p) for p in per_param),
        chunk_numels=tuple(chunk_numels),
    )


@dataclass(frozen=True)
class Dim0Messages:
    """A ``Dim0Plan`` as point-to-point messages, one per parameter and
    pair of ranks, in the order both ends list them (parameter order).

    ``shard_side[r]``: the ``(offset in this rank's flat shard, numel)``
    segments exchanged with rank ``r``; ``chunk_side[r]``: the
    ``(parameter, start in its dim-0 chunk, numel)`` pieces exchanged with
    rank ``r``. A save sends ``shard_side`` and receives ``chunk_side``; a
    load, backwards, sends ``chunk_side`` and receives ``shard_side``. Rank
    ``r``'s ``shard_side[me]`` and this rank's ``chunk_side[r]`` describe
    the same messages (and ``chunk_side[me]`` pairs with ``shard_side[me]``
    for the rank's own part).
    """

    shard_side: tuple[tuple[tuple[int, int], ...], ...]
    chunk_side: tuple[tuple[tuple[int, int, int], ...], ...]


def dim0_messages(plan: Dim0Plan) -> Dim0Messages:
    """``plan``'s send and receive buffers cut into their messages."""
    shard_side: list[list[tuple[int, int]]] = []
    segs = iter(plan.send_segments)
    for size in plan.send_sizes:
        got, mine = 0, []
        while got < size:
            off, n = next(segs)
            mine.append((off, n))
            got += n
        if got != size:
            raise AssertionError("dim-0 plan: send segments do not add up to a rank's size")
        shard_side.append(mine)
    starts = list(itertools.accumulate(plan.recv_sizes, initial=0))
    by_rank: list[list[tuple[int, int, int, int]]] = [[] for _ in plan.recv_sizes]
    for i, piece_segs in enumerate(plan.recv_segments):
        at = 0
        for pos, k in piece_segs:
            r = bisect.bisect_right(starts, pos) - 1
            if pos + k > starts[r + 1]:
                raise AssertionError("dim-0 plan: a chunk piece crosses two ranks' blocks")
            by_rank[r].append((pos, i, at, k))
            at += k
    chunk_side = tuple(tuple((i, at, k) for _, i, at, k in sorted(m)) for m in by_rank)
    return Dim0Messages(tuple(tuple(m) for m in shard_side), chunk_side)


def dim0_chunk_numels(shapes: Sequence[torch.Size], world_size: int) -> list[list[int]] | None:
    """``numels[r][i]``: elements of ``torch.chunk(param_i, world_size, dim=0)[r]``
    (0 past the last chunk); None if a parameter has no dim 0 to chunk."""
    if any(len(s) == 0 or s[0] == 0 for s in shapes):
        return None
    out = []
    for r in range(world_size):
        row = []
        for shape in shapes:
            n = math.prod(shape)
            c = _chunk_numel(n, shape[0], world_size)
            row.append(max(0, min(c, n - r * c)))
        out.append(row)
    return out


def pack_chunks_into(
    plan: Dim0Plan, chunks: Sequence[torch.Tensor | None], out: torch.Tensor
) -> None:
    """``plan`` backwards, first half: every parameter's dim-0 chunk
    (``chunks[i]``, None for zeros) into ``out``, laid out as the save's
    receive buffer (``recv_segments``), i.e. what a sharded load sends to
    each rank (``recv_sizes[d]`` elements to rank ``d``). One C batch."""
    if len(chunks) != len(plan.chunk_numels):
        raise ValueError(f"expected {len(plan.chunk_numels)} chunks, got {len(chunks)}")
    if out.dim() != 1 or out.numel() != sum(plan.recv_sizes):
        raise ValueError(
            f"the send buffer needs {sum(plan.recv_sizes)} elements, got shape {tuple(out.shape)}"
        )
    items = []
    for i, (c, segs) in enumerate(zip(chunks, plan.recv_segments)):
        if c is None:
            continue
        if c.numel() != plan.chunk_numels[i]:
            raise ValueError(
                f"parameter {i}'s chunk has {c.numel()} elements, expected {plan.chunk_numels[i]}"
            )
        flat, at = c.reshape(-1), 0
        for pos, k in segs:
            items.append((pos, flat[at : at + k]))
            at += k
    _flatops.place_many([(out, items)])


def shard_pieces(plan: Dim0Plan, recv: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``plan`` backwards, second half: a received buffer (laid out as the
    save's send buffer, ``send_sizes[s]`` elements from rank ``s``) as
    ``(offset in this rank's flat shard, view of recv)`` pairs; the rest of
    the shard is padding. ``_flatops.place_many`` writes them."""
    if recv.dim() != 1 or recv.numel() != sum(plan.send_sizes):
        raise ValueError(
            f"the receive buffer needs {sum(plan.send_sizes)} elements, "
            f"got shape {tuple(recv.shape)}"
        )
    out, pos = [], 0
    for off, n in plan.send_segments:
        out.append((off, recv[pos : pos + n]))
        pos += n
    return out


# ---------------------------------------------------------------------------
# The exchanges
# ---------------------------------------------------------------------------


def shards_to_chunks(
    local: torch.Tensor | list[torch.Tensor | None],
    layout: _flatops.UnitLayout,
    pg: dist.ProcessGroup | None,
    what: str,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor] | None:
    """One all-to-all: every rank's flat shard -> this rank's dim-0 chunk of every parameter.

    ``local`` is this rank's flat shard, or (``use_orig_params=True``) the
    per-parameter local pieces, packed straight into the send buffer.
    Each rank receives about one shard's worth instead of the whole unit.
    None when a parameter cannot be chunked on dim 0 (the caller gathers instead).
    """
    plan = dim0_plan(layout)
    if plan is None:
        return None
    if isinstance(local, torch.Tensor) and (
        local.dim() != 1 or local.numel() != layout.shard_numel
    ):
        raise ValueError(
            f"optimizer state {what} should be this rank's flat shard of "
            f"{layout.shard_numel} elements but has shape {tuple(local.shape)}"
        )
    if device.type == "cpu" and comm.point_to_point([], pg):
        return _shards_to_chunks_p2p(local, layout, plan, pg, dtype)
    send = torch.empty(sum(plan.send_sizes), dtype=dtype, device=device)
    if isinstance(local, list):
        _flatops.pack_local_segments_into(layout, local, plan.send_segments, send)
    else:
        _flatops.pack_segments(local, plan.send_segments, send)
    recv = torch.empty(sum(plan.recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, list(plan.recv_sizes), list(plan.send_sizes), group=pg)
    del send
    out = []
    jobs = []
    for i, n in enumerate(plan.chunk_numels):
        segs = plan.recv_segments[i]
        if len(segs) == 1:
            # The chunk came whole from one rank: a view, no copy (all of
            # recv belongs to some chunk, so the views waste nothing).
            off, k = segs[0]
            out.append(recv[off : off + k])
            continue
        chunk = torch.empty(n, dtype=dtype, device=device)
        jobs.append((recv, segs, chunk))
        out.append(chunk)
    _flatops.pack_segments_many(jobs)  # the chunks cut by a shard boundary, one C batch
    return out


def _zeros(cache: list[torch.Tensor], n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` zeros, a view of one zero buffer kept in ``cache`` (grown as
    needed) for the messages of a parameter without state."""
    if not cache or cache[0].numel() < n:
        cache[:] = [torch.zeros(n, dtype=dtype)]
    return cache[0][:n]


def _shards_to_chunks_p2p(
    local: torch.Tensor | list[torch.Tensor | None],
    layout: _flatops.UnitLayout,
    plan: Dim0Plan,
    pg: dist.ProcessGroup | None,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """``shards_to_chunks`` as point-to-point messages (gloo): each segment of
    the local state goes from where it lies, each received piece lands in
    its chunk; nothing is packed or unpacked."""
    msgs = dim0_messages(plan)
    me = layout.rank
    out = [torch.empty(n, dtype=dtype) for n in plan.chunk_numels]
    zeros: list[torch.Tensor] = []

    def segments(segs: tuple[tuple[int, int], ...]) -> list[torch.Tensor]:
        if isinstance(local, list):
            views = _flatops.local_segment_views(layout, local, segs)
        else:
            views = [local[off : off + n] for off, n in segs]
        res = []
        for v, (_, n) in zip(views, segs):
            if v is None:  # a parameter without this state: zeros, as the packed buffer held
                v = _zeros(zeros, n, dtype)
            elif v.dtype != dtype:
                raise ValueError(f"local optimizer state is {v.dtype}, expected {dtype}")
            res.append(v.contiguous())
        return res

    def pieces(r: int) -> list[torch.Tensor]:
        return [out[i][at : at + k] for i, at, k in msgs.chunk_side[r]]

    for src, dst in zip(segments(msgs.shard_side[me]), pieces(me)):
        dst.copy_(src)
    sends = [(t, r) for r in range(layout.world_size) if r != me
             for t in segments(msgs.shard_side[r])]
    recvs = [(t, r) for r in range(layout.world_size) if r != me for t in pieces(r)]
    comm.exchange(sends, recvs, pg)
    return out


def chunks_to_shard(
    fsdp_state: Any,
    layout: _flatops.UnitLayout,
    chunks: list[torch.Tensor | None],
    dtype: torch.dtype,
    into: Any = None,
) -> list[tuple[int, torch.Tensor]] | None:
    """The inverse of ``shards_to_chunks``, one exchange: every rank's dim-0
    chunks of the unit's parameters (``chunks[i]``, None for zeros) -> the
    pieces of this rank's local flat state, as ``(offset, piece)`` pairs in
    the flat shard (or, not sharded, the whole unpadded flat buffer).

    Sharded: one ``all_to_all_single`` on ``dim0_plan`` with the roles
    swapped (what the save receives is sent, what it sends is received), so
    every rank receives only its shard. On a gloo group, given ``into``
    (``into(offset, numel)``: the 1-D view of the final destination of that
    part of the flat shard, or None to drop it), the pieces travel as
    point-to-point messages straight from the chunks into their
    destinations instead, and the result is None: every non-padding element
    of the shard has been written, the padding is left alone. NO_SHARD: one
    all-gather of every rank's packed chunks (every rank needs the whole unit).
    """
    pg, device = fsdp_state.process_group, fsdp_state.compute_device
    ws, rank = fsdp_state.world_size, fsdp_state.rank
    numels = dim0_chunk_numels(layout.shapes, ws)
    if numels is None or len(chunks) != layout.num_params:
        raise AssertionError("a unit without dim-0 chunks has no chunk exchange")
    for i, c in enumerate(chunks):
        if c is not None and c.numel() != numels[rank][i]:
            raise ValueError(
                f"parameter {i}'s dim-0 chunk has {c.numel()} elements, rank {rank}'s "
                f"chunk of a {tuple(layout.shapes[i])} tensor has {numels[rank][i]}"
            )
    if layout.sharded:
        plan = dim0_plan(layout)
        assert plan is not None
        if into is not None and device.type == "cpu" and comm.point_to_point([], pg):
            _chunks_to_shard_p2p(layout, plan, chunks, dtype, into, pg)
            return None
        send = torch.empty(sum(plan.recv_sizes), dtype=dtype, device=device)
        pack_chunks_into(plan, chunks, send)
        recv = torch.empty(sum(plan.send_sizes), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, list(plan.send_sizes), list(plan.recv_sizes), group=pg)
        return shard_pieces(plan, recv)
    per_rank = sum(numels[0])  # rank 0 holds the largest chunks
    send = torch.empty(per_rank, dtype=dtype, device=device)
    items, pos = [], 0
    for i, c in enumerate(chunks):
        if c is not None:
            items.append((pos, c))
        pos += numels[rank][i]
    _flatops.place_many([(send, items)])
    if ws > 1:
        every = torch.empty(ws * per_rank, dtype=dtype, device=device)
        comm.all_gather_into(every, send, pg)
    else:
        every = send
    out = []
    for r in range(ws):
        pos = r * per_rank
        for i, n in enumerate(numels[r]):
            if n:
                out.append((layout.offsets[i] + r * numels[0][i], every[pos : pos + n]))
            pos += n
    return out


def _chunks_to_shard_p2p(
    layout: _flatops.UnitLayout,
    plan: Dim0Plan,
    chunks: list[torch.Tensor | None],
    dtype: torch.dtype,
    into: Any,
    pg: dist.ProcessGroup | None,
) -> None:
    """``chunks_to_shard``'s sharded exchange as point-to-point messages
    (gloo): ``_shards_to_chunks_p2p`` backwards."""
    msgs = dim0_messages(plan)
    me = layout.rank
    zeros: list[torch.Tensor] = []

    def pieces(r: int) -> list[torch.Tensor]:
        res = []
        for i, at, k in msgs.chunk_side[r]:
            c = chunks[i]
            if c is None:  # no state for this parameter: zeros, as the packed buffer held
                res.append(_zeros(zeros, k, dtype))
                continue
            if c.dtype != dtype:
                raise ValueError(f"parameter {i}'s dim-0 chunk is {c.dtype}, expected {dtype}")
            res.append(c.reshape(-1)[at : at + k].contiguous())
        return res

    def dests(r: int) -> list[torch.Tensor]:
        res = []
        for off, n in msgs.shard_side[r]:
            v = into(off, n)
            if v is None:
                v = torch.empty(n, dtype=dtype)  # received and dropped
            elif v.dtype != dtype or v.numel() != n or not v.is_contiguous():
                raise AssertionError(f"the destination of ({off}, {n}) is not {n} {dtype}")
            res.append(v)
        return res

    for src, dst in zip(pieces(me), dests(me)):
        dst.copy_(src)
    sends = [(t, r) for r in range(layout.world_size) if r != me for t in pieces(r)]
    recvs = [(t, r) for r in range(layout.world_size) if r != me for t in dests(r)]
    comm.exchange(sends, recvs, pg)
