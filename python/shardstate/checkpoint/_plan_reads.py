"""Read-item geometry: which saved chunks fill which destination chunks.

``create_read_items_for_chunk_list`` turns a tensor's saved chunks and the
destination's chunks into ReadItems (offsets relative to each chunk, in
torch 2.13's order), with the shortcuts that keep a load's planning linear:
a whole saved chunk read into the same box, a single saved chunk, a NumPy
scan of the saved boxes for a few destination chunks, else one
``geometry.OverlapIndex`` query per tensor. Pure geometry on chunk
metadata, with no state dict or planner state: kept apart from the load
planner in :mod:`.default_planner`, which re-exports every name (torch's
``planner_helpers`` does too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..geometry import OverlapIndex, chunk_arrays
from ._mdlazy import arrays_of
from ._tensors import to_size
from .metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from .planner import LoadItemType, ReadItem


def _sweep_dim(local: Sequence[ChunkStorageMetadata], saved: Sequence[ChunkStorageMetadata],
               ndim: int, saved_ends: list[int] | None = None) -> int:
    """The dim with the largest extent (torch orders its reads along it);
    ``saved_ends``: the saved chunks' largest end per dim, when known."""
    best, best_extent = 0, 0
    if ndim > 1:
        for d in range(ndim):
            saved_end = saved_ends[d] if saved_ends is not None else \
                max((c.offsets[d] + c.sizes[d] for c in saved), default=0)
            extent = max(max((c.offsets[d] + c.sizes[d] for c in local), default=0), saved_end)
            if extent > best_extent:
                best, best_extent = d, extent
    return best


def create_read_items_for_chunk_list(
    fqn: str,
    checkpoint_md: TensorStorageMetadata,
    local_chunks: list[ChunkStorageMetadata],
    *,
    _index: OverlapIndex | None = None,
) -> list[ReadItem]:
    """The reads that fill ``local_chunks`` from the saved chunks of ``fqn``.

    One ReadItem per (local chunk, saved chunk) pair that shares at least one
    element, with offsets relative to each chunk, in torch's order: local
    chunks by their start along the sweep dim, then saved chunks by their
    end along it. Overlaps are found with an OverlapIndex over the saved
    chunks (a single saved chunk is handled directly).
    """
    saved = checkpoint_md.chunks
    if not local_chunks or not saved:
        return []
    ndim = len(local_chunks[0].offsets)
    # The reader's compact chunk lists (_mdlazy) answer from their arrays,
    # making no chunk object; a list of another ndim is the list's business.
    arrays = arrays_of(saved)
    if arrays is not None and arrays[0].shape[1] != ndim:
        arrays = None
    chunk_at = saved.make_chunk if arrays is not None else saved.__getitem__
    if len(saved) == 1 and len(local_chunks) == 1:
        item = _same_box_read(fqn, chunk_at(0), local_chunks[0])
        if item is not None:
            return [item]
    # The saved boxes as arrays, read in C (every saved chunk is looked at
    # once, for about 0.1 us; torch sorts them all in Python per call).
    lazy = arrays is not None
    if not lazy and ndim and len(saved) > 1 and _index is None:
        try:
            arrays = chunk_arrays(saved, ndim)
        except (AttributeError, OverflowError, TypeError, ValueError):
            arrays = None
    ends = None
    if arrays is not None and ndim > 1:
        ends = np.maximum((arrays[0] + arrays[1]).max(axis=0), 0).tolist() \
            if len(arrays[0]) else [0] * ndim
    d = _sweep_dim(local_chunks, saved, ndim, ends)
    if ndim == 0:
        local_order: Sequence[int] = range(len(local_chunks))
    else:
        local_order = sorted(range(len(local_chunks)), key=lambda i: local_chunks[i].offsets[d])
    if len(saved) == 1:
        hits = [_single_overlap(chunk_at(0), local_chunks[i]) for i in local_order]
    else:
        requests = [(local_chunks[i].offsets, local_chunks[i].sizes) for i in local_order]
        found = None
        if arrays is not None and len(requests) <= _SCAN_MAX:
            found = _scan_overlaps(arrays[0], arrays[1], requests)
        if found is not None:
            hits = found
        else:
            if _index is not None:
                index = _index
            elif arrays is not None:
                index = OverlapIndex.from_arrays(*arrays)
            else:
                index = OverlapIndex([(c.offsets, c.sizes) for c in saved], ndim=ndim)
            hits = index.query_many(requests)
    if lazy:
        assert arrays is not None
        offs = arrays[0]
        end_d = arrays[0][:, d] + arrays[1][:, d] if ndim else None

        def saved_end(si: int) -> int:
            return int(end_d[si])  # type: ignore[index]

        def saved_offsets(si: int) -> Any:
            return to_size(offs[si].tolist())
    else:
        def saved_end(si: int) -> int:
            return saved[si].offsets[d] + saved[si].sizes[d]

        def saved_offsets(si: int) -> Any:
            return saved[si].offsets
    items: list[ReadItem] = []
    for li, overlaps in zip(local_order, hits):
        local = local_chunks[li]
        if ndim and len(overlaps) > 1:
            overlaps = sorted(overlaps, key=lambda o: (saved_end(o[0]), o[0]))
        dest_index = MetadataIndex(fqn, local.offsets, li)
        for si, soff, doff, lengths in overlaps:
            items.append(ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=dest_index,
                dest_offsets=to_size(doff),
                storage_index=MetadataIndex(fqn, saved_offsets(si), si),
                storage_offsets=to_size(soff),
                lengths=to_size(lengths),
            ))
    return items


def _same_box_read(fqn: str, saved: ChunkStorageMetadata,
                   local: ChunkStorageMetadata) -> ReadItem | None:
    """The one read of a whole saved chunk into the same box (a plain
    tensor loaded at the world size it was saved at: the common case, which
    the general path spends tens of microseconds on); None for any other
    pair, and for an empty box (no element: no read)."""
    sizes = tuple(saved.sizes)
    if (tuple(local.sizes) != sizes or tuple(local.offsets) != tuple(saved.offsets)
            or not all(n > 0 for n in sizes)):
        return None
    zeros = to_size((0,) * len(sizes))
    return ReadItem(type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(fqn, local.offsets, 0),
                    dest_offsets=zeros,
                    storage_index=MetadataIndex(fqn, saved.offsets, 0),
                    storage_offsets=zeros,
                    lengths=to_size(sizes))


# Up to this many destination chunks (a DTensor has one) the saved boxes are
# scanned with NumPy instead of indexed: building a GeomIndex costs ~0.4 us a
# box, a scan a few nanoseconds a box per destination chunk.
_SCAN_MAX = 4
_SCAN_LIMIT = 1 << 62  # offsets and sizes below this add up without overflow


def _scan_overlaps(offsets: Any, sizes: Any, requests: list[Any]) -> list[list[Any]] | None:
    """OverlapIndex.query_many's answer for a few requests, by comparing each
    with every saved box in NumPy: the saved boxes sharing an element with
    it, in ascending index, as (index, saved offset, request offset,
    lengths). None when a value is negative or near int64's limit (the
    index then answers, or refuses the box, as before)."""
    if len(offsets) and (int(offsets.min()) < 0 or int(sizes.min()) < 0
                         or int(offsets.max()) >= _SCAN_LIMIT
                         or int(sizes.max()) >= _SCAN_LIMIT):
        return None
    ndim = offsets.shape[1]
    ends = offsets + sizes
    # Column by column: NumPy reduces along a short axis slowly.
    nonempty = np.logical_and.reduce([sizes[:, d] > 0 for d in range(ndim)])
    out = []
    for off, size in requests:
        if len(off) != ndim or len(size) != ndim:
            return None
        if min(off) < 0 or min(size) < 0 or max(off) >= _SCAN_LIMIT or max(size) >= _SCAN_LIMIT:
            return None
        lo = np.array(off, dtype=np.int64)
        hi = lo + np.array(size, dtype=np.int64)
        if min(size) == 0:
            out.append([])
            continue
        hit = nonempty.copy()
        for d in range(ndim):
            hit &= offsets[:, d] < hi[d]
            hit &= ends[:, d] > lo[d]
        idx = np.flatnonzero(hit)
        start = np.maximum(offsets[idx], lo)
        lengths = np.minimum(ends[idx], hi) - start
        out.append(list(zip(idx.tolist(), map(tuple, (start - offsets[idx]).tolist()),
                            map(tuple, (start - lo).tolist()), map(tuple, lengths.tolist()))))
    return out


def _single_overlap(saved: ChunkStorageMetadata, local: ChunkStorageMetadata) -> list[Any]:
    """[(0, saved_offset, local_offset, lengths)] when the boxes share an element."""
    soff, loff, lens = [], [], []
    for so, sn, lo, ln in zip(saved.offsets, saved.sizes, local.offsets, local.sizes):
        n = min(so + sn, lo + ln) - max(so, lo)
        if n <= 0:
            return []
        soff.append(max(lo - so, 0))
        loff.append(max(so - lo, 0))
        lens.append(n)
    return [(0, soff, loff, lens)]
