"""Cross-rank steps that never leave a rank waiting for a failed one.

``_Coordinator`` wraps a torch.distributed group (or no group at all, for a
single process; then torch is never imported). Each step runs a function on
every rank and exchanges the results with object collectives; an exception
on any rank is caught, carried to the coordinator, and re-raised on *every*
rank as one :class:`CheckpointException` naming the failing ranks and their
causes. Because every rank always reaches the same collective, a failure
can't strand the others in a collective that never completes.

A rank that dies (SystemExit leaving the call, ``os._exit``, a signal) never
reaches it: on a group of 2+ ranks every collective here is a bounded wait
(``_liveness``) that tells a dead peer from a slow one by its heartbeat, and
every survivor raises CheckpointException naming the rank that is gone.
``session()`` marks one checkpoint call (save, load).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

from .._util import import_torch
from ._liveness import Guard, is_shared
from .api import CheckpointException, _get_failure_dict, _wrap_exception

T = TypeVar("T")
R = TypeVar("R")


def dist_ready() -> bool:
    """True when torch.distributed is importable and initialised."""
    import sys

    if "torch" not in sys.modules:
        # A process that never imported torch cannot have a process group.
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


class _Coordinator:
    def __init__(self, group: Any, use_dist: bool, coordinator_rank: int = 0):
        self.group = group
        self.use_dist = use_dist
        self.coordinator_rank = coordinator_rank
        if use_dist:
            import torch.distributed as dist

            self._dist = dist
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.global_coordinator_rank = (
                dist.get_global_rank(group, coordinator_rank) if group is not None
                else coordinator_rank)
        else:
            self.rank = 0
            self.world_size = 1
            self.global_coordinator_rank = 0
        self.is_coordinator = self.rank == coordinator_rank
        self._step = "collective"  # the step the next collective belongs to
        self._guard: Guard | None = None
        self._guarded = False  # whether _guard has been made (it may be None)

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world_size

    # ---- liveness (a group of 2+ ranks)

    def _liveness(self) -> Guard | None:
        if not self._guarded:
            self._guarded = True
            if self.use_dist and self.world_size > 1:
                self._guard = Guard.make(self._dist, self.group, self.rank,
                                         self.coordinator_rank)
        return self._guard

    def session(self) -> contextlib.AbstractContextManager[None]:
        """``with coord.session():`` one checkpoint call, from before its
        first step to after its last (re-entrant)."""
        guard = self._liveness()
        return contextlib.nullcontext() if guard is None else guard.session()

    def _wait(self, fn: Callable[[], T]) -> T:
        """A collective of this group, as a bounded wait where there are peers."""
        guard = self._liveness()
        return fn() if guard is None else guard.run(self._step, fn)

    # ---- object collectives (no-ops without a group)

    def gather_object(self, obj: T) -> list[T] | None:
        if not self.use_dist:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        self._wait(lambda: self._dist.gather_object(obj, out, dst=self.global_coordinator_rank,
                                                    group=self.group))
        return out

    def scatter_object(self, objs: list[T] | None) -> T:
        if not self.use_dist:
            assert objs is not None
            return objs[0]
        out: list[Any] = [None]
        self._wait(lambda: self._dist.scatter_object_list(
            out, objs if self.is_coordinator else None, src=self.global_coordinator_rank,
            group=self.group))
        return out[0]

    def broadcast_object(self, obj: T | None) -> T:
        if not self.use_dist:
            return obj  # type: ignore[return-value]
        box = [obj]
        self._wait(lambda: self._dist.broadcast_object_list(
            box, src=self.global_coordinator_rank, group=self.group))
        return box[0]  # type: ignore[return-value]

    def all_gather_object(self, obj: T) -> list[T]:
        if not self.use_dist:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._wait(lambda: self._dist.all_gather_object(out, obj, group=self.group))
        return out

    def barrier(self) -> None:
        if self.use_dist:
            self._wait(lambda: self._dist.barrier(group=self.group))

    # ---- bulk transport for load-once-broadcast (the reader's exchange)

    def any_failed(self, failed: bool) -> bool:
        """Whether any rank passed True (every rank must call it)."""
        if not self.use_dist:
            return failed

        def reduce() -> bool:
            torch = import_torch()
            flag = torch.tensor([1 if failed else 0], dtype=torch.int64,
                                device=self._transport_device())
            self._dist.all_reduce(flag, group=self.group)
            return int(flag.item()) > 0

        return self._wait(reduce)

    def broadcast_bytes(self, buf: Any, src: int) -> None:
        """Broadcasts a contiguous uint8 NumPy buffer, in place, from group
        rank ``src`` (every rank passes a buffer of the same size). The one
        place the load's bulk bytes cross ranks, through shardstate.comm:
        gloo sends host memory as is; an NCCL group needs device memory, so
        the bytes are staged through the current CUDA device and sent over
        shardstate's NCCL communicator (torch's, where that is off)."""
        if not self.use_dist or buf.nbytes == 0:
            return
        from .. import comm

        def send() -> None:
            t = import_torch().from_numpy(buf)
            dev = self._transport_device()
            if dev == "cpu":
                comm.broadcast(t, src, self.group)
                return
            staged = t.to(dev)
            comm.broadcast(staged, src, self.group)
            t.copy_(staged.cpu())

        self._wait(send)

    def _transport_device(self) -> Any:
        backend = str(self._dist.get_backend(self.group))
        if backend == "nccl":
            torch = import_torch()
            return torch.device("cuda", torch.cuda.current_device())
        return "cpu"

    # ---- failure-safe steps

    @staticmethod
    def _run(fn: Callable[[], T]) -> Any:
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 - carried to every rank
            if is_shared(e):
                raise  # a peer is gone: every rank knows already
            return _wrap_exception(e)

    def reduce_scatter(self, step: str, map_fun: Callable[[], T],
                       reduce_fun: Callable[[list[T]], list[R]]) -> R:
        """map_fun on every rank; reduce_fun on the coordinator over all
        results; rank i receives element i of its output."""
        self._step = step
        gathered = self.gather_object(self._run(map_fun))
        outputs: list[Any] | None = None
        if self.is_coordinator:
            assert gathered is not None
            failures = _get_failure_dict(gathered)
            if not failures:
                reduced = self._run(lambda: reduce_fun(gathered))
                if _get_failure_dict([reduced]):
                    failures[self.rank] = reduced
                elif isinstance(reduced, list) and len(reduced) == self.world_size:
                    outputs = reduced
                else:
                    failures[self.rank] = _wrap_exception(ValueError(
                        f"{step}: the global step returned {type(reduced).__name__} "
                        f"instead of a list of {self.world_size} plans"))
            if failures:
                outputs = [CheckpointException(step, failures)] * self.world_size
        result = self.scatter_object(outputs)
        if isinstance(result, CheckpointException):
            raise result
        return result

    def all_reduce(self, step: str, map_fun: Callable[[], T],
                   reduce_fun: Callable[[list[T]], R]) -> R:
        """map_fun on every rank; reduce_fun on the coordinator; its result
        broadcast to every rank."""
        self._step = step
        gathered = self.gather_object(self._run(map_fun))
        result: Any = None
        if self.is_coordinator:
            assert gathered is not None
            failures = _get_failure_dict(gathered)
            if not failures:
                result = self._run(lambda: reduce_fun(gathered))
                if _get_failure_dict([result]):
                    failures[self.rank] = result
            if failures:
                result = CheckpointException(step, failures)
        result = self.broadcast_object(result)
        if isinstance(result, CheckpointException):
            raise result
        return result

    def all_gather(self, step: str, map_fun: Callable[[], T]) -> list[T]:
        """map_fun on every rank; every rank gets all results."""
        self._step = step
        results = self.all_gather_object(self._run(map_fun))
        failures = _get_failure_dict(results)
        if failures:
            raise CheckpointException(step, failures)
        return results

    def broadcast(self, step: str, map_fun: Callable[[], T]) -> T:
        """map_fun on the coordinator; its result on every rank."""
        self._step = step
        result: Any = None
        if self.is_coordinator:
            result = self._run(map_fun)
            if _get_failure_dict([result]):
                result = CheckpointException(step, {self.rank: result})
        result = self.broadcast_object(result)
        if isinstance(result, CheckpointException):
            raise result
        return result

    def agree(self, step: str, fn: Callable[[], None]) -> None:
        """fn() on every rank, then one small all-reduce: when it raised on
        any rank, every rank raises one CheckpointException naming each
        failing rank (what runs after a call's last step, such as a
        Stateful's load_state_dict, would otherwise fail on that rank
        alone). Without a group, fn's exception is raised as it is."""
        if not self.use_dist:
            fn()
            return
        self._step = step
        error = None
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - carried to every rank
            if is_shared(e):
                raise
            error = _wrap_exception(e)
        if self.any_failed(error is not None):
            raise CheckpointException(step, _get_failure_dict(self.all_gather_object(error)))
