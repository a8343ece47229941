"""shardstate.testing.run_distributed: real processes, real gloo groups."""

import multiprocessing as mp
import os
import time

import pytest
from shardstate.testing import DistributedTestError, run_distributed


def _allreduce(rank, world_size, scale=1):
    import torch
    import torch.distributed as dist

    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    t = torch.tensor([float(rank * scale)])
    dist.all_reduce(t)
    return (rank, os.getpid(), float(t))


def _fail_on_rank1(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise KeyError("boom on rank one")
    dist.barrier()  # never completes: rank 1 is gone
    return rank


def _hang_on_rank0(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    return rank


def _crash_on_last(rank, world_size):
    # every rank through the group's setup first: a rank that returns at once
    # tears its side down while a slow peer is still connecting, which fails
    # that peer in init_process_group instead of letting it reach the crash
    import torch.distributed as dist

    dist.barrier()
    if rank == world_size - 1:
        os._exit(3)
    return rank


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_collective_on_real_processes(world_size):
    out = run_distributed(_allreduce, world_size, scale=10)
    expected = float(10 * sum(range(world_size)))
    assert [r for r, _, _ in out] == list(range(world_size))
    assert all(v == expected for _, _, v in out)
    pids = {pid for _, pid, _ in out}
    assert len(pids) == world_size and os.getpid() not in pids
    assert mp.active_children() == []


def test_failing_rank_surfaces_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank1, 3, timeout=60)
    err = info.value
    assert 1 in err.failures
    assert "KeyError" in err.failures[1] and "boom on rank one" in err.failures[1]
    assert "_fail_on_rank1" in err.failures[1]  # a real traceback
    assert "rank 1" in str(err)
    # The ranks stuck in the barrier were stopped, well before the timeout.
    assert time.monotonic() - t0 < 45
    assert mp.active_children() == []


def test_hung_rank_times_out_instead_of_hanging():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out") as info:
        run_distributed(_hang_on_rank0, 2, timeout=8)
    assert 0 in info.value.failures
    assert 1 not in info.value.failures  # rank 1 finished normally
    assert time.monotonic() - t0 < 30
    assert mp.active_children() == []


def _crash_rank1_others_wait(rank, world_size):
    import torch.distributed as dist

    dist.barrier()  # all connected first (see _crash_on_last)
    if rank == 1:
        os._exit(5)
    time.sleep(2)  # past the grace the helper gives the others after a failure
    return rank * 10


def test_may_fail_tolerates_a_rank_that_dies_on_purpose():
    out = run_distributed(_crash_rank1_others_wait, 3, timeout=60, may_fail={1})
    assert out[0] == 0 and out[2] == 20
    assert isinstance(out[1], str) and "exited with code 5" in out[1]
    assert mp.active_children() == []
    with pytest.raises(DistributedTestError) as info:  # only the named ranks may fail
        run_distributed(_crash_on_last, 2, timeout=60, may_fail={0})
    assert "exited with code 3" in info.value.failures[1]
    with pytest.raises(ValueError, match="may_fail"):
        run_distributed(_allreduce, 2, may_fail={2})


def test_crashed_rank_is_named_with_exit_code():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_crash_on_last, 2, timeout=60)
    assert "exited with code 3" in info.value.failures[1]
    assert mp.active_children() == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_allreduce, 0)
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(_allreduce, 1, timeout=0)


@pytest.mark.distributed_timeout(60)
def test_fixture(run_distributed):
    out = run_distributed(_allreduce, 2)
    assert [v for _, _, v in out] == [1.0, 1.0]


def _env_and_modules(rank, world_size, name):
    import sys

    import torch
    import torch.distributed as dist

    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return (os.environ.get(name), os.getpid(), float(t), "shardstate.checkpoint" in sys.modules)


def test_forkserver_ranks_see_the_callers_environment(monkeypatch):
    name = "SHARDSTATE_TESTING_PROBE"
    monkeypatch.setenv(name, "first")
    out = run_distributed(_env_and_modules, 3, name, timeout=60, start_method="forkserver")
    assert [e for e, _, _, _ in out] == ["first"] * 3
    assert [v for _, _, v, _ in out] == [3.0] * 3
    assert all(pre for _, _, _, pre in out)  # forked after the server's imports
    monkeypatch.setenv(name, "second")  # the server started with "first"
    again = run_distributed(_env_and_modules, 2, name, timeout=60, start_method="forkserver")
    assert [e for e, _, _, _ in again] == ["second"] * 2
    assert not {p for _, p, _, _ in out} & {p for _, p, _, _ in again}
    assert mp.active_children() == []


def _stuck_rank1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def test_may_fail_rank_still_running_is_killed_after_a_grace():
    t0 = time.monotonic()
    out = run_distributed(_stuck_rank1, 3, timeout=120, may_fail={1}, start_method="forkserver")
    assert out[0] == 0 and out[2] == 2
    assert isinstance(out[1], str) and "still running" in out[1] and "killed" in out[1]
    assert time.monotonic() - t0 < 60  # not the run's timeout
    assert mp.active_children() == []


def _barrier_past_group_timeout(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        time.sleep(8)  # past the group's timeout, within the run's
        return None
    t0 = time.monotonic()
    try:
        dist.barrier()
    except RuntimeError:
        return time.monotonic() - t0
    return None


def test_group_timeout_is_the_process_groups_own():
    out = run_distributed(_barrier_past_group_timeout, 2, timeout=60, group_timeout=2,
                          may_fail={1}, start_method="forkserver")
    assert out[0] is not None and 1.5 < out[0] < 7.0, out
    with pytest.raises(ValueError, match="group_timeout"):
        run_distributed(_allreduce, 1, group_timeout=0)
    with pytest.raises(ValueError, match="start_method"):
        run_distributed(_allreduce, 1, start_method="fork")
