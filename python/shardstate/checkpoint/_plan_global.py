"""The save coordinator's step: dedup, the global plan and its validation.

``dedup_save_plans`` (torch 2.13's byte-balancing rule), the global plan
and metadata built from every rank's plan (``create_default_global_save_plan``
in :mod:`.default_planner` calls ``_global_save_plan_fast``, or
``_global_save_plan`` where an item breaks a rule) and
``_validate_global_plan``'s bounds, overlap and fill checks. They run once
per save on the coordinator, over every rank's items at once, and are worked
out on NumPy arrays and in C (``geometry.GeomIndex``, ``_core``) rather than
per item: a concern of its own, apart from the planner classes each rank
runs. :mod:`.default_planner` re-exports every name, so imports from there
keep working; ``_validate_global_plan`` logs on that module's logger, as it
did when it lived there.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from itertools import chain, compress, repeat
from typing import Any

import numpy as np

from .._core import with_index_hints
from .._util import gc_paused
from ..geometry import GeomIndex, OverlapIndex, chunk_arrays
from .metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from .planner import SavePlan, WriteItem, WriteItemType

# The validation's warnings keep the logger name they had in default_planner
# (what a user's logging configuration names).
logger = logging.getLogger(__package__ + ".default_planner")


def dedup_save_plans(
    all_plans: list[SavePlan], save_to_lowest_rank: bool = False
) -> list[SavePlan]:
    """Keep each item (same ``MetadataIndex``) in one plan only.

    torch 2.13's rule: items are assigned in first-seen order (rank 0's
    first); each goes to the plan with the fewest bytes assigned so far
    (ties: lowest rank), or to the lowest rank with ``save_to_lowest_rank``.
    A bytes item counts as 1 byte.
    """
    with gc_paused():
        return _dedup(all_plans, save_to_lowest_rank)


def _dedup(all_plans: list[SavePlan], save_to_lowest_rank: bool) -> list[SavePlan]:
    lens = [len(plan.items) for plan in all_plans]
    items = list(chain.from_iterable(plan.items for plan in all_plans))
    # MetadataIndex hashes and compares (class, fqn, offset) only: items are
    # numbered by that key (a tuple made and hashed in C) in first-seen order.
    indexes = list(map(_INDEX, items))
    if len(set(map(type, indexes))) <= 1:
        keys = list(map(_FQN_OFFSET, indexes))
    else:
        keys = list(zip(map(type, indexes), map(_FQN_OFFSET, indexes)))
    del indexes
    first_seen = dict.fromkeys(keys)
    n = len(first_seen)
    ids = dict(zip(first_seen, range(n)))
    flat = np.fromiter(map(ids.__getitem__, keys), dtype=np.int64, count=len(keys))
    del keys, first_seen, ids
    plan_of = np.repeat(np.arange(len(all_plans), dtype=np.int64), lens)
    count = np.bincount(flat, minlength=n)
    # Ids grow in first-seen order: an id's first occurrence is where the
    # running maximum grows.
    seen_before = np.maximum.accumulate(np.concatenate(([-1], flat[:-1])))
    chosen = plan_of[flat > seen_before]
    rep = np.flatnonzero(count > 1)
    if len(rep):
        # Only the bytes of items up to the last replicated one decide
        # anything; each item's size is its last plan's copy's (torch).
        limit = int(rep[-1]) + 1
        last = np.zeros(limit, dtype=np.int64)
        head = flat < limit
        np.maximum.at(last, flat[head], np.flatnonzero(head))
        sizes = _storage_sizes(list(map(items.__getitem__, last.tolist())))
        _balance(flat, plan_of, count, rep, chosen, sizes, len(all_plans), save_to_lowest_rank)
    keep = (chosen[flat] == plan_of).tolist()
    out, start = [], 0
    for plan, m in zip(all_plans, lens):
        out.append(dataclasses.replace(
            plan, items=list(compress(items[start:start + m], keep[start:start + m]))))
        start += m
    return out


def _balance(flat: Any, plan_of: Any, count: Any, rep: Any, chosen: Any, sizes: list[int],
             nplans: int, save_to_lowest_rank: bool) -> None:
    """torch's choice for the items in several plans (``rep``, ascending):
    in first-seen order, each goes to the plan of the fewest bytes so far,
    ties decided by the iteration order of the set of its plans, as in torch
    (that set is built the same way: plan indices added in order)."""
    mask = count[flat] > 1
    rep_ids, rep_plans = flat[mask], plan_of[mask]
    order = np.argsort(rep_ids, kind="stable")  # plans stay ascending within an id
    rep_plans = rep_plans[order].tolist()
    bounds = np.cumsum(count[rep]).tolist()
    # Bytes planned per plan (Python ints: exact). Every item before the
    # next replicated one lands on its first plan: their bytes are added in
    # one C loop per stretch between replicated items.
    planned = np.zeros(nplans, dtype=object)
    size_arr = np.array(sizes, dtype=object)
    prev, start = 0, 0
    for i, end in zip(rep.tolist(), bounds):
        if i > prev:
            np.add.at(planned, chosen[prev:i], size_arr[prev:i])
        plans = set(rep_plans[start:end])
        c = min(plans) if save_to_lowest_rank else min(plans, key=planned.__getitem__)
        chosen[i] = c
        planned[c] += sizes[i]
        prev, start = i + 1, end


_INDEX = operator.attrgetter("index")
_FQN_OFFSET = operator.attrgetter("fqn", "offset")


def _storage_sizes(items: list[Any]) -> list[int]:
    """``[item.tensor_storage_size() or 1 for item in items]``. For WriteItem
    itself (a subclass may override the method) the size depends on the
    global size and dtype alone: asked once per distinct pair, the pairs
    read and looked up in C."""
    if set(map(type, items)) != {WriteItem}:
        return [item.tensor_storage_size() or 1 for item in items]
    tds = list(map(_TENSOR_DATA, items))
    is_tensor = list(map(operator.is_not, tds, repeat(None)))
    keys = list(map(_SIZE_DTYPE, compress(tds, is_tensor)))
    tensor_items = list(compress(items, is_tensor))
    first = dict(zip(reversed(keys), reversed(tensor_items)))  # each pair's first item
    size_of = {k: item.tensor_storage_size() or 1 for k, item in first.items()}
    if len(keys) == len(items):
        return list(map(size_of.__getitem__, keys))
    sizes = np.ones(len(items), dtype=object)
    sizes[np.array(is_tensor, dtype=bool)] = list(map(size_of.__getitem__, keys))
    return sizes.tolist()


_SIZE_DTYPE = operator.attrgetter("size", "properties.dtype")


def _with_index_hint(item: Any, hint: int) -> Any:
    """``dataclasses.replace(item, index=replace(item.index, index=hint))``.
    For WriteItem and MetadataIndex themselves (frozen dataclasses whose
    init only stores the fields; MetadataIndex's turns the offset into a
    size, which it already is) the copies are made by copying the instance
    dict: five times faster, and the same objects."""
    index = item.index
    if type(item) is not WriteItem or type(index) is not MetadataIndex:
        return dataclasses.replace(item, index=dataclasses.replace(index, index=hint))
    new_index = _new(MetadataIndex)
    d = new_index.__dict__
    d.update(index.__dict__)
    d["index"] = hint
    new = _new(WriteItem)
    d = new.__dict__
    d.update(item.__dict__)
    d["index"] = new_index
    return new


_new = object.__new__


def _global_save_plan_fast(
    all_plans: list[SavePlan], rewrite_index_hints: bool
) -> tuple[list[SavePlan], Metadata] | None:
    """_global_save_plan's result, worked out on arrays: fqns numbered in
    first-seen order, each tensor item's hint its rank among its fqn's
    tensor items. None when some item breaks a rule (a non-SHARD item
    after another of its key, a bytes key planned twice, a tensor item
    without a chunk): _global_save_plan then raises its error, in order."""
    lens = [len(plan.items) for plan in all_plans]
    items = list(chain.from_iterable(plan.items for plan in all_plans))
    if not items:
        return None
    kinds = list(map(_TYPE, items))
    fqns = list(map(_INDEX_FQN, items))
    first_seen = dict.fromkeys(fqns)
    n = len(first_seen)
    ids = dict(zip(first_seen, range(n)))
    fid = np.fromiter(map(ids.__getitem__, fqns), dtype=np.int64, count=len(items))
    is_first = fid > np.maximum.accumulate(np.concatenate(([-1], fid[:-1])))
    not_shard = np.fromiter(map(operator.is_not, kinds, repeat(WriteItemType.SHARD)),
                            dtype=bool, count=len(items))
    is_bytes = np.fromiter(map(operator.is_, kinds, repeat(WriteItemType.BYTE_IO)),
                           dtype=bool, count=len(items))
    if not (is_first | ~not_shard).all():
        return None
    if (np.bincount(fid, minlength=n)[fid[is_bytes]] != 1).any():
        return None
    tensor_at = np.flatnonzero(~is_bytes)
    tensor_items = [items[k] for k in tensor_at.tolist()]
    tds = list(map(_TENSOR_DATA, tensor_items))
    if any(map(operator.is_, tds, repeat(None))):
        return None
    chunks = list(map(_CHUNK, tds))
    if any(map(operator.is_, chunks, repeat(None))):
        return None
    # Tensor items grouped by fqn, item order kept inside each group.
    tf = fid[tensor_at]
    order = np.argsort(tf, kind="stable")
    per = np.bincount(tf, minlength=n)
    starts = np.cumsum(per) - per
    md: dict[str, STORAGE_TYPES] = {}
    order_list = order.tolist()
    for f, fqn in enumerate(first_seen):
        if per[f]:
            group = order_list[starts[f]:starts[f] + per[f]]
            td = tds[group[0]]
            md[fqn] = TensorStorageMetadata(properties=td.properties, size=td.size,
                                            chunks=list(map(chunks.__getitem__, group)))
        else:
            md[fqn] = BytesStorageMetadata()
    if rewrite_index_hints:
        hints = np.empty(len(order), dtype=np.int64)
        hints[order] = np.arange(len(order), dtype=np.int64) - starts[tf[order]]
        if set(map(type, tensor_items)) == {WriteItem} and \
                set(map(type, map(_INDEX, tensor_items))) == {MetadataIndex}:
            new_items = with_index_hints(tensor_items, hints.tolist())  # in C
        else:
            new_items = list(map(_with_index_hint, tensor_items, hints.tolist()))
        for k, item in zip(tensor_at.tolist(), new_items):
            items[k] = item
    new_plans, start = [], 0
    for plan, m in zip(all_plans, lens):
        new_plans.append(dataclasses.replace(plan, items=items[start:start + m]))
        start += m
    return new_plans, Metadata(md)


_TYPE = operator.attrgetter("type")
_INDEX_FQN = operator.attrgetter("index.fqn")
_TENSOR_DATA = operator.attrgetter("tensor_data")
_CHUNK = operator.attrgetter("chunk")


def _global_save_plan(
    all_plans: list[SavePlan], rewrite_index_hints: bool
) -> tuple[list[SavePlan], Metadata]:
    md: dict[str, STORAGE_TYPES] = {}
    new_plans = []
    shard, byte_io = WriteItemType.SHARD, WriteItemType.BYTE_IO
    for plan in all_plans:
        new_items: list[WriteItem] = []
        append = new_items.append
        for item in plan.items:
            index = item.index
            fqn = index.fqn
            kind = item.type
            entry = md.get(fqn)
            if kind is not shard and entry is not None:
                raise AssertionError(
                    f"key {fqn!r} is planned twice: a {kind.name} item may appear in "
                    "one plan only (dedup the plans first)"
                )
            if kind is byte_io:
                md[fqn] = BytesStorageMetadata()
                append(item)
                continue
            td = item.tensor_data
            if td is None or td.chunk is None:
                raise AssertionError(f"tensor item for {fqn!r} has no tensor_data/chunk")
            if entry is None:
                entry = md[fqn] = TensorStorageMetadata(
                    properties=td.properties, size=td.size, chunks=[]
                )
            elif not isinstance(entry, TensorStorageMetadata):
                raise AssertionError(f"key {fqn!r} is planned both as bytes and as a tensor")
            chunks = entry.chunks
            if rewrite_index_hints:
                item = _with_index_hint(item, len(chunks))
            append(item)
            chunks.append(td.chunk)
        new_plans.append(dataclasses.replace(plan, items=new_items))
    return new_plans, Metadata(md)


def _validate_global_plan(global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
    """Errors: chunks out of bounds, overlapping chunks, chunks not covering
    the tensor (checked with more than one plan). 0-d tensors are skipped.

    Per tensor O(n log n) in its n chunks, nearly all of it in C: the boxes
    are read into arrays once (``geometry.chunk_arrays``), bounds and volume
    are checked on them, overlaps found by a ``GeomIndex`` over them."""
    errors: list[str] = []
    check_fill = len(global_plan) > 1
    for key, value in metadata.state_dict_metadata.items():
        if not isinstance(value, TensorStorageMetadata) or len(value.size) == 0:
            continue
        size = tuple(value.size)
        arrays = _valid_chunk_arrays(value.chunks, size)
        if arrays is None:
            _validate_chunks_slow(key, value, check_fill, errors)
        else:
            _validate_chunks(key, value, arrays, check_fill, errors)
    for msg in errors:
        logger.warning(msg)
    return errors


_BIG = 1 << 62  # offsets, sizes and volumes below this add up without int64 overflow


def _valid_chunk_arrays(chunks: list[Any], size: tuple[int, ...]) -> Any:
    """The chunks' boxes as int64 arrays when the fast checks apply (every
    chunk of the tensor's ndim, every value and the tensor's volume well
    inside int64), else None."""
    if not chunks or math.prod(size) >= _BIG or max(size) >= _BIG:
        return None
    try:
        arrays = chunk_arrays(chunks, len(size))
    except (AttributeError, OverflowError, TypeError, ValueError):
        return None
    if arrays is None:
        return None
    off, sz = arrays
    if int(off.max()) >= _BIG or int(sz.max()) >= _BIG or int(off.min()) <= -_BIG \
            or int(sz.min()) <= -_BIG:
        return None
    return arrays


def _validate_chunks(key: str, value: Any, arrays: Any, check_fill: bool,
                     errors: list[str]) -> None:
    """_validate_chunks_slow's checks and messages, in its order, on arrays."""
    chunks = value.chunks
    off, sz = arrays
    usable = (off >= 0).all(axis=1) & (sz >= 0).all(axis=1)
    inside = usable & (off + sz <= np.asarray(value.size, dtype=np.int64)).all(axis=1)
    for i in np.flatnonzero(~inside).tolist():
        errors.append(f"key:{key} has out of bounds chunk: tensor-size:{value.size} "
                      f"chunk: {chunks[i]}")
    if inside.all():  # each volume <= the tensor's < 2**62: exact in int64
        volume = sum(np.prod(sz, axis=1).tolist())
    else:
        volume = sum(math.prod(c.sizes) for c in chunks)
    boxes = np.flatnonzero(usable)
    if len(boxes) > 1:
        o, n = off[boxes], sz[boxes]
        req, idx = GeomIndex(o, n).query_many(o, n)[:2]
        pairs = idx > req  # each pair once
        for j, i in zip(req[pairs].tolist(), idx[pairs].tolist()):
            errors.append(f"key:{key} has overlapping chunks: "
                          f"{chunks[boxes[i]]} {chunks[boxes[j]]}")
    total = math.prod(value.size)
    if check_fill and volume != total:
        errors.append(f"key:{key} invalid fill tensor-volume: {total} chunks-volume: {volume}")


def _validate_chunks_slow(key: str, value: Any, check_fill: bool, errors: list[str]) -> None:
    """The checks chunk by chunk, for chunks the arrays cannot hold (another
    ndim, values near or past int64)."""
    size = tuple(value.size)
    chunks = value.chunks
    volume = 0
    for chunk in chunks:
        if not all(
            o >= 0 and n >= 0 and o + n <= s
            for o, n, s in zip(chunk.offsets, chunk.sizes, size)
        ):
            errors.append(f"key:{key} has out of bounds chunk: tensor-size:{value.size} "
                          f"chunk: {chunk}")
        volume += math.prod(chunk.sizes)
    # Boxes with negative numbers (reported above) cannot go in the index.
    boxes = [i for i, c in enumerate(chunks)
             if len(c.offsets) == len(size) == len(c.sizes)
             and min(c.offsets, default=0) >= 0 and min(c.sizes, default=0) >= 0]
    if len(boxes) > 1:
        index = OverlapIndex([(chunks[i].offsets, chunks[i].sizes) for i in boxes],
                             ndim=len(size))
        hits = index.query_many([(chunks[i].offsets, chunks[i].sizes) for i in boxes])
        for j, overlaps in enumerate(hits):
            for ov in overlaps:
                if ov.saved_index > j:  # each pair once
                    errors.append(f"key:{key} has overlapping chunks: "
                                  f"{chunks[boxes[ov.saved_index]]} {chunks[boxes[j]]}")
    total = math.prod(size)
    if check_fill and volume != total:
        errors.append(f"key:{key} invalid fill tensor-volume: {total} chunks-volume: {volume}")
