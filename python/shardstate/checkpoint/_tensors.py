"""How a state-dict value is seen as tensor chunks.

For each kind of value this module gives its write items (what a rank saves),
its chunk list (which boxes of the global tensor this rank holds, for
loading), and the local tensor behind a ``MetadataIndex``:

* CPU ``torch.Tensor``: one chunk covering it (``WriteItemType.TENSOR``);
* ``DTensor`` with any placements: one ``SHARD`` chunk, the local shard's box
  from torch's own ``compute_local_shape_and_global_offset`` (uneven and
  empty shards included; ``Partial`` placements raise as in torch);
* legacy ``ShardedTensor``: one ``SHARD`` chunk per local shard;
* ``numpy.ndarray`` of a dtype torch has: saved as a tensor, one chunk;
* anything else: one ``BYTE_IO`` item.

The results equal torch 2.13's ``planner_helpers`` field for field, built
from shardstate's torch-free data classes. torch is never imported here: a
tensor can only exist if torch is already loaded, so a NumPy-only state dict
is planned without torch (dtypes then are ``TorchName`` stand-ins).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._util import loaded_torch
from .metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties, TorchName, _size
from .planner import TensorWriteData, WriteItem, WriteItemType

__all__ = [
    "chunk_list",
    "dtensor_in_mesh",
    "find_state_dict_object",
    "global_size",
    "is_dtensor",
    "is_saved_array",
    "is_sharded_tensor",
    "is_torch_tensor",
    "narrow",
    "numpy_dtype_name",
    "to_size",
    "write_items",
]

# NumPy dtype -> torch dtype name. Only native byte order (or byte order
# free) dtypes map; other arrays are saved in native order by resolve_data.
_NUMPY_TO_TORCH = {
    np.dtype(np.bool_): "torch.bool",
    np.dtype(np.uint8): "torch.uint8",
    np.dtype(np.int8): "torch.int8",
    np.dtype(np.int16): "torch.int16",
    np.dtype(np.uint16): "torch.uint16",
    np.dtype(np.int32): "torch.int32",
    np.dtype(np.uint32): "torch.uint32",
    np.dtype(np.int64): "torch.int64",
    np.dtype(np.uint64): "torch.uint64",
    np.dtype(np.float16): "torch.float16",
    np.dtype(np.float32): "torch.float32",
    np.dtype(np.float64): "torch.float64",
    np.dtype(np.complex64): "torch.complex64",
    np.dtype(np.complex128): "torch.complex128",
}


# torch.Size when torch is loaded, else a tuple of ints (they compare equal).
to_size = _size


def _zeros(ndim: int) -> Any:
    """``to_size([0] * ndim)``."""
    return to_size((0,) * ndim)


def numpy_dtype_name(dtype: np.dtype) -> str | None:
    """'torch.<name>' for a NumPy dtype torch has, else None."""
    return _NUMPY_TO_TORCH.get(dtype.newbyteorder("=") if dtype.byteorder == ">" else dtype)


_TORCH_TO_NUMPY = {v: k for k, v in _NUMPY_TO_TORCH.items()}


def numpy_dtype(name: str) -> np.dtype | None:
    """The NumPy dtype for 'torch.<name>', or None when NumPy has none."""
    return _TORCH_TO_NUMPY.get(str(name))


def is_saved_array(value: Any) -> bool:
    """An ndarray saved as a tensor (its dtype maps to a torch dtype)."""
    return isinstance(value, np.ndarray) and numpy_dtype_name(value.dtype) is not None


def is_torch_tensor(value: Any) -> bool:
    torch = loaded_torch()
    return torch is not None and isinstance(value, torch.Tensor)


def is_dtensor(value: Any) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(value, mod.DTensor)


def is_sharded_tensor(value: Any) -> bool:
    mod = sys.modules.get("torch.distributed._shard.sharded_tensor")
    return mod is not None and isinstance(value, mod.ShardedTensor)


def _array_properties(arr: np.ndarray) -> TensorProperties:
    name = numpy_dtype_name(arr.dtype)
    assert name is not None
    dtype: Any = TorchName(name).resolve() if loaded_torch() is not None else TorchName(name)
    return TensorProperties(dtype=dtype)


# --------------------------------------------------------------------------
# Write items
# --------------------------------------------------------------------------


# mesh -> {(global shape, placements, this rank's coordinate): (offsets, sizes)}.
# A model's parameters repeat a few shapes and placements, and torch's helper
# costs ~30 us a call (a 2 GiB transformer state: 6-8 ms of every save and
# load). Weak keys: the cache never keeps a mesh (and its groups) alive.
_BOXES: weakref.WeakKeyDictionary[Any, dict[tuple, tuple[tuple, tuple]]] = \
    weakref.WeakKeyDictionary()
_BOXES_MAX = 4096  # entries per mesh; past it the mesh's entries start over


def _dtensor_box(tensor: Any) -> tuple[Any, Any]:
    """(offsets, sizes) of this rank's shard of a DTensor, from torch's
    helper (remembered per mesh, global shape, placements and coordinate:
    the helper is a function of those alone). Fresh torch.Size objects each
    call, as the helper's results would be."""
    check = getattr(tensor, "_raise_if_contains_partial_placements", None)
    if check is not None:
        check()
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    coord = mesh.get_coordinate()
    key = (tuple(tensor.shape), placements, None if coord is None else tuple(coord))
    try:
        boxes = _BOXES.setdefault(mesh, {})
        hit = boxes.get(key)
    except TypeError:  # an unhashable placement or mesh: no cache
        boxes, hit = None, None
    if hit is None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
        hit = (tuple(offsets), tuple(sizes))
        if boxes is not None:
            if len(boxes) >= _BOXES_MAX:
                boxes.clear()
            boxes[key] = hit
    return to_size(hit[0]), to_size(hit[1])


def dtensor_in_mesh(tensor: Any) -> bool:
    """Whether this rank holds part of the DTensor (it may live on a submesh)."""
    return tensor.device_mesh.get_coordinate() is not None


def _from_torch_item(item: Any) -> WriteItem:
    """A WriteItem from one of torch's (a custom ``__create_write_items__``)."""
    if isinstance(item, WriteItem):
        return item
    td = item.tensor_data
    tensor_data = None
    if td is not None:
        p = td.properties
        tensor_data = TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=td.chunk.offsets, sizes=td.chunk.sizes),
            properties=TensorProperties(
                dtype=p.dtype, layout=p.layout, requires_grad=p.requires_grad,
                memory_format=p.memory_format, pin_memory=p.pin_memory,
            ),
            size=td.size,
        )
    idx = item.index
    return WriteItem(
        index=MetadataIndex(idx.fqn, idx.offset, idx.index),
        type=WriteItemType[item.type.name],
        tensor_data=tensor_data,
    )


def _tensor_item(fqn: str, size: Any, properties: TensorProperties) -> WriteItem:
    offsets = _zeros(len(size))
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=size),
            properties=properties,
            size=size,
        ),
    )


def _shard_item(fqn: str, st: Any, shard_md: Any) -> WriteItem:
    md = st.metadata()
    p = md.tensor_properties
    offsets = to_size(shard_md.shard_offsets)
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=to_size(shard_md.shard_sizes)),
            properties=TensorProperties(
                dtype=p.dtype, layout=p.layout, requires_grad=p.requires_grad,
                memory_format=p.memory_format, pin_memory=p.pin_memory,
            ),
            size=md.size,
        ),
    )


def write_items(fqn: str, value: Any) -> list[WriteItem]:
    """The items this rank writes for ``value`` (torch's ``_create_write_items``).

    The caller skips DTensors whose mesh does not include this rank.
    """
    if is_saved_array(value):
        return [_tensor_item(fqn, to_size(value.shape), _array_properties(value))]
    if not is_torch_tensor(value):
        if hasattr(value, "__create_write_items__"):
            return [_from_torch_item(i) for i in value.__create_write_items__(fqn, value)]
        return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]
    if is_dtensor(value):
        local = value._local_tensor
        if hasattr(local, "__create_write_items__"):
            return [_from_torch_item(i) for i in local.__create_write_items__(fqn, value)]
        offsets, sizes = _dtensor_box(value)
        return [WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=TensorProperties.create_from_tensor(value.to_local()),
                size=value.size(),
            ),
        )]
    if is_sharded_tensor(value):
        return [_shard_item(fqn, value, s.metadata) for s in value.local_shards()]
    if hasattr(value, "__create_write_items__"):
        return [_from_torch_item(i) for i in value.__create_write_items__(fqn, value)]
    return [_tensor_item(fqn, value.size(), TensorProperties.create_from_tensor(value))]


# --------------------------------------------------------------------------
# Chunk lists (load side)
# --------------------------------------------------------------------------


def chunk_list(value: Any) -> list[ChunkStorageMetadata]:
    """Boxes of the global tensor that ``value`` holds on this rank
    (torch's ``_create_chunk_list``); ValueError for a non-tensor."""
    if isinstance(value, np.ndarray):
        return [ChunkStorageMetadata(offsets=_zeros(value.ndim), sizes=to_size(value.shape))]
    if is_dtensor(value):
        local = value._local_tensor
        if hasattr(local, "__create_chunk_list__"):
            return [_from_torch_chunk(c) for c in local.__create_chunk_list__()]
        offsets, sizes = _dtensor_box(value)
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]
    if hasattr(value, "__create_chunk_list__"):
        return [_from_torch_chunk(c) for c in value.__create_chunk_list__()]
    if is_sharded_tensor(value):
        return [
            ChunkStorageMetadata(
                offsets=to_size(s.metadata.shard_offsets), sizes=to_size(s.metadata.shard_sizes)
            )
            for s in value.local_shards()
        ]
    if is_torch_tensor(value):
        return [ChunkStorageMetadata(offsets=_zeros(value.dim()), sizes=value.size())]
    raise ValueError(
        "Unsupported Type, expecting one of [Tensor, DTensor, ShardedTensor, numpy.ndarray], "
        f"but got {type(value)}"
    )


def _from_torch_chunk(c: Any) -> ChunkStorageMetadata:
    if isinstance(c, ChunkStorageMetadata):
        return c
    return ChunkStorageMetadata(offsets=c.offsets, sizes=c.sizes)


def global_size(value: Any) -> tuple[int, ...] | None:
    """The global shape of a tensor-like destination, or None for other values."""
    if isinstance(value, np.ndarray):
        return tuple(value.shape)
    if is_torch_tensor(value):
        return tuple(value.size())
    size = getattr(value, "size", None)  # objects that mimic tensors (torch checks this)
    if callable(size):
        return tuple(size())
    return None


# --------------------------------------------------------------------------
# Looking up the local tensor behind an index
# --------------------------------------------------------------------------


def find_tensor_shard(tensor: Any, index: MetadataIndex) -> Any:
    """The local tensor of the chunk ``index`` names in ``tensor`` (a DTensor's
    local tensor, a ShardedTensor's shard at ``index.offset``, or ``tensor``)."""
    if hasattr(tensor, "__get_tensor_shard__"):
        return tensor.__get_tensor_shard__(index)  # DTensor: its local tensor
    if is_sharded_tensor(tensor):
        if index.offset is None:
            raise ValueError(
                f"Cannot lookup {index.fqn} since its a ShardedTensor and no offset was provided"
            )
        shards = tensor.local_shards()
        if index.index is not None and index.index < len(shards):
            shard = shards[index.index]
            if tuple(shard.metadata.shard_offsets) == tuple(index.offset):
                return shard.tensor
        for shard in shards:
            if tuple(shard.metadata.shard_offsets) == tuple(index.offset):
                return shard.tensor
        raise ValueError(f"Could not find shard at '{index.offset}' for FQN: '{index.fqn}'")
    if index.offset is not None:
        ndim = tensor.ndim
        if tuple(index.offset) == (0,) * ndim:
            return tensor
        raise ValueError(
            f"FQN: '{index.fqn}' is not a ShardedTensor, can't find by offset: '{index.offset}'"
        )
    return tensor


def find_state_dict_object(state_dict: dict[str, Any], index: MetadataIndex) -> Any:
    """The value (for a tensor, the local tensor of the chunk) ``index`` names."""
    if index.fqn not in state_dict:
        raise ValueError(f"Could not find FQN: '{index.fqn}'")
    obj = state_dict[index.fqn]
    if is_torch_tensor(obj) or isinstance(obj, np.ndarray):
        return find_tensor_shard(obj, index)
    if index.offset is not None:
        raise ValueError(
            f"FQN: '{index.fqn}' is not a ShardedTensor, can't find by offset: '{index.offset}'"
        )
    return obj


def narrow(tensor: Any, offsets: Sequence[int], lengths: Sequence[int]) -> Any:
    """A view of ``tensor[offsets : offsets + lengths]`` (a tensor or an ndarray)."""
    if isinstance(tensor, np.ndarray):
        # The trailing Ellipsis keeps a 0-d result a view, not a scalar copy.
        return tensor[tuple(slice(o, o + n) for o, n in zip(offsets, lengths)) + (Ellipsis,)]
    out = tensor
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if n < tensor.size(dim):
            out = out.narrow(dim, o, n)
    return out
