"""Bounded waits in a checkpoint call's collective steps: a rank that dies
does not leave the others blocked until the group's timeout.

A collective on a group whose member is gone either fails at once on some
ranks (gloo: "Connection closed by peer", which names no rank) or blocks
until the group's timeout (30 min by default) on the others. Here:

* **Heartbeat.** A process taking part in a checkpoint call on a group of
  2+ ranks keeps one key on the default group's store,
  ``shardstate/alive/<global rank>``, counted up every ``_BEAT`` seconds by
  one daemon thread, from its first such call until it exits.
* **Bounded waits.** ``Guard.run`` runs a collective in a helper thread and
  waits for it in slices of ``_TICK``. A step that ends within the first
  slice touches the store not at all. After it, each slice the waiter looks
  at the call's note (below), and at heartbeats: the coordinator at every
  rank's, the others at the coordinator's (and at everyone's once they have
  waited ``_WATCH_ALL_AFTER``). A peer whose count has not moved for
  ``_dead_after()`` seconds (``SHARDSTATE_DEAD_RANK_S``, default 10) is
  gone; a slow peer that is alive (writing for minutes) keeps beating and
  is waited for. A collective that fails with a RuntimeError (gloo's lost
  connection) is followed by up to that limit plus ``2 * _BEAT`` seconds
  of looking, to name the rank.
* **A rank stuck alive.** A rank that never arrives at a step but keeps
  beating (blocked forever in a planner, a stager, a ``load_state_dict``)
  is not gone; nor is a slow one, and the two can't be told apart by
  looking. The rule: a live rank is waited for as long as the process
  group's own timeout (``init_process_group(timeout=)``; async_save's
  private group gets the same) allows for one collective, and no longer.
  When a collective fails after waiting that long, the ranks that never
  arrived at it are named: each waiter that passes its first slice marks
  ``shardstate/arrive/<group>/<call>`` + ``/<rank>`` with its collective's
  index in the call, and on the timeout a rank whose mark is missing or
  lower is one the others waited for in vain (one that arrived within the
  last slice may be named with it). A rank slow for minutes
  inside a step (writing) delays the others' next collective by as long,
  and is waited for: set the group's timeout above the longest step.
* **Notes.** ``shardstate/note/<group>/<call>``: the first rank to know why
  a call cannot finish (a peer gone or stuck, its own collective failed, or
  a SystemExit / KeyboardInterrupt leaving the call) writes the failures
  there, so every other waiter raises the same CheckpointException within
  a slice; a rank that reaches its own verdict after the note was written
  raises the note's. Calls are numbered per group by ``Guard.session``, and
  collectives within a call by ``Guard.run``; every rank of a group makes
  the same calls and collectives in the same order.

Cost on the normal path: a hand-off to a helper thread per collective (one
thread per calling thread, reused); one store op at a process's first
call; nothing per item. A collective that outlasts its first slice costs
one more store op (its arrival mark). A rank that is declared gone
leaves its collective running in the helper thread (until the group's own
timeout); the group is unusable by then anyway.

Thread safety: a Guard belongs to one coordinator, used by one thread at a
time; the heartbeat registry and the call counters have their own lock.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from .api import CheckpointException, _wrap_exception

T = TypeVar("T")

_BEAT = 1.0  # seconds between a process's heartbeats


def _dead_after() -> float:
    """A heartbeat that has not moved for this long: the rank is gone. Long
    enough that a live rank whose Python threads are held off by a long
    GIL-holding call is not taken for dead; SHARDSTATE_DEAD_RANK_S sets it
    (read at each use: a process forked from one that imported this module
    earlier sees its own environment)."""
    return float(os.environ.get("SHARDSTATE_DEAD_RANK_S", "10"))

_TICK = 0.5  # a waiter looks at notes and heartbeats this often
_WATCH_ALL_AFTER = 15.0  # a non-coordinator then watches every rank, not just the coordinator
_PREFIX = "shardstate"

_lock = threading.Lock()
_calls: dict[str, int] = {}  # group name -> checkpoint calls made on it


class _Heartbeat:
    """The process's one beating thread, over every (store, key) it was given."""

    def __init__(self) -> None:
        self._targets: dict[tuple[int, str], Any] = {}
        self._thread: threading.Thread | None = None

    def beat_on(self, store: Any, key: str) -> None:
        with _lock:
            if (id(store), key) in self._targets:
                return
        store.add(key, 1)  # at once: a peer may be waiting for this rank already
        with _lock:
            self._targets[(id(store), key)] = store
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shardstate-heartbeat",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(_BEAT)
            with _lock:
                targets = list(self._targets.items())
            for (sid, key), store in targets:
                try:
                    store.add(key, 1)
                except Exception:  # noqa: BLE001 - the store is gone: stop beating on it
                    with _lock:
                        self._targets.pop((sid, key), None)


_HEART = _Heartbeat()


def shared(e: CheckpointException) -> CheckpointException:
    """Marks a CheckpointException that every surviving rank raises by
    itself (a peer gone, a note): a step passes it on as it is, rather than
    carrying it to the others as this rank's failure."""
    e._shared = True
    return e


def is_shared(e: BaseException) -> bool:
    return getattr(e, "_shared", False) is True


class _Worker:
    """The helper thread running one calling thread's collectives, one at a
    time. It ends once that thread no longer holds it (the thread ended, or
    abandoned it in a collective that will not complete), after its job."""

    def __init__(self) -> None:
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs = jobs
        threading.Thread(target=_serve, args=(jobs,), name="shardstate-collective",
                         daemon=True).start()
        weakref.finalize(self, jobs.put, None)

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job()
        del job


_local = threading.local()


def _worker() -> _Worker:
    w = getattr(_local, "worker", None)
    if w is None:
        w = _local.worker = _Worker()
    return w


def _abandon() -> None:
    _local.worker = None


def _device_setter() -> Callable[[], None]:
    """The caller's current CUDA device, for the helper thread (torch's
    current device is per thread; object collectives on NCCL use it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return lambda: None
    index = torch.cuda.current_device()
    return lambda: torch.cuda.set_device(index)


def group_timeout(dist: Any, group: Any) -> float | None:
    """The process group's own timeout for a collective, in seconds (None
    where the backend does not say)."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        for device in pg._device_types:
            return float(pg._get_backend(device).options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - a backend without options: unknown
        pass
    return None


class Guard:
    """Liveness of one coordinator's group (2+ ranks): bounded waits,
    heartbeats and notes. ``make`` returns None where the group's store
    can't be used (then waits are plain, as before)."""

    def __init__(self, dist: Any, group: Any, rank: int, coordinator_rank: int) -> None:
        c10d = dist.distributed_c10d
        self.store = c10d._get_default_store()
        self.ranks = (list(dist.get_process_group_ranks(group)) if group is not None
                      else list(range(dist.get_world_size())))
        self.group_name = c10d._get_process_group_name(group if group is not None
                                                       else c10d._get_default_group())
        self.rank = rank
        self.coordinator_rank = coordinator_rank
        self._note: str | None = None  # the current call's note key
        self._arrive: str | None = None  # the current call's arrival marks' prefix
        self._seq = 0  # the next collective's index in the current call
        self._limit = group_timeout(dist, group)
        self._depth = 0
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (count, since)
        self._present: set[int] = set()  # ranks whose heartbeat key exists
        _HEART.beat_on(self.store, self._alive_key(rank))

    @classmethod
    def make(cls, dist: Any, group: Any, rank: int, coordinator_rank: int) -> Guard | None:
        try:
            return cls(dist, group, rank, coordinator_rank)
        except Exception:  # noqa: BLE001 - a group without a usable store: plain waits
            return None

    def _alive_key(self, rank: int) -> str:
        return f"{_PREFIX}/alive/{self.ranks[rank]}"

    # ---- a checkpoint call

    def session(self) -> _Session:
        return _Session(self)

    def _enter(self) -> None:
        self._depth += 1
        if self._depth == 1:
            with _lock:
                n = _calls.get(self.group_name, 0)
                _calls[self.group_name] = n + 1
            self._note = f"{_PREFIX}/note/{self.group_name}/{n}"
            self._arrive = f"{_PREFIX}/arrive/{self.group_name}/{n}/"
            self._seq = 0

    def _exit(self, exc: BaseException | None) -> None:
        self._depth -= 1
        if self._depth:
            return
        if exc is not None and not isinstance(exc, (Exception, CheckpointException)):
            # SystemExit, KeyboardInterrupt: this rank leaves the call, and
            # tells those that may wait for it
            self._publish("checkpoint", {self.rank: _wrap_exception(exc)})
        self._note = self._arrive = None

    # ---- waits

    def run(self, step: str, fn: Callable[[], T]) -> T:
        """fn() (a collective) in a helper thread; returns its result, or
        raises CheckpointException when a peer is gone or another rank's
        note says the call failed."""
        box: dict[str, Any] = {}
        done = threading.Event()
        set_device = _device_setter()
        seq = self._seq
        self._seq += 1

        def work() -> None:
            try:
                set_device()
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                box["error"] = e
            finally:
                done.set()

        start = time.monotonic()
        _worker().submit(work)
        try:
            if not done.wait(_TICK):
                self._seen.clear()
                self._mark(seq)
                while not done.wait(_TICK):
                    waited = time.monotonic() - start
                    self._look(step, all_ranks=self.rank == self.coordinator_rank
                               or waited >= _WATCH_ALL_AFTER)
        except BaseException:
            _abandon()  # its thread stays in the collective; the next gets a new one
            raise
        if "error" in box:
            self._failed(step, seq, box["error"], time.monotonic() - start)
        return box["value"]

    def _failed(self, step: str, seq: int, error: BaseException, waited: float) -> None:
        """The collective raised: after a wait as long as the group's
        timeout, name the ranks that never arrived; else name a peer that is
        gone if there is one (a lost connection comes first, the heartbeat
        stops after); else report this rank's error."""
        if isinstance(error, RuntimeError):
            self._mark(seq)
            if self._limit is not None and waited >= self._limit:
                self._look(step, all_ranks=True)  # a note, or a peer gone, comes first
                absent = self._absent(seq)
                if absent:
                    raise self._verdict(step, {r: _wrap_exception(RuntimeError(
                        f"rank {r}{self._global(r)} never arrived at step '{step}' while the "
                        f"others waited there for the process group's timeout "
                        f"({self._limit:g} s): it is stuck, or slower than that timeout "
                        f"allows")) for r in absent}) from error
            self._seen.clear()
            deadline = time.monotonic() + _dead_after() + 2 * _BEAT
            while True:
                self._look(step, all_ranks=True)
                if time.monotonic() >= deadline:
                    break
                time.sleep(_TICK)
        raise self._verdict(step, {self.rank: _wrap_exception(error)}) from error

    def _look(self, step: str, all_ranks: bool) -> None:
        """Raises CheckpointException if the call has a note, or a watched
        peer's heartbeat has stopped."""
        store = self.store
        try:
            if self._note is not None and store.check([self._note]):
                noted_step, failures = pickle.loads(store.get(self._note))
                raise shared(CheckpointException(noted_step, failures))
            others = [r for r in range(len(self.ranks)) if r != self.rank]
            if not all_ranks:
                others = [r for r in others if r == self.coordinator_rank]
            gone = self._stopped(others)
        except CheckpointException:
            raise
        except Exception as e:  # noqa: BLE001 - the store is unreachable
            raise shared(CheckpointException(step, {self.rank: _wrap_exception(RuntimeError(
                f"rank {self.rank} cannot reach the process group's store to tell whether "
                f"its peers are alive: {type(e).__name__}: {e}"))})) from e
        if gone:
            raise self._verdict(step, {r: _wrap_exception(RuntimeError(
                f"rank {r}{self._global(r)} is gone: no heartbeat for {secs:.0f} s while step "
                f"'{step}' waited for it (it died, was killed, or stopped running)"))
                for r, secs in sorted(gone.items())})

    def _stopped(self, ranks: list[int]) -> dict[int, float]:
        """Ranks whose heartbeat has not moved for _dead_after() seconds of
        this waiter's looking -> for how long. A rank without a heartbeat
        key yet (not at its first call) is not judged."""
        unknown = [r for r in ranks if r not in self._present]
        if unknown:
            keys = [self._alive_key(r) for r in unknown]
            if self.store.check(keys):
                self._present.update(unknown)
            else:
                self._present.update(r for r, k in zip(unknown, keys) if self.store.check([k]))
        ranks = [r for r in ranks if r in self._present]
        if not ranks:
            return {}
        counts = self.store.multi_get([self._alive_key(r) for r in ranks])
        now = time.monotonic()
        limit = _dead_after()
        gone = {}
        for r, count in zip(ranks, counts):
            old = self._seen.get(r)
            if old is None or old[0] != count:
                self._seen[r] = (count, now)
            elif now - old[1] >= limit:
                gone[r] = now - old[1]
        return gone

    def _global(self, rank: int) -> str:
        g = self.ranks[rank]
        return "" if g == rank else f" (global rank {g})"

    def _mark(self, seq: int) -> None:
        """This rank has arrived at the call's collective ``seq`` (written
        once a wait outlasts its first slice)."""
        if self._arrive is None:
            return
        try:
            self.store.set(self._arrive + str(self.rank), str(seq))
        except Exception:  # noqa: BLE001 - best effort: then this rank may be named
            pass

    def _absent(self, seq: int) -> list[int]:
        """The peers that have not arrived at the call's collective ``seq``
        (nor at a later one)."""
        if self._arrive is None:
            return []
        absent = []
        try:
            for r in range(len(self.ranks)):
                key = self._arrive + str(r)
                if r != self.rank and (not self.store.check([key])
                                       or int(self.store.get(key)) < seq):
                    absent.append(r)
        except Exception:  # noqa: BLE001 - the store is unreachable: nobody is named
            return []
        return absent

    def _verdict(self, step: str, failures: dict[int, Any]) -> CheckpointException:
        """The call's outcome: its note if another rank wrote one first,
        else ``failures``, published as the note."""
        standing = self._publish(step, failures)
        if standing is not None:
            step, failures = standing
        return shared(CheckpointException(step, failures))

    def _publish(self, step: str, failures: dict[int, Any]) -> tuple[str, Any] | None:
        """The call's note, unless there is one already (the first cause
        stands); returns the note that stands (None if unknown)."""
        if self._note is None:
            return None
        try:
            return pickle.loads(self.store.compare_set(self._note, "",
                                                       pickle.dumps((step, failures))))
        except Exception:  # noqa: BLE001 - best effort: the others still watch heartbeats
            return None


class _Session:
    """``with guard.session():`` one checkpoint call (re-entrant)."""

    def __init__(self, guard: Guard) -> None:
        self._guard = guard

    def __enter__(self) -> None:
        self._guard._enter()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._guard._exit(exc)
