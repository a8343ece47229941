"""A rank that dies or fails alone, at world 3 (issue 15, cases 3 and 4).

* A rank that dies inside a save or a load (SystemExit, ``os._exit``,
  SIGKILL) does not leave the others blocked until gloo's timeout: every
  survivor raises CheckpointException naming it within seconds.
* A rank that is slow but alive (15 s in ``write_data``) is waited for.
* A load whose Stateful ``load_state_dict`` raises on one rank raises
  CheckpointException on every rank.

Each run's group timeout (gloo's) is ``_TIMEOUT``: a survivor that is only
released by it takes longer than ``_BOUND``. The faults and the phases they
are met in: tests/_rank_faults.py (test_sweep_dist_faults.py runs every
kind on every rank in every phase).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import shardstate.checkpoint as dcp  # noqa: E402
from _rank_faults import Fault, FaultyWriter, outcome, scenario, state, survivors_failed  # noqa: E402
from shardstate.testing import run_distributed  # noqa: E402

_TIMEOUT = 75  # the run's and its gloo group's timeout, seconds
_BOUND = 30.0  # a survivor must have raised by then
_VICTIM = 1


def _run(fn, *args, **kwargs):
    """fn on 3 ranks forked from a server that imported torch once."""
    return run_distributed(fn, 3, *args, timeout=_TIMEOUT, start_method="forkserver",
                           **kwargs)


def _check_survivors(out: list, fault: Fault, died: bool = True) -> None:
    if died:
        # the victim really left (its reason is a str from the helper)
        assert isinstance(out[fault.victim], str), out[fault.victim]
    survivors_failed(out, fault, _BOUND)


@pytest.mark.parametrize("kind,phase", [
    ("exit", "state_dict"),  # SystemExit leaves save before its first step
    ("exit", "write"),  # inside a step: carried to every rank as a failure
    ("os_exit", "write"),
    ("sigkill", "write"),
    ("sigkill", "plan"),
])
def test_rank_dying_in_save_reaches_survivors(tmp_path, kind, phase):
    fault = Fault(kind, _VICTIM, phase)
    out = _run(scenario, str(tmp_path), fault, may_fail={_VICTIM})
    # (a SystemExit inside a step comes back to rank 1 as its CheckpointException)
    _check_survivors(out, fault, died=(kind, phase) != ("exit", "write"))
    assert not (tmp_path / "ckpt" / ".metadata").exists()


def test_rank_killed_in_async_save_reaches_survivors(tmp_path):
    fault = Fault("sigkill", _VICTIM, "write")
    out = _run(scenario, str(tmp_path), fault, "async", may_fail={_VICTIM})
    _check_survivors(out, fault)
    assert not (tmp_path / "ckpt" / ".metadata").exists()


def _slow_body(rank: int, world: int, root: str) -> dict:
    path = os.path.join(root, "ckpt")
    writer = FaultyWriter(path, Fault("sleep", _VICTIM, "write"))
    out = outcome(lambda: dcp.save(state(rank), storage_writer=writer))
    if out["type"] is None:
        sd = state(rank)
        sd["w"].zero_()
        out["loaded"] = outcome(lambda: dcp.load(sd, checkpoint_id=path))
        out["w"] = sd["w"].tolist()
    return out


def test_slow_rank_is_waited_for(tmp_path):
    out = _run(_slow_body, str(tmp_path))
    for rank, got in enumerate(out):
        assert got["type"] is None, (rank, got)
        assert got["elapsed"] >= 14.0 if rank == _VICTIM else True
        assert got["loaded"]["type"] is None, (rank, got["loaded"])
        # the replicated "w" is deduplicated to one rank's copy
        assert got["w"] in ([float(i + r) for i in range(6)] for r in range(3)), got["w"]


def test_rank_killed_in_load_reaches_survivors(tmp_path):
    fault = Fault("sigkill", _VICTIM, "read")
    out = _run(scenario, str(tmp_path), fault, may_fail={_VICTIM})
    _check_survivors(out, fault)


def test_stateful_load_failure_reaches_every_rank(tmp_path):
    fault = Fault("raise", _VICTIM, "commit")
    out = _run(scenario, str(tmp_path), fault)
    for rank, got in enumerate(out):
        assert got["type"] == "CheckpointException", (rank, got)
        assert got["ranks"] == [_VICTIM], (rank, got)
        assert "injected fault on rank 1 in commit" in got["text"], (rank, got["text"])
