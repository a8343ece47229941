"""The default save and load planners (torch 2.13's ``default_planner.py``).

``DefaultSavePlanner`` and ``DefaultLoadPlanner`` take the same arguments and
produce the same plans and metadata as torch's, item for item (the tests
compare them field by field). Where torch loops over pairs of chunks, these
use ``shardstate.geometry.OverlapIndex``: validation and read planning cost
about O(n log n) in the number of chunks.

Deliberate differences from torch:

* reads of zero elements (an empty chunk strictly inside another) are not
  planned; torch plans them and copies nothing;
* the save's validation does not call an empty chunk inside another, or a
  chunk at a negative offset (reported out of bounds), overlapping; torch
  reports both as overlaps too;
* a load falls back to pre-2.4 keys only when they match more of the
  checkpoint's keys (torch falls back as soon as one missing key is
  explained, which breaks a rank holding an empty shard of a parameter);
* with ``enable_plan_caching`` a cached plan is reused only if the dtypes and
  flatten mapping are unchanged too (torch compares keys and boxes only and
  would reuse metadata with a stale dtype);
* bytes items are unpickled through ``loads`` (default: plain Python values
  only, never a full unpickler) instead of ``torch.load(weights_only=False)``;
  with ``flatten_state_dict=False`` they also land in the caller's dict (torch
  writes them only into its internal copy);
* a global plan whose planner_data is None is merged as empty (torch fails);
* NumPy arrays are saved as tensors (and lists of them are descended into
  like lists of tensors); without torch the whole planner works on NumPy-only
  state dicts;
* error messages keep torch's exception types and wording and add what was
  expected (all missing keys, both shapes).

torch is imported only when the state dict holds torch objects (and then it
is already loaded).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import operator
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from itertools import chain, compress, repeat
from typing import Any

import numpy as np

from .._core import with_index_hints
from .._util import gc_paused
from ..geometry import GeomIndex, OverlapIndex, chunk_arrays
from . import _tensors
from ._nested_dict import FLATTEN_MAPPING, flatten_state_dict
from ._tensors import find_state_dict_object, to_size
from ._traverse import set_element, traverse_state_dict
from .metadata import (
    STATE_DICT_TYPE,
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from .planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)

__all__ = [
    "DefaultLoadPlanner",
    "DefaultSavePlanner",
    "create_default_global_load_plan",
    "create_default_global_save_plan",
    "create_default_local_load_plan",
    "create_default_local_save_plan",
    "create_read_items_for_chunk_list",
    "dedup_save_plans",
    "plain_loads",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------
# Save planning
# --------------------------------------------------------------------------


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


def create_default_local_save_plan(state_dict: dict[str, Any], is_coordinator: bool) -> SavePlan:
    """One plan item per value (DTensors only where this rank is in the mesh).

    Every rank plans every plain tensor and bytes value; the coordinator's
    dedup keeps one copy.
    """
    items: list[WriteItem] = []
    for fqn, obj in state_dict.items():
        if _tensors.is_dtensor(obj) and not _tensors.dtensor_in_mesh(obj):
            continue
        items += _tensors.write_items(fqn, obj)
    return SavePlan(items)


def create_default_global_save_plan(
    all_plans: list[SavePlan], rewrite_index_hints: bool = True
) -> tuple[list[SavePlan], Metadata]:
    """The metadata of all plans' items; index hints set to chunk positions."""
    with gc_paused():
        fast = _global_save_plan_fast(all_plans, rewrite_index_hints)
        return fast if fast is not None else _global_save_plan(all_plans, rewrite_index_hints)


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


def _create_default_local_metadata(state_dict: STATE_DICT_TYPE) -> Metadata:
    """The ``Metadata`` a save of ``state_dict`` (already flat) with the
    default planner would write, from every chunk of every value (all shards
    of a ShardedTensor, not only the local ones); no data is planned."""
    from .planner_helpers import _create_default_metadata_only_plan

    _, md = create_default_global_save_plan([_create_default_metadata_only_plan(state_dict)])
    return md


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


def _compare_save_plans(plan: SavePlan, other: SavePlan) -> bool:
    """Whether two local plans describe the same writes (for plan caching):
    same items, boxes, sizes and dtypes, and the same planner data."""
    if plan.usable != other.usable or len(plan.items) != len(other.items):
        return False
    for a, b in zip(plan.items, other.items):
        if a.type != b.type or a.index.fqn != b.index.fqn or a.index.offset != b.index.offset \
                or a.index.index != b.index.index:
            return False
        ta, tb = a.tensor_data, b.tensor_data
        if (ta is None) != (tb is None):
            return False
        if ta is not None and tb is not None:
            if tuple(ta.size) != tuple(tb.size) or str(ta.properties.dtype) != str(
                tb.properties.dtype
            ):
                return False
            if (ta.chunk is None) != (tb.chunk is None):
                return False
            if ta.chunk is not None and tb.chunk is not None and (
                tuple(ta.chunk.offsets) != tuple(tb.chunk.offsets)
                or tuple(ta.chunk.sizes) != tuple(tb.chunk.sizes)
            ):
                return False
    return plan.planner_data == other.planner_data


def _contains_usable_plan(delta_plans: list[SavePlan]) -> bool:
    return any(p and p.usable for p in delta_plans)


def _merge_delta_local_plans(cached: list[SavePlan], delta: list[SavePlan]) -> list[SavePlan]:
    return [c if (d and not d.usable) else d for c, d in zip(cached, delta)]


def _flatten_sharded_tensors(state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
    """torch's ``_flatten_sharded_tensors``: the state dict rebuilt from its
    leaves (so empty dicts vanish and keys become strings, as in torch), with
    FSDP1's ShardedTensor-of-ShardedTensor collapsed into one level and
    ShardedTensors without local shards dropped."""
    st_loaded = "torch.distributed._shard.sharded_tensor" in sys.modules
    if all(type(k) is str and not isinstance(v, (Mapping, list))
           and not (st_loaded and _tensors.is_sharded_tensor(v))
           for k, v in state_dict.items()):
        return state_dict  # already flat: rebuilding it would copy it unchanged
    out: STATE_DICT_TYPE = {}
    nested_st = False

    def rebuild(path: Any, value: Any) -> None:
        nonlocal nested_st
        if _tensors.is_sharded_tensor(value):
            shards = value.local_shards()
            if not shards:
                return
            if len(shards) == 1 and _tensors.is_sharded_tensor(shards[0].tensor):
                nested_st = True
        set_element(out, path, value)

    traverse_state_dict(state_dict, rebuild)
    if not nested_st:
        return out
    # Rare (FSDP1 + TP): torch's own code builds the collapsed ShardedTensors.
    from torch.distributed.checkpoint._sharded_tensor_utils import (
        _flatten_sharded_tensors as torch_flatten,
    )

    return torch_flatten(state_dict)


def _to_bytes_io(obj: Any) -> io.BytesIO:
    """A torch.save archive of ``obj`` (torch.save itself when torch is loaded)."""
    buf = io.BytesIO()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.save(obj, buf)
    else:
        from ._zipfmt import bytes_record

        buf.write(bytes_record(pickle.dumps(obj, protocol=2)))
    buf.seek(0)
    return buf


class DefaultSavePlanner(SavePlanner):
    """torch 2.13's DefaultSavePlanner: flattens nested containers, dedups
    replicated items (balancing bytes, or to the lowest rank), builds the
    metadata and validates the chunks; optionally caches plans."""

    mappings: FLATTEN_MAPPING

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        dedup_replicated_tensors: bool | None = None,
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
    ) -> None:
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.mappings = {}
        self.dedup_save_to_lowest_rank = dedup_save_to_lowest_rank
        if dedup_replicated_tensors is not None:
            logger.warning(
                "DefaultSavePlanner's `dedup_replicated_tensors` argument is being "
                "deprecated, and no longer has any effect. Please remove this argument "
                "from your call."
            )
        # The plan caches are SavePlanner's class dicts, shared with torch's
        # planners (the same class when torch is installed); torch keys them
        # by bare class name, so ours are keyed by the qualified one: torch's
        # DefaultSavePlanner and ours never read each other's plans.
        cls = type(self)
        self._cached_plans_key: str = f"{cls.__module__}.{cls.__qualname__}"
        self._enable_plan_caching = enable_plan_caching

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        if self.flatten_sharded_tensors:
            state_dict = _flatten_sharded_tensors(state_dict)
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        if self._enable_plan_caching:
            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
            if cached is not None and _compare_save_plans(plan, cached):
                logger.info("No change in the local plan. Skipping sending the plan to the "
                            "coordinator")
                return SavePlan([], usable=False)
            # Promoted to the class cache by finish_plan, once the global plan succeeded.
            self._pending_local_plan = plan
        return self.plan

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        return dedup_save_plans(all_plans, self.dedup_save_to_lowest_rank)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        with gc_paused():  # (millions of short-lived objects, no cycles)
            return self._create_global_plan_unpaused(all_plans)

    def _create_global_plan_unpaused(
        self, all_plans: list[SavePlan]
    ) -> tuple[list[SavePlan], Metadata]:
        deduped = self._dedup_save_plans(all_plans)
        global_plan, metadata = create_default_global_save_plan(deduped)
        if self.flatten_state_dict:
            # dict(ChainMap(*maps)): keys in the order of first appearance
            # from the last map, values from the first map holding them.
            merged: dict[str, Any] = {}
            for p in reversed(global_plan):
                merged.update(p.planner_data or {})
            metadata = dataclasses.replace(metadata, planner_data=merged)
        errors = _validate_global_plan(global_plan, metadata)
        if errors:
            summary = "; ".join(errors)
            if len(summary) > 500:
                summary = summary[:500] + "... (truncated)"
            raise ValueError(f"Failed to validate global plan: {summary}")
        return global_plan, metadata

    def _create_global_plan_with_caching(
        self, all_plans: list[SavePlan]
    ) -> tuple[list[SavePlan], list[SavePlan], Metadata]:
        """(global plan delta, global plan, metadata)."""
        key = self._cached_plans_key
        if key not in SavePlanner._cached_all_plans:
            global_plan, metadata = self._create_global_plan(all_plans)
            SavePlanner._cached_all_plans[key] = all_plans
            SavePlanner._cached_global_plan[key] = global_plan
            SavePlanner._cached_metadata[key] = metadata
            return global_plan, global_plan, metadata
        if not _contains_usable_plan(all_plans):
            delta = [SavePlan([], usable=False)] * len(all_plans)
            return delta, SavePlanner._cached_global_plan[key], SavePlanner._cached_metadata[key]
        merged = _merge_delta_local_plans(SavePlanner._cached_all_plans[key], all_plans)
        # (cached only once it validates: a failed save leaves every cache
        # as it was, so the ranks' and the coordinator's stay in step)
        global_plan, metadata = self._create_global_plan(merged)
        SavePlanner._cached_all_plans[key] = merged
        delta = []
        cached_global = SavePlanner._cached_global_plan.get(key)
        if cached_global is not None:
            for old, new in zip(cached_global, global_plan):
                delta.append(SavePlan([], usable=False) if _compare_save_plans(old, new) else new)
        SavePlanner._cached_global_plan[key] = global_plan
        SavePlanner._cached_metadata[key] = metadata
        return delta, global_plan, metadata

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self._enable_plan_caching:
            delta, global_plan, metadata = self._create_global_plan_with_caching(all_plans)
        else:
            global_plan, metadata = self._create_global_plan(all_plans)
            delta = global_plan
        self.global_plan = global_plan
        self.metadata = metadata
        return delta, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        finished = new_plan
        if self._enable_plan_caching:
            key = self._cached_plans_key
            if not new_plan.usable:
                finished = SavePlanner._cached_final_save_plan[key]
            else:
                SavePlanner._cached_final_save_plan[key] = new_plan
            pending = self.__dict__.pop("_pending_local_plan", None)
            if pending is not None:
                SavePlanner._cached_save_plan[key] = pending
        self.plan = finished
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        """The tensor (a DTensor's local tensor, a shard, an ndarray in
        native byte order) or, for bytes items, a BytesIO holding a
        torch.save archive of the value."""
        return self.transform_object(write_item, self.lookup_object(write_item.index))

    def lookup_object(self, index: MetadataIndex) -> Any:
        return find_state_dict_object(self.state_dict, index)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002
        if write_item.type == WriteItemType.BYTE_IO:
            return _to_bytes_io(object)
        if isinstance(object, np.ndarray) and not object.dtype.isnative:
            return object.astype(object.dtype.newbyteorder("="))
        return object


# --------------------------------------------------------------------------
# Load planning
# --------------------------------------------------------------------------


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
    if len(saved) == 1 and len(local_chunks) == 1:
        item = _same_box_read(fqn, saved[0], local_chunks[0])
        if item is not None:
            return [item]
    ndim = len(local_chunks[0].offsets)
    # The saved boxes as arrays, read in C (every saved chunk is looked at
    # once, for about 0.1 us; torch sorts them all in Python per call).
    arrays = None
    if ndim and len(saved) > 1 and _index is None:
        try:
            arrays = chunk_arrays(saved, ndim)
        except (AttributeError, OverflowError, TypeError, ValueError):
            arrays = None
    ends = None
    if arrays is not None and ndim > 1:
        ends = np.maximum((arrays[0] + arrays[1]).max(axis=0), 0).tolist()
    d = _sweep_dim(local_chunks, saved, ndim, ends)
    if ndim == 0:
        local_order: Sequence[int] = range(len(local_chunks))
    else:
        local_order = sorted(range(len(local_chunks)), key=lambda i: local_chunks[i].offsets[d])
    if len(saved) == 1:
        hits = [_single_overlap(saved[0], local_chunks[i]) for i in local_order]
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
    items: list[ReadItem] = []
    for li, overlaps in zip(local_order, hits):
        local = local_chunks[li]
        if ndim and len(overlaps) > 1:
            overlaps = sorted(overlaps, key=lambda o: (
                saved[o[0]].offsets[d] + saved[o[0]].sizes[d], o[0]))
        dest_index = MetadataIndex(fqn, local.offsets, li)
        for si, soff, doff, lengths in overlaps:
            items.append(ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=dest_index,
                dest_offsets=to_size(doff),
                storage_index=MetadataIndex(fqn, saved[si].offsets, si),
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


def _missing_key_error(fqn: str, state_dict: dict[str, Any], metadata: Metadata) -> RuntimeError:
    saved = metadata.state_dict_metadata
    missing = [k for k in state_dict if k not in saved]
    more = ""
    if len(missing) > 1:
        shown = ", ".join(repr(k) for k in missing[:5]) + (", ..." if len(missing) > 5 else "")
        more = f" {len(missing)} keys are missing in all ({shown})."
    return RuntimeError(
        f"Missing key in checkpoint state_dict: {fqn}. The checkpoint ({len(saved)} keys) has "
        f"no entry {fqn!r}.{more} Pass allow_partial_load=True to DefaultLoadPlanner to leave "
        "missing keys unloaded."
    )


def create_default_local_load_plan(
    state_dict: dict[str, Any], metadata: Metadata, strict: bool = True
) -> LoadPlan:
    """Reads for every value of ``state_dict`` (torch's rules: a key missing
    from the checkpoint is an error when ``strict``, skipped otherwise; a
    tensor's global shape must equal the saved one)."""
    items: list[ReadItem] = []
    saved = metadata.state_dict_metadata
    for fqn, obj in state_dict.items():
        md = saved.get(fqn)
        if md is None:
            if strict:
                raise _missing_key_error(fqn, state_dict, metadata)
            continue
        if _is_tensor_md(md):
            shape = _tensors.global_size(obj)
            if shape is not None and shape != tuple(md.size):
                raise ValueError(
                    f"Size mismatch between saved {tuple(md.size)} and current: {shape} for "
                    f"{fqn}: the checkpoint holds {fqn!r} with shape {tuple(md.size)}, the "
                    f"destination has shape {shape}"
                )
        if _tensors.is_dtensor(obj) and not _tensors.dtensor_in_mesh(obj):
            continue
        items += _create_read_items(fqn, md, obj)
    return LoadPlan(items)


def _is_tensor_md(md: Any) -> bool:
    """TensorStorageMetadata, ours or torch's (metadata may come from either)."""
    return hasattr(md, "chunks") and hasattr(md, "size")


def _create_read_items(fqn: str, md: STORAGE_TYPES, obj: Any) -> list[ReadItem]:
    if not _is_tensor_md(md):
        zero = to_size((0,))
        return [ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn),
                         dest_offsets=zero, storage_index=MetadataIndex(fqn),
                         storage_offsets=zero, lengths=zero)]
    try:
        local_chunks = _tensors.chunk_list(obj)
    except ValueError as ex:
        raise ValueError(
            f"Invalid checkpoint metadata for {fqn}, expected BytesStorageMetadata but found "
            f"{type(md)}: the checkpoint holds a tensor under {fqn!r} and the destination is a "
            f"{type(obj).__name__}"
        ) from ex
    return create_read_items_for_chunk_list(fqn, md, local_chunks)


def create_default_global_load_plan(all_plans: list[LoadPlan]) -> list[LoadPlan]:
    """The load plans need no global coordination: returned unchanged."""
    return all_plans


# -- bytes items ------------------------------------------------------------

class _TrustedBytesIO(io.BytesIO):
    """A bytes item from a reader the user opened with ``unsafe_unpickle=True``:
    the default planner loads it with a plain unpickler (any class, as
    torch does), so that one switch admits trusted objects end to end."""


def plain_loads(data: bytes) -> Any:
    """Unpickle a bytes item (a torch.save archive) through the restricted
    unpickler of :mod:`._pickle`: plain Python values, pure paths, torch
    sizes/dtypes and NumPy arrays only. Anything else raises
    ``UnsafePickleError`` (a ``pickle.UnpicklingError``) naming it; no code
    from the archive runs."""
    from ._pickle import loads_object

    return loads_object(data)


def _init_state_dict(state_dict: dict[str, Any]) -> None:
    """Materialise meta-device tensors and DTensors in place, on the process
    group's default device (torch's ``_init_state_dict``)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    meta = torch.device("meta")

    def fix(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.device != meta:
            return value
        if _tensors.is_sharded_tensor(value):
            raise RuntimeError(f"Found unsupported type {type(value)} for meta device loading.")
        import torch.distributed as dist

        # The process group's device type (torch asks _get_pg_default_device,
        # which warns that it is deprecated); CPU without a group.
        device_type = "cpu"
        if dist.is_available() and dist.is_initialized():
            device_type = dist.distributed_c10d._get_object_coll_device()
        device = torch._utils._get_device_module(device_type).current_device()
        if _tensors.is_dtensor(value):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(
                torch.empty_like(value.to_local(), device=device), device_mesh=value.device_mesh,
                placements=value.placements, shape=value.size(), stride=value.stride(),
            )
        return torch.empty_like(value, device=device)

    stack: list[Any] = [state_dict]
    while stack:
        container = stack.pop()
        keys = container.keys() if isinstance(container, dict) else range(len(container))
        for k in list(keys):
            v = container[k]
            if isinstance(v, (dict, list)):
                stack.append(v)
            else:
                container[k] = fix(v)


class DefaultLoadPlanner(LoadPlanner):
    """torch 2.13's DefaultLoadPlanner: flattens the destination like the
    saver did (falling back to pre-2.4 keys for old checkpoints), plans the
    reads that reshard saved chunks into the destination's, and loads bytes
    items back into the original nested state dict.

    ``loads`` turns a bytes item (a torch.save archive, as bytes) into its
    value; the default, :func:`plain_loads`, admits plain Python values only.
    """

    original_state_dict: STATE_DICT_TYPE
    mappings: FLATTEN_MAPPING

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
        *,
        loads: Callable[[bytes], Any] | None = None,
    ) -> None:
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.original_state_dict = {}
        self.mappings = {}
        self.allow_partial_load = allow_partial_load
        self.loads: Callable[[bytes], Any] = loads if loads is not None else plain_loads
        # resolve_tensor temporaries (destinations not in CPU memory), by read item.
        self._pending: dict[ReadItem, Any] = {}

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        _init_state_dict(state_dict)
        self.original_state_dict = state_dict
        if self.flatten_sharded_tensors:
            state_dict = _flatten_sharded_tensors(state_dict)
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is None:
            raise ValueError("DefaultLoadPlanner.create_local_plan: set_up_planner was given "
                             "no metadata")
        if self.flatten_state_dict:
            # Keys the checkpoint has and the current flattening lacks may come
            # from a checkpoint written before torch 2.4: use the old rule's
            # keys when they match more of the checkpoint's. (torch switches
            # as soon as the old rule explains one missing key, which also
            # fires when this rank merely lacks some keys, e.g. an empty
            # shard of a parameter, and then misses every list it flattens.)
            ckpt_keys = self.metadata.state_dict_metadata.keys()
            missing = ckpt_keys - self.state_dict.keys()
            if missing:
                old_sd, old_mappings = flatten_state_dict(self.original_state_dict, v2_3=True)
                if len(old_sd.keys() & ckpt_keys) > len(self.state_dict.keys() & ckpt_keys):
                    self.state_dict, self.mappings = old_sd, old_mappings
        return create_default_local_load_plan(
            self.state_dict, self.metadata, not self.allow_partial_load
        )

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return create_default_global_load_plan(global_plan)

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        return new_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        data = value.getvalue() if isinstance(value, io.BytesIO) else value.read()
        try:
            if isinstance(value, _TrustedBytesIO) and self.loads is plain_loads:
                from ._pickle import loads_object

                obj = loads_object(data, allow_unsafe=True)  # the reader's trusted opt-in
            else:
                obj = self.loads(data)
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(f"cannot load bytes item {fqn!r}: {e}") from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
            # torch writes only into the rebuilt copy of the state dict that
            # flatten_sharded_tensors makes; the caller's dict gets it too here.
            if fqn in self.original_state_dict:
                self.original_state_dict[fqn] = obj

    def resolve_tensor(self, read_item: ReadItem) -> Any:
        """The destination narrowed to the read's box (a view). For a
        destination outside CPU memory, a CPU temporary that commit_tensor
        copies into place."""
        return self.transform_tensor(read_item, self.lookup_tensor(read_item.dest_index))

    def commit_tensor(self, read_item: ReadItem, tensor: Any) -> None:
        dest = self._pending.pop(read_item, None)
        if dest is not None:
            dest.copy_(tensor)

    def lookup_tensor(self, index: MetadataIndex) -> Any:
        return find_state_dict_object(self.state_dict, index)

    def transform_tensor(self, read_item: ReadItem, tensor: Any) -> Any:
        view = _tensors.narrow(tensor, read_item.dest_offsets, read_item.lengths)
        if _tensors.is_torch_tensor(view) and view.device.type != "cpu":
            tmp = view.new_empty(view.shape, device="cpu")
            self._pending[read_item] = view
            return tmp
        return view


class _EmptyStateDictLoadPlanner(DefaultLoadPlanner):
    """A DefaultLoadPlanner that builds the state dict from the checkpoint's
    metadata (torch 2.13's): for loading without a model, e.g. converting a
    checkpoint into a torch.save file. The state dict passed to the load
    must be empty; it is filled with a tensor of the saved shape and dtype
    for every tensor (on CPU; an ndarray without torch) and the value of
    every bytes item, nested as when it was saved.

    ``keys``: load only these keys: a flat key of the checkpoint, or a
    prefix of one's nested path joined by dots (``"model"``,
    ``"model.layer1"``). The other arguments are DefaultLoadPlanner's.
    Everything is loaded into this process: keep it to one rank for large
    checkpoints.
    """

    def __init__(self, keys: Any = None, *args: Any, **kwargs: Any) -> None:
        self.keys = keys
        super().__init__(*args, **kwargs)

    def _should_include_key(self, key: str, metadata: Metadata) -> bool:
        if self.keys is None or key in self.keys:
            return True
        # The nested path's prefixes joined by dots: ("a", "b", 0) -> a, a.b, a.b.0.
        # (A key without planner data has only itself; torch fails on it.)
        path = (metadata.planner_data or {}).get(key) or ()
        prefix = ""
        for part in path:
            prefix = f"{prefix}.{part}" if prefix else str(part)
            if prefix in self.keys:
                return True
        return False

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if state_dict:
            raise AssertionError(
                f"not state_dict: _EmptyStateDictLoadPlanner builds the state dict from the "
                f"checkpoint's metadata and needs an empty one, got {len(state_dict)} keys"
            )
        if metadata is None:
            raise AssertionError("metadata is not None: _EmptyStateDictLoadPlanner builds the "
                                 "state dict from the checkpoint's metadata and was given none")
        planner_data = metadata.planner_data or {}
        for key, md in metadata.state_dict_metadata.items():
            if not self._should_include_key(key, metadata):
                continue
            value: Any = _empty_like_saved(md) if _is_tensor_md(md) else md
            if key in planner_data:
                set_element(state_dict, planner_data[key], value)
            else:
                state_dict[key] = value
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _empty_like_saved(md: Any) -> Any:
    """An uninitialised CPU tensor of a saved tensor's shape and dtype (an
    ndarray where torch is not loaded)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.empty(md.size, dtype=md.properties.dtype)
    dtype = _tensors.numpy_dtype(str(md.properties.dtype))
    if dtype is None:
        raise ValueError(f"cannot make a NumPy array of {md.properties.dtype} without torch")
    return np.empty(tuple(md.size), dtype=dtype)
