"""The default save and load planners (torch 2.13's ``default_planner.py``).

``DefaultSavePlanner`` and ``DefaultLoadPlanner`` take the same arguments and
produce the same plans and metadata as torch's, item for item (the tests
compare them field by field). Where torch loops over pairs of chunks, these
use ``shardstate.geometry.OverlapIndex``: validation and read planning cost
about O(n log n) in the number of chunks. The coordinator's step (dedup,
global plan, validation) lives in :mod:`._plan_global` and the read-item
geometry in :mod:`._plan_reads`; this module keeps the planner classes and
torch's module-level functions, and re-exports every name it held before.

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

# Besides what the classes use, the names this module had before the save
# coordinator's step (_plan_global) and the read-item geometry (_plan_reads)
# moved out stay importable from here (the imports marked F401). A
# monkeypatch of a moved name here no longer reaches the moved code: patch
# it in its own module.
import dataclasses
import io
import logging
import math  # noqa: F401
import operator  # noqa: F401
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence  # noqa: F401
from itertools import chain, compress, repeat  # noqa: F401
from typing import Any

import numpy as np

from .._core import with_index_hints  # noqa: F401
from .._util import gc_paused
from ..geometry import GeomIndex, OverlapIndex, chunk_arrays  # noqa: F401
from . import _tensors
from ._nested_dict import FLATTEN_MAPPING, flatten_state_dict
from ._plan_global import (  # noqa: F401
    _BIG,
    _CHUNK,
    _FQN_OFFSET,
    _INDEX,
    _INDEX_FQN,
    _SIZE_DTYPE,
    _TENSOR_DATA,
    _TYPE,
    _balance,
    _dedup,
    _global_save_plan,
    _global_save_plan_fast,
    _new,
    _storage_sizes,
    _valid_chunk_arrays,
    _validate_chunks,
    _validate_chunks_slow,
    _validate_global_plan,
    _with_index_hint,
    dedup_save_plans,
)
from ._plan_reads import (  # noqa: F401
    _SCAN_LIMIT,
    _SCAN_MAX,
    _same_box_read,
    _scan_overlaps,
    _single_overlap,
    _sweep_dim,
    create_read_items_for_chunk_list,
)
from ._tensors import find_state_dict_object, to_size
from ._traverse import set_element, traverse_state_dict
from .metadata import (  # noqa: F401
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



def _create_default_local_metadata(state_dict: STATE_DICT_TYPE) -> Metadata:
    """The ``Metadata`` a save of ``state_dict`` (already flat) with the
    default planner would write, from every chunk of every value (all shards
    of a ShardedTensor, not only the local ones); no data is planned."""
    from .planner_helpers import _create_default_metadata_only_plan

    _, md = create_default_global_save_plan([_create_default_metadata_only_plan(state_dict)])
    return md


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
