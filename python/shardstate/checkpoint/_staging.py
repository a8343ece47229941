"""Staging for async_save: a private host copy of a state dict, made in a
bounded pool of reusable buffers.

A training loop saves the same structure again and again. torch's default
stager copies every tensor into freshly allocated memory each time, so each
save pays for page faults and zeroing as well as the copy. Here each save
takes one *arena* (an anonymous mapping)
from a per-process pool, copies every CPU tensor and ndarray into it with
the C engine (GIL released, large copies split over the I/O threads), and
gives the arena back when its background save has finished. The next save
of the same size reuses it: a plain memory copy into memory already mapped.

The pool is bounded: at most ``_SLOTS`` arenas are in use at a time (one
being written, one being staged). A save that finds every slot taken waits
until the oldest background save finishes, so checkpoints can never pile up
unbounded host memory. Free arenas are kept (at most ``_SLOTS`` of them)
and reused for any save they are large enough for.

Staged tensors are views into the arena laid out as their clones would be;
the writer saves such a view's own range of the arena (the record torch
writes for the clone), so nothing is copied again.
"""

from __future__ import annotations

import copy
import mmap
import sys
import threading
from typing import Any

import numpy as np

_SLOTS = 2  # arenas in use at once, per process
_ALIGN = 64  # every staged tensor starts 64-byte aligned
_HUGE = 2 << 20


class _Arena:
    """One reusable host buffer."""

    def __init__(self, nbytes: int) -> None:
        size = max(_HUGE, -(-nbytes // _HUGE) * _HUGE)
        # (no MADV_HUGEPAGE: with THP defrag on "madvise", the first touch
        # of a huge-page region compacts memory synchronously, which took
        # seconds on a busy host; the pool's reuse is what saves the faults).
        # MAP_POPULATE has the kernel fault the whole arena in at once, which
        # took 0.30 s per GiB against 0.6 s for one fault per page during the
        # first copy (the staging copy touches every byte anyway).
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, size, flags=flags)
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.size = size
        self._pinned: Any = None  # torch's cudart, once registered with CUDA

    def pin(self, torch: Any) -> bool:
        """Page-lock the arena for CUDA (cudaHostRegister, once per arena:
        the pool reuses it), so device-to-host copies into it run at full
        DMA speed and asynchronously. False when CUDA refuses."""
        if self._pinned is None:
            cudart = torch.cuda.cudart()
            if int(cudart.cudaHostRegister(self.bytes.ctypes.data, self.size, 0)) != 0:
                return False
            self._pinned = cudart
        return True

    def __del__(self) -> None:
        if self._pinned is not None:
            try:
                self._pinned.cudaHostUnregister(self.bytes.ctypes.data)
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass


class _StagingPool:
    def __init__(self, slots: int) -> None:
        self._slots = slots
        self._free: list[_Arena] = []
        self._busy = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> _Arena:
        """An arena of at least nbytes, waiting while every slot is busy."""
        with self._cond:
            while self._busy >= self._slots:
                self._cond.wait()
            self._busy += 1
            fits = [a for a in self._free if a.size >= nbytes]
            if fits:
                arena = min(fits, key=lambda a: a.size)
                self._free.remove(arena)
                return arena
            if self._free:  # too small for this state: let the largest go
                self._free.remove(max(self._free, key=lambda a: a.size))
        try:
            return _Arena(nbytes)
        except BaseException:
            self.release(None)
            raise

    def release(self, arena: _Arena | None) -> None:
        with self._cond:
            self._busy -= 1
            if arena is not None:
                self._free.append(arena)
                while len(self._free) > self._slots:
                    self._free.remove(min(self._free, key=lambda a: a.size))
            self._cond.notify()


_pool = _StagingPool(_SLOTS)


def _stage_target(value: Any, torch: Any) -> Any:
    """The host tensor (or ndarray) whose elements are staged for value, or
    None when value is not staged through the arena."""
    if isinstance(value, np.ndarray):
        return value
    if torch is None or not isinstance(value, torch.Tensor):
        return None
    t = value
    if hasattr(t, "to_local") and type(t).__name__ == "DTensor":
        t = t.to_local()
    elif type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return None  # ShardedTensor and other subclasses: staged by clone
    if t.device.type not in ("cpu", "cuda") or t.layout != torch.strided or t.is_conj() \
            or t.is_neg():
        return None
    return t


def _nbytes(x: Any) -> int:
    return int(x.nbytes)


def _collect(value: Any, torch: Any, out: list[Any]) -> None:
    """Every staged source in value, depth first, in the order _build uses."""
    if isinstance(value, dict):
        for v in value.values():
            _collect(v, torch, out)
    elif isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        for v in value:
            _collect(v, torch, out)
    else:
        src = _stage_target(value, torch)
        if src is not None:
            out.append(src)


class StagedState:
    """A staged state dict and the arena it lives in (None when nothing
    needed one). ``release()`` gives the arena back; call it once, when the
    save that uses ``state_dict`` has finished."""

    def __init__(self, state_dict: Any, arena: _Arena | None) -> None:
        self.state_dict = state_dict
        self._arena = arena
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self._arena is not None:
                _pool.release(self._arena)


def stage(state_dict: Any) -> StagedState:
    """A private host copy of state_dict: CPU and CUDA tensors, DTensor
    local shards and ndarrays are copied into a pooled arena (page-locked
    for CUDA, whose copies run asynchronously and are waited for once);
    other values are deep-copied."""
    from ..geometry import copy_region
    from ..io import _pool_for

    torch = sys.modules.get("torch")
    sources: list[Any] = []
    _collect(state_dict, torch, sources)
    offsets, total = [], 0
    for s in sources:
        offsets.append(total)
        total += -(-_nbytes(s) // _ALIGN) * _ALIGN
    arena = _pool.acquire(total) if total else None
    try:
        threads = _pool_for(None, None)
        cuda = [s for s in sources if not isinstance(s, np.ndarray) and s.is_cuda]
        # CUDA sources: asynchronous copies into the page-locked arena on
        # each device's current stream (after the kernels that wrote them),
        # waited for once at the end
        async_d2h = bool(cuda) and arena is not None and arena.pin(torch)
        views = []
        for s, off in zip(sources, offsets):
            raw = arena.bytes[off : off + _nbytes(s)] if arena is not None else None
            if isinstance(s, np.ndarray):
                dst = raw.view(s.dtype).reshape(s.shape) if s.size else np.empty(s.shape, s.dtype)
            elif s.numel():
                # laid out as s.clone() would be, so the writer saves it as
                # torch saves the clone (byte for byte) without another copy
                layout = torch.empty_like(s, device="meta").stride()
                dst = torch.from_numpy(raw).view(s.dtype).as_strided(s.shape, layout)
            else:
                dst = torch.empty(s.shape, dtype=s.dtype)
            if not isinstance(s, np.ndarray) and s.is_cuda:
                if s.numel():
                    dst.copy_(s.detach(), non_blocking=async_d2h)
            elif dst.size if isinstance(dst, np.ndarray) else dst.numel():
                zeros = (0,) * s.ndim
                copy_region(dst, zeros, s, zeros, tuple(s.shape), pool=threads)
            views.append(dst)
        for dev in {s.device for s in cuda}:
            torch.cuda.current_stream(dev).synchronize()
        staged = _build(state_dict, torch, iter(views))
    except BaseException:
        if arena is not None:
            _pool.release(arena)
        raise
    return StagedState(staged, arena)


def _build(value: Any, torch: Any, views: Any) -> Any:
    """value with each staged source replaced by its copy (same walk as
    _collect)."""
    if isinstance(value, dict):
        staged = {k: _build(v, torch, views) for k, v in value.items()}
        return staged if type(value) is dict else type(value)(staged)
    if isinstance(value, list):
        return [_build(v, torch, views) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_build(v, torch, views) for v in value)
    src = _stage_target(value, torch)
    if src is not None:
        dst = next(views)
        if src is value or isinstance(value, np.ndarray):
            return dst
        if type(value).__name__ == "DTensor":
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(dst, value.device_mesh, value.placements,
                                      run_check=False, shape=value.shape,
                                      stride=value.stride())
        return dst  # a Parameter: staged as a plain tensor, as torch's stager does
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            return value.detach().clone()
        return value.detach().to("cpu")
    return copy.deepcopy(value)
