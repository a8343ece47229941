"""Staging for async_save: a private host copy of a state dict, made in a
bounded pool of reusable buffers.

A training loop saves the same structure again and again. torch's default
stager copies every tensor into freshly allocated memory each time, so each
save pays for page faults and zeroing as well as the copy. Here each save
takes one *arena* (an anonymous mapping, or a shared memory file that the
PROCESS checkpointer's process maps too) from a per-process pool, copies
every CPU tensor and ndarray into it with the C engine (GIL released, large
copies split over the I/O threads), and gives the arena back when its
background save has finished. The next save of the same size (and kind)
reuses it: a plain memory copy into memory already mapped.

The pool is bounded: at most ``_SLOTS`` arenas are in use at a time (one
being written, one being staged). A save that finds every slot taken waits
until the oldest background save finishes, so checkpoints can never pile up
unbounded host memory. Free arenas are kept (at most ``_SLOTS`` of them)
and reused for any save they are large enough for.

An arena goes back to the pool when its save has finished
(``StagedState.release``, or ``release_staged`` for a stager's output), or
else when every staged value that lives in it has been garbage collected
(a stager's output dropped by its user), whichever comes first.

Staged tensors are views into the arena laid out as their clones would be;
the writer saves such a view's own range of the arena (the record torch
writes for the clone), so nothing is copied again.

Thread safety: the pool is safe from any thread, and from a finalizer.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import ctypes
import itertools
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

_SLOTS = 2  # arenas in use at once, per process
_ALIGN = 64  # every staged tensor starts 64-byte aligned
_HUGE = 2 << 20
_ids = itertools.count(1)


def _shared_fd(size: int) -> int:
    """A file descriptor of ``size`` bytes of shared memory that no name
    refers to: a memfd (counted against the process's memory, not a small
    /dev/shm), or an unlinked temporary file where memfd is missing."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("shardstate-staging", os.MFD_CLOEXEC)
    else:  # pragma: no cover - not Linux
        import tempfile

        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, name = tempfile.mkstemp(prefix="shardstate-staging-", dir=shm)
        os.unlink(name)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Arena:
    """One reusable host buffer. ``shared``: a shared mapping of a memory
    file (``fd``) that another process can map, for the PROCESS checkpointer;
    otherwise an anonymous private mapping. ``id`` names it to that
    process."""

    def __init__(self, nbytes: int, shared: bool = False) -> None:
        size = max(_HUGE, -(-nbytes // _HUGE) * _HUGE)
        # (no MADV_HUGEPAGE: with THP defrag on "madvise", the first touch
        # of a huge-page region compacts memory synchronously, which took
        # seconds on a busy host; the pool's reuse is what saves the faults).
        # MAP_POPULATE has the kernel fault the whole arena in at once, which
        # took 0.30 s per GiB against 0.6 s for one fault per page during the
        # first copy (the staging copy touches every byte anyway).
        populate = getattr(mmap, "MAP_POPULATE", 0)
        self.id = next(_ids)
        self.shared = shared
        self.holder: Any = None  # the release of the staging using it now
        self.fd = -1
        if shared:
            self.fd = _shared_fd(size)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | populate)
        else:
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self.bytes.ctypes.data
        self.size = size
        _all_arenas[self.id] = self
        if shared:
            _shared_arenas[self.id] = self
        self._pinned: Any = None  # torch's cudart, once registered with CUDA

    def pin(self, torch: Any) -> bool:
        """Page-lock the arena for CUDA (cudaHostRegister, once per arena:
        the pool reuses it), so device-to-host copies into it run at full
        DMA speed and asynchronously. False when CUDA refuses."""
        if self._pinned is None:
            cudart = torch.cuda.cudart()
            if int(cudart.cudaHostRegister(self.base, self.size, 0)) != 0:
                return False
            self._pinned = cudart
        return True

    def __del__(self) -> None:
        if self._pinned is not None:
            try:
                self._pinned.cudaHostUnregister(self.base)
            except Exception:  # noqa: BLE001 - interpreter teardown
                pass
        if self.fd >= 0:
            os.close(self.fd)


# Every live arena, and every live shared one, by id: to find the arena a
# staged value lives in.
_all_arenas: weakref.WeakValueDictionary[int, _Arena] = weakref.WeakValueDictionary()
_shared_arenas: weakref.WeakValueDictionary[int, _Arena] = weakref.WeakValueDictionary()


def _find(address: int, nbytes: int, arenas: Any) -> tuple[_Arena, int] | None:
    for arena in list(arenas.values()):
        off = address - arena.base
        if 0 <= off and off + nbytes <= arena.size:
            return arena, off
    return None


def locate(address: int, nbytes: int) -> tuple[_Arena, int] | None:
    """The live shared arena holding bytes [address, address + nbytes) and
    their offset in it, or None."""
    return _find(address, nbytes, _shared_arenas)


class _StagingPool:
    """At most ``slots`` arenas in use at once; free ones kept for reuse.

    ``release`` may be called from a garbage-collection finalizer (a staged
    state dict dropped unreleased), so at any point in any thread: a release
    that can't take the lock at once is queued and applied by the next
    caller, and waiters look at the queue while they wait."""

    def __init__(self, slots: int) -> None:
        self._slots = slots
        self._free: list[_Arena] = []
        self._busy = 0
        self._cond = threading.Condition(threading.Lock())
        self._deferred: collections.deque[_Arena | None] = collections.deque()

    def acquire(self, nbytes: int, shared: bool = False) -> _Arena:
        """An arena of at least nbytes (a shared one if ``shared``; a free
        shared one may serve a private staging), waiting while every slot
        is busy."""
        with self._cond:
            self._drain()
            while self._busy >= self._slots:
                self._cond.wait(0.05)
                self._drain()
            self._busy += 1
            # a shared arena serves a private staging too (one kind, preferred)
            fits = [a for a in self._free if a.size >= nbytes and (a.shared or not shared)]
            if fits:
                arena = min(fits, key=lambda a: (a.shared != shared, a.size))
                self._free.remove(arena)
                return arena
            if self._free:  # none fits this state: let the largest go
                self._free.remove(max(self._free, key=lambda a: a.size))
        try:
            return _Arena(nbytes, shared)
        except BaseException:
            self.release(None)
            raise

    def release(self, arena: _Arena | None) -> None:
        if not self._cond.acquire(blocking=False):
            self._deferred.append(arena)  # the lock's holder (or the next caller) applies it
            if self._cond.acquire(blocking=False):  # it may have been let go meanwhile
                try:
                    self._drain()
                finally:
                    self._cond.release()
            return
        try:
            self._release(arena)
            self._drain()
        finally:
            self._cond.release()

    def _drain(self) -> None:
        while self._deferred:
            self._release(self._deferred.popleft())

    def _release(self, arena: _Arena | None) -> None:
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


class _Release:
    """Gives one staging's arena back to the pool, once: called by
    ``StagedState.release`` (the save that used it has finished), or by the
    garbage collector when the staged values are gone unreleased (a stager's
    output dropped by its user)."""

    def __init__(self, arena: _Arena) -> None:
        self._box = {"arena": arena}

    def __call__(self) -> None:
        arena = self._box.pop("arena", None)  # atomic: released once
        if arena is not None:
            if arena.holder is self:
                arena.holder = None
            _pool.release(arena)


class StagedState:
    """A staged state dict and the arena it lives in (None when nothing
    needed one). ``release()`` gives the arena back; call it once, when the
    save that uses ``state_dict`` has finished. Without it the arena goes
    back when the staged values are garbage collected."""

    def __init__(self, state_dict: Any, release: Any = None) -> None:
        self.state_dict = state_dict
        self._release = release

    def release(self) -> None:
        if self._release is not None:
            self._release()


class ArenaCache:
    """One arena kept by one stager for all its stagings (outside the pool:
    ``BlockingAsyncStager(cache_staged_state_dict=True)``), grown when a
    state no longer fits. Each staging overwrites the last."""

    def __init__(self) -> None:
        self.arena: _Arena | None = None

    def get(self, nbytes: int, shared: bool) -> _Arena:
        if self.arena is None or self.arena.size < nbytes or self.arena.shared != shared:
            self.arena = None
            self.arena = _Arena(nbytes, shared)
        return self.arena


def _address(x: Any) -> int:
    if isinstance(x, np.ndarray):
        return int(x.__array_interface__["data"][0])
    return int(x.untyped_storage().data_ptr())


def release_staged(state_dict: Any) -> None:
    """Gives back the pooled arenas that state_dict's staged values live in
    (a no-op for values staged elsewhere): async_save calls it once its
    save of a stager's output has finished."""
    torch = sys.modules.get("torch")
    sources: list[Any] = []
    _collect(state_dict, torch, sources)
    done: set[int] = set()
    for src in sources:
        if _nbytes(src) == 0 or getattr(src, "is_cuda", False):
            continue
        found = _find(_address(src), _nbytes(src), _all_arenas)
        if found is not None and found[0].id not in done:
            done.add(found[0].id)
            holder = found[0].holder
            if holder is not None:
                holder()


def stage(state_dict: Any, *, shared: bool = False, pin_memory: bool = True,
          non_blocking: bool = True, after: dict[Any, Any] | None = None,
          cache: ArenaCache | None = None) -> StagedState:
    """A private host copy of state_dict: CPU and CUDA tensors, DTensor
    local shards and ndarrays are copied into an arena from the pool (or
    ``cache``'s); other values are deep-copied.

    ``shared``: the arena is shared memory another process can map.
    ``pin_memory``: with CUDA sources, the arena is page-locked and the
    copies run asynchronously (``non_blocking``), waited for once at the end.
    ``after``: device -> CUDA event recorded by the caller; the copies from
    that device then run on a side stream that waits for the event (staging
    in a background thread, after the work queued before it), else on the
    device's current stream."""
    from ..geometry import copy_region
    from ..io import _pool_for

    torch = sys.modules.get("torch")
    sources: list[Any] = []
    _collect(state_dict, torch, sources)
    offsets, total = [], 0
    for s in sources:
        offsets.append(total)
        total += -(-_nbytes(s) // _ALIGN) * _ALIGN
    arena: _Arena | None = None
    release: _Release | None = None
    if total and cache is not None:
        arena = cache.get(total, shared)
    elif total:
        arena = _pool.acquire(total, shared)
        release = _Release(arena)
        arena.holder = release
    try:
        threads = _pool_for(None, None)
        cuda = [s for s in sources if not isinstance(s, np.ndarray) and s.is_cuda]
        # CUDA sources: asynchronous copies into the page-locked arena,
        # after the kernels that wrote them, waited for once at the end
        async_d2h = (bool(cuda) and arena is not None and pin_memory and non_blocking
                     and arena.pin(torch))
        streams = {}
        for dev in {s.device for s in cuda}:
            if after is not None and dev in after:
                streams[dev] = _side_stream(torch, dev)
                streams[dev].wait_event(after[dev])
            else:
                streams[dev] = torch.cuda.current_stream(dev)
        # a view of the arena for this staging only: the staged values hold
        # it, and when they are all gone, the arena goes back to the pool (a
        # ctypes array: NumPy keeps the exporter of a buffer alive, and for a
        # memoryview that would be the arena's map itself)
        anchor = ((ctypes.c_uint8 * arena.size).from_buffer(arena._map)
                  if arena is not None else None)
        whole = np.frombuffer(anchor, dtype=np.uint8) if anchor is not None else None
        views = []
        for s, off in zip(sources, offsets):
            raw = whole[off : off + _nbytes(s)] if whole is not None else None
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
                    with torch.cuda.stream(streams[s.device]):
                        dst.copy_(s.detach(), non_blocking=async_d2h)
            elif dst.size if isinstance(dst, np.ndarray) else dst.numel():
                zeros = (0,) * s.ndim
                copy_region(dst, zeros, s, zeros, tuple(s.shape), pool=threads)
            views.append(dst)
        for stream in streams.values():
            stream.synchronize()
        staged = _build(state_dict, torch, iter(views))
    except BaseException:
        if release is not None:
            release()
        raise
    if release is not None:
        weakref.finalize(anchor, release).atexit = False
    return StagedState(staged, release)


_local = threading.local()


@contextlib.contextmanager
def sharing(wanted: bool) -> Iterator[None]:
    """Within the block, on this thread, stagers without a shared-memory
    option of their own (``BlockingAsyncStager``, FileSystemWriter) stage
    into shared memory when ``wanted``: async_save's PROCESS checkpointer
    then maps their output instead of copying it again."""
    was = getattr(_local, "shared", False)
    _local.shared = wanted
    try:
        yield
    finally:
        _local.shared = was


def shared_wanted() -> bool:
    return bool(getattr(_local, "shared", False))


_side_streams: dict[Any, Any] = {}


def _side_stream(torch: Any, device: Any) -> Any:
    """One staging stream per device, kept for the process."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


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
