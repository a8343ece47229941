"""FSDP1 flat-parameter layout and the bulk copies between flat shards and per-parameter state.

Everything that knows how an FSDP1 unit lays its parameters out in one flat
buffer, or that copies state between that flat layout and per-parameter
tensors, lives here (the dim-0 all-to-all plans on top of it: ``_dim0``).
The layout is the C core's ``_core.FlatLayout`` (``ss_flat``), computed
from the unit's parameter shapes, world size and alignment exactly as torch
2.13's ``FlatParamHandle`` does (``torch/distributed/fsdp/_flat_param.py``):

- parameters in order; with ``align_numel > 0`` (``use_orig_params=True``,
  where torch uses ``16 // itemsize``) padding is inserted before a
  parameter when the running total is not a multiple of ``align_numel``,
  and after the last one up to a multiple of ``world_size``
  (``_init_flat_param_and_metadata``);
- sharding as ``torch.chunk`` + ``F.pad`` (``_get_shard``): every rank's
  shard has ``ceil(flat_numel / world_size)`` elements, and a rank past the
  last chunk holds only padding;
- per rank, per parameter, ``ShardParamInfo`` equal to torch's
  ``_ShardParamInfo`` (``_get_shard_metadata``).

The C layout itself is used as it is (its properties, ``shard_range``,
``shard_infos`` and ``range_infos`` are torch's). Two layers sit on it:

    flatten_many / unflatten_many   batches of copies on C layouts, any buffers
    shard_infos, flat_views         a rank's ShardParamInfos; each parameter's range of a
                                    whole flat buffer
    UnitLayout, unit_layout, layout_of   one rank's view of one FSDP unit, and its copies:
    unflatten            flat_views + a reshape per parameter (views)
    flatten_shard_into   flatten_many(pieces, rank, out, pad_value=0)
    flatten_full_into    every rank's shard in one flatten_many batch
    pack_local_into      flatten of (piece, intra_param_start_idx) parts
    pack_local_segments_into  the all-to-all send buffer straight from those parts
    pack_segments(_many) flatten_many over layouts whose "parameters" are the segments
    place_many           the reverse: pieces written at given offsets, the gaps zeroed
    local_segment_views  segments of the shard pack_local_into would build, as views
    shard_spans, zero_padding   where the parameters lie in the shard; the rest zeroed
    slice_local          one torch copy (a single slice; as one C batch per unit it
                         measured ~1.3x slower than torch's clone single-threaded)

``flatten_many`` builds a rank's shard exactly as
``FlatParamHandle._get_shard(handle.flatten_tensors(pieces, align), rank,
world_size)[0]`` does, bit for bit: padding inside the flat parameter holds
``_FLAT_PARAM_PADDING_VALUE`` (42) as torch's ``_construct_padding_tensor``
makes it (aligned mode only), the ``F.pad`` tail holds 0, and a missing
piece (``None``) is zeros as in torch's optimizer-state flattening. Pass
``pad_value`` to choose another padding value. Its buffers are NumPy arrays
or CPU torch tensors (bfloat16 and other dtypes NumPy lacks are viewed as
same-width ints); every one is checked for dtype, size, contiguity and
writability with a ValueError naming it. The copies of a whole batch run in
one C call with the GIL released, split over a thread pool.

Only the parameters' shapes (``flat_param._shapes``, which the C layout
cannot know) and the handle's alignment are read from torch; offsets,
sizes, padding and shard infos are the C layout's, equal to torch's
(tests/test_fsdp_layout.py, tests/test_fsdp_optim.py check both).

Padding in the unit copies: torch's optimizer-state flattening
(``_flatten_tensor_optim_state``, ``use_orig_params=False``, no alignment)
pads a shard with 0; every ``UnitLayout`` copy fills padding with 0, also in
aligned (``use_orig_params=True``) layouts, where the local flat state is
never returned and only the parameters' ranges are read from it.

Buffers of the unit copies: CPU tensors go to C as they are (contiguous
views, no staging copy); a piece that is not contiguous is made so first,
and a buffer on another device is staged through the CPU with one torch
copy each way.

Invariants: a ``UnitLayout`` describes one rank's view of one FlatParameter
and never changes; every offset it hands out lies inside the buffers it
describes (checked where a caller passes a buffer in). Nothing here
communicates; nothing here keeps a reference to the tensors it is given.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.distributed.fsdp.api import ShardingStrategy

from .. import _core
from ..io import _pool_for

__all__ = [
    "FLAT_PARAM_PADDING_VALUE",
    "ShardParamInfo",
    "UnitLayout",
    "flat_views",
    "flatten_full_into",
    "flatten_many",
    "flatten_shard_into",
    "is_sharded",
    "layout_of",
    "local_segment_views",
    "pack_local_into",
    "pack_local_segments_into",
    "pack_segments",
    "pack_segments_many",
    "place_many",
    "shard_infos",
    "shard_spans",
    "slice_local",
    "unflatten",
    "unflatten_many",
    "unit_layout",
    "zero_padding",
]

FlatLayout = _core.FlatLayout  # the C layout, used as it is (no Python wrapper)

# torch.distributed.fsdp._flat_param._FLAT_PARAM_PADDING_VALUE
FLAT_PARAM_PADDING_VALUE = 42

_CPU = torch.device("cpu")


class ShardParamInfo(NamedTuple):
    """torch.distributed.fsdp._flat_param._ShardParamInfo, field for field.

    ``flat_shard[offset_in_shard : offset_in_shard + numel_in_shard]`` is
    ``param.flatten()[intra_param_start_idx : intra_param_end_idx + 1]``.
    """

    in_shard: bool
    offset_in_shard: int | None
    numel_in_shard: int | None
    intra_param_start_idx: int | None
    intra_param_end_idx: int | None  # inclusive, as torch


# ---------------------------------------------------------------------------
# Batches of copies on C layouts (NumPy arrays or CPU tensors)
# ---------------------------------------------------------------------------


def shard_infos(flat: FlatLayout, rank: int) -> tuple[ShardParamInfo, ...]:
    """One ShardParamInfo per real parameter, equal to torch's
    ``flat_param._shard_param_infos`` on ``rank``."""
    return tuple(ShardParamInfo._make(t) for t in flat.shard_infos(rank))


def flat_views(flat: FlatLayout, flat_full: Any) -> list[Any]:
    """Views (no copy) of each parameter's range in a whole flat parameter:
    a 1-D array or tensor of ``flat_numel`` or ``padded_numel`` elements."""
    shape = getattr(flat_full, "shape", None)
    if shape is None or len(shape) != 1:
        raise ValueError(
            "unflatten: flat_full must be a 1-D array or tensor, got "
            + type(flat_full).__name__
            + (f" of shape {tuple(shape)}" if shape is not None else "")
        )
    if shape[0] not in (flat.flat_numel, flat.padded_numel):
        raise ValueError(
            f"unflatten: flat_full has {shape[0]} elements, expected {flat.flat_numel} "
            f"(flat) or {flat.padded_numel} (padded)"
        )
    return [flat_full[o : o + n] for o, n in zip(flat.offsets, flat.numels)]


# torch dtypes Tensor.numpy() converts (decided up front: a C++ exception
# under an LD_PRELOADed ASan runtime aborts).
_NUMPY_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
})
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Buf(NamedTuple):
    array: np.ndarray  # shares the memory
    dtype: str  # the original dtype's name (bfloat16 stays bfloat16)
    torch_dtype: Any  # for tensors, else None


def _as_buf(x: Any, what: str, *, writable: bool) -> _Buf:
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous")
        if writable and not x.flags.writeable:
            raise ValueError(f"{what} is read-only")
        if x.dtype.hasobject:
            raise ValueError(f"{what} holds Python objects")
        if not x.dtype.isnative:
            raise ValueError(f"{what} has non-native byte order ({x.dtype.str})")
        return _Buf(x, x.dtype.name, None)
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{what} is on {x.device}; only CPU tensors")
        if not x.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        t = x.detach()
        if t.is_conj() or t.is_neg():
            raise ValueError(f"{what} has a lazy conjugate/negative bit; resolve it first")
        dtype = t.dtype
        if dtype not in _NUMPY_DTYPES:
            if t.element_size() not in _INTS:
                raise ValueError(f"{what} has unsupported dtype {dtype}")
            t = t.view(_INTS[t.element_size()])
            name = str(dtype).removeprefix("torch.")
        else:
            name = None
        a = t.numpy()
        return _Buf(a, name or a.dtype.name, dtype)
    raise TypeError(f"{what} must be a numpy.ndarray or a CPU torch.Tensor, got {type(x).__name__}")


def _pad_bytes(out: _Buf, value: float) -> bytes | None:
    """value as one element of out's dtype; None for all-zero bytes."""
    if out.torch_dtype is not None and out.array.dtype.name != out.dtype:
        t = torch.tensor([value], dtype=out.torch_dtype)
        raw = t.view(torch.uint8).numpy().tobytes()
    else:
        raw = np.array(value, dtype=out.array.dtype).tobytes()
    return None if not any(raw) else raw


def _piece(p: Any, what: str, numel: int, dtype: str, *, writable: bool) -> tuple[np.ndarray, int]:
    """A parameter's buffer as (1-D array, start): a whole parameter, or a
    (buffer, start) pair holding elements [start, start + size)."""
    partial = isinstance(p, tuple)
    start = 0
    if partial:
        if len(p) != 2:
            raise ValueError(f"{what} must be a buffer or a (buffer, start) pair")
        p, start = p
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
            raise TypeError(f"{what}: start must be an int, got {type(start).__name__}")
        start = int(start)
    b = _as_buf(p, what, writable=writable)
    if b.dtype != dtype:
        raise ValueError(f"{what} has dtype {b.dtype}, expected {dtype}")
    n = b.array.size
    if partial:
        if start < 0 or start + n > numel:
            raise ValueError(
                f"{what} holds elements [{start}, {start + n}) of a parameter of {numel}"
            )
    elif n != numel:
        raise ValueError(f"{what} has {n} elements, the parameter has {numel}")
    return b.array.reshape(-1), start


def _check_job(layout: Any, rank: Any, what: str) -> int:
    if not isinstance(layout, FlatLayout):
        raise TypeError(f"{what}: layout must be a FlatLayout, got {type(layout).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} outside [0, {layout.world_size})")
    return int(rank)


def _flat_job(job: Any, what: str, names: tuple[str, str], to_shard: bool) -> tuple:
    """Check one flatten (``to_shard``: ``(layout, rank, pieces, out)``) or
    unflatten (``(layout, rank, shard, outs)``) job: the shard-side buffer
    holds the layout's shard, one parameter-side piece per parameter (or
    None). Returns ``(layout, rank, shard buffer, pieces)``."""
    params, shard_name = names
    if not isinstance(job, tuple) or len(job) != 4:
        order = f"{params}, {shard_name}" if to_shard else f"{shard_name}, {params}"
        raise TypeError(f"{what} must be a (layout, rank, {order}) tuple")
    layout, rank, a, b = job
    pieces, shard = (a, b) if to_shard else (b, a)
    rank = _check_job(layout, rank, what)
    buf = _as_buf(shard, f"{what}: {shard_name}", writable=to_shard)
    if buf.array.size != layout.shard_numel:
        raise ValueError(
            f"{what}: {shard_name} has {buf.array.size} elements, the shard has "
            f"{layout.shard_numel}"
        )
    numels = layout.numels
    if len(pieces) != len(numels):
        raise ValueError(f"{what}: {len(pieces)} {params} for {len(numels)} parameters")
    out = [
        None
        if p is None
        else _piece(p, f"{what}: {params}[{i}]", n, buf.dtype, writable=not to_shard)
        for i, (p, n) in enumerate(zip(pieces, numels))
    ]
    return layout, rank, buf, out


def flatten_many(
    jobs: Iterable[tuple[FlatLayout, int, Sequence[Any], Any]],
    *,
    pad_value: float | None = None,
    threads: int | None = None,
) -> None:
    """Write rank's shard of the flat parameter built from ``pieces`` into
    ``out`` (contiguous, ``shard_numel`` elements) for every ``(layout,
    rank, pieces, out)`` job, in one C call: all buffers are checked first,
    then every copy of the batch runs with the GIL released on a thread pool
    (``threads`` counts the calling thread; default: the I/O default).

    ``pieces[i]``: parameter i's data, a contiguous array or tensor of
    ``numels[i]`` elements (any shape), or ``(buffer, start)`` holding its
    flattened elements ``[start, start + buffer.size)`` (enough to cover
    rank's part of it), or ``None`` for zeros. All share ``out``'s dtype.
    Padding gets ``pad_value`` (default: torch's, see the module docstring).
    Destinations that overlap each other or a source raise ShardstateError.
    """
    cjobs = []
    for j, job in enumerate(jobs):
        layout, rank, o, cp = _flat_job(job, f"flatten job {j}", ("pieces", "out"), True)
        value = pad_value
        if value is None:
            value = FLAT_PARAM_PADDING_VALUE if layout.align_numel > 0 else 0
        cjobs.append((layout, rank, o.array.reshape(-1), cp, _pad_bytes(o, value)))
    _core.flat_copy(cjobs, False, _pool_for(None, threads))


def unflatten_many(
    jobs: Iterable[tuple[FlatLayout, int, Any, Sequence[Any]]],
    *,
    threads: int | None = None,
) -> None:
    """Copy rank's ``shard`` into the parameters' buffers for every
    ``(layout, rank, shard, outs)`` job, in one C call (see
    :func:`flatten_many`): ``outs[i]`` is a contiguous writable buffer of
    parameter i (``numels[i]`` elements, or ``(buffer, start)`` for a part of
    it), or None to skip. Only the elements the shard holds are written."""
    cjobs = []
    for j, job in enumerate(jobs):
        layout, rank, s, co = _flat_job(job, f"unflatten job {j}", ("outs", "shard"), False)
        cjobs.append((layout, rank, s.array.reshape(-1), co, None))
    _core.flat_copy(cjobs, True, _pool_for(None, threads))


# ---------------------------------------------------------------------------
# One FSDP unit, as one rank sees it, and its copies (torch tensors)
# ---------------------------------------------------------------------------

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


def is_sharded(fsdp_state: Any) -> bool:
    """Whether an FSDP state's units are sharded (not world size 1, not NO_SHARD)."""
    return fsdp_state.world_size != 1 and fsdp_state.sharding_strategy != ShardingStrategy.NO_SHARD


def layout_of(info: Any) -> UnitLayout:
    """The layout of the unit of an ``FSDPParamInfo``, as its FSDP state's rank sees it."""
    st = info.state
    return unit_layout(info.handle, st.world_size, st.rank, is_sharded(st))


def unit_layout(handle: Any, world_size: int, rank: int, sharded: bool) -> UnitLayout:
    """The layout of ``handle``'s FlatParameter (an FSDP1 ``FlatParamHandle``)."""
    if sharded and not handle.uses_sharded_strategy:
        raise ValueError(
            "unit_layout: a NO_SHARD handle is not sharded (every rank holds its whole "
            "flat parameter)"
        )
    shapes = tuple(torch.Size(s) for s in handle.flat_param._shapes)
    numels = tuple(math.prod(s) for s in shapes)
    align = int(handle._aligned_numel)
    # torch's flat parameter: alignment padding, then (aligned mode only)
    # padding up to a multiple of the handle's world size, NO_SHARD included.
    whole = FlatLayout(numels, int(handle.world_size), align)
    if sharded:
        if whole.world_size != world_size:
            raise AssertionError(
                f"the FSDP unit's handle has world size {whole.world_size}, its state {world_size}"
            )
        flat = whole
        shard_numel, padded = flat.shard_numel, flat.padded_numel
    else:
        world_size, rank = 1, 0
        flat = FlatLayout(numels, 1, align)
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
        shard_infos=shard_infos(flat, rank),
        flat=flat,
    )


def unflatten(layout: UnitLayout, flat_full: torch.Tensor) -> list[torch.Tensor]:
    """Views (no copy) of every parameter's range of a full flat buffer, shaped as the parameter."""
    if flat_full.dim() != 1 or flat_full.numel() < layout.unpadded_numel:
        raise ValueError(
            f"a full flat state needs at least {layout.unpadded_numel} elements in one "
            f"dimension, got shape {tuple(flat_full.shape)}"
        )
    views = flat_views(layout.flat, flat_full[: layout.flat.flat_numel])
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
        _run_flatten([(FlatLayout(sizes, 1, 0), 0, pieces, out)])


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
        lay = FlatLayout([n for _, n in segments], 1, 0)
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
            cjobs.append((FlatLayout(sizes, 1, 0), 0, pieces, out))
    if cjobs:
        _run_flatten(cjobs)


