"""CheckpointManager on real checkpoints: the save policy, retention,
commit markers, crash leftovers, one save in flight, failures, restore at
another world size, and preemption of a torchrun job by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import pytest
import shardstate.checkpoint as dcp
import torch
import torch.distributed.checkpoint as tdcp
from _child_env import package_env
from shardstate.checkpoint import CheckpointManager
from shardstate.checkpoint._steps import list_steps

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(step: int) -> dict:
    return {"x": torch.full((5, 3), float(step)), "meta": {"step": step}}


def test_policy_and_retention(tmp_path):
    with CheckpointManager(tmp_path, save_interval_steps=2, max_to_keep=2, keep_period=4,
                           preemption_signals=()) as mgr:
        started = [step for step in range(11) if mgr.save(step, _state(step))]
        assert started == [0, 2, 4, 6, 8, 10]
    assert mgr.all_steps() == [0, 4, 8, 10]  # the last two, and every 4th
    assert [s.state for s in list_steps(tmp_path)] == ["committed"] * 4
    marker = json.loads((tmp_path / "10" / ".shardstate-commit").read_text())
    assert marker["step"] == 10
    out = _state(-1)
    assert CheckpointManager(tmp_path, preemption_signals=()).restore(out) == 10
    assert torch.equal(out["x"], _state(10)["x"]) and out["meta"] == {"step": 10}
    out = _state(-1)
    assert CheckpointManager(tmp_path, preemption_signals=()).restore(out, step=4) == 4
    assert torch.equal(out["x"], _state(4)["x"])
    with pytest.raises(FileNotFoundError, match="step 6 is not a step of"):
        CheckpointManager(tmp_path, preemption_signals=()).restore(out, step=6)


def test_keep_best_by_metric_and_force(tmp_path):
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 6.0, 6: 3.0}
    mgr = CheckpointManager(tmp_path, save_interval_steps=0, max_to_keep=0, keep_best=2,
                            best_fn=lambda m: m["loss"], best_mode="min",
                            enable_async_checkpointing=False, preemption_signals=())
    for step, loss in losses.items():
        assert not mgr.save(step, _state(step))  # no interval: only forced saves
        assert mgr.save(step, _state(step), metrics={"loss": loss}, force=True)
    assert mgr.all_steps() == [2, 4, 6]  # the two best losses, and the latest
    assert mgr.metrics(4) == {"loss": 2.0}
    with pytest.raises(ValueError, match="not after the latest step 6"):
        mgr.save(5, _state(5), force=True)
    with pytest.raises(ValueError, match="keep_best needs best_fn"):
        CheckpointManager(tmp_path, keep_best=1)


def test_crash_leftovers_removed_and_foreign_steps_left(tmp_path):
    mgr = CheckpointManager(tmp_path, preemption_signals=())
    mgr.save(1, _state(1))
    mgr.close()
    # a run that crashed mid-save at step 2: its directory, pending, no .metadata
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / ".shardstate-pending").write_bytes(b"")
    (tmp_path / "2" / "__0_0.distcp").write_bytes(b"partial")
    # a plain DCP save in the same root, torch's, in torchtitan's naming: not
    # the manager's, so never removed, but a step to restore
    tdcp.save(_state(3), checkpoint_id=tmp_path / "step-3")
    (tmp_path / "5").mkdir()  # somebody's directory: never overwritten
    (tmp_path / "5" / "notes").write_text("mine")
    with pytest.warns(UserWarning, match="step 2 .* left incomplete"):
        mgr = CheckpointManager(tmp_path, max_to_keep=1, preemption_signals=())
    assert not (tmp_path / "2").exists() and (tmp_path / "step-3" / ".metadata").exists()
    assert mgr.all_steps() == [1, 3] and mgr.metrics(3) is None
    out = _state(-1)
    assert mgr.restore(out) == 3 and torch.equal(out["x"], _state(3)["x"])
    with pytest.raises(ValueError, match="not after the latest step 3"):
        mgr.save(3, _state(3))
    with pytest.raises(FileExistsError, match="not a step this manager left pending"):
        mgr.save(5, _state(5))
    assert mgr.save(6, _state(6)) and (mgr.wait() or True)
    # retention removed the manager's step 1, and left torch's step 3 and "5" alone
    assert mgr.all_steps() == [3, 6] and (tmp_path / "5" / "notes").read_text() == "mine"


class _Gate:
    """async_save held until released: a save that takes as long as the
    test says."""

    def __init__(self, monkeypatch) -> None:
        self.release = threading.Event()
        real = dcp.async_save

        def held(state, **kw) -> Future:
            fut: Future = Future()

            def run() -> None:
                self.release.wait(60)
                try:
                    fut.set_result(real(state, **kw).result())
                except BaseException as e:
                    fut.set_exception(e)

            threading.Thread(target=run, daemon=True).start()
            return fut

        monkeypatch.setattr(dcp, "async_save", held)


def test_one_save_in_flight_skip_or_wait(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    mgr = CheckpointManager(tmp_path / "skip", on_busy="skip", preemption_signals=())
    assert mgr.save(1, _state(1))
    assert not mgr.save(2, _state(2))  # step 1 still saving: skipped
    assert mgr.all_steps() == []  # not committed yet
    gate.release.set()
    mgr.wait()
    assert mgr.all_steps() == [1]
    gate.release.clear()
    mgr = CheckpointManager(tmp_path / "wait", preemption_signals=())
    assert mgr.save(1, _state(1))
    threading.Timer(0.5, gate.release.set).start()
    t0 = time.monotonic()
    assert mgr.save(2, _state(2))  # waits for step 1 first
    assert time.monotonic() - t0 >= 0.4
    mgr.close()
    assert mgr.all_steps() == [1, 2]


def test_a_failed_save_is_never_committed(tmp_path, monkeypatch):
    def failing(state, **kw) -> Future:
        fut: Future = Future()
        fut.set_exception(OSError(28, "No space left on device"))
        return fut

    mgr = CheckpointManager(tmp_path, preemption_signals=())
    monkeypatch.setattr(dcp, "async_save", failing)
    assert mgr.save(1, _state(1))
    with pytest.raises(OSError, match="No space left"):
        mgr.wait()
    assert mgr.all_steps() == [] and [s.state for s in list_steps(tmp_path)] == ["incomplete"]
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="step 1 .* left incomplete"):
        mgr = CheckpointManager(tmp_path, preemption_signals=())
    assert list_steps(tmp_path) == []


def _save_sharded(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    mgr = CheckpointManager(root, save_interval_steps=5, max_to_keep=1)
    for step in range(1, 11):
        full = torch.arange(60.0).reshape(12, 5) + step
        mgr.save(step, {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step})
    mgr.close()


def _restore_sharded(rank: int, world: int, root: str) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.zeros(12, 5), mesh, [Shard(1)]), "step": -1}
    mgr = CheckpointManager(root)
    step = mgr.restore(state)
    ok = torch.equal(state["w"].full_tensor(), torch.arange(60.0).reshape(12, 5) + step)
    steps = mgr.all_steps()
    mgr.close()
    return step, state["step"], ok, steps


def test_save_at_two_ranks_restore_at_three(run_distributed, tmp_path):
    run_distributed(_save_sharded, 2, str(tmp_path), timeout=300)
    for res in run_distributed(_restore_sharded, 3, str(tmp_path), timeout=300):
        assert res == (10, 10, True, [10])


_TRAIN = r"""
import sys, time
import torch, torch.distributed as dist
from shardstate.checkpoint import CheckpointManager

root, ready = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
state = {"w": torch.zeros(8), "step": 0}
mgr = CheckpointManager(root, save_interval_steps=1000)
step = mgr.restore(state) or 0
while True:
    step += 1
    state["w"] += 1
    state["step"] = step
    time.sleep(0.02)
    mgr.save(step, state)   # every call: do the ranks agree on a preemption?
    if step == 20 and rank == 0:
        open(ready, "w").close()
"""


def test_sigterm_to_torchrun_saves_and_commits_the_current_step(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    root, ready = tmp_path / "run", tmp_path / "ready"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(root), str(ready)]
    proc = subprocess.Popen(cmd, env=package_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            assert time.monotonic() < deadline, "training never reached step 20"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # torchrun passes it to every worker
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    steps = list_steps(root)
    assert [s.state for s in steps] == ["committed"], out.decode(errors="replace")[-3000:]
    final = steps[0].step
    assert final >= 20
    # the state of that step (every rank saved it: the save is collective)
    md = dcp.FileSystemReader(steps[0].path).read_metadata()
    assert "w" in md.state_dict_metadata
    got = {"w": torch.zeros(8), "step": -1}
    dcp.load(got, checkpoint_id=steps[0].path)
    assert got["step"] == final
    assert torch.equal(got["w"], torch.full((8,), float(final)))


def test_a_chosen_signal_saves_the_step_at_once(tmp_path):
    mgr = CheckpointManager(tmp_path, save_interval_steps=100,
                            preemption_signals=(signal.SIGUSR1, signal.SIGUSR2),
                            exit_on_preemption=False)
    assert not mgr.save(1, _state(1))
    os.kill(os.getpid(), signal.SIGUSR2)
    assert mgr.save(2, _state(2))  # not a save step: saved because of the signal
    assert mgr.reached_preemption and mgr.all_steps() == [2]  # committed before it returned
    mgr.close()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # handlers given back
    mgr = CheckpointManager(tmp_path, save_interval_steps=100,
                            preemption_signals=(signal.SIGUSR1,))
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.raises(SystemExit) as e:
        mgr.save(3, _state(3))
    assert e.value.code == 128 + signal.SIGUSR1 and mgr.all_steps() == [2, 3]
