"""torch's SHARDED optimizer-state values: ShardedTensor / DTensor in dim-0 chunks.

torch 2.13's SHARDED_STATE_DICT holds each parameter's tensor state as
``torch.chunk(state, W, dim=0)[r]`` on group rank ``r``, wrapped in a
ShardedTensor (or, with ``_use_dtensor``, a DTensor). This module makes
such values and recognises them; moving the data is ``_dim0``'s:

    chunk_tensor     torch's own chunking of a full value (the slow save path)
    fast_sharded     whether a save may build its results from our chunks
    sharded_tensor   torch's ``_create_chunk_sharded_tensor`` for a chunk we hold
    dim0_check       is a value torch's dim-0 chunks (from global metadata only)
    local_chunk      ... and this rank's chunk of it
    is_dist_tensor, dist_shape, dist_dtype   ShardedTensor / DTensor metadata
    agree_sharded    one small all-reduce before a sharded load: every rank sees
                     the same structure, or every rank raises
"""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.distributed_c10d import _get_pg_default_device
from torch.distributed.fsdp._fsdp_extensions import _ext_chunk_dtensor, _ext_chunk_tensor
from torch.distributed.fsdp._optim_utils import FSDPParamInfo
from torch.distributed.fsdp._shard_utils import _get_remote_device_str
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard

__all__ = [
    "agree_sharded",
    "chunk_tensor",
    "dim0_check",
    "dist_dtype",
    "dist_shape",
    "fast_sharded",
    "is_dist_tensor",
    "local_chunk",
    "sharded_tensor",
]


# ---------------------------------------------------------------------------
# Making them (save)
# ---------------------------------------------------------------------------


def chunk_tensor(fsdp_state: Any, value: torch.Tensor) -> torch.Tensor:
    """``value`` as the sharded (dim-0 chunked) tensor torch's SHARDED state dict holds."""
    if getattr(fsdp_state._optim_state_dict_config, "_use_dtensor", False):
        if fsdp_state._device_mesh is None:
            raise AssertionError("_use_dtensor is set but the FSDP state has no device mesh")
        return _ext_chunk_dtensor(
            value, fsdp_state.rank, fsdp_state._device_mesh, fsdp_state._fsdp_extension
        )
    if fsdp_state.process_group is None:
        raise AssertionError("the FSDP state has no process group")
    return _ext_chunk_tensor(
        value,
        fsdp_state.rank,
        fsdp_state.world_size,
        fsdp_state._device_handle.device_count(),
        fsdp_state.process_group,
        fsdp_state._fsdp_extension,
    )


def fast_sharded(fsdp_state: Any) -> bool:
    """Whether SHARDED results can be built by an all-to-all (plain ShardedTensors)."""
    return not getattr(fsdp_state._optim_state_dict_config, "_use_dtensor", False) and (
        fsdp_state._fsdp_extension is None
    )


def sharded_tensor(fsdp_state: Any, chunk: torch.Tensor, size: torch.Size) -> ShardedTensor:
    """torch's ``_create_chunk_sharded_tensor`` for a ``size`` tensor of which we hold our chunk."""
    ws, rank, pg = fsdp_state.world_size, fsdp_state.rank, fsdp_state.process_group
    chunks = torch.empty(size, device="meta").chunk(ws, dim=0)
    local_shards = []
    if len(chunks) > rank:
        offsets = [0] * len(size)
        offsets[0] = math.ceil(size[0] / ws) * rank
        local = chunk.view(chunks[rank].shape)
        local_shards = [Shard.from_tensor_and_offsets(local, offsets, rank)]
    chunk_sizes = [list(c.size()) for c in chunks]
    dim0_offsets = [0] + list(itertools.accumulate(cs[0] for cs in chunk_sizes))[:-1]
    chunk_offsets = [[d0] + [0] * (len(size) - 1) for d0 in dim0_offsets]
    device_type = _get_pg_default_device(pg).type
    ndev = fsdp_state._device_handle.device_count()
    placements = [
        _get_remote_device_str(dist.get_global_rank(pg, r), device_type, ndev)
        for r in range(len(chunk_sizes))
    ]
    metadata = ShardedTensorMetadata(
        shards_metadata=[
            ShardMetadata(off, sz, pl)
            for off, sz, pl in zip(chunk_offsets, chunk_sizes, placements)
        ],
        size=size,
        tensor_properties=TensorProperties(
            dtype=chunk.dtype,
            layout=chunk.layout,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        ),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=metadata, process_group=pg
    )


# ---------------------------------------------------------------------------
# Recognising them (load)
# ---------------------------------------------------------------------------


def is_dist_tensor(v: Any) -> bool:
    return isinstance(v, (ShardedTensor, DTensor))


def dist_shape(v: ShardedTensor | DTensor) -> torch.Size:
    return torch.Size(v.metadata().size if isinstance(v, ShardedTensor) else v.shape)


def dist_dtype(v: ShardedTensor | DTensor) -> torch.dtype:
    return v.metadata().tensor_properties.dtype if isinstance(v, ShardedTensor) else v.dtype


def dim0_check(fsdp_state: Any, value: Any, shape: torch.Size) -> tuple[bool, str | None]:
    """Is ``value`` (a ShardedTensor or DTensor) torch's dim-0 chunks of a
    ``shape`` tensor over the unit's process group (``torch.chunk(t, W, 0)[r]``
    on group rank ``r``, as the SHARDED state dict holds it)?

    The answer comes from the value's global metadata only, which every rank
    holds alike, so every rank takes the same path. The second element says
    what is wrong with this rank's local shard when the metadata says yes
    (None: nothing).
    """
    if not is_dist_tensor(value) or len(shape) == 0 or shape[0] == 0:
        return False, None
    if dist_shape(value) != shape:
        return False, None  # the gather path reports torch's shape error
    ws, rank, pg = fsdp_state.world_size, fsdp_state.rank, fsdp_state.process_group
    chunks = torch.empty(shape, device="meta").chunk(ws, dim=0)
    step = -(-shape[0] // ws)
    ranks = [dist.get_global_rank(pg, r) for r in range(ws)]
    want = tuple(chunks[rank].shape) if rank < len(chunks) else (0, *shape[1:])
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        if (
            mesh.ndim != 1
            or tuple(value.placements) != (DShard(0),)
            or mesh.mesh.flatten().tolist() != ranks
        ):
            return False, None
        local = value.to_local()
        if tuple(local.shape) != want or local.dtype != value.dtype:
            return True, (
                f"its DTensor's local tensor is {tuple(local.shape)} {local.dtype}, "
                f"rank {rank}'s chunk is {want} {value.dtype}"
            )
        return True, None
    md = value.metadata()
    if len(md.shards_metadata) != len(chunks):
        return False, None
    seen = set()
    for m in md.shards_metadata:
        off = list(m.shard_offsets)
        k = off[0] // step
        if (
            any(off[1:])
            or off[0] % step
            or k >= len(chunks)
            or k in seen
            or list(m.shard_sizes) != list(chunks[k].shape)
            or m.placement is None
            or m.placement.rank() != ranks[k]
        ):
            return False, None
        seen.add(k)
    shards = value.local_shards()
    if rank >= len(chunks):
        if shards:
            return True, f"rank {rank} holds {len(shards)} local shards, its chunk is empty"
        return True, None
    if (
        len(shards) != 1
        or list(shards[0].metadata.shard_offsets) != [rank * step] + [0] * (len(shape) - 1)
        or tuple(shards[0].tensor.shape) != want
        or shards[0].tensor.dtype != md.tensor_properties.dtype
    ):
        got = [(list(sh.metadata.shard_offsets), tuple(sh.tensor.shape)) for sh in shards]
        return True, (
            f"its ShardedTensor's local shards are {got}, rank {rank}'s chunk is "
            f"{want} at row {rank * step} ({md.tensor_properties.dtype})"
        )
    return True, None


def local_chunk(value: ShardedTensor | DTensor) -> torch.Tensor | None:
    if isinstance(value, DTensor):
        return value.to_local()
    shards = value.local_shards()
    return shards[0].tensor if shards else None


def agree_sharded(
    fqn_to_info: dict[str, FSDPParamInfo],
    unflat_state: dict[Any, Any],
    group: dist.ProcessGroup | None,
) -> None:
    """One small all-reduce before a sharded load: every rank must see the
    same parameters, state names, types, shapes and shard layouts (so every
    rank runs the same collectives), and no rank's local shard may disagree
    with its metadata. Otherwise every rank raises, instead of one rank
    raising while the others wait in a collective."""
    if dist.get_world_size(group) == 1:
        return
    desc: list[str] = []
    errors: list[str] = []
    for fqn in sorted(k for k in unflat_state if isinstance(k, str) and k in fqn_to_info):
        state = unflat_state[fqn]
        if not isinstance(state, dict):
            continue
        info = fqn_to_info[fqn]
        shape = torch.Size(info.handle.flat_param._shapes[info.param_indices[fqn]])
        for name in sorted(state, key=str):
            v = state[name]
            if is_dist_tensor(v):
                ok, err = dim0_check(info.state, v, shape)
                kind = f"{type(v).__name__}:{ok}:{dist_dtype(v)}:{tuple(dist_shape(v))}"
                if err is not None:
                    errors.append(f"state {name!r} of {fqn!r}: {err}")
            elif torch.is_tensor(v) and v.dim() > 0:
                kind = f"Tensor:{v.dtype}:{tuple(v.shape)}"
            else:
                continue
            desc.append(f"{fqn}\0{name}\0{kind}")
    digest = hashlib.blake2b("\n".join(desc).encode(), digest_size=7).digest()
    h = int.from_bytes(digest, "little")
    flags = torch.tensor([h, -h, -len(errors)], dtype=torch.int64)
    flags = flags.to(_get_pg_default_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    lo, hi, bad = (int(x) for x in flags.cpu())
    if errors:
        raise ValueError(
            "sharded optimizer state whose local shard does not match its metadata: "
            + "; ".join(errors[:4])
            + (f" (and {len(errors) - 4} more)" if len(errors) > 4 else "")
        )
    if bad:
        raise ValueError(
            "another rank holds sharded optimizer state whose local shard does not match "
            "its metadata (that rank's error names it)"
        )
    if lo != -hi:
        raise ValueError(
            "the sharded optimizer state differs between ranks (parameters, state names, "
            "types, shapes or shard layouts): every rank must pass the same structure"
        )
