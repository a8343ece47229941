"""Between shards and full tensors: gather DTensors and FSDP1's
ShardedTensors (every rank takes part, in one order), apply
``full_state_dict`` / ``cpu_offload`` to a state dict being saved, and cut
a full tensor to a DTensor's local shard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ._info import _Info


def _gather_sharded_tensor(value: ShardedTensor) -> torch.Tensor:
    """All-gather a ShardedTensor chunked along dim 0 over the default group
    (FSDP1's layout): every rank contributes its shard padded to one chunk."""
    world = dist.get_world_size()
    size = value.size()
    numel = size.numel()
    chunk = -(-size[0] // world) * (numel // size[0]) if size[0] else 0
    shards = value.local_shards()
    device = shards[0].tensor.device if shards else torch.device("cpu")
    mine = torch.zeros(chunk, dtype=value.dtype, device=device)
    if shards:
        local = shards[0].tensor.reshape(-1)
        if local.numel() > chunk:
            raise ValueError(
                f"ShardedTensor shard of {local.numel()} elements exceeds the "
                f"{chunk}-element chunk of a dim-0 split over {world} ranks"
            )
        mine[: local.numel()] = local
    out = torch.empty(chunk * world, dtype=value.dtype, device=device)
    from ... import comm

    comm.all_gather_into(out, mine)  # NCCL for CUDA shards; older torch's name too
    return out[:numel].reshape(size)


def _gather(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        full = value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)
        local = full.to_local()
        wait = getattr(local, "wait", None)  # an AsyncCollectiveTensor
        return wait() if callable(wait) else local
    if isinstance(value, ShardedTensor):
        return _gather_sharded_tensor(value)
    return value


_PLAIN_LEAVES = (int, float, str, bytes, type(None))


def _map_state(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Copy of nested dicts/lists/tuples with ``fn`` applied to each tensor
    (depth first, in order, so collectives line up across ranks)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, _PLAIN_LEAVES) or type(obj).__name__ == "BytesIO":
        return obj
    if isinstance(obj, dict):
        return {k: _map_state(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_state(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_state(v, fn) for v in obj)
    raise ValueError(f"Unexpected value type {type(obj)}")


def _full_or_offloaded(state: dict[str, Any], info: _Info) -> dict[str, Any]:
    """Apply ``full_state_dict`` / ``cpu_offload`` to a state dict being saved."""
    cpu = torch.device("cpu")
    if info.full_state_dict:
        rank0_only = info.cpu_offload and dist.is_initialized()
        keep = not rank0_only or dist.get_rank() == 0

        def full(t: torch.Tensor) -> torch.Tensor | None:
            t = _gather(t)  # every rank takes part
            if not keep:
                return None  # dropped at once: other ranks never hold the whole
            return t.to(cpu) if info.cpu_offload else t

        result = _map_state(state, full)
        return result if keep else {}
    if info.cpu_offload:
        return _map_state(state, lambda t: t.to(cpu))
    return state


def _shard_like(local: DTensor, full: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``local``'s shard of the full tensor: copied into ``local`` itself
    (``in_place``, unless it lives on the meta device) or a new DTensor.
    A tensor of another shape, or a DTensor, is returned as it is, for
    ``load_state_dict`` to copy or to report (``size mismatch for ...``)."""
    if isinstance(full, DTensor) or tuple(full.shape) != tuple(local.shape):
        return full
    shape, offset = compute_local_shape_and_global_offset(
        full.shape, local.device_mesh, local.placements
    )
    piece = full[tuple(slice(o, o + n) for n, o in zip(shape, offset))]
    if in_place and not local.is_meta:
        local.to_local().copy_(piece)
        return local
    device = full.device if local.is_meta else local.to_local().device
    return DTensor.from_local(
        piece.detach().to(device).clone(),
        local.device_mesh,
        local.placements,
        shape=local.shape,
        stride=local.stride(),
    )
