"""The few FlatParameter layout and bulk-copy operations the optimizer-state code needs.

Everything that knows how an FSDP1 unit lays its parameters out in one flat
buffer, or that copies state between that flat layout and per-parameter
tensors, goes through this module and nothing else in ``shardstate.fsdp``
does. Today each operation is written with torch ops on the FlatParameter's
own metadata (``_numels_with_padding``, ``_is_padding_mask``, ``_shapes``,
``_shard_param_infos``, ...); the C layout (``_layout.FlatLayout``) can take
over each one here without its callers changing:

    unit_layout          -> _layout.FlatLayout(numels, world_size, align_numel=...)
    unflatten            -> FlatLayout.unflatten + a reshape per parameter
    flatten_shard_into   -> FlatLayout.flatten(pieces, rank, out)
    pack_local_into      -> a copy job list (offset_in_shard, piece) run in C
    slice_local          -> FlatLayout.shard_infos(rank)[i] + one copy

Invariants: a ``UnitLayout`` describes one rank's view of one FlatParameter
and never changes; every offset it hands out lies inside the buffers it
describes (checked where a caller passes a buffer in). Nothing here
communicates; nothing here keeps a reference to the tensors it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "UnitLayout",
    "unit_layout",
    "unflatten",
    "flatten_shard_into",
    "pack_local_into",
    "slice_local",
]


@dataclass(frozen=True)
class UnitLayout:
    """One FSDP unit's flat layout, as rank ``rank`` of ``world_size`` sees it.

    ``offsets[i]``/``numels[i]``/``shapes[i]``: parameter ``i``'s start, size
    and shape in the unpadded unsharded flat buffer (alignment padding, when
    ``use_orig_params=True``, sits between parameters). ``sharded`` is False
    under world size 1 or NO_SHARD: then the local flat state is the whole
    unpadded buffer and ``shard_numel == padded_numel == unpadded_numel``.
    ``shard_infos[i]`` is torch's ``_ShardParamInfo`` for this rank.
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
    shard_infos: tuple[Any, ...]

    @property
    def num_params(self) -> int:
        return len(self.numels)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the padded unsharded buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel


def unit_layout(handle: Any, world_size: int, rank: int, sharded: bool) -> UnitLayout:
    """The layout of ``handle``'s FlatParameter (an FSDP1 ``FlatParamHandle``)."""
    fp = handle.flat_param
    numels_pad = tuple(int(n) for n in fp._numels_with_padding)
    mask = tuple(bool(m) for m in fp._is_padding_mask)
    if len(numels_pad) != len(mask):
        raise AssertionError("FlatParameter metadata: padding mask length differs from numels")
    offsets: list[int] = []
    pos = 0
    for n, is_pad in zip(numels_pad, mask):
        if not is_pad:
            offsets.append(pos)
        pos += n
    unpadded = int(fp._unpadded_unsharded_size.numel())
    if pos != unpadded:
        raise AssertionError(
            f"FlatParameter metadata: numels with padding sum to {pos}, "
            f"unpadded unsharded size is {unpadded}"
        )
    numels = tuple(int(n) for n in fp._numels)
    shapes = tuple(fp._shapes)
    if len(numels) != len(offsets) or len(shapes) != len(offsets):
        raise AssertionError("FlatParameter metadata: param counts disagree")
    if sharded:
        shard_numel = int(fp._sharded_size.numel())
        padded = shard_numel * world_size
        if padded < unpadded:
            raise AssertionError(
                f"FlatParameter metadata: {world_size} shards of {shard_numel} "
                f"cannot hold {unpadded} elements"
            )
    else:
        world_size, rank = 1, 0
        shard_numel = padded = unpadded
    return UnitLayout(
        world_size=world_size,
        rank=rank,
        sharded=sharded,
        numels=numels,
        shapes=shapes,
        offsets=tuple(offsets),
        unpadded_numel=unpadded,
        padded_numel=padded,
        shard_numel=shard_numel,
        shard_infos=tuple(fp._shard_param_infos),
    )


def unflatten(layout: UnitLayout, flat_full: torch.Tensor) -> list[torch.Tensor]:
    """Views (no copy) of every parameter's range of a full flat buffer, shaped as the parameter."""
    if flat_full.dim() != 1 or flat_full.numel() < layout.unpadded_numel:
        raise ValueError(
            f"a full flat state needs at least {layout.unpadded_numel} elements in one "
            f"dimension, got shape {tuple(flat_full.shape)}"
        )
    return [
        flat_full[off : off + n].view(shape)
        for off, n, shape in zip(layout.offsets, layout.numels, layout.shapes)
    ]


def flatten_shard_into(
    layout: UnitLayout,
    pieces: Sequence[torch.Tensor | None],
    rank: int,
    out: torch.Tensor,
) -> None:
    """Write ``rank``'s flat shard of full per-parameter state into ``out``.

    ``pieces[i]`` is parameter ``i``'s whole state (any shape with
    ``numels[i]`` elements) or None (no state: zeros). Padding is zero, as
    torch pads a shard. Only the part of each piece inside the shard is read.
    """
    if len(pieces) != layout.num_params:
        raise ValueError(f"expected {layout.num_params} pieces, got {len(pieces)}")
    if out.dim() != 1 or out.numel() != layout.shard_numel:
        raise ValueError(
            f"the shard buffer needs {layout.shard_numel} elements, got shape {tuple(out.shape)}"
        )
    start, end = layout.shard_range(rank)
    out.zero_()
    for i, piece in enumerate(pieces):
        if piece is None:
            continue
        n = layout.numels[i]
        if piece.numel() != n:
            raise ValueError(f"piece {i} has {piece.numel()} elements, the parameter {n}")
        lo = max(start, layout.offsets[i])
        hi = min(end, layout.offsets[i] + n)
        if lo >= hi:
            continue
        src = piece.reshape(-1)[lo - layout.offsets[i] : hi - layout.offsets[i]]
        out[lo - start : hi - start].copy_(src)


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
    if len(local_pieces) != layout.num_params:
        raise ValueError(f"expected {layout.num_params} pieces, got {len(local_pieces)}")
    if out.dim() != 1 or out.numel() != layout.shard_numel:
        raise ValueError(
            f"the shard buffer needs {layout.shard_numel} elements, got shape {tuple(out.shape)}"
        )
    out.zero_()
    for i, piece in enumerate(local_pieces):
        if piece is None or piece.numel() == 0:
            continue
        info = layout.shard_infos[i]
        if not info.in_shard or piece.numel() != info.numel_in_shard:
            raise ValueError(
                f"parameter {i}'s local state has {piece.numel()} elements but its shard "
                f"holds {info.numel_in_shard if info.in_shard else 0}"
            )
        off = info.offset_in_shard
        out[off : off + info.numel_in_shard].copy_(piece.reshape(-1))


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


def _dim0_range(numel: int, shape: torch.Size, world_size: int, r: int) -> tuple[int, int]:
    rows = shape[0]
    row = numel // rows
    c0 = -(-rows // world_size)
    lo = min(r * c0, rows)
    hi = min((r + 1) * c0, rows)
    return lo * row, hi * row


def dim0_plan(layout: UnitLayout) -> Dim0Plan | None:
    """The all-to-all plan, or None if a parameter has no dim 0 to chunk (0-dim or empty)."""
    if any(len(s) == 0 or s[0] == 0 for s in layout.shapes):
        return None
    W, me, S = layout.world_size, layout.rank, layout.shard_numel

    def piece(s: int, d: int, i: int) -> tuple[int, int]:
        lo, hi = _dim0_range(layout.numels[i], layout.shapes[i], W, d)
        lo = max(lo + layout.offsets[i], s * S)
        hi = min(hi + layout.offsets[i], (s + 1) * S)
        return lo, max(lo, hi)

    send_sizes, send_segments = [], []
    for d in range(W):
        total = 0
        for i in range(layout.num_params):
            lo, hi = piece(me, d, i)
            if hi > lo:
                send_segments.append((lo - me * S, hi - lo))
                total += hi - lo
        send_sizes.append(total)
    recv_sizes = []
    per_param: list[list[tuple[int, int]]] = [[] for _ in range(layout.num_params)]
    pos = 0
    for s in range(W):
        start = pos
        for i in range(layout.num_params):
            lo, hi = piece(s, me, i)
            if hi > lo:
                per_param[i].append((pos, hi - lo))
                pos += hi - lo
        recv_sizes.append(pos - start)
    chunk_numels = []
    for i in range(layout.num_params):
        lo, hi = _dim0_range(layout.numels[i], layout.shapes[i], W, me)
        n = hi - lo
        if sum(k for _, k in per_param[i]) != n:
            raise AssertionError(f"dim-0 plan: parameter {i}'s chunk is not covered exactly")
        chunk_numels.append(n)
    return Dim0Plan(
        send_sizes=tuple(send_sizes),
        recv_sizes=tuple(recv_sizes),
        send_segments=tuple(send_segments),
        recv_segments=tuple(tuple(p) for p in per_param),
        chunk_numels=tuple(chunk_numels),
    )


def pack_segments(
    src: torch.Tensor, segments: Sequence[tuple[int, int]], out: torch.Tensor
) -> None:
    """``out`` = the concatenation of ``src[off:off+n]`` for each segment."""
    pos = 0
    for off, n in segments:
        if off < 0 or off + n > src.numel() or pos + n > out.numel():
            raise ValueError(f"segment ({off}, {n}) outside a buffer of {src.numel()}")
        out[pos : pos + n].copy_(src[off : off + n])
        pos += n
    if pos != out.numel():
        raise ValueError(f"segments cover {pos} of {out.numel()} elements")
