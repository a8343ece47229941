"""Loading FSDP1's sharded optimizer state from a checkpoint (torch 2.13's
``optimizer``: ``load_sharded_optimizer_state_dict``, same signature and
result).

The optimizer's entries of the checkpoint become destinations shaped like
what FSDP1's ``SHARDED_STATE_DICT`` hands out: a ShardedTensor chunked
along dim 0 over the ranks for each tensor state (over the data-parallel
group, at the model's tensor-parallel slice, for a 2-D model whose state
dict holds ShardedTensors of ShardedTensors), a plain tensor for
one-element states such as ``step``; they are filled by shardstate's loader
(resharded from however many ranks saved them) and returned nested, ready
for ``FSDP.optim_state_dict_to_load``.

Deliberate differences from torch: each rank allocates only its own chunk
of a state (torch allocates the whole tensor, then copies its chunk out);
the load is shardstate's ``_load_state_dict``, without the deprecation
warning torch's internal call to ``load_state_dict`` prints; the process
group's device is asked without torch's deprecation warning either.

torch is imported on the first call (the module itself imports without it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, cast

from .._util import import_torch
from . import _tensors
from ._nested_dict import unflatten_state_dict
from ._setup import _coordinator
from .default_planner import (
    DefaultLoadPlanner,
    _create_read_items,
    _is_tensor_md,
    create_read_items_for_chunk_list,
)
from .metadata import STATE_DICT_TYPE, ChunkStorageMetadata, Metadata, MetadataIndex
from .metadata import BytesStorageMetadata as BytesStorageMetadata
from .metadata import TensorProperties as TensorProperties
from .metadata import TensorStorageMetadata as TensorStorageMetadata
from .planner import LoadPlan
from .planner import LoadPlanner as LoadPlanner
from .state_dict_loader import _load_state_dict
from .state_dict_loader import load_state_dict as load_state_dict
from .storage import StorageReader as StorageReader
from .utils import _element_wise_add, _element_wise_sub, _normalize_device_info

__all__ = ["load_sharded_optimizer_state_dict"]

STATE_DICT_2D_LAYOUT = dict[str, tuple[Sequence[int] | None, Sequence[int]]]


def _pg_device_type(pg: Any) -> str:
    """The device type of ``pg``'s backend (the default group's for None):
    torch's ``_get_pg_default_device(pg).type``, which warns that it is
    deprecated; this is the helper torch points to instead."""
    import torch.distributed as dist

    return str(dist.distributed_c10d._get_object_coll_device(pg))


def _gen_rank_device(global_rank: int, device_type: str = "cuda") -> str:
    if device_type == "cpu":
        return "cpu"
    device_module = import_torch()._utils._get_device_module(device_type)
    if device_module.is_available():
        return _normalize_device_info(device_type, global_rank % device_module.device_count())
    return "cpu"


def _create_colwise_spec(pg: Any = None) -> Any:
    """Dim-0 chunk sharding over the ranks of ``pg`` (the world for None)."""
    import torch.distributed as dist
    from torch.distributed._shard.sharding_spec.chunk_sharding_spec import ChunkShardingSpec

    device_type = _pg_device_type(pg)
    if pg is None:
        placements = [f"rank:{i}/{_gen_rank_device(i, device_type)}"
                      for i in range(dist.get_world_size())]
    else:
        placements = [f"rank:{i}/{_gen_rank_device(dist.get_global_rank(pg, i), device_type)}"
                      for i in range(pg.size())]
    return ChunkShardingSpec(dim=0, placements=placements)  # type: ignore[arg-type]


def _is_nested_tensor(val: Any) -> bool:
    """Whether ``val`` is a ShardedTensor whose local shard is a ShardedTensor
    (FSDP1 over tensor parallelism); nested DTensors are refused."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed.tensor import DTensor

    if type(val) is ShardedTensor:
        if len(val.local_shards()) == 0:
            return False
        inner = type(val.local_shards()[0].tensor)
        if inner is ShardedTensor:
            return True
        if inner is DTensor:
            raise ValueError("Cannot handle DTensor nested inside ShardedTensor")
    elif type(val) is DTensor and type(val._local_tensor) in (DTensor, ShardedTensor):
        raise ValueError("Cannot handle nested DTensor")
    return False


def _alloc_tensor(props: Any, size: Sequence[int], device_type: str = "cuda") -> Any:
    """An uninitialised tensor with the saved properties, on this rank's
    current device of ``device_type``."""
    torch = import_torch()
    module = torch._utils._get_device_module(device_type)
    device = (module.current_device() if device_type == "cpu"
              else torch.device(device_type, module.current_device()))
    return torch.empty(size=size, dtype=props.dtype, layout=props.layout,
                       requires_grad=props.requires_grad, pin_memory=props.pin_memory,
                       device=device)


def _get_state_dict_2d_layout(state_dict: STATE_DICT_TYPE) -> tuple[STATE_DICT_2D_LAYOUT, Any]:
    """For each key of a model state dict from FSDP1's sharded_state_dict,
    (offset, size) of this rank's tensor-parallel slice ((None, size) when
    the value is not nested), and the data-parallel group of the nested
    ShardedTensors (None when there are none)."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    specs: STATE_DICT_2D_LAYOUT = {}
    dp_pg = None
    for key, value in state_dict.items():
        # A ShardedTensor's size() warns that ShardedTensor is deprecated; its metadata doesn't.
        size = value.metadata().size if _tensors.is_sharded_tensor(value) else value.size()
        specs[key] = (None, size)
        if _is_nested_tensor(value):
            if len(value.local_shards()) != 1:
                raise AssertionError(f"Cannot handle ST with multiple shards: {key!r} has "
                                     f"{len(value.local_shards())} local shards")
            if not isinstance(value, ShardedTensor):
                raise AssertionError("Can only handle nested ShardedTensor")
            shard = value.local_shards()[0]
            specs[key] = (shard.metadata.shard_offsets, shard.metadata.shard_sizes)
            dp_pg = shard.tensor._process_group
    return specs, dp_pg


def _chunk_sharded_tensor(props: Any, size: Any, device_type: str) -> Any:
    """torch's ``_create_chunk_sharded_tensor`` of an empty ``size`` tensor on
    the default group: this rank's dim-0 chunk (of ``tensor.chunk(world)``)
    as its one local shard, allocated alone; none where the chunks run out."""
    torch = import_torch()
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import (
        Shard,
        ShardedTensor,
        ShardedTensorMetadata,
    )
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    from torch.distributed.distributed_c10d import _get_default_group
    from torch.distributed.fsdp._shard_utils import _get_remote_device_str

    pg = _get_default_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    ndev = torch._utils._get_device_module(device_type).device_count()
    chunks = torch.empty(size, device="meta").chunk(world, dim=0)
    local_shards = []
    if len(chunks) > rank:
        offsets = [0] * len(size)
        offsets[0] = math.ceil(size[0] / world) * rank
        local = _alloc_tensor(props, chunks[rank].shape, device_type)
        local_shards = [Shard.from_tensor_and_offsets(local, offsets, rank)]
    chunk_sizes = [list(c.size()) for c in chunks]
    dim0 = [0] + list(itertools.accumulate(cs[0] for cs in chunk_sizes))[:-1]

    metadata = ShardedTensorMetadata(
        shards_metadata=[ShardMetadata([d0] + [0] * (len(size) - 1), cs,
                                       _get_remote_device_str(dist.get_global_rank(pg, r),
                                                              device_type, ndev))
                         for r, (d0, cs) in enumerate(zip(dim0, chunk_sizes))],
        size=torch.Size(size),
        tensor_properties=TensorProperties(
            dtype=props.dtype, layout=props.layout, requires_grad=False,
            memory_format=torch.contiguous_format, pin_memory=bool(props.pin_memory)),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=metadata, process_group=pg)


def _tp_sharded_tensor(props: Any, alloc_size: Sequence[int], sharding_spec: Any,
                       dp_pg: Any, device_type: str) -> Any:
    """A ShardedTensor of ``alloc_size`` (the tensor-parallel slice) chunked
    over the data-parallel group, this rank's shards allocated."""
    torch = import_torch()
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        TensorProperties as ShardTensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard

    properties = ShardTensorProperties(
        dtype=props.dtype, layout=props.layout, requires_grad=props.requires_grad,
        memory_format=props.memory_format, pin_memory=props.pin_memory)
    st_md = sharding_spec.build_metadata(torch.Size(alloc_size), properties)
    me = dist.get_rank(dp_pg)
    local_shards = [Shard(tensor=_alloc_tensor(props, md.shard_sizes, device_type), metadata=md)
                    for md in st_md.shards_metadata if md.placement.rank() == me]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, st_md, process_group=dp_pg)


class _ReaderWithOffset(DefaultLoadPlanner):
    """Reads each nested (2-D) optimizer state at its tensor-parallel
    offset: the destination's chunk is shifted by ``fqn_to_offset[fqn]``
    in the saved tensor, and looked up at its own offset again."""

    translation: dict[MetadataIndex, MetadataIndex]
    state_dict: STATE_DICT_TYPE
    metadata: Metadata

    def __init__(self, fqn_to_offset: dict[str, Sequence[int]]) -> None:
        super().__init__()
        self.fqn_to_offset = fqn_to_offset
        self.metadata = Metadata({})
        self.state_dict = {}
        self.translation = {}

    def create_local_plan(self) -> LoadPlan:
        requests = []
        self.translation = {}
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            if not _tensors.is_sharded_tensor(obj) or fqn not in self.fqn_to_offset:
                requests += _create_read_items(fqn, md, obj)
                continue
            offset = self.fqn_to_offset[fqn]
            if len(obj.local_shards()) != 1:
                raise AssertionError(f"Expected exactly one local shard of {fqn!r}, found "
                                     f"{len(obj.local_shards())}")
            shard_md = obj.local_shards()[0].metadata
            local_chunks = [ChunkStorageMetadata(
                offsets=_tensors.to_size(_element_wise_add(shard_md.shard_offsets, offset)),
                sizes=_tensors.to_size(shard_md.shard_sizes))]
            reqs = create_read_items_for_chunk_list(fqn, cast(Any, md), local_chunks)
            for ri in reqs:
                if ri.dest_index.offset is None:
                    raise AssertionError("dest_index.offset must not be None")
                original = _element_wise_sub(ri.dest_index.offset, offset)
                self.translation[ri.dest_index] = dataclasses.replace(
                    ri.dest_index, offset=_tensors.to_size(original))
            requests += reqs
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> Any:
        return super().lookup_tensor(self.translation.get(index, index))


def load_sharded_optimizer_state_dict(
    model_state_dict: STATE_DICT_TYPE,
    optimizer_key: str,
    storage_reader: Any,
    planner: Any = None,
) -> STATE_DICT_TYPE:
    """The optimizer state saved under ``optimizer_key`` (the first level of
    the saved state dict), loaded as FSDP1's sharded optimizer state for
    this rank and returned nested (``{optimizer_key: {...}}``), for
    ``FSDP.optim_state_dict_to_load``.

    ``model_state_dict``: this rank's model state dict from FSDP1's
    ``SHARDED_STATE_DICT`` (it gives the tensor-parallel slices of a 2-D
    model). ``planner`` is used when the model is not 2-D. Call it on
    every rank of the default process group::

        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model_sd = model.state_dict()
            osd = load_sharded_optimizer_state_dict(
                model_sd, "optimizer", dcp.FileSystemReader("checkpoint"))
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd["optimizer"]))
    """
    metadata = storage_reader.read_metadata()
    layout_specs, dp_pg = _get_state_dict_2d_layout(model_state_dict)
    device_type = _pg_device_type(dp_pg)
    sharding_spec = _create_colwise_spec(dp_pg) if dp_pg is not None else None

    state_dict: STATE_DICT_TYPE = {}
    fqn_to_offset: dict[str, Sequence[int]] = {}
    for key, value in metadata.state_dict_metadata.items():
        key_path = metadata.planner_data[key]
        if key_path[0] != optimizer_key:
            continue
        if not _is_tensor_md(value):
            state_dict[key] = "<bytes_io>"
            continue
        if value.size.numel() == 1:
            state_dict[key] = _alloc_tensor(value.properties, value.size, device_type)
        elif dp_pg is None:
            state_dict[key] = _chunk_sharded_tensor(value.properties, value.size, device_type)
        else:
            spec_key = key_path[2]
            alloc_size = layout_specs.get(spec_key, (None, value.size))[1]
            state_dict[key] = _tp_sharded_tensor(value.properties, alloc_size, sharding_spec,
                                                 dp_pg, device_type)
            if spec_key in layout_specs and layout_specs[spec_key][0] is not None:
                fqn_to_offset[key] = cast(Sequence[int], layout_specs[spec_key][0])

    # torch's deprecated load_state_dict: reset the reader, load on the default group.
    storage_reader.reset()
    _load_state_dict(state_dict, storage_reader, _coordinator(None, False),
                     _ReaderWithOffset(fqn_to_offset) if dp_pg is not None else planner)
    return unflatten_state_dict(state_dict, metadata.planner_data)
