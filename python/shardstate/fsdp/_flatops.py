"""The few FlatParameter layout and bulk-copy operations the optimizer-state code needs.

Everything that knows how an FSDP1 unit lays its parameters out in one flat
buffer, or that copies state between that flat layout and per-parameter
tensors, goes through this module and nothing else in ``shardstate.fsdp``
does. The layout is the C core's (``_layout.FlatLayout``, ``ss_flat``),
computed from the unit's parameter shapes, world size and alignment; the
bulk copies are C copy jobs run with the GIL released:

    unit_layout          FlatLayout(numels, world_size, align_numel=handle._aligned_numel)
    unflatten            FlatLayout.unflatten + a reshape per parameter (views)
    flatten_shard_into   FlatLayout.flatten(pieces, rank, out, pad_value=0)
    flatten_full_into    every rank's shard in one flatten_many batch
    pack_local_into      FlatLayout.flatten of (piece, intra_param_start_idx) parts
    pack_local_segments_into  the all-to-all send buffer straight from those parts
    pack_segments(_many) flatten_many over layouts whose "parameters" are the segments
    place_many           the reverse: pieces written at given offsets, the gaps zeroed
    pack_chunks_into     dim0_plan backwards: dim-0 chunks -> what a sharded load sends
    shard_pieces         ... and where the received pieces go in the flat shard
    dim0_chunk_numels    torch.chunk(param, W, dim=0)'s sizes, per parameter and rank
    slice_local          one torch copy (a single slice; as one C batch per unit it
                         measured ~1.3x slower than torch's clone single-threaded)

Only the parameters' shapes (``flat_param._shapes``, which the C layout
cannot know) and the handle's alignment are read from torch; offsets,
sizes, padding and shard infos are the C layout's, equal to torch's
(tests/test_fsdp_layout.py, tests/test_fsdp_optim.py check both).

Padding: torch's optimizer-state flattening (``_flatten_tensor_optim_state``,
``use_orig_params=False``, no alignment) pads a shard with 0; every copy here
fills padding with 0, also in aligned (``use_orig_params=True``) layouts,
where the local flat state is never returned and only the parameters'
ranges are read from it.

Buffers: CPU tensors go to C as they are (contiguous views, no staging copy);
a piece that is not contiguous is made so first, and a buffer on another
device is staged through the CPU with one torch copy each way.

Invariants: a ``UnitLayout`` describes one rank's view of one FlatParameter
and never changes; every offset it hands out lies inside the buffers it
describes (checked where a caller passes a buffer in). Nothing here
communicates; nothing here keeps a reference to the tensors it is given.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._layout import FlatLayout, ShardParamInfo, flatten_many

__all__ = [
    "Dim0Plan",
    "UnitLayout",
    "dim0_plan",
    "flatten_full_into",
    "flatten_shard_into",
    "pack_local_into",
    "pack_local_segments_into",
    "pack_segments",
    "pack_segments_many",
    "place_many",
    "dim0_chunk_numels",
    "pack_chunks_into",
    "shard_pieces",
    "slice_local",
    "unflatten",
    "unit_layout",
]

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class UnitLayout:
    """One FSDP unit's flat layout, as rank ``rank`` of ``world_size`` sees it.

    ``offsets[i]``/``numels[i]``/``shapes[i]``: parameter ``i``'s start, size
    and shape in the unpadded unsharded flat buffer (alignment padding, when
    ``use_orig_params=True``, sits between parameters). ``unpadded_numel`` is
    torch's ``_unpadded_unsharded_size`` (the flat parameter, alignment and
    world-size padding included). ``sharded`` is False under world size 1 or
    NO_SHARD: then the local flat state is the whole unpadded buffer and
    ``shard_numel == padded_numel == unpadded_numel``. ``shard_infos[i]`` is
    torch's ``_ShardParamInfo`` for this rank. ``flat`` is the C layout the
    copies run on (world size 1 when not sharded; its shard may then stop
    short of ``shard_numel`` by NO_SHARD's world-size padding, zero-filled).
    """

    world_size: int
    rank: int
    sharded: bool
    numels: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    unpadded_numel: int
    padded_numel: int
    shard_numel: int
    shard_infos: tuple[ShardParamInfo, ...]
    flat: FlatLayout

    @property
    def num_params(self) -> int:
        return len(self.numels)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the padded unsharded buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel


def unit_layout(handle: Any, world_size: int, rank: int, sharded: bool) -> UnitLayout:
    """The layout of ``handle``'s FlatParameter (an FSDP1 ``FlatParamHandle``)."""
    shapes = tuple(torch.Size(s) for s in handle.flat_param._shapes)
    numels = tuple(math.prod(s) for s in shapes)
    align = int(handle._aligned_numel)
    # torch's flat parameter: alignment padding, then (aligned mode only)
    # padding up to a multiple of the handle's world size, NO_SHARD included.
    whole = FlatLayout(numels, int(handle.world_size), align_numel=align)
    if sharded:
        if whole.world_size != world_size:
            raise AssertionError(
                f"the FSDP unit's handle has world size {whole.world_size}, its state {world_size}"
            )
        flat = whole
        shard_numel, padded = flat.shard_numel, flat.padded_numel
    else:
        world_size, rank = 1, 0
        flat = FlatLayout(numels, 1, align_numel=align)
        shard_numel = padded = whole.flat_numel
    return UnitLayout(
        world_size=world_size,
        rank=rank,
        sharded=sharded,
        numels=numels,
        shapes=shapes,
        offsets=flat.offsets,
        unpadded_numel=whole.flat_numel,
        padded_numel=padded,
        shard_numel=shard_numel,
        shard_infos=flat.shard_infos(rank),
        flat=flat,
    )


def unflatten(layout: UnitLayout, flat_full: torch.Tensor) -> list[torch.Tensor]:
    """Views (no copy) of every parameter's range of a full flat buffer, shaped as the parameter."""
    if flat_full.dim() != 1 or flat_full.numel() < layout.unpadded_numel:
        raise ValueError(
            f"a full flat state needs at least {layout.unpadded_numel} elements in one "
            f"dimension, got shape {tuple(flat_full.shape)}"
        )
    views = layout.flat.unflatten(flat_full[: layout.flat.flat_numel])
    return [v.view(shape) for v, shape in zip(views, layout.shapes)]


def _check_out(layout: UnitLayout, out: torch.Tensor) -> None:
    if out.dim() != 1 or out.numel() != layout.shard_numel:
        raise ValueError(
            f"the shard buffer needs {layout.shard_numel} elements, got shape {tuple(out.shape)}"
        )


def _src(t: torch.Tensor | None) -> torch.Tensor | None:
    """A piece as C can read it: a contiguous CPU tensor (a copy only if it is not one)."""
    if t is None:
        return None
    t = t.detach()
    if t.device != _CPU:
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def _run_flatten(jobs: list[tuple[FlatLayout, int, list[Any], torch.Tensor]]) -> None:
    """flatten_many with zero padding; destinations off the CPU staged through it."""
    staged = []
    cjobs = []
    for lay, rank, pieces, out in jobs:
        if out.device != _CPU:
            tmp = torch.empty(out.shape, dtype=out.dtype)
            staged.append((tmp, out))
            out = tmp
        cjobs.append((lay, rank, pieces, out))
    flatten_many(cjobs, pad_value=0)
    for tmp, out in staged:
        out.copy_(tmp)


def _shard_jobs(
    layout: UnitLayout, pieces: list[Any], rank: int, out: torch.Tensor
) -> list[tuple[FlatLayout, int, list[Any], torch.Tensor]]:
    """One flatten job writing ``rank``'s shard into ``out``; NO_SHARD's
    world-size padding past the C layout's shard is zeroed here."""
    n = layout.flat.shard_numel
    if out.numel() > n:
        out[n:].zero_()
        out = out[:n]
    return [(layout.flat, rank, pieces, out)]


def _check_pieces(layout: UnitLayout, pieces: Sequence[torch.Tensor | None]) -> list[Any]:
    if len(pieces) != layout.num_params:
        raise ValueError(f"expected {layout.num_params} pieces, got {len(pieces)}")
    out = []
    for i, piece in enumerate(pieces):
        if piece is not None and piece.numel() != layout.numels[i]:
            raise ValueError(
                f"piece {i} has {piece.numel()} elements, the parameter {layout.numels[i]}"
            )
        out.append(_src(piece))
    return out


def flatten_shard_into(
    layout: UnitLayout,
    pieces: Sequence[torch.Tensor | None],
    rank: int,
    out: torch.Tensor,
) -> None:
    """Write ``rank``'s flat shard of full per-parameter state into ``out``.

    ``pieces[i]`` is parameter ``i``'s whole state (any shape with
    ``numels[i]`` elements, ``out``'s dtype) or None (no state: zeros).
    Padding is zero, as torch pads a shard. Only the part of each piece
    inside the shard is read.
    """
    _check_out(layout, out)
    srcs = _check_pieces(layout, pieces)
    _run_flatten(_shard_jobs(layout, srcs, rank, out))


def flatten_full_into(
    layout: UnitLayout, pieces: Sequence[torch.Tensor | None], out: torch.Tensor
) -> None:
    """Every rank's flat shard, one after another, into ``out`` (``padded_numel``
    elements): ``flatten_shard_into`` for all ranks as one C batch."""
    if out.dim() != 1 or out.numel() != layout.padded_numel:
        raise ValueError(
            f"the padded flat buffer needs {layout.padded_numel} elements, "
            f"got shape {tuple(out.shape)}"
        )
    srcs = _check_pieces(layout, pieces)
    if not layout.sharded:
        _run_flatten(_shard_jobs(layout, srcs, 0, out))
        return
    parts = out.split(layout.shard_numel)
    _run_flatten([(layout.flat, r, srcs, part) for r, part in enumerate(parts)])


def pack_local_into(
    layout: UnitLayout,
    local_pieces: Sequence[torch.Tensor | None],
    out: torch.Tensor,
) -> None:
    """Assemble this rank's flat shard from per-parameter local pieces (``use_orig_params``).

    ``local_pieces[i]`` is parameter ``i``'s state restricted to this rank's
    shard (``numel_in_shard`` elements, as the optimizer keeps it for a
    sharded original parameter) or None (zeros). Everything else is zero.
    """
    _check_out(layout, out)
    _run_flatten(_shard_jobs(layout, _local_parts(layout, local_pieces), layout.rank, out))


def _local_parts(
    layout: UnitLayout, local_pieces: Sequence[torch.Tensor | None]
) -> list[tuple[torch.Tensor, int] | None]:
    """Checked local pieces as flatten's ``(buffer, intra_param_start_idx)`` parts."""
    if len(local_pieces) != layout.num_params:
        raise ValueError(f"expected {layout.num_params} pieces, got {len(local_pieces)}")
    parts: list[Any] = []
    for i, piece in enumerate(local_pieces):
        if piece is None or piece.numel() == 0:
            parts.append(None)
            continue
        info = layout.shard_infos[i]
        if not info.in_shard or piece.numel() != info.numel_in_shard:
            raise ValueError(
                f"parameter {i}'s local state has {piece.numel()} elements but its shard "
                f"holds {info.numel_in_shard if info.in_shard else 0}"
            )
        parts.append((_src(piece), info.intra_param_start_idx))
    return parts


def pack_local_segments_into(
    layout: UnitLayout,
    local_pieces: Sequence[torch.Tensor | None],
    segments: Sequence[tuple[int, int]],
    out: torch.Tensor,
) -> None:
    """``pack_segments(shard, segments, out)`` for the shard ``pack_local_into``
    would build from ``local_pieces``, without building it: one copy, straight
    from the pieces. Every segment ``(offset in shard, numel)`` must lie inside
    one parameter's part of the shard (``dim0_plan``'s send segments do)."""
    if out.dim() != 1:
        raise ValueError("pack_local_segments_into: out must be 1-D")
    pieces = local_segment_views(layout, local_pieces, segments)
    sizes = [n for _, n in segments]
    if sum(sizes) != out.numel():
        raise ValueError(f"segments cover {sum(sizes)} of {out.numel()} elements")
    if segments:
        _run_flatten([(FlatLayout(sizes, 1), 0, pieces, out)])


def slice_local(
    layout: UnitLayout, i: int, source: torch.Tensor, *, full: bool
) -> torch.Tensor | None:
    """Parameter ``i``'s part of this rank's shard, as a new 1-D tensor; None if outside it.

    ``source`` is the parameter's whole state (``full=True``) or this rank's
    flat shard of the unit (``full=False``).
    """
    info = layout.shard_infos[i]
    if not info.in_shard:
        return None
    if full:
        if source.numel() != layout.numels[i]:
            raise ValueError(
                f"state has {source.numel()} elements, the parameter {layout.numels[i]}"
            )
        lo, hi = info.intra_param_start_idx, info.intra_param_end_idx + 1
        return source.reshape(-1)[lo:hi].clone()
    if source.numel() != layout.shard_numel:
        raise ValueError(f"a shard has {layout.shard_numel} elements, got {source.numel()}")
    off = info.offset_in_shard
    return source[off : off + info.numel_in_shard].clone()


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


def dim0_plan(layout: UnitLayout) -> Dim0Plan | None:
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


def shard_spans(layout: UnitLayout) -> list[tuple[int, int, int]]:
    """``(start, end, parameter)`` of every parameter's non-empty part of this
    rank's flat shard, in shard order."""
    return sorted(
        (info.offset_in_shard, info.offset_in_shard + info.numel_in_shard, i)
        for i, info in enumerate(layout.shard_infos)
        if info.in_shard and info.numel_in_shard > 0
    )


def local_segment_views(
    layout: UnitLayout,
    local_pieces: Sequence[torch.Tensor | None],
    segments: Sequence[tuple[int, int]],
) -> list[torch.Tensor | None]:
    """Each ``(offset in shard, numel)`` segment of the shard that
    ``pack_local_into`` would build from ``local_pieces``, as a 1-D view of
    its piece (None where the piece is None: zeros), without building the
    shard. Every segment must lie inside one parameter's part."""
    parts = _local_parts(layout, local_pieces)
    spans = shard_spans(layout)
    starts = [a for a, _, _ in spans]
    out: list[torch.Tensor | None] = []
    for off, n in segments:
        k = bisect.bisect_right(starts, off) - 1
        if n < 0 or k < 0 or off + n > spans[k][1]:
            raise ValueError(f"segment ({off}, {n}) is not inside one parameter of the shard")
        a, _, i = spans[k]
        part = parts[i]
        out.append(None if part is None else part[0][off - a : off - a + n])
    return out


def zero_padding(layout: UnitLayout, shard: torch.Tensor) -> None:
    """Zero the elements of this rank's flat ``shard`` that belong to no
    parameter (alignment and world-size padding), as optimizer state holds them."""
    if shard.dim() != 1 or shard.numel() != layout.shard_numel:
        raise ValueError(
            f"zero_padding: the shard has {layout.shard_numel} elements, got {tuple(shard.shape)}"
        )
    pos = 0
    for a, b, _ in shard_spans(layout):
        if a > pos:
            shard[pos:a].zero_()
        pos = max(pos, b)
    if pos < shard.numel():
        shard[pos:].zero_()


def pack_segments_many(
    jobs: Sequence[tuple[torch.Tensor, Sequence[tuple[int, int]], torch.Tensor]],
) -> None:
    """``out`` = the concatenation of ``src[off:off+n]`` for each segment, for
    every ``(src, segments, out)`` job, as one C batch (the segments are the
    "parameters" of a one-rank flat layout whose flat buffer is ``out``)."""
    cjobs = []
    for src, segments, out in jobs:
        if src.dim() != 1 or out.dim() != 1:
            raise ValueError("pack_segments: src and out must be 1-D")
        pos = 0
        for off, n in segments:
            if off < 0 or n < 0 or off + n > src.numel():
                raise ValueError(f"segment ({off}, {n}) outside a buffer of {src.numel()}")
            pos += n
        if pos != out.numel():
            raise ValueError(f"segments cover {pos} of {out.numel()} elements")
        if not segments:
            continue
        s = _src(src)
        lay = FlatLayout([n for _, n in segments], 1)
        cjobs.append((lay, 0, [s[off : off + n] for off, n in segments], out))
    if cjobs:
        _run_flatten(cjobs)


def pack_segments(
    src: torch.Tensor, segments: Sequence[tuple[int, int]], out: torch.Tensor
) -> None:
    """``out`` = the concatenation of ``src[off:off+n]`` for each segment."""
    pack_segments_many([(src, segments, out)])


def place_many(
    jobs: Sequence[tuple[torch.Tensor, Sequence[tuple[int, torch.Tensor]]]],
) -> None:
    """``out[dst : dst + src.numel()] = src.flatten()`` for every ``(dst, src)``
    of every ``(out, items)`` job, the rest of ``out`` zero, as one C batch
    (the pieces and the gaps between them are the "parameters" of a one-rank
    flat layout whose flat buffer is ``out``). Items may come in any order
    but must not overlap; every source has ``out``'s dtype."""
    cjobs = []
    for out, items in jobs:
        if out.dim() != 1:
            raise ValueError("place_many: out must be 1-D")
        sizes: list[int] = []
        pieces: list[Any] = []
        pos = 0
        for dst, src in sorted(((d, s) for d, s in items if s.numel()), key=lambda x: x[0]):
            if dst < pos:
                raise ValueError(f"place_many: a piece at {dst} overlaps the one ending at {pos}")
            if dst > pos:
                sizes.append(dst - pos)
                pieces.append(None)
            src = _src(src)
            sizes.append(src.numel())
            pieces.append(src.reshape(-1))
            pos = dst + src.numel()
        if pos > out.numel():
            raise ValueError(f"place_many: pieces reach {pos}, past out's {out.numel()} elements")
        if pos < out.numel():
            sizes.append(out.numel() - pos)
            pieces.append(None)
        if sizes:
            cjobs.append((FlatLayout(sizes, 1), 0, pieces, out))
    if cjobs:
        _run_flatten(cjobs)


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
    place_many([(out, items)])


def shard_pieces(plan: Dim0Plan, recv: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``plan`` backwards, second half: a received buffer (laid out as the
    save's send buffer, ``send_sizes[s]`` elements from rank ``s``) as
    ``(offset in this rank's flat shard, view of recv)`` pairs; the rest of
    the shard is padding. ``place_many`` writes them."""
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
