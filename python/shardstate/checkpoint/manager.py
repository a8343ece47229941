"""``CheckpointManager``: one object per training run over a root of step
checkpoints (``_steps``' layout: ``ROOT/<step>/``), with Orbax's names where
they fit.

    mgr = CheckpointManager("/ckpt/run1", max_to_keep=3, save_interval_steps=100)
    start = mgr.restore(state) or 0          # the latest committed step, if any
    for step in range(start + 1, steps):
        train_step(...)
        mgr.save(step, state, metrics={"loss": loss})   # saves on the policy's steps
    mgr.close()

The root is a local directory or an fsspec URL: steps on an object store
are saved and loaded through ``FsspecWriter`` / ``FsspecReader``, and the
markers are objects put whole.

A step's life: rank 0 makes its directory with a pending marker
(``.shardstate-pending``); every rank saves into it (``async_save`` by
default, at most one save in flight); the save publishes ``.metadata``
last; then rank 0 writes the commit marker (``.shardstate-commit``, JSON:
step, time, metrics) atomically, and only then applies retention: only
committed steps that no rule keeps are removed, ``.metadata`` first. A
step of the manager's is visible (``all_steps``, ``latest_step``,
``restore``) only once committed; a complete checkpoint another writer left
in the root (torch's plain DCP save as ``step-100``, say) is visible too,
and never removed. At start, steps a crashed run left pending are reported
(a warning) and removed by rank 0 before any rank goes on.

Preemption: with ``preemption_signals`` (default SIGTERM), a signal sets a
flag; every ``save`` call has the ranks agree (one all-reduce on a private
gloo group) whether any rank got one, and if so every rank saves that step
synchronously, it is committed, and ``save`` raises SystemExit(128 +
signal) (``exit_on_preemption=False``: it returns and
``reached_preemption`` is True).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._steps import COMMIT_MARKER, PENDING_MARKER, Step, Store

__all__ = ["CheckpointManager"]

logger = logging.getLogger(__name__)


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class CheckpointManager:
    """Saves a run's state on a policy, keeps what the retention rules
    say, and restores the latest committed step at any world size.

    ``save_interval_steps``: save when ``step % N == 0`` (0 or None: never
    by step count); ``save_interval_seconds``: also save when T seconds
    have passed since the last save (rank 0's clock decides for all).
    Retention (applied after each commit; a committed step stays if any
    rule keeps it, and the latest always stays): ``max_to_keep`` the last
    K (None: all), ``keep_period`` every step divisible by M, ``best_fn``
    with ``best_mode`` ("max" or "min") and ``keep_best``: the K best by
    ``best_fn(metrics)`` (steps saved without metrics are not ranked).
    ``enable_async_checkpointing``: save through ``async_save`` (one save in
    flight; ``on_busy``: "wait" for it, or "skip" the new save, agreed by
    all ranks). ``process_group``: the group the saves and loads use.
    ``root`` is a local directory or an fsspec URL (``s3://bucket/run1``;
    ``storage_options``: fsspec's keyword arguments, as ``FsspecWriter``'s).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        max_to_keep: int | None = None,
        save_interval_steps: int | None = 1,
        save_interval_seconds: float | None = None,
        keep_period: int | None = None,
        best_fn: Callable[[dict[str, Any]], float] | None = None,
        best_mode: str = "max",
        keep_best: int | None = None,
        enable_async_checkpointing: bool = True,
        on_busy: str = "wait",
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        exit_on_preemption: bool = True,
        process_group: Any = None,
    ) -> None:
        for name, v in (("max_to_keep", max_to_keep), ("keep_period", keep_period),
                        ("keep_best", keep_best), ("save_interval_steps", save_interval_steps)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {v!r}")
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
        if on_busy not in ("wait", "skip"):
            raise ValueError(f"on_busy must be 'wait' or 'skip', got {on_busy!r}")
        if keep_best is not None and best_fn is None:
            raise ValueError("keep_best needs best_fn")
        self._store = Store(root, storage_options)
        self.root = self._store.root
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.save_interval_seconds = save_interval_seconds
        self.keep_period = keep_period
        self.best_fn, self.best_mode, self.keep_best = best_fn, best_mode, keep_best
        self.async_save = enable_async_checkpointing
        self.on_busy = on_busy
        self.exit_on_preemption = exit_on_preemption
        self.process_group = process_group
        self.reached_preemption = False
        self._lock = threading.Lock()
        # (step, future, committed-or-failed event) of the save in flight
        self._pending: tuple[int, Any, threading.Event] | None = None
        self._error: BaseException | None = None  # from a background commit
        self._last_save = time.monotonic()
        self._signal: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self._vote_group: Any = None
        d = _dist()
        self._rank = d.get_rank(process_group) if d else 0
        self._world = d.get_world_size(process_group) if d else 1
        if d and self._world > 1:
            # agreement on one flag, on the CPU whatever the main backend
            self._vote_group = d.new_group(
                ranks=None if process_group is None else d.get_process_group_ranks(process_group),
                backend="gloo")
        if threading.current_thread() is threading.main_thread():
            for sig in preemption_signals:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        elif preemption_signals:
            warnings.warn("CheckpointManager: not made in the main thread, so it cannot "
                          "install its preemption signal handlers", stacklevel=2)
        if self._rank == 0:
            self._store.makedirs(self.root)
            self._remove_crashed()
        self._barrier()

    # -- the steps ----------------------------------------------------------

    def _step_dir(self, step: int) -> Path | str:
        return self._store.step_path(step)

    def _committed(self) -> list[Step]:
        return [s for s in self._store.steps(sizes=False) if s.state == "committed"]

    def all_steps(self) -> list[int]:
        """The steps there are to restore, ascending: the committed ones,
        and complete checkpoints of other writers in the root's layout
        (torch's or shardstate's plain DCP saves, e.g. ``step-100``)."""
        self._raise_error()
        return [s.step for s in self._store.steps(sizes=False) if s.loadable]

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with a committed step (None: none given)."""
        try:
            info = json.loads(self._store.read(self._store.join(self._step_dir(step),
                                                                COMMIT_MARKER)))
        except (OSError, ValueError):
            return None
        m = info.get("metrics") if isinstance(info, dict) else None
        return m if isinstance(m, dict) else None

    def _remove_crashed(self) -> None:
        for s in self._store.steps(sizes=False):
            if s.state != "committed" and self._store.exists(
                    self._store.join(s.path, PENDING_MARKER)):
                warnings.warn(f"CheckpointManager: step {s.step} in {self.root} was left "
                              f"incomplete by an earlier run ({s.state}); removing it",
                              stacklevel=3)
                self._store.remove(s)

    # -- saving -------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether the policy saves ``step`` (the same answer on every rank)."""
        n = self.save_interval_steps
        by_steps = bool(n) and step % n == 0
        by_time = False
        if self.save_interval_seconds is not None:
            by_time = time.monotonic() - self._last_save >= self.save_interval_seconds
            by_time = self._vote(by_time, rank0=True)
        return by_steps or by_time

    def save(self, step: int, state: Any, *, metrics: dict[str, Any] | None = None,
             force: bool = False) -> bool:
        """Saves ``state`` as ``step`` when the policy (or ``force``) says
        so; returns whether a save was started. Every rank must call it
        with the same step. A step at or below the latest one (``all_steps``)
        is refused (ValueError)."""
        self._raise_error()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        preempted = self._vote(self._signal is not None) if self._old_handlers else False
        if not (force or preempted or self.should_save(step)):
            return False
        if self._pending is not None:
            busy = self._vote(not self._pending[2].is_set()) if self.on_busy == "skip" else False
            if busy and not preempted:
                logger.info("CheckpointManager: step %d skipped, step %d still saving", step,
                            self._pending[0])
                return False
            self.wait()
        latest = self.latest_step()
        if latest is not None and step <= latest:
            if preempted:  # this step is committed already
                self._preempted()
                return True
            raise ValueError(f"step {step} is not after the latest step {latest} of {self.root}")
        self._start(step, state, metrics, sync=preempted or not self.async_save)
        if preempted:
            self._preempted()
        return True

    def _start(self, step: int, state: Any, metrics: dict[str, Any] | None, sync: bool) -> None:
        from . import async_save, save

        store = self._store
        path = self._step_dir(step)
        pending = store.join(path, PENDING_MARKER)
        err: BaseException | None = None
        if store.exists(path) and not store.exists(pending):
            err = FileExistsError(f"{path} exists and is not a step this manager left "
                                  "pending; not overwriting it")
        # every rank looks before rank 0 makes the directory
        self._agree(err, f"checking step {step}'s directory")
        if self._rank == 0:
            try:
                if store.exists(path):  # a pending leftover of this step
                    store.remove(Step(step, path, "incomplete", 0))
                store.makedirs(path)
                store.publish(pending, b"")
            except OSError as e:
                err = e
        self._agree(err, f"preparing step {step}")
        self._last_save = time.monotonic()
        if sync:
            save(state, checkpoint_id=path, storage_writer=self._writer(path),
                 process_group=self.process_group)
            err = None
            if self._rank == 0:
                try:
                    self._commit(step, metrics)
                except OSError as e:
                    err = e
            self._agree(err, f"committing step {step}")
            return
        fut = async_save(state, checkpoint_id=path, storage_writer=self._writer(path),
                         process_group=self.process_group)
        done = threading.Event()
        self._pending = (step, fut, done)
        fut.add_done_callback(lambda f: self._finish_async(f, step, metrics, done))

    def _finish_async(self, fut: Any, step: int, metrics: dict[str, Any] | None,
                      done: threading.Event) -> None:
        """In the saving thread, when the save is over: rank 0 commits."""
        try:
            if fut.exception() is None and self._rank == 0:
                self._commit(step, metrics)
        except BaseException as e:  # raised by the manager's next call
            with self._lock:
                self._error = e
        finally:
            done.set()

    def _commit(self, step: int, metrics: dict[str, Any] | None) -> None:
        """Rank 0, after the step's .metadata is published: the commit
        marker, then retention."""
        store = self._store
        path = self._step_dir(step)
        info = {"step": step, "time": time.time(), "metrics": metrics}
        store.publish(store.join(path, COMMIT_MARKER), json.dumps(info, default=str).encode())
        store.unlink(store.join(path, PENDING_MARKER))
        with self._lock:
            self._retain()

    def _retain(self) -> None:
        committed = self._committed()
        if not committed:
            return
        keep = {committed[-1].step}
        if self.max_to_keep is None:
            keep |= {s.step for s in committed}
        elif self.max_to_keep:
            keep |= {s.step for s in committed[-self.max_to_keep:]}
        if self.keep_period:
            keep |= {s.step for s in committed if s.step % self.keep_period == 0}
        if self.best_fn is not None and self.keep_best:
            ranked = []
            for s in committed:
                m = self.metrics(s.step)
                if m is None:
                    continue
                v = float(self.best_fn(m))
                if not math.isnan(v):
                    ranked.append((v if self.best_mode == "max" else -v, s.step))
            keep |= {st for _v, st in sorted(ranked, reverse=True)[: self.keep_best]}
        for s in committed:
            if s.step not in keep:
                self._store.remove(s)

    def wait(self) -> None:
        """Waits for the save in flight and its commit; raises its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            self._raise_error()
            return
        step, fut, done = pending
        err: BaseException | None = None
        try:
            fut.result()
        except BaseException as e:
            err = e
        done.wait()
        with self._lock:
            err, self._error = err or self._error, None
        # rank 0's commit is over before any rank goes on; a failure anywhere fails all
        self._agree(err, f"saving step {step}")

    # Orbax's name
    wait_until_finished = wait

    def _raise_error(self) -> None:
        with self._lock:
            e, self._error = self._error, None
        if e is not None:
            raise e

    def _writer(self, path: Path | str) -> Any:
        """The storage writer of a step: the default one for the path
        (``None``), or an ``FsspecWriter`` with the manager's
        ``storage_options``."""
        if not (self._store.remote and self._store.storage_options):
            return None
        from ._fsspec_filesystem import FsspecWriter

        return FsspecWriter(path, **self._store.storage_options)

    def _reader(self, path: Path | str) -> Any:
        if not (self._store.remote and self._store.storage_options):
            return None
        from ._fsspec_filesystem import FsspecReader

        return FsspecReader(path, **self._store.storage_options)

    # -- restoring ----------------------------------------------------------

    def restore(self, state: Any, step: int | None = None) -> int | None:
        """Loads ``step`` (default: the latest in ``all_steps``) into
        ``state`` in place, at any world size; returns the step, or None
        when there is none to restore."""
        from . import load

        self.wait()
        steps = [s for s in self._store.steps(sizes=False) if s.loadable]
        if step is not None:
            steps = [s for s in steps if s.step == step]
            if not steps:
                raise FileNotFoundError(f"step {step} is not a step of {self.root} "
                                        "to restore (committed or complete)")
        if not steps:
            return None
        # of one step under two names (``7`` and ``step-7``), the committed one
        found = max((s for s in steps if s.step == steps[-1].step),
                    key=lambda s: s.state == "committed")
        load(state, checkpoint_id=found.path, storage_reader=self._reader(found.path),
             process_group=self.process_group)
        return found.step

    # -- agreement and signals ----------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal = signum

    def _vote(self, flag: bool, rank0: bool = False) -> bool:
        """``flag`` agreed by every rank: any rank's (rank0: rank 0's)."""
        if self._vote_group is None:
            return flag
        import torch

        d = _dist()
        t = torch.tensor([int(flag)], dtype=torch.int32)
        if rank0:
            d.broadcast(t, group=self._vote_group,
                        src=d.get_global_rank(self._vote_group, 0))
        else:
            d.all_reduce(t, op=d.ReduceOp.MAX, group=self._vote_group)
        return bool(t.item())

    def _agree(self, err: BaseException | None, what: str) -> None:
        """Every rank's outcome of a step: raises ``err`` where it happened
        and a RuntimeError on the other ranks when any rank failed."""
        if self._vote(err is not None) or err is not None:
            if err is not None:
                raise err
            raise RuntimeError(f"CheckpointManager: {what} failed on another rank")

    def _barrier(self) -> None:
        d = _dist()
        if d is not None and self._world > 1:
            d.barrier(group=self._vote_group if self._vote_group is not None
                      else self.process_group)

    def _preempted(self) -> None:
        self.reached_preemption = True
        sig = self._signal if self._signal is not None else signal.SIGTERM
        logger.warning("CheckpointManager: preempted (signal %d): final step saved", sig)
        if self.exit_on_preemption:
            self.close()
            raise SystemExit(128 + int(sig))

    def close(self) -> None:
        """Waits for the save in flight, restores the signal handlers."""
        try:
            self.wait()
        finally:
            for sig, old in self._old_handlers.items():
                try:
                    signal.signal(sig, old)
                except (ValueError, TypeError):
                    pass
            self._old_handlers = {}

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
