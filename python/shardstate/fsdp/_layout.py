"""FSDP1 FlatParameter layout, and copies between per-parameter buffers and
a rank's flat shard (the C core's ``ss_flat``).

``FlatLayout`` computes exactly what torch 2.13's ``FlatParamHandle`` does
for one FSDP unit (``torch/distributed/fsdp/_flat_param.py``):

- parameters in order; with ``align_numel > 0`` (``use_orig_params=True``,
  where torch uses ``16 // itemsize``, see :func:`aligned_numel`) padding
  is inserted before a parameter when the running total is not a multiple
  of ``align_numel``, and after the last one up to a multiple of
  ``world_size`` (``_init_flat_param_and_metadata``);
- sharding as ``torch.chunk`` + ``F.pad`` (``_get_shard``): every rank's
  shard has ``ceil(flat_numel / world_size)`` elements, and a rank past the
  last chunk holds only padding;
- per rank, per parameter, ``ShardParamInfo`` equal to torch's
  ``_ShardParamInfo`` (``_get_shard_metadata``).

``flatten`` builds a rank's shard exactly as
``FlatParamHandle._get_shard(handle.flatten_tensors(pieces, align), rank,
world_size)[0]`` does, bit for bit: padding inside the flat parameter holds
``_FLAT_PARAM_PADDING_VALUE`` (42) as torch's ``_construct_padding_tensor``
makes it (aligned mode only), the ``F.pad`` tail holds 0, and a missing
piece (``None``) is zeros as in torch's optimizer-state flattening. Pass
``pad_value`` to choose another padding value.

Buffers are NumPy arrays or CPU torch tensors (bfloat16 and other dtypes
NumPy lacks are viewed as same-width ints); every one is checked for
dtype, size, contiguity and writability with a ValueError naming it. The
copies of a whole batch run in one C call with the GIL released, split
over a thread pool. torch is never imported here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import _core
from ..io import _pool_for

__all__ = [
    "FLAT_PARAM_PADDING_VALUE",
    "FlatLayout",
    "ShardParamInfo",
    "aligned_numel",
    "flatten_many",
    "unflatten_many",
]

# torch.distributed.fsdp._flat_param._FLAT_PARAM_PADDING_VALUE
FLAT_PARAM_PADDING_VALUE = 42

# torch's alignment for use_orig_params=True (_get_aligned_numel), in bytes.
_ALIGNMENT_BYTES = 16


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


def aligned_numel(itemsize: int) -> int:
    """torch's ``_get_aligned_numel``: elements per 16 bytes."""
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"itemsize must be an int >= 1, got {itemsize!r}")
    return _ALIGNMENT_BYTES // itemsize


def _check_int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"FlatLayout: {name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"FlatLayout: {name} must be >= {low}, got {value}")
    return int(value)


class FlatLayout:
    """The FSDP1 flat-parameter layout of one unit over ``world_size`` ranks.

    ``numels``: each real parameter's numel, in the unit's order (shared
    parameters excluded, as torch does). ``align_numel``: 0 for
    ``use_orig_params=False``, ``aligned_numel(itemsize)`` for True.
    ``itemsize``: bytes per element of the parameters' dtype, recorded for
    callers; the copies take their element size from their buffers, so one
    layout serves every state dtype.
    """

    __slots__ = ("_c", "itemsize")

    def __init__(
        self,
        numels: Sequence[int],
        world_size: int,
        *,
        align_numel: int = 0,
        itemsize: int = 4,
    ) -> None:
        numels = [_check_int(n, f"numels[{i}]", 0) for i, n in enumerate(numels)]
        if not numels:
            raise ValueError("FlatLayout: a flat parameter needs at least one parameter")
        world_size = _check_int(world_size, "world_size", 1)
        align_numel = _check_int(align_numel, "align_numel", 0)
        self.itemsize = _check_int(itemsize, "itemsize", 1)
        self._c = _core.FlatLayout(numels, world_size, align_numel)

    @classmethod
    def from_handle(cls, handle: Any) -> FlatLayout:
        """The layout of a torch ``FlatParamHandle`` (an FSDP1 unit's
        ``_handle``) with a sharded strategy: its real parameters' numels,
        its world size and its alignment."""
        if not handle.uses_sharded_strategy:
            raise ValueError(
                "FlatLayout.from_handle: a NO_SHARD handle is not sharded (every rank "
                "holds its whole flat parameter)"
            )
        fp = handle.flat_param
        return cls(list(fp._numels), handle.world_size, align_numel=handle._aligned_numel,
                   itemsize=fp.element_size())

    # -- the layout ------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self._c.world_size

    @property
    def align_numel(self) -> int:
        return self._c.align_numel

    @property
    def numels(self) -> tuple[int, ...]:
        """Numel of each real parameter."""
        return self._c.numels

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start of each real parameter in the unsharded flat parameter."""
        return self._c.offsets

    @property
    def unpadded_numel(self) -> int:
        """End of the last parameter."""
        return self._c.unpadded_numel

    @property
    def flat_numel(self) -> int:
        """Parameters plus alignment and world-size padding: the numel of
        torch's unsharded flat parameter (``_unpadded_unsharded_size``)."""
        return self._c.flat_numel

    @property
    def padded_numel(self) -> int:
        """``shard_numel * world_size``: the flat parameter with every
        shard padded (torch's ``_padded_unsharded_size``)."""
        return self._c.padded_numel

    @property
    def shard_numel(self) -> int:
        """Elements in every rank's shard, padding included."""
        return self._c.shard_numel

    @property
    def numels_with_padding(self) -> tuple[int, ...]:
        """torch's ``flat_param._numels_with_padding``."""
        return self._c.numels_with_padding

    @property
    def is_padding_mask(self) -> tuple[bool, ...]:
        """torch's ``flat_param._is_padding_mask``."""
        return self._c.is_padding_mask

    def _rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        return int(rank)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """rank's ``[start, end)`` in the (padded) flat parameter."""
        return self._c.shard_range(self._rank(rank))

    def shard_infos(self, rank: int) -> tuple[ShardParamInfo, ...]:
        """One ShardParamInfo per real parameter, equal to torch's
        ``flat_param._shard_param_infos`` on ``rank``."""
        return tuple(ShardParamInfo._make(t) for t in self._c.shard_infos(self._rank(rank)))

    def range_infos(self, start: int, end: int) -> tuple[ShardParamInfo, ...]:
        """ShardParamInfos of any range ``[start, end)`` of the flat
        parameter: torch's ``_get_shard_metadata(start, end - 1)`` (end may
        pass the flat parameter's end, as torch allows)."""
        if not 0 <= start <= end:
            raise ValueError(f"bad range [{start}, {end}): need 0 <= start <= end")
        return tuple(ShardParamInfo._make(t) for t in self._c.range_infos(start, end))

    def __repr__(self) -> str:
        return (
            f"FlatLayout(numels={list(self.numels)}, world_size={self.world_size}, "
            f"align_numel={self.align_numel}, itemsize={self.itemsize})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FlatLayout):
            return NotImplemented
        return (self.numels, self.world_size, self.align_numel, self.itemsize) == (
            other.numels, other.world_size, other.align_numel, other.itemsize)

    def __hash__(self) -> int:
        return hash((self.numels, self.world_size, self.align_numel, self.itemsize))

    # -- copies ----------------------------------------------------------

    def flatten(
        self,
        pieces: Sequence[Any],
        rank: int,
        out: Any,
        *,
        pad_value: float | None = None,
        threads: int | None = None,
    ) -> None:
        """Write rank's shard of the flat parameter built from ``pieces``
        into ``out`` (contiguous, ``shard_numel`` elements).

        ``pieces[i]``: parameter i's data, a contiguous array or tensor of
        ``numels[i]`` elements (any shape), or ``(buffer, start)`` holding
        its flattened elements ``[start, start + buffer.size)`` (enough to
        cover rank's part of it), or ``None`` for zeros. All share ``out``'s
        dtype. Padding gets ``pad_value`` (default: torch's, see the module
        docstring).
        """
        flatten_many([(self, rank, pieces, out)], pad_value=pad_value, threads=threads)

    def unflatten(self, flat_full: Any) -> list[Any]:
        """Views (no copy) of each parameter's range in a whole flat
        parameter: a 1-D array or tensor of ``flat_numel`` or
        ``padded_numel`` elements."""
        shape = getattr(flat_full, "shape", None)
        if shape is None or len(shape) != 1:
            raise ValueError(
                "unflatten: flat_full must be a 1-D array or tensor, got "
                + type(flat_full).__name__
                + (f" of shape {tuple(shape)}" if shape is not None else "")
            )
        if shape[0] not in (self.flat_numel, self.padded_numel):
            raise ValueError(
                f"unflatten: flat_full has {shape[0]} elements, expected {self.flat_numel} "
                f"(flat) or {self.padded_numel} (padded)"
            )
        return [flat_full[o : o + n] for o, n in zip(self.offsets, self.numels)]

    def unflatten_into(
        self, shard: Any, rank: int, outs: Sequence[Any], *, threads: int | None = None
    ) -> None:
        """Copy rank's ``shard`` into the parameters' buffers: ``outs[i]`` is
        a contiguous writable buffer of parameter i (``numels[i]`` elements,
        or ``(buffer, start)`` for a part of it), or None to skip. Only the
        elements the shard holds are written."""
        unflatten_many([(self, rank, shard, outs)], threads=threads)


# ---- buffers ---------------------------------------------------------------


def _torch_numpy_dtypes(torch: Any) -> frozenset[Any]:
    """torch dtypes Tensor.numpy() converts (decided up front: a C++
    exception under an LD_PRELOADed ASan runtime aborts)."""
    return frozenset({
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    })


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
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{what} is on {x.device}; only CPU tensors")
        if not x.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        t = x.detach()
        if t.is_conj() or t.is_neg():
            raise ValueError(f"{what} has a lazy conjugate/negative bit; resolve it first")
        dtype = t.dtype
        if dtype not in _torch_numpy_dtypes(torch):
            ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            if t.element_size() not in ints:
                raise ValueError(f"{what} has unsupported dtype {dtype}")
            t = t.view(ints[t.element_size()])
            name = str(dtype).removeprefix("torch.")
        else:
            name = None
        a = t.numpy()
        return _Buf(a, name or a.dtype.name, dtype)
    raise TypeError(f"{what} must be a numpy.ndarray or a CPU torch.Tensor, got {type(x).__name__}")


def _pad_bytes(out: _Buf, value: float) -> bytes | None:
    """value as one element of out's dtype; None for all-zero bytes."""
    if out.torch_dtype is not None and out.array.dtype.name != out.dtype:
        torch = sys.modules["torch"]
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


def _check_layout(layout: Any, what: str) -> FlatLayout:
    if not isinstance(layout, FlatLayout):
        raise TypeError(f"{what}: layout must be a FlatLayout, got {type(layout).__name__}")
    return layout


def flatten_many(
    jobs: Iterable[tuple[FlatLayout, int, Sequence[Any], Any]],
    *,
    pad_value: float | None = None,
    threads: int | None = None,
) -> None:
    """``layout.flatten(pieces, rank, out)`` for every ``(layout, rank,
    pieces, out)`` job, in one C call: all buffers are checked first, then
    every copy of the batch runs with the GIL released on a thread pool
    (``threads`` counts the calling thread; default: the I/O default).
    Destinations that overlap each other or a source raise ShardstateError.
    """
    cjobs = []
    for j, job in enumerate(jobs):
        if not isinstance(job, tuple) or len(job) != 4:
            raise TypeError(f"flatten job {j} must be a (layout, rank, pieces, out) tuple")
        layout, rank, pieces, out = job
        what = f"flatten job {j}"
        layout = _check_layout(layout, what)
        rank = layout._rank(rank)
        o = _as_buf(out, f"{what}: out", writable=True)
        if o.array.size != layout.shard_numel:
            raise ValueError(
                f"{what}: out has {o.array.size} elements, the shard has {layout.shard_numel}"
            )
        if len(pieces) != len(layout.numels):
            raise ValueError(
                f"{what}: {len(pieces)} pieces for {len(layout.numels)} parameters"
            )
        cp = []
        for i, (p, n) in enumerate(zip(pieces, layout.numels)):
            if p is None:
                cp.append(None)
                continue
            cp.append(_piece(p, f"{what}: pieces[{i}]", n, o.dtype, writable=False))
        value = pad_value
        if value is None:
            value = FLAT_PARAM_PADDING_VALUE if layout.align_numel > 0 else 0
        cjobs.append((layout._c, rank, o.array.reshape(-1), cp, _pad_bytes(o, value)))
    _core.flat_copy(cjobs, False, _pool_for(None, threads))


def unflatten_many(
    jobs: Iterable[tuple[FlatLayout, int, Any, Sequence[Any]]],
    *,
    threads: int | None = None,
) -> None:
    """``layout.unflatten_into(shard, rank, outs)`` for every ``(layout,
    rank, shard, outs)`` job, in one C call (see :func:`flatten_many`)."""
    cjobs = []
    for j, job in enumerate(jobs):
        if not isinstance(job, tuple) or len(job) != 4:
            raise TypeError(f"unflatten job {j} must be a (layout, rank, shard, outs) tuple")
        layout, rank, shard, outs = job
        what = f"unflatten job {j}"
        layout = _check_layout(layout, what)
        rank = layout._rank(rank)
        s = _as_buf(shard, f"{what}: shard", writable=False)
        if s.array.size != layout.shard_numel:
            raise ValueError(
                f"{what}: shard has {s.array.size} elements, the layout's shard has "
                f"{layout.shard_numel}"
            )
        if len(outs) != len(layout.numels):
            raise ValueError(f"{what}: {len(outs)} outs for {len(layout.numels)} parameters")
        co = []
        for i, (p, n) in enumerate(zip(outs, layout.numels)):
            if p is None:
                co.append(None)
                continue
            co.append(_piece(p, f"{what}: outs[{i}]", n, s.dtype, writable=True))
        cjobs.append((layout._c, rank, s.array.reshape(-1), co, None))
    _core.flat_copy(cjobs, True, _pool_for(None, threads))
