"""torch 2.13's ``planner_helpers``: the write items, chunk lists and read
items of one state-dict value, and plan-caching helpers, as torch's planners
and user planners call them. Each is shardstate's own (``_tensors`` for
values, ``default_planner`` for planning, read items through the C overlap
index), under torch's names and signatures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _tensors
from .default_planner import (
    _compare_save_plans,
    _contains_usable_plan,
    _create_read_items,
    _init_state_dict,
    _merge_delta_local_plans,
    create_read_items_for_chunk_list,
)
from .metadata import BytesStorageMetadata as BytesStorageMetadata
from .metadata import ChunkStorageMetadata, MetadataIndex
from .metadata import TensorProperties as TensorProperties
from .metadata import TensorStorageMetadata as TensorStorageMetadata
from .planner import LoadItemType, ReadItem, SavePlan, WriteItem, WriteItemType
from .planner import TensorWriteData as TensorWriteData

__all__ = ["create_read_items_for_chunk_list"]

# Re-exported under torch's names (same signatures and results).
_ = (_compare_save_plans, _contains_usable_plan, _create_read_items, _init_state_dict,
     _merge_delta_local_plans)


def _create_write_items(fqn: str, object: Any) -> list[WriteItem]:  # noqa: A002
    """What one rank writes for ``object``: one item per local chunk of a
    tensor (a DTensor's local shard, each ShardedTensor shard), one bytes
    item for anything else."""
    return _tensors.write_items(fqn, object)


def _create_chunk_list(tensor: Any) -> list[ChunkStorageMetadata]:
    """The boxes of the global tensor this rank holds; ValueError for a
    value that is not a tensor."""
    return _tensors.chunk_list(tensor)


def _create_chunk_from_tensor(tensor: Any) -> ChunkStorageMetadata:
    """The box of the whole (global) tensor."""
    size = tensor.size()
    return ChunkStorageMetadata(offsets=_tensors.to_size((0,) * len(size)), sizes=size)


def _create_chunk_from_dtensor(tensor: Any) -> ChunkStorageMetadata:
    offsets, sizes = _tensors._dtensor_box(tensor)
    return ChunkStorageMetadata(offsets=offsets, sizes=sizes)


def _create_write_item_for_tensor(fqn: str, tensor: Any) -> WriteItem:
    size = tensor.size()
    return _tensors._tensor_item(fqn, size, _tensors.TensorProperties.create_from_tensor(tensor))


def _create_write_item_for_shard(fqn: str, sharded_tensor: Any, shard_md: Any) -> WriteItem:
    return _tensors._shard_item(fqn, sharded_tensor, shard_md)


def _create_write_items_for_dtensor(fqn: str, tensor: Any) -> WriteItem:
    (item,) = _tensors.write_items(fqn, tensor)
    return item


def _create_write_item_for_bytesio(fqn: str, bytes: Any) -> WriteItem:  # noqa: A002
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def _create_read_item_for_byteio(dest_index: Any, dest_offset: int, storage_index: Any,
                                 storage_offset: int, length: int) -> ReadItem:
    size = _tensors.to_size
    return ReadItem(type=LoadItemType.BYTE_IO, dest_index=dest_index,
                    dest_offsets=size((dest_offset,)), storage_index=storage_index,
                    storage_offsets=size((storage_offset,)), lengths=size((length,)))


def _create_read_item_for_tensor(dest_index: Any, dest_offsets: Any, storage_index: Any,
                                 storage_offsets: Any, lengths: Any) -> ReadItem:
    size = _tensors.to_size
    return ReadItem(type=LoadItemType.TENSOR, dest_index=dest_index,
                    dest_offsets=size(dest_offsets), storage_index=storage_index,
                    storage_offsets=size(storage_offsets), lengths=size(lengths))


def _create_default_metadata_only_plan(state_dict: dict[str, Any]) -> SavePlan:
    """A plan of every chunk of every value (all shards of a ShardedTensor,
    not just the local ones), for building metadata without data."""
    items: list[WriteItem] = []
    for fqn, obj in state_dict.items():
        if _tensors.is_sharded_tensor(obj):
            items.extend(_tensors._shard_item(fqn, obj, md)
                         for md in obj.metadata().shards_metadata)
        elif _tensors.is_dtensor(obj):
            items.append(_create_write_items_for_dtensor(fqn, obj))
        elif _tensors.is_torch_tensor(obj):
            items.append(_create_write_item_for_tensor(fqn, obj))
        else:
            items.append(_create_write_item_for_bytesio(fqn, obj))
    return SavePlan(items)


def _iterate_state_dict(iter_object: Any, dtensor_func: Callable, sharded_tensor_func: Callable,
                        tensor_func: Callable) -> Any:
    """Apply the function for its kind to each tensor in ``iter_object``,
    replacing it in place (dicts) or in a rebuilt list/tuple."""
    if _tensors.is_dtensor(iter_object):
        return dtensor_func(iter_object)
    if _tensors.is_sharded_tensor(iter_object):
        return sharded_tensor_func(iter_object)
    if _tensors.is_torch_tensor(iter_object):
        return tensor_func(iter_object)
    if isinstance(iter_object, dict):
        for key, value in iter_object.items():
            iter_object[key] = _iterate_state_dict(value, dtensor_func, sharded_tensor_func,
                                                   tensor_func)
        return iter_object
    if isinstance(iter_object, (list, tuple)):
        out = [_iterate_state_dict(v, dtensor_func, sharded_tensor_func, tensor_func)
               for v in iter_object]
        return tuple(out) if isinstance(iter_object, tuple) else out
    return iter_object
