"""A rank that dies or fails alone, at world 3 (issue 15, cases 3 and 4).

* A rank that dies inside a save or a load (SystemExit, ``os._exit``,
  SIGKILL) does not leave the others blocked until gloo's timeout: every
  survivor raises CheckpointException naming it within seconds.
* A rank that is slow but alive (15 s in ``write_data``) is waited for.
* A load whose Stateful ``load_state_dict`` raises on one rank raises
  CheckpointException on every rank.

Each run's group timeout (gloo's) is ``_TIMEOUT``: a survivor that is only
released by it takes longer than ``_BOUND``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import shardstate.checkpoint as dcp  # noqa: E402
from shardstate.checkpoint.filesystem import FileSystemReader, FileSystemWriter  # noqa: E402

_TIMEOUT = 75  # the run's and its gloo group's timeout, seconds
_BOUND = 30.0  # a survivor must have raised by then
_VICTIM = 1


def _fault(kind: str) -> None:
    if kind == "exit":
        raise SystemExit(7)
    if kind == "os_exit":
        os._exit(1)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # not reached
    if kind == "sleep":
        time.sleep(15)
        return
    raise AssertionError(kind)


def _victim() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == _VICTIM


class _FaultyWriter(FileSystemWriter):
    """Rank 1 meets ``fault`` inside write_data (in the write phase)."""

    def __init__(self, path: str, fault: str) -> None:
        super().__init__(path)
        self.fault = fault

    def write_data(self, plan: Any, planner: Any) -> Any:
        if _victim():
            _fault(self.fault)
        return super().write_data(plan, planner)


class _FaultyPlanner(dcp.DefaultSavePlanner):
    """Rank 1 meets ``fault`` while making its local plan (the plan phase)."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def create_local_plan(self) -> Any:
        if _victim():
            _fault(self.fault)
        return super().create_local_plan()


class _FaultyStateful(dcp.Stateful):
    """Rank 1 meets ``fault`` in state_dict(), before the save's first step."""

    def __init__(self, fault: str) -> None:
        self.fault = fault

    def state_dict(self) -> dict:
        if _victim():
            _fault(self.fault)
        return {"x": torch.ones(2)}

    def load_state_dict(self, sd: dict) -> None:
        raise AssertionError("not loaded here")


class _FaultyReader(FileSystemReader):
    """Rank 1 meets ``fault`` inside read_data."""

    def __init__(self, path: str, fault: str) -> None:
        super().__init__(path)
        self.fault = fault

    def read_data(self, plan: Any, planner: Any) -> Any:
        if _victim():
            _fault(self.fault)
        return super().read_data(plan, planner)


class _Counter(dcp.Stateful):
    """A Stateful whose load_state_dict raises on rank 1."""

    def __init__(self) -> None:
        self.t = torch.zeros(4)

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        if _victim():
            raise ValueError("load_state_dict refused on rank 1")
        self.t = sd["t"]


def _state(rank: int) -> dict:
    return {"w": torch.arange(6, dtype=torch.float32) + rank, "step": 3,
            f"own{rank}": torch.full((3,), float(rank))}


def _outcome(fn: Any) -> dict:
    """What a survivor saw: the exception's type, failing ranks and text,
    and how long the call took."""
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


def _save_body(rank: int, world: int, root: str, fault: str, phase: str, mode: str) -> dict:
    path = os.path.join(root, "ckpt")
    state = _state(rank)
    writer, planner = FileSystemWriter(path), None
    if phase == "write":
        writer = _FaultyWriter(path, fault)
    elif phase == "plan":
        planner = _FaultyPlanner(fault)
    else:
        state["s"] = _FaultyStateful(fault)
    if mode == "sync":
        return _outcome(lambda: dcp.save(state, storage_writer=writer, planner=planner))
    return _outcome(lambda: dcp.async_save(state, storage_writer=writer,
                                           planner=planner).result(timeout=_TIMEOUT))


def _check_survivors(out: list, died: bool = True) -> None:
    victim = out[_VICTIM]
    if died:
        # the victim really left (its reason is a str from the helper)
        assert isinstance(victim, str), victim
    for rank in (0, 2):
        got = out[rank]
        assert got["type"] == "CheckpointException", (rank, got)
        assert got["ranks"] == [_VICTIM], (rank, got)
        assert "rank 1" in got["text"].lower(), (rank, got["text"])
        assert got["elapsed"] < _BOUND, (rank, got["elapsed"])


@pytest.mark.parametrize("fault,phase", [
    ("exit", "state_dict"),  # SystemExit leaves save before its first step
    ("exit", "write"),  # inside a step: carried to every rank as a failure
    ("os_exit", "write"),
    ("sigkill", "write"),
    ("sigkill", "plan"),
])
def test_rank_dying_in_save_reaches_survivors(tmp_path, fault, phase):
    from shardstate.testing import run_distributed

    out = run_distributed(_save_body, 3, str(tmp_path), fault, phase, "sync",
                          timeout=_TIMEOUT, may_fail={_VICTIM})
    # (a SystemExit inside a step comes back to rank 1 as its CheckpointException)
    _check_survivors(out, died=(fault, phase) != ("exit", "write"))
    assert not (tmp_path / "ckpt" / ".metadata").exists()


def test_rank_killed_in_async_save_reaches_survivors(tmp_path):
    from shardstate.testing import run_distributed

    out = run_distributed(_save_body, 3, str(tmp_path), "sigkill", "write", "async",
                          timeout=_TIMEOUT, may_fail={_VICTIM})
    _check_survivors(out)
    assert not (tmp_path / "ckpt" / ".metadata").exists()


def _slow_body(rank: int, world: int, root: str) -> dict:
    path = os.path.join(root, "ckpt")
    out = _outcome(lambda: dcp.save(_state(rank), storage_writer=_FaultyWriter(path, "sleep")))
    if out["type"] is None:
        sd = _state(rank)
        sd["w"].zero_()
        out["loaded"] = _outcome(lambda: dcp.load(sd, checkpoint_id=path))
        out["w"] = sd["w"].tolist()
    return out


def test_slow_rank_is_waited_for(tmp_path):
    from shardstate.testing import run_distributed

    out = run_distributed(_slow_body, 3, str(tmp_path), timeout=_TIMEOUT)
    for rank, got in enumerate(out):
        assert got["type"] is None, (rank, got)
        assert got["elapsed"] >= 14.0 if rank == _VICTIM else True
        assert got["loaded"]["type"] is None, (rank, got["loaded"])
        # the replicated "w" is deduplicated to one rank's copy
        assert got["w"] in ([float(i + r) for i in range(6)] for r in range(3)), got["w"]


def _load_body(rank: int, world: int, root: str, fault: str) -> dict:
    import torch.distributed as dist

    path = os.path.join(root, "ckpt")
    dcp.save({"c": _Counter(), **_state(rank)}, checkpoint_id=path)
    dist.barrier()
    if fault == "stateful":
        return _outcome(lambda: dcp.load({"c": _Counter(), **_state(rank)}, checkpoint_id=path))
    return _outcome(lambda: dcp.load(_state(rank), storage_reader=_FaultyReader(path, fault)))


def test_rank_killed_in_load_reaches_survivors(tmp_path):
    from shardstate.testing import run_distributed

    out = run_distributed(_load_body, 3, str(tmp_path), "sigkill", timeout=_TIMEOUT,
                          may_fail={_VICTIM})
    _check_survivors(out)


def test_stateful_load_failure_reaches_every_rank(tmp_path):
    from shardstate.testing import run_distributed

    out = run_distributed(_load_body, 3, str(tmp_path), "stateful", timeout=_TIMEOUT)
    for rank, got in enumerate(out):
        assert got["type"] == "CheckpointException", (rank, got)
        assert got["ranks"] == [_VICTIM], (rank, got)
        assert "load_state_dict refused on rank 1" in got["text"], (rank, got["text"])
