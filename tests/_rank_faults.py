"""Faults injected into one rank of a save or a load, for the tests of what
the other ranks then see (test_rank_failures, test_sweep_dist_faults).

A :class:`Fault` names a kind, a victim rank and a phase; the storage
writer, planner, reader and Stateful below meet it there, on the victim
only. The phases, and where each one's fault happens:

* ``state_dict``: a save's Stateful ``state_dict()`` (before its first step).
* ``plan``: ``planner.create_local_plan`` on a rank other than the
  coordinator (rank 0); on the coordinator, ``create_global_plan``.
* ``stage``: async_save's staging, ``stage()`` of the storage writer (the
  stager async_save uses when given a FileSystemWriter), in the caller's
  thread before the background save starts.
* ``write``: the start of ``storage_writer.write_data``.
* ``finish``: the coordinator's ``storage_writer.finish``, before it
  publishes ``.metadata``. The other ranks run no finish: theirs is the end
  of their part of the write, right after their ``write_data`` has written
  its files and before its results go to the coordinator (the last thing
  they do before the coordinator's finish).
* ``read``: the start of ``storage_reader.read_data``.
* ``commit``: a load's Stateful ``load_state_dict`` (after the read).

The kinds: ``raise`` (an :class:`InjectedFault`), ``exit`` (SystemExit),
``os_exit``, ``sigkill``, ``stuck`` (blocks forever on an Event that never
fires; its heartbeat thread lives on), ``sleep`` (15 s, then carries on).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import shardstate.checkpoint as dcp
from shardstate.checkpoint.filesystem import FileSystemReader, FileSystemWriter

COORDINATOR = 0


class InjectedFault(Exception):
    """The ``raise`` kind's exception."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


@dataclass(frozen=True)
class Fault:
    kind: str
    victim: int
    phase: str

    def hit(self, phase: str) -> None:
        """Meets the fault if this is its phase and this rank its victim."""
        if phase != self.phase or _rank() != self.victim:
            return
        kind = self.kind
        if kind == "raise":
            raise InjectedFault(f"injected fault on rank {self.victim} in {phase}")
        if kind == "exit":
            raise SystemExit(7)
        if kind == "os_exit":
            os._exit(1)
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # not reached
        if kind == "stuck":
            threading.Event().wait()
        if kind == "sleep":
            time.sleep(15)
            return
        raise AssertionError(kind)


class FaultyWriter(FileSystemWriter):
    """Meets ``fault`` in the stage, write and finish phases."""

    def __init__(self, path: str, fault: Fault) -> None:
        super().__init__(path)
        self.fault = fault

    def stage(self, state_dict: Any) -> Any:
        self.fault.hit("stage")
        return super().stage(state_dict)

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.fault.hit("write")
        futures = super().write_data(plan, planner)
        if _rank() != COORDINATOR:
            futures.wait()  # this rank's files are written
            self.fault.hit("finish")
        return futures

    def finish(self, metadata: Any, results: Any) -> None:
        self.fault.hit("finish")
        super().finish(metadata=metadata, results=results)


class FaultyPlanner(dcp.DefaultSavePlanner):
    """Meets ``fault`` in the plan phase."""

    def __init__(self, fault: Fault) -> None:
        super().__init__()
        self.fault = fault

    def create_local_plan(self) -> Any:
        if _rank() != COORDINATOR:
            self.fault.hit("plan")
        return super().create_local_plan()

    def create_global_plan(self, all_plans: list) -> Any:
        self.fault.hit("plan")
        return super().create_global_plan(all_plans)


class FaultyReader(FileSystemReader):
    """Meets ``fault`` in the read phase (broadcasting shared reads, so a
    rank's read_data also waits in collectives for the others)."""

    def __init__(self, path: str, fault: Fault) -> None:
        super().__init__(path, broadcast_shared_reads=True)
        self.fault = fault

    def read_data(self, plan: Any, planner: Any) -> Any:
        self.fault.hit("read")
        return super().read_data(plan, planner)


class FaultyStateful(dcp.Stateful):
    """Meets ``fault`` in state_dict() (the state_dict phase) and in
    load_state_dict() (the commit phase)."""

    def __init__(self, fault: Fault) -> None:
        import torch

        self.fault = fault
        self.t = torch.zeros(4)

    def state_dict(self) -> dict:
        self.fault.hit("state_dict")
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.fault.hit("commit")
        self.t = sd["t"]


def state(rank: int) -> dict:
    """A small state with a replicated tensor, a value and a rank's own."""
    import torch

    return {"w": torch.arange(6, dtype=torch.float32) + rank, "step": 3,
            f"own{rank}": torch.full((3,), float(rank))}


def outcome(fn: Any) -> dict:
    """What a rank saw: the exception's type, failing ranks and text, and
    how long the call took."""
    t0 = time.monotonic()
    try:
        fn()
    except dcp.CheckpointException as e:
        return {"type": "CheckpointException", "ranks": sorted(e.failures), "text": str(e),
                "elapsed": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - reported to the test (SystemExit goes on)
        return {"type": type(e).__name__, "ranks": [], "text": str(e),
                "elapsed": time.monotonic() - t0}
    return {"type": None, "ranks": [], "text": "", "elapsed": time.monotonic() - t0}


SAVE_PHASES = ("state_dict", "plan", "stage", "write", "finish")
LOAD_PHASES = ("read", "commit")


def scenario(rank: int, world: int, root: str, fault: Fault, mode: str = "sync") -> dict:
    """One save (``mode``: sync or async; the stage phase is async_save's)
    or, for a load phase, a good save and then a load, with ``fault``."""
    import torch.distributed as dist

    path = os.path.join(root, "ckpt")
    sd = state(rank)
    sd["s"] = FaultyStateful(fault)
    if fault.phase in LOAD_PHASES:
        dcp.save(sd, checkpoint_id=path)
        dist.barrier()
        sd = state(rank)
        sd["s"] = FaultyStateful(fault)
        return outcome(lambda: dcp.load(sd, storage_reader=FaultyReader(path, fault)))
    writer = FaultyWriter(path, fault)
    planner = FaultyPlanner(fault)
    if mode == "sync" and fault.phase != "stage":
        return outcome(lambda: dcp.save(sd, storage_writer=writer, planner=planner))
    return outcome(lambda: dcp.async_save(sd, storage_writer=writer,
                                          planner=planner).result(timeout=120))


def survivors_failed(out: list, fault: Fault, bound: float, where: str = "") -> None:
    """Every rank but the victim raised CheckpointException naming the
    victim alone, within ``bound`` seconds of its call's start; ``where``
    prefixes each message (how to reproduce)."""
    for rank, got in enumerate(out):
        if rank == fault.victim:
            continue
        msg = f"{where}rank {rank} saw {got!r}"
        assert isinstance(got, dict), msg
        assert got["type"] == "CheckpointException", msg
        assert got["ranks"] == [fault.victim], msg
        assert f"rank {fault.victim}" in got["text"].lower(), msg
        assert got["elapsed"] < bound, msg
