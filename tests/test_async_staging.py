"""async_save's stagers (``staging``) and checkpointers (THREAD, PROCESS).

The stagers on real data, each option; their output goes back to the
bounded pool; async_save with each kind of stager, ours under torch's
async_save and torch's under ours; THREAD and PROCESS at world 1 and 2
(real processes, gloo), loaded back by shardstate and by torch; PROCESS
writing in another, long-lived process that errors come back from and whose
death fails the save instead of hanging it; and torch's own PROCESS
async_save on the same state.
"""

from __future__ import annotations

import gc
import os
import pickle
import threading
import time
import weakref
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import shardstate.checkpoint as dcp
import torch
import torch.distributed.checkpoint as tdcp
import torch.distributed.checkpoint.staging as tstaging
import torch.distributed.checkpoint.state_dict_saver as tsaver
from shardstate.checkpoint import _async_process, _staging
from shardstate.checkpoint.staging import (
    AsyncStager,
    BlockingAsyncStager,
    DefaultStager,
    StagingOptions,
)
from shardstate.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

THREAD, PROCESS = AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS


@pytest.fixture(autouse=True)
def _clean_pool_and_processes():
    """Each test starts with an empty staging pool, and leaves it so, with
    no checkpoint process running (the pool is per process: other tests in
    this one count its arenas)."""
    gc.collect()
    assert _staging._pool._busy == 0
    _staging._pool._free.clear()
    yield
    _async_process.shutdown()
    assert _pool_settles() == 0  # every staging went back
    _staging._pool._free.clear()


def _pool_settles(timeout: float = 30.0) -> int:
    """The staging arenas still taken once the threads that held staged
    values let go. torch's upload thread completes its future before it
    drops the work item that names the staged state (concurrent.futures),
    so the arena comes back a moment after ``result()`` returns: milliseconds
    normally, more under ASan on a loaded machine. A leak stays taken."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        if _staging._pool._busy == 0 or time.monotonic() > deadline:
            return _staging._pool._busy
        time.sleep(0.01)


def _local_state() -> dict:
    base = torch.arange(600, dtype=torch.float32).reshape(20, 30)
    return {
        "w": base.clone(),
        "view": base[3:7],
        "t": base.t(),
        "bf": torch.linspace(-2, 2, 17).to(torch.bfloat16),
        "i": torch.arange(9, dtype=torch.int64),
        "zero": torch.empty(0, 3),
        "np": np.arange(12, dtype=np.int16).reshape(3, 4),
        "nested": {"list": [torch.ones(4), "text", 3], "step": 11},
    }


def _clone(sd):
    if isinstance(sd, dict):
        return {k: _clone(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_clone(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return sd.clone()
    if isinstance(sd, np.ndarray):
        return sd.copy()
    return sd


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def _mutate(sd) -> None:
    for v in sd.values():
        if isinstance(v, dict):
            _mutate(v)
        elif isinstance(v, torch.Tensor) and v.numel():
            (v.to_local() if hasattr(v, "to_local") else v).add_(100)
        elif isinstance(v, np.ndarray):
            v += 100


def _blank(sd):
    """A load target shaped like sd."""
    if isinstance(sd, dict):
        return {k: _blank(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_blank(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        if hasattr(sd, "to_local"):
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(torch.zeros(sd.shape, dtype=sd.dtype), sd.device_mesh,
                                     sd.placements)
        return torch.zeros_like(sd).contiguous()
    if isinstance(sd, np.ndarray):
        return np.zeros_like(sd)
    return None if isinstance(sd, (int, str)) else sd


def _as_torch(sd):
    """sd with ndarrays as tensors (what torch's load fills: shardstate
    saves an ndarray as the tensor it views)."""
    if isinstance(sd, dict):
        return {k: _as_torch(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_as_torch(v) for v in sd]
    return torch.from_numpy(sd) if isinstance(sd, np.ndarray) else sd


def _loads_back(ref, path) -> bool:
    """Loaded by shardstate, and by torch, path holds ref."""
    back = _blank(ref)
    dcp.load(back, checkpoint_id=path)
    ok = _equal(_full(back), _full(ref))
    ref = _as_torch(ref)
    back = _blank(ref)
    tdcp.load(back, checkpoint_id=path)
    return ok and _equal(_full(back), _full(ref))


def _full(sd):
    """sd with DTensors as their full tensors (what ranks can compare)."""
    if isinstance(sd, dict):
        return {k: _full(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_full(v) for v in sd]
    if hasattr(sd, "full_tensor"):
        return sd.full_tensor()
    return sd


# ---------------------------------------------------------------------------
# The stagers
# ---------------------------------------------------------------------------

_OPTIONS = [StagingOptions(p, s, a, n) for p in (False, True) for s in (False, True)
            for a in (False, True) for n in (False, True)]


@pytest.mark.parametrize("opts", _OPTIONS, ids=lambda o: "".join(
    c if v else "-" for c, v in zip("psan", (o.use_pinned_memory, o.use_shared_memory,
                                            o.use_async_staging, o.use_non_blocking_copy))))
def test_default_stager_options_on_real_data(opts):
    busy = _staging._pool._busy
    sd = _local_state()
    ref = _clone(sd)
    stager = DefaultStager(opts)
    out = stager.stage(sd)
    if opts.use_async_staging:
        assert isinstance(out, Future)
        stager.synchronize_staging()
        assert out.done()
        staged = out.result()
    else:
        assert isinstance(out, dict)
        staged = out
    _mutate(sd)  # the caller trains on: the staged copy does not change
    assert _equal(staged, ref)
    assert staged["t"].stride() == ref["t"].stride()  # laid out as its clone
    w = staged["w"]
    in_shared = _staging.locate(w.untyped_storage().data_ptr(), w.untyped_storage().nbytes())
    assert (in_shared is not None) == opts.use_shared_memory
    assert _staging._pool._busy == busy + 1
    del staged, out, w, in_shared
    gc.collect()
    assert _staging._pool._busy == busy  # dropped: its arena is back in the pool
    stager.close()


def test_staging_is_bounded_a_third_waits_for_the_oldest():
    assert _staging._pool._busy == 0
    stager = DefaultStager(StagingOptions(False, False, False, False))
    sd = {"w": torch.randn(64, 64)}
    first = stager.stage(sd)
    second = stager.stage(sd)
    got: list = []
    t = threading.Thread(target=lambda: got.append(stager.stage(sd)))
    t.start()
    t.join(0.5)
    assert t.is_alive() and not got  # two in use: the third waits
    arena = _staging._find(first["w"].data_ptr(), 1, _staging._all_arenas)[0]
    del first
    t.join(10)
    assert got and _staging._find(got[0]["w"].data_ptr(), 1, _staging._all_arenas)[0] is arena
    got.clear()
    del second
    gc.collect()
    assert _staging._pool._busy == 0


def test_blocking_async_stager_as_torchs():
    sd = _local_state()
    del sd["np"]  # torch's own stager copies tensors, not ndarrays
    ours, theirs = BlockingAsyncStager(), tstaging.BlockingAsyncStager()
    assert not ours.should_synchronize_after_execute
    assert _equal(ours.stage(sd), theirs.stage(sd))
    # type_check: torch's rule, torch's error
    bad = {"w": torch.ones(2), "np": np.ones(2)}
    for stager in (BlockingAsyncStager(type_check=True), tstaging.BlockingAsyncStager(
            type_check=True)):
        with pytest.raises(ValueError, match="Unexpected value type"):
            stager.stage(bad)
    assert _equal(BlockingAsyncStager().stage(bad)["np"], bad["np"])
    # the cache: one arena for every staging, the values of the latest
    cached = BlockingAsyncStager(cache_staged_state_dict=True)
    a = cached.stage(sd)
    ptr = a["w"].data_ptr()
    _mutate(sd)
    b = cached.stage(sd)
    assert b["w"].data_ptr() == ptr and _equal(b, _clone(sd))
    assert cached.state_dict_cache is b
    assert pickle.loads(pickle.dumps(cached)).state_dict_cache is None  # memory, not config


class _CountingWriter(dcp.FileSystemWriter):
    stagings = 0

    def stage(self, state_dict):
        type(self).stagings += 1
        return super().stage(state_dict)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_file_system_writer_is_an_async_stager(tmp_path):
    w = dcp.FileSystemWriter(tmp_path, cache_staged_state_dict=True)
    assert isinstance(w, AsyncStager) and isinstance(w, tstaging.AsyncStager)
    assert isinstance(w, BlockingAsyncStager) and w.cache_staged_state_dict
    assert not w.should_synchronize_after_execute
    w.stage({"x": torch.ones(3)})
    assert w.per_thread_copy_ahead == 0  # as torch's: the staged state is on the host
    assert pickle.loads(pickle.dumps(w)).path == w.path
    # async_save stages through a writer that is an AsyncStager, as torch does
    sd = _local_state()
    ref = _clone(sd)
    before = _CountingWriter.stagings
    fut = dcp.async_save(sd, storage_writer=_CountingWriter(tmp_path / "c"))
    assert _CountingWriter.stagings == before + 1
    _mutate(sd)
    fut.result(timeout=60)
    assert _loads_back(ref, tmp_path / "c")
    # its cache is reused, and a save that still reads it is waited for
    cw = dcp.FileSystemWriter(tmp_path / "cc", cache_staged_state_dict=True)
    futs = []
    for i in range(3):
        futs.append(dcp.async_save({"w": torch.full((256, 256), float(i))}, storage_writer=cw,
                                   checkpoint_id=tmp_path / f"cc{i}"))
    for i, f in enumerate(futs):
        f.result(timeout=60)
        back = {"w": torch.zeros(256, 256)}
        dcp.load(back, checkpoint_id=tmp_path / f"cc{i}")
        assert torch.equal(back["w"], torch.full((256, 256), float(i)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_async_save_with_an_asynchronous_stager(tmp_path):
    sd = _local_state()
    ref = _clone(sd)
    stager = DefaultStager(StagingOptions(False, False, True, False))
    resp = dcp.async_save(sd, checkpoint_id=tmp_path, async_stager=stager)
    assert isinstance(resp, AsyncSaveResponse) and isinstance(resp, tsaver.AsyncSaveResponse)
    resp.staging_completion.result(timeout=60)
    _mutate(sd)
    md = resp.upload_completion.result(timeout=60)
    assert resp.result() is md and "w" in md.state_dict_metadata
    stager.close()
    assert _loads_back(ref, tmp_path)


def test_async_save_response():
    staging, upload = Future(), Future()
    r = AsyncSaveResponse(staging, upload)
    assert r.staging_completion is staging and r.upload_completion is upload
    assert isinstance(r, tsaver.AsyncSaveResponse) and isinstance(r, Future)
    assert r != AsyncSaveResponse(staging, upload) and len({r}) == 1  # a future: by identity
    upload.set_result(5)
    assert r.result(timeout=1) == 5
    own = AsyncSaveResponse(staging, None)
    assert own.upload_completion is own


def test_async_checkpointer_type_is_torchs_and_checked(tmp_path):
    assert AsyncCheckpointerType is tsaver.AsyncCheckpointerType
    with pytest.raises(ValueError, match="async_checkpointer_type"):
        dcp.async_save({"w": torch.ones(2)}, checkpoint_id=tmp_path, async_checkpointer_type="gpu")
    assert not (tmp_path / ".metadata").exists()


class _LockedWriter(dcp.FileSystemWriter):
    def __init__(self, path):
        super().__init__(path)
        self.lock = threading.Lock()


class _MainWriter(dcp.FileSystemWriter):
    pass


_MainWriter.__module__ = "__main__"  # as if defined in a training script


def test_process_refuses_what_it_cannot_be_given(tmp_path):
    for writer, what in ((_LockedWriter(tmp_path), "lock"), (_MainWriter(tmp_path), "__main__")):
        with pytest.raises(TypeError, match=f"PROCESS.*{what}"):
            dcp.async_save({"w": torch.ones(2)}, storage_writer=writer,
                           async_checkpointer_type=PROCESS)
    assert not _async_process._processes  # nothing started, no thread in its place
    assert not (tmp_path / ".metadata").exists()


def test_process_sends_descriptors_not_bytes():
    stager = DefaultStager(StagingOptions(False, True, False, False))
    staged = stager.stage({"w": torch.randn(512, 512), "np": np.ones(1000), "n": 3})
    assert not _async_process.needs_restaging(staged)
    payload, arenas = _async_process.dumps(staged)
    assert len(payload) < 2000 and len(arenas) == 1  # 1 MiB of tensor, a few bytes sent
    private = DefaultStager(StagingOptions(False, False, False, False)).stage({"w": torch.ones(9)})
    assert _async_process.needs_restaging(private)


class _PidWriter(dcp.FileSystemWriter):
    """Records which process wrote (in the checkpoint directory)."""

    def write_data(self, plan, planner):
        (Path(self.path) / f"pid_{self.rank}").write_text(str(os.getpid()))
        return super().write_data(plan, planner)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_stagers_across_libraries_without_a_group(tmp_path, monkeypatch):
    sd = _local_state()
    del sd["np"]  # torch's stagers copy tensors only
    ref = _clone(sd)
    # ours under torch's async_save: torch drops the staged state, the pool
    # gets its arena back
    stager = DefaultStager(StagingOptions(False, False, True, False))
    resp = tdcp.async_save(sd, checkpoint_id=tmp_path / "t", async_stager=stager)
    resp.upload_completion.result(timeout=60)
    stager.close()
    del resp, stager
    assert _pool_settles() == 0
    # torch's under ours, written by the checkpoint process (staged into
    # shared memory once, there), and our FileSystemWriter as the stager of
    # a PROCESS save: staged straight into shared memory
    calls: list[bool] = []
    stage = _staging.stage
    monkeypatch.setattr(_staging, "stage", lambda s, **kw: calls.append(kw.get("shared")) or
                        stage(s, **kw))
    tstager = tstaging.DefaultStager(tstaging.StagingOptions(False, True, False, False))
    dcp.async_save(sd, checkpoint_id=tmp_path / "o", async_stager=tstager,
                   async_checkpointer_type=PROCESS).result(timeout=120)
    assert calls == [True]
    calls.clear()
    dcp.async_save(sd, storage_writer=_PidWriter(tmp_path / "w"),
                   async_checkpointer_type=PROCESS).result(timeout=120)
    assert calls == [True]
    assert int((tmp_path / "w" / "pid_0").read_text()) != os.getpid()
    for d in ("t", "o", "w"):
        assert _loads_back(ref, tmp_path / d), d


# ---------------------------------------------------------------------------
# THREAD and PROCESS across ranks
# ---------------------------------------------------------------------------


class _FailingWriter(dcp.FileSystemWriter):
    def __init__(self, path, rank):
        super().__init__(path)
        self.fail_rank = rank

    def write_data(self, plan, planner):
        if self.rank == self.fail_rank:
            raise OSError(28, "No space left on device (checkpoint process)")
        return super().write_data(plan, planner)


class _DyingWriter(dcp.FileSystemWriter):
    def __init__(self, path, rank):
        super().__init__(path)
        self.die_rank = rank

    def write_data(self, plan, planner):
        if self.rank == self.die_rank:
            os._exit(3)
        return super().write_data(plan, planner)


def _rank_state(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = _local_state()
    sd["dt"] = distribute_tensor(torch.arange(96.0).reshape(12, 8), mesh, [Shard(0)])
    sd[f"own_{rank}"] = torch.full((5, 3), float(rank))
    return sd


def _modes(rank: int, world: int, root: str) -> dict:
    import multiprocessing

    import torch.distributed as dist

    res: dict = {"trainer": os.getpid()}
    for mode in (THREAD, PROCESS):
        sd = _rank_state(rank, world)
        ref = _clone(sd)
        fut = dcp.async_save(sd, storage_writer=_PidWriter(f"{root}/{mode.value}"),
                             async_checkpointer_type=mode)
        assert fut.staging_completion.done()
        _mutate(sd)  # the training step that follows
        md = fut.result(timeout=120)
        assert "dt" in md.state_dict_metadata
        dist.barrier()
        res[f"{mode.value}_loads"] = _loads_back(ref, f"{root}/{mode.value}")
        res[f"{mode.value}_pid"] = int(Path(root, mode.value, f"pid_{rank}").read_text())
    # later PROCESS saves reuse the same process, back to back
    futs = [dcp.async_save({"w": torch.full((64, 64), float(i)), "i": i},
                           storage_writer=_PidWriter(f"{root}/again{i}"),
                           async_checkpointer_type=PROCESS) for i in range(3)]
    for f in futs:
        f.result(timeout=120)
    res["again_pids"] = {int(Path(root, f"again{i}", f"pid_{rank}").read_text()) for i in range(3)}
    res["again_loads"] = True
    for i in range(3):
        back = {"w": torch.zeros(64, 64), "i": None}
        dcp.load(back, checkpoint_id=f"{root}/again{i}")
        res["again_loads"] &= torch.equal(back["w"], torch.full((64, 64), float(i))) \
            and back["i"] == i
    res["processes"] = [p.pid for p in _async_process._processes.values()]
    # an error in the last rank's checkpoint process reaches every rank
    fut = dcp.async_save(_rank_state(rank, world),
                         storage_writer=_FailingWriter(f"{root}/err", world - 1),
                         async_checkpointer_type=PROCESS)
    try:
        fut.result(timeout=120)
        res["error"] = None
    except dcp.CheckpointException as e:
        res["error"] = (sorted(e.failures), "No space left" in str(e))
    dist.barrier()
    res["err_committed"] = os.path.exists(f"{root}/err/.metadata")
    # an asynchronous stager into shared memory, then the process survives
    stager = DefaultStager(StagingOptions(False, True, True, False))
    sd = _rank_state(rank, world)
    ref = _clone(sd)
    resp = dcp.async_save(sd, storage_writer=_PidWriter(f"{root}/staged"), async_stager=stager,
                          async_checkpointer_type=PROCESS)
    resp.staging_completion.result(timeout=60)
    _mutate(sd)
    resp.upload_completion.result(timeout=120)
    stager.close()
    dist.barrier()
    res["staged_loads"] = _loads_back(ref, f"{root}/staged")
    res["staged_pid"] = int(Path(root, "staged", f"pid_{rank}").read_text())
    # torch's own PROCESS async_save of the same state (its spawn refuses a
    # daemonic parent, which these test ranks are)
    multiprocessing.current_process().daemon = False
    sd = _rank_state(rank, world)
    del sd["np"]  # torch saves an ndarray as bytes, shardstate as the tensor it views
    ref = _clone(sd)
    tfut = tdcp.async_save(sd, checkpoint_id=f"{root}/torch",
                           async_checkpointer_type=tsaver.AsyncCheckpointerType.PROCESS)
    ofut = dcp.async_save(sd, checkpoint_id=f"{root}/ours",
                          async_checkpointer_type=tsaver.AsyncCheckpointerType.PROCESS)
    ofut.result(timeout=120)
    tfut.result(timeout=120)
    dist.barrier()
    res["torch_loads"] = _loads_back(ref, f"{root}/torch") and _loads_back(ref, f"{root}/ours")
    _async_process.shutdown()
    res["after_shutdown"] = list(_async_process._processes)
    return res


@pytest.mark.parametrize("world", [1, 2])
def test_thread_and_process_saves(run_distributed, tmp_path, world):
    results = run_distributed(_modes, world, str(tmp_path), timeout=400)
    ckpt_pids = set()
    for res in results:
        assert res["thread_loads"] and res["process_loads"], res
        assert res["thread_pid"] == res["trainer"]  # THREAD: written here
        assert res["process_pid"] != res["trainer"]  # PROCESS: in another process
        assert res["again_pids"] == {res["process_pid"]} == {res["staged_pid"]}  # reused
        assert res["processes"] == [res["process_pid"]]  # one per rank
        assert res["again_loads"] and res["staged_loads"] and res["torch_loads"]
        assert res["error"] == ([world - 1], True)
        assert not res["err_committed"]
        assert res["after_shutdown"] == []
        ckpt_pids.add(res["process_pid"])
    assert len(ckpt_pids) == world


def _dies(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    res: dict = {}
    sd = {"w": torch.full((8, 8), float(rank)), f"r{rank}": torch.ones(3)}
    dcp.async_save(sd, checkpoint_id=f"{root}/ok", async_checkpointer_type=PROCESS).result(120)
    first = [p.pid for p in _async_process._processes.values()]
    fut = dcp.async_save(sd, storage_writer=_DyingWriter(f"{root}/die", world - 1),
                         async_checkpointer_type=PROCESS)
    try:
        fut.result(timeout=120)  # never a hang: it fails
        res["died"] = None
    except dcp.CheckpointException as e:
        res["died"] = str(e)
    # the rank whose process died is told so at the call from now on (the
    # others' processes are alive, in a group that is not)
    res["next"] = None
    if rank == world - 1:
        try:
            dcp.async_save(sd, checkpoint_id=f"{root}/next", async_checkpointer_type=PROCESS)
        except RuntimeError as e:
            res["next"] = str(e)
    dist.barrier()
    _async_process.shutdown()  # every rank: PROCESS saves start afresh
    dist.barrier()
    dcp.async_save(sd, storage_writer=_PidWriter(f"{root}/fresh"),
                   async_checkpointer_type=PROCESS).result(timeout=120)
    res["fresh"] = int(Path(root, "fresh", f"pid_{rank}").read_text()) not in first
    back = {"w": torch.zeros(8, 8), f"r{rank}": torch.zeros(3)}
    dcp.load(back, checkpoint_id=f"{root}/fresh")
    res["fresh"] &= bool(back[f"r{rank}"].eq(1).all())
    return res


def test_a_dying_checkpoint_process_fails_the_save(run_distributed, tmp_path):
    world = 2
    results = run_distributed(_dies, world, str(tmp_path), timeout=300)
    for rank, res in enumerate(results):
        assert res["died"] is not None
        if rank == world - 1:
            assert "died, exit code 3" in res["died"]
            assert "died" in res["next"] and "shutdown" in res["next"]
        assert res["fresh"]
    assert not (tmp_path / "die" / ".metadata").exists()


def _failures(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    res: dict = {}
    sd = {"w": torch.full((8, 8), float(rank)), f"r{rank}": torch.ones(3)}
    # without collectives, a rank that fails still meets the others at the
    # end, in a thread and in the checkpoint process
    for mode in (None, THREAD, PROCESS):
        name = "sync" if mode is None else mode.value
        writer = _FailingWriter(f"{root}/nc_{name}", world - 1)
        try:
            if mode is None:
                dcp.save(sd, storage_writer=writer, use_collectives=False)
            else:
                dcp.async_save(sd, storage_writer=writer, use_collectives=False,
                               async_checkpointer_type=mode).result(timeout=120)
            res[name] = "ok"
        except dcp.CheckpointException as e:
            res[name] = sorted(e.failures)
        except OSError as e:  # without collectives a rank's own error is raised as is
            res[name] = e.errno
    # a rank whose staging fails takes part in the PROCESS save, failing
    bad = dict(sd)
    if rank == world - 1:
        bad["lock"] = threading.Lock()
    fut = dcp.async_save(bad, checkpoint_id=f"{root}/bad", async_checkpointer_type=PROCESS)
    res["bad_staged"] = fut.staging_completion.exception() is None
    try:
        fut.result(timeout=120)
        res["bad"] = None
    except dcp.CheckpointException as e:
        res["bad"] = (sorted(e.failures), "lock" in str(e))
    dist.barrier()
    res["bad_committed"] = os.path.exists(f"{root}/bad/.metadata")
    # async_save keeps nothing of a finished save: a failure's traceback
    # holds the staged state (and its shared arena) until it is dropped
    finished = weakref.ref(fut)
    del fut
    for t in threading.enumerate():
        if t.name == "shardstate-async-save":
            t.join(timeout=60)
    _staging._pool._free.clear()
    gc.collect()
    res["kept"] = (finished() is not None, len(_staging._all_arenas))
    return res


def test_failures_reach_every_rank_and_none_waits(run_distributed, tmp_path):
    world = 2
    for rank, res in enumerate(run_distributed(_failures, world, str(tmp_path), timeout=300)):
        failed = rank == world - 1
        for name in ("sync", "thread"):
            assert res[name] == (28 if failed else "ok"), (name, res)
        # the checkpoint process's errors come back as CheckpointException
        assert res["process"] == ([rank] if failed else "ok"), res
        assert res["bad_staged"] == (not failed)
        assert res["bad"] == ([world - 1], True)
        assert not res["bad_committed"]
        assert res["kept"] == (False, 0), res
