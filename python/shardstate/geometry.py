"""Chunk geometry: which saved chunks overlap a requested box, and copying
the overlapping sub-boxes.

A box is ``(offsets, sizes)`` in global element coordinates, like DCP's
``ChunkStorageMetadata``. A box with a zero size is empty and overlaps
nothing; a 0-d box (a scalar) always overlaps every other 0-d box. Identical
saved boxes (replicas) are all reported; the caller picks one.

torch is never imported here: a tensor can only exist if torch was already
imported, so tensors are recognised through ``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from ._core import GeomIndex, ThreadPool
from ._core import chunk_boxes as _chunk_boxes
from ._core import copy_region as _copy_region

__all__ = ["GeomIndex", "Overlap", "OverlapIndex", "chunk_arrays", "copy_region", "overlaps"]

Box = tuple[Sequence[int], Sequence[int]]


class Overlap(NamedTuple):
    """One overlap of a saved box with a request.

    ``saved_offset`` is where it starts inside the saved box,
    ``request_offset`` where it starts inside the request, ``lengths`` its
    extent along each dim.
    """

    saved_index: int
    saved_offset: tuple[int, ...]
    request_offset: tuple[int, ...]
    lengths: tuple[int, ...]


def _box_arrays(boxes: Sequence[Box], ndim: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(n, ndim) int64 offsets and sizes from a list of (offsets, sizes)."""
    if ndim is None:
        if not boxes:
            raise ValueError("OverlapIndex: ndim is needed when there are no boxes")
        ndim = len(boxes[0][0])
    offs = [b[0] for b in boxes]
    sizes = [b[1] for b in boxes]
    for i, (off, size) in enumerate(zip(offs, sizes)):
        if len(off) != ndim or len(size) != ndim:
            raise ValueError(
                f"OverlapIndex: box {i} has {len(off)} offsets and {len(size)} sizes, "
                f"expected {ndim} each"
            )
    return _int_rows(offs, ndim), _int_rows(sizes, ndim)


def _int_rows(rows: list[Sequence[int]], ndim: int) -> np.ndarray:
    """(len(rows), ndim) int64 from rows of ndim ints each (checked by the
    caller), converted in C: np.fromiter over the chained rows."""
    n = len(rows)
    return np.fromiter(chain.from_iterable(rows), dtype=np.int64,
                       count=n * ndim).reshape(n, ndim)


def chunk_arrays(chunks: Sequence[Any], ndim: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(n, ndim) int64 ``offsets`` and ``sizes`` of chunks (objects with
    those attributes, like DCP's ChunkStorageMetadata), or None when some
    chunk does not have ndim of each. Values outside int64 raise
    OverflowError, values that are not integers TypeError. Read in C
    (``_core.chunk_boxes``): a few tens of nanoseconds a chunk."""
    return _chunk_boxes(chunks, ndim)


class OverlapIndex:
    """An index over saved boxes, queried with requested boxes.

    ``OverlapIndex([(offsets, sizes), ...])``; pass ``ndim`` when the list
    may be empty. Queries cost about O(log n + k) on tilings.
    """

    def __init__(self, boxes: Sequence[Box], ndim: int | None = None) -> None:
        offsets, sizes = _box_arrays(boxes, ndim)
        self._index = GeomIndex(offsets, sizes)

    @classmethod
    def from_arrays(cls, offsets: np.ndarray, sizes: np.ndarray) -> OverlapIndex:
        """The index of (n, ndim) int64 offsets and sizes (e.g. chunk_arrays')."""
        self = cls.__new__(cls)
        self._index = GeomIndex(offsets, sizes)
        return self

    @property
    def ndim(self) -> int:
        return self._index.ndim

    def __len__(self) -> int:
        return len(self._index)

    def query_arrays(
        self, offsets: Sequence[int], sizes: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(saved_index, saved_offset, request_offset, lengths)`` arrays."""
        return self._index.query(offsets, sizes)

    def query(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[Overlap]:
        """Every overlap with the request, in ascending saved index order."""
        idx, soff, roff, lens = self._index.query(offsets, sizes)
        return [
            Overlap(i, tuple(s), tuple(r), tuple(n))
            for i, s, r, n in zip(idx.tolist(), soff.tolist(), roff.tolist(), lens.tolist())
        ]

    def query_many(self, requests: Sequence[Box]) -> list[list[Overlap]]:
        """``[self.query(*r) for r in requests]`` in one call to the core."""
        offsets, sizes = _box_arrays(requests, self.ndim)
        req, idx, soff, roff, lens = self._index.query_many(offsets, sizes)
        out: list[list[Overlap]] = [[] for _ in requests]
        for j, i, s, r, n in zip(req.tolist(), idx.tolist(), soff.tolist(), roff.tolist(),
                                 lens.tolist()):
            out[j].append(Overlap(i, tuple(s), tuple(r), tuple(n)))
        return out


def overlaps(saved_boxes: Sequence[Box], request: Box) -> list[Overlap]:
    """Overlaps of ``request`` with each of ``saved_boxes`` (one-off query)."""
    offsets, sizes = request
    return OverlapIndex(saved_boxes, ndim=len(offsets)).query(offsets, sizes)


def _numpy_dtypes(torch: Any) -> frozenset[Any]:
    """torch dtypes that Tensor.numpy() converts. Decided up front rather
    than by catching its TypeError: a C++ exception thrown under an
    LD_PRELOADed ASan runtime aborts the process."""
    return frozenset({
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    })


def _as_array(x: Any, name: str) -> np.ndarray:
    """A NumPy view of x sharing its memory: an ndarray, or a CPU tensor.

    Tensor dtypes NumPy lacks (bfloat16, float8, complex32) are viewed as
    signed integers of the same width; copy_region moves bytes, so the
    bits arrive intact.
    """
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"copy_region: {name} is on {x.device}; only CPU tensors")
        t = x.detach()
        if t.dtype not in _numpy_dtypes(torch):  # view the bits as an int
            ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            width = t.element_size()
            if width not in ints:
                raise TypeError(f"copy_region: {name} has unsupported dtype {t.dtype}")
            t = t.view(ints[width])
        return t.numpy()
    raise TypeError(
        f"copy_region: {name} must be a numpy.ndarray or a CPU torch.Tensor, "
        f"got {type(x).__name__}"
    )


def copy_region(
    dst: Any,
    dst_offset: Sequence[int],
    src: Any,
    src_offset: Sequence[int],
    lengths: Sequence[int],
    pool: ThreadPool | None = None,
) -> None:
    """``dst[dst_offset : dst_offset + lengths] = src[src_offset : ...]``.

    dst and src are NumPy arrays or CPU torch tensors of the same dtype and
    ndim, with any strides; the GIL is released and copies over 1 MiB use
    ``pool``'s threads. Bounds are checked (ValueError naming the dim); a
    read-only dst raises ValueError; src and dst whose memory ranges
    intersect raise ShardstateError.
    """
    a = _as_array(dst, "dst")
    b = _as_array(src, "src")
    # Compare the original dtypes too: bfloat16 and int16 share a view.
    if a.dtype != b.dtype or (a is not dst and b is not src and dst.dtype != src.dtype):
        raise TypeError(f"copy_region: dst dtype {dst.dtype} differs from src dtype {src.dtype}")
    _copy_region(a, tuple(dst_offset), b, tuple(src_offset), tuple(lengths), pool)
