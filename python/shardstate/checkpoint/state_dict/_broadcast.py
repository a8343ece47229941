"""``broadcast_from_rank0``: rank 0's full tensors to every rank. First one
object broadcast (keys, small values, tensor sizes; an error on rank 0
raises on every rank), then the tensors in buckets of one dtype, each cut
to the local shard as it arrives."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from ._shards import _shard_like


class _TensorInfo(NamedTuple):
    """What rank 0 tells the others about a tensor it is about to broadcast."""

    size: torch.Size
    dtype: torch.dtype


def _broadcast_from_rank0(
    full: dict[str, Any],
    local: dict[str, Any],
    device: torch.device,
    *,
    strict: bool,
    cpu_offload: bool,
) -> None:
    """Rank 0's ``full`` into every rank's ``local`` (in place): one object
    broadcast with the keys, small values and tensor sizes, then the tensors
    in buckets (:func:`_broadcast_tensors`), each cut to the local shard as
    it arrives."""
    rank = dist.get_rank()

    def describe() -> dict[str, Any]:
        header: dict[str, Any] = {}
        for key, value in full.items():
            if not torch.is_tensor(value):
                header[key] = value
            elif value.dim() == 0:
                header[key] = value.cpu()
            else:
                _full_for_broadcast(value, key)
                header[key] = _TensorInfo(value.size(), value.dtype)
        return header

    header = _header_from_rank0(describe)

    keys = []
    for key, info in header.items():
        if isinstance(info, _TensorInfo):
            keys.append(key)
        elif key in local:
            local[key] = info

    def deliver(i: int, buf: torch.Tensor) -> None:
        mine = local.get(keys[i])
        if mine is None:
            return
        mine = _shard_like(mine, buf, in_place=True) if isinstance(mine, DTensor) else buf
        local[keys[i]] = mine.cpu() if cpu_offload else mine

    sources = (full[k] for k in keys) if rank == 0 else None
    _broadcast_tensors([header[k] for k in keys], sources, device, deliver)
    if strict:
        for key in [k for k in local if k not in header]:
            del local[key]


# Small tensors of one dtype travel together, up to this many bytes a broadcast.
_BUCKET_BYTES = 16 << 20


def _broadcast_tensors(
    infos: list[_TensorInfo],
    sources: Iterator[torch.Tensor] | None,
    device: torch.device,
    deliver: Callable[[int, torch.Tensor], None],
) -> None:
    """Broadcast rank 0's tensors (``sources``, described by ``infos``; None
    on the other ranks). Runs of one dtype go as one flat buffer of at most
    _BUCKET_BYTES (a bigger tensor alone, without a copy on rank 0): one
    collective per bucket. ``deliver(i, tensor)`` gets each tensor as soon
    as its bucket arrived, so at most one bucket (or one big tensor) of full
    tensors exists at a time beyond what ``deliver`` keeps."""
    rank = dist.get_rank()
    i = 0
    while i < len(infos):
        dtype = infos[i].dtype
        item = torch.empty((), dtype=dtype).element_size()
        j, nbytes = i, 0
        while j < len(infos) and infos[j].dtype == dtype:
            size = infos[j].size.numel() * item
            if j > i and nbytes + size > _BUCKET_BYTES:
                break
            nbytes += size
            j += 1
        group = infos[i:j]
        if rank == 0:
            assert sources is not None
            tensors = [_full_for_broadcast(next(sources), f"#{k}").to(device)
                       for k in range(i, j)]
        if j - i == 1:
            buf = (tensors[0].contiguous() if rank == 0
                   else torch.empty(group[0].size, dtype=dtype, device=device))
            dist.broadcast(buf, src=0)
            deliver(i, buf)
        else:
            flat = (torch.cat([t.reshape(-1) for t in tensors]) if rank == 0
                    else torch.empty(nbytes // item, dtype=dtype, device=device))
            dist.broadcast(flat, src=0)
            at = 0
            for k, info in enumerate(group):
                n = info.size.numel()
                # A copy: nothing keeps the bucket alive or shares its storage.
                deliver(i + k, flat[at:at + n].view(info.size).clone())
                at += n
        i = j


def _header_from_rank0(describe: Callable[[], Any]) -> Any:
    """``describe()`` run on rank 0 and sent to every rank; if it raises,
    every rank raises (none is left waiting in a broadcast)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [(True, describe())]
        except (ValueError, TypeError, KeyError, RuntimeError) as e:
            box = [(False, e)]
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _full_for_broadcast(value: torch.Tensor, key: str) -> torch.Tensor:
    if isinstance(value, (DTensor, ShardedTensor)):
        raise ValueError(
            f"broadcast_from_rank0 needs full tensors on rank 0, but '{key}' is a "
            f"{type(value).__name__} (get it with full_state_dict=True)"
        )
    return value.detach()
