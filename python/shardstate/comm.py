"""Collective transport for shardstate's bulk traffic.

Four collectives carry checkpoint and optimizer-state bytes between ranks:
all-gather and gather (flat optimizer-state shards into a full state, on
every rank or on one), broadcast (an item read from storage once, sent to
every rank that needs it) and scatter (a full state from one rank, in
shards). The planning code above
calls the functions here with torch tensors and a torch process group;
only the transport differs:

* CUDA tensors, with shardstate's CUDA runtime and NCCL available, go over
  an NCCL communicator of shardstate's C core (``_core.NcclComm``): one
  per process group, made on first use from a unique id that the group's
  first rank creates and sends to the others over the group itself, kept,
  and destroyed by :func:`close_communicators` (at exit, or when the caller
  tears the group down). Its collectives are ordered after the work queued
  on the current CUDA stream, and that stream waits for them.
* Everything else (CPU tensors, gloo groups, no NCCL) goes through
  ``torch.distributed`` on the group. On a gloo group the all-gather and
  the gather of CPU tensors are torch.distributed's point-to-point
  ``isend``/``irecv`` straight between each pair of ranks, every receive
  landing in its slice of ``out``: gloo's own ``gather`` and
  ``all_gather_into_tensor`` move the same bytes three times slower
  (``benchmarks/bench_comm.py``). Broadcast and scatter stay gloo's
  collectives, which are as fast as the point-to-point form.

Set ``SHARDSTATE_NCCL=0`` to keep CUDA tensors on ``torch.distributed``
as well.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

from . import _core

__all__ = ["all_gather_into", "broadcast", "close_communicators", "communicator", "exchange",
           "gather", "point_to_point", "scatter"]

_comms: dict[int, tuple[Any, Any]] = {}  # id(group) -> (group, NcclComm)
_failed: set[int] = set()  # groups whose communicator could not be made
_lock = threading.Lock()


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _group(group: Any) -> Any:
    dist = _dist()
    return group if group is not None else dist.group.WORLD


def exchange_unique_id(group: Any, make: Any = None) -> bytes:
    """A unique id made by the group's first rank (``make()``, default
    ``_core.nccl_unique_id``) and received by every rank over the group."""
    dist = _dist()
    box = [None]
    if dist.get_rank(group) == 0:
        box[0] = (make or _nccl_unique_id)()
    dist.broadcast_object_list(box, group_src=0, group=group)
    uid = box[0]
    if not isinstance(uid, bytes) or len(uid) != 128:
        raise RuntimeError(f"the NCCL unique id from rank 0 is malformed: {uid!r:.80}")
    return uid


def _nccl_unique_id() -> bytes:
    from . import cuda as sscuda

    return _core.nccl_unique_id(cudart=list(sscuda.candidates("cudart")),
                                nccl=list(sscuda.candidates("nccl")))


def communicator(group: Any = None, device: int | None = None) -> Any:
    """shardstate's NCCL communicator for ``group`` (None: the default
    group), made collectively on first use; None where NCCL cannot be used
    (no library, no GPU, ``SHARDSTATE_NCCL=0``). Every rank of the group
    must call it the first time, as for any collective."""
    if os.environ.get("SHARDSTATE_NCCL", "1") == "0":
        return None
    group = _group(group)
    key = id(group)
    with _lock:
        if key in _comms:
            return _comms[key][1]
        if key in _failed:
            return None
    from . import cuda as sscuda

    st = sscuda.status()
    # every rank decides alike only if every rank sees the same: agree first
    ok = bool(st.cuda.available and st.nccl.loaded)
    dist = _dist()
    flags = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, ok, group=group)
    if not all(flags):
        with _lock:
            _failed.add(key)
        return None
    if device is None:
        import torch

        device = torch.cuda.current_device()
    uid = exchange_unique_id(group)
    comm = _core.NcclComm(dist.get_world_size(group), dist.get_rank(group), uid, device,
                          cudart=list(sscuda.candidates("cudart")),
                          nccl=list(sscuda.candidates("nccl")))
    with _lock:
        _comms[key] = (group, comm)
    return comm


def close_communicators(group: Any = None) -> None:
    """Destroy shardstate's communicator of ``group`` (all of them when
    None). Call before destroying the torch group itself."""
    with _lock:
        keys = [k for k, (g, _) in _comms.items() if group is None or g is group]
        comms = [_comms.pop(k)[1] for k in keys]
        if group is None:
            _failed.clear()
        else:
            _failed.discard(id(group))
    for c in comms:
        c.close()


atexit.register(close_communicators)


def _stream(t: Any) -> int:
    import torch

    return torch.cuda.current_stream(t.device).cuda_stream


def _bytes(t: Any) -> Any:
    return t.reshape(-1).view(__import__("torch").uint8)


def _nccl_for(tensors: list[Any], group: Any) -> Any:
    if not all(t is not None and t.is_cuda and t.is_contiguous() for t in tensors):
        return None
    return communicator(group, tensors[0].device.index)


# The tag of shardstate's point-to-point messages, apart from a user's tag 0.
P2P_TAG = 0x5353


def point_to_point(tensors: list[Any], group: Any = None) -> bool:
    """Whether ``tensors`` (CPU, contiguous) on ``group`` travel as
    point-to-point messages (a gloo group; ``SHARDSTATE_P2P=0``: never)."""
    if os.environ.get("SHARDSTATE_P2P", "1") == "0":
        return False
    if not all(t is not None and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return False
    return "gloo" in str(_dist().get_backend(group))


def exchange(sends: list[tuple[Any, int]], recvs: list[tuple[Any, int]], group: Any = None) -> None:
    """Point-to-point messages on ``group``: every ``(tensor, group rank)``
    of ``recvs`` is filled by a message from that rank, every one of
    ``sends`` goes to its rank. Messages between two ranks match in the
    order they are listed, so both sides must list them alike. All
    receives are posted first; the first failure is raised after every
    message has been waited for, so no buffer is released while in use."""
    dist = _dist()
    works = [dist.irecv(_bytes(t), group=group, group_src=src, tag=P2P_TAG) for t, src in recvs]
    works += [dist.isend(_bytes(t), group=group, group_dst=dst, tag=P2P_TAG) for t, dst in sends]
    err = None
    for w in works:
        try:
            w.wait()
        except Exception as e:  # noqa: BLE001 - re-raised below
            err = err or e
    if err is not None:
        raise err


def _blocks(out: Any, inp: Any, world: int) -> list[Any]:
    """``out`` as ``world`` blocks of ``inp.numel()`` (> 0) elements."""
    n = inp.numel()
    if out.dtype != inp.dtype:
        raise TypeError(f"out is {out.dtype} but the input is {inp.dtype}")
    if out.numel() != n * world:
        raise ValueError(f"out has {out.numel()} elements, not {world} ranks x {n}")
    return list(out.reshape(-1).split(n))


def all_gather_into(out: Any, inp: Any, group: Any = None) -> None:
    """``out`` (world x ``inp`` elements) <- every rank's ``inp`` in rank
    order (torch's ``all_gather_single``)."""
    comm = _nccl_for([out, inp], group)
    if comm is None:
        dist = _dist()
        if point_to_point([out, inp], group) and inp.numel():
            world, me = dist.get_world_size(group), dist.get_rank(group)
            blocks = _blocks(out, inp, world)
            blocks[me].copy_(inp.reshape(-1))
            others = [r for r in range(world) if r != me]
            exchange([(inp, r) for r in others], [(blocks[r], r) for r in others], group)
            return
        # all_gather_single is torch 2.13's name; older releases have the other
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, inp, group=group)
        return
    comm.all_gather(_bytes(inp), _bytes(out), stream=_stream(inp))


def broadcast(t: Any, group_src: int, group: Any = None) -> None:
    """``t`` on every rank <- ``t`` on group rank ``group_src``."""
    comm = _nccl_for([t], group)
    if comm is None:
        _dist().broadcast(t, group=group, group_src=group_src)
        return
    comm.broadcast(_bytes(t), group_src, stream=_stream(t))


def scatter(out: Any, send: Any, group_src: int, group: Any = None) -> None:
    """``out`` on group rank r <- block r of ``send`` (world x ``out``
    elements, contiguous) on group rank ``group_src``; ``send`` is None on
    the other ranks."""
    dist = _dist()
    comm = _nccl_for([out] + ([send] if send is not None else []), group)
    if comm is None:
        parts = list(send.reshape(-1).split(out.numel())) if send is not None else None
        dist.scatter(out, parts, group=group, group_src=group_src)
        return
    comm.scatter(_bytes(send) if send is not None else None, _bytes(out), group_src,
                 stream=_stream(out))


def gather(out: Any, inp: Any, group_dst: int, group: Any = None) -> None:
    """``out`` (world x ``inp`` elements, contiguous) on group rank
    ``group_dst`` <- every rank's ``inp`` in rank order; ``out`` is None on
    the other ranks, which never hold the whole."""
    dist = _dist()
    comm = _nccl_for([inp] + ([out] if out is not None else []), group)
    if comm is None:
        if point_to_point([inp] + ([out] if out is not None else []), group) and inp.numel():
            world, me = dist.get_world_size(group), dist.get_rank(group)
            if me != group_dst:
                exchange([(inp, group_dst)], [], group)
                return
            if out is None:
                raise ValueError("gather: the destination rank needs an out tensor")
            blocks = _blocks(out, inp, world)
            blocks[me].copy_(inp.reshape(-1))
            exchange([], [(blocks[r], r) for r in range(world) if r != me], group)
            return
        parts = list(out.reshape(-1).split(inp.numel())) if out is not None else None
        dist.gather(inp, parts, group=group, group_dst=group_dst)
        return
    comm.gather(_bytes(inp), _bytes(out) if out is not None else None, group_dst,
                stream=_stream(inp))
