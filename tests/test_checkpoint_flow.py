"""shardstate.checkpoint's save/load/async_save flow across real ranks.

These drive our orchestration with torch 2.13's own planners and
FileSystemWriter/Reader (the protocols are the same), so the cross-rank
protocol, failure propagation, Stateful handling and async staging are
checked against checkpoints torch itself reads and writes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from shardstate.checkpoint.api import CheckpointException
from shardstate.checkpoint.state_dict_loader import load, load_state_dict
from shardstate.checkpoint.state_dict_saver import async_save, save, save_state_dict


def _writer(path):
    return tdcp.FileSystemWriter(path)


def _reader(path):
    return tdcp.FileSystemReader(path)


def _rank_state(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {
        f"only_on_{rank}": torch.randn(5, 3, generator=g),
        "replicated": torch.arange(12, dtype=torch.float64).reshape(3, 4),
        "nested": {"step": 7, "ints": torch.tensor([rank, world], dtype=torch.int32)},
    }


class Counter:
    """A Stateful object (state_dict / load_state_dict)."""

    def __init__(self, n: int):
        self.n = n
        self.loaded = False

    def state_dict(self) -> dict:
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, sd: dict) -> None:
        self.n = int(sd["n"])
        self.loaded = True


# torch's own load warns that it runs without a process group
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_round_trip_with_torch_components(tmp_path):
    sd = _rank_state(0, 1)
    sd["counter"] = Counter(41)
    md = save(sd, storage_writer=_writer(tmp_path), planner=tdcp.DefaultSavePlanner())
    assert "only_on_0" in md.state_dict_metadata and (tmp_path / ".metadata").exists()

    # torch reads what our flow committed
    back = {"only_on_0": torch.zeros(5, 3), "replicated": torch.zeros(3, 4, dtype=torch.float64)}
    tdcp.load(back, checkpoint_id=str(tmp_path))
    assert torch.equal(back["only_on_0"], sd["only_on_0"])
    assert torch.equal(back["replicated"], sd["replicated"])

    # our flow loads it, Stateful included
    dest = {"only_on_0": torch.zeros(5, 3), "counter": Counter(0),
            "nested": {"step": 0, "ints": torch.zeros(2, dtype=torch.int32)}}
    load(dest, storage_reader=_reader(tmp_path), planner=tdcp.DefaultLoadPlanner())
    assert torch.equal(dest["only_on_0"], sd["only_on_0"])
    assert dest["counter"].loaded and dest["counter"].n == 41
    assert dest["nested"]["step"] == 7
    assert torch.equal(dest["nested"]["ints"], torch.tensor([0, 1], dtype=torch.int32))


def test_deprecated_names_warn_and_work(tmp_path):
    sd = {"w": torch.ones(4)}
    with pytest.warns(FutureWarning, match="deprecated"):
        save_state_dict(sd, _writer(tmp_path), planner=tdcp.DefaultSavePlanner())
    out = {"w": torch.zeros(4)}
    with pytest.warns(FutureWarning, match="deprecated"):
        load_state_dict(out, _reader(tmp_path), planner=tdcp.DefaultLoadPlanner())
    assert torch.equal(out["w"], torch.ones(4))


def test_missing_checkpoint_id_is_a_clear_error():
    with pytest.raises(RuntimeError, match="checkpoint_id"):
        save({"w": torch.ones(1)})


# ---------------------------------------------------------------- multi-rank


def _round_trip(rank, world, path):
    sd = _rank_state(rank, world)
    md = save(sd, storage_writer=_writer(path), planner=tdcp.DefaultSavePlanner())
    keys = sorted(md.state_dict_metadata)
    # every rank gets the same metadata, and torch's own load agrees
    out = {"replicated": torch.zeros(3, 4, dtype=torch.float64),
           f"only_on_{(rank + 1) % world}": torch.zeros(5, 3)}
    load(out, storage_reader=_reader(path), planner=tdcp.DefaultLoadPlanner())
    other = _rank_state((rank + 1) % world, world)[f"only_on_{(rank + 1) % world}"]
    ok = torch.equal(out["replicated"], sd["replicated"]) and torch.equal(
        out[f"only_on_{(rank + 1) % world}"], other)
    return keys, ok


@pytest.mark.parametrize("world", [2, 3])
def test_multi_rank_round_trip(run_distributed, tmp_path, world):
    results = run_distributed(_round_trip, world, str(tmp_path))
    keys = [k for k, _ in results]
    assert all(k == keys[0] for k in keys)
    assert {f"only_on_{r}" for r in range(world)} <= set(keys[0])
    assert all(ok for _, ok in results)


class _FailingPlanner(tdcp.DefaultSavePlanner):
    def __init__(self, bad_rank: int):
        super().__init__()
        self.bad_rank = bad_rank

    def create_local_plan(self):
        import torch.distributed as dist

        if dist.get_rank() == self.bad_rank:
            raise ValueError(f"planner refused on rank {self.bad_rank}")
        return super().create_local_plan()


class _FailingWriter(tdcp.FileSystemWriter):
    def __init__(self, path, bad_rank):
        super().__init__(path)
        self.bad_rank = bad_rank

    def write_data(self, plan, planner):
        import torch.distributed as dist

        if dist.get_rank() == self.bad_rank:
            raise OSError(28, "No space left on device (injected)")
        return super().write_data(plan, planner)


def _fail_somewhere(rank, world, path, where):
    sd = _rank_state(rank, world)
    try:
        if where == "plan":
            save(sd, storage_writer=_writer(path), planner=_FailingPlanner(world - 1))
        else:
            save(sd, storage_writer=_FailingWriter(path, world - 1),
                 planner=tdcp.DefaultSavePlanner())
    except CheckpointException as e:
        return sorted(e.failures), str(e), e.args[0]
    return None


@pytest.mark.parametrize("where", ["plan", "write"])
def test_failure_on_one_rank_reaches_every_rank(run_distributed, tmp_path, where):
    world = 3
    results = run_distributed(_fail_somewhere, world, str(tmp_path), where, timeout=90)
    for res in results:
        assert res is not None, "a rank finished without seeing the failure"
        ranks, text, step = res
        assert ranks == [world - 1]
        assert step == where
        assert ("planner refused" in text) if where == "plan" else ("No space left" in text)
    # nothing was committed
    assert not os.path.exists(tmp_path / ".metadata")


def _async_round_trip(rank, world, path):
    sd = {"w": torch.full((64, 64), float(rank)), "step": rank}
    fut = async_save(sd, storage_writer=_writer(path), planner=tdcp.DefaultSavePlanner())
    assert fut.staging_completion.done()
    sd["w"].add_(100.0)  # modified after staging: must not reach the checkpoint
    md = fut.result(timeout=60)
    assert fut.upload_completion is fut and fut.done()
    # the training loop's own collectives are unaffected
    import torch.distributed as dist

    t = torch.tensor([1.0])
    dist.all_reduce(t)
    out = {"w": torch.zeros(64, 64)}
    load(out, storage_reader=_reader(path), planner=tdcp.DefaultLoadPlanner())
    return float(out["w"][0, 0]), float(t), sorted(md.state_dict_metadata)


def test_async_save_stages_then_writes(run_distributed, tmp_path):
    res = run_distributed(_async_round_trip, 2, str(tmp_path))
    # "w" is replicated across ranks with different values: the dedup keeps
    # one rank's copy, and it is the staged (unmodified) value.
    for w0, reduced, keys in res:
        assert w0 in (0.0, 1.0)
        assert reduced == 2.0
        assert "w" in keys


def test_async_save_failure_is_delivered_through_the_future(tmp_path):
    class Broken(tdcp.FileSystemWriter):
        def write_data(self, plan, planner):
            raise RuntimeError("disk on fire")

    fut = async_save({"w": torch.ones(3)}, storage_writer=Broken(str(tmp_path)),
                     planner=tdcp.DefaultSavePlanner())
    with pytest.raises(CheckpointException, match="disk on fire"):
        fut.result(timeout=60)
    assert not (tmp_path / ".metadata").exists()
