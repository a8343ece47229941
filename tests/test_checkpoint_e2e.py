"""End to end: ``shardstate.checkpoint`` with its own defaults against torch 2.13 DCP.

Everything here goes through the user-facing calls only
(``dcp.save(sd, checkpoint_id=path)`` / ``dcp.load(sd, checkpoint_id=path)``
with the default planners and FileSystemWriter/Reader), and checks the
result against ``torch.distributed.checkpoint`` itself: the same files byte
for byte, cross-loads both ways, and resharding between every pair of world
sizes 1..4 with DTensors (uneven, empty and zero-size shards) and
ShardedTensors saved and loaded in different placements (and from a 2x2
mesh to every world size), plus an FSDP2 model and its Adam state saved by
2 ranks and loaded by 3.

Process start-up dominates, so the reshard matrix runs in eight
``run_distributed`` calls: one per saving world size (which also
round-trips and compares the files with torch's), then one per loading world
size that loads every saved checkpoint. One world-3 run covers failures that
must reach every rank, process groups and async_save across ranks; the
rest runs in this process (no process group: no_dist is implied).

Where we differ from torch on purpose the test asserts our documented
behaviour: a refused ``.metadata`` is a StorageFormatError caused by an
UnsafePickleError, error messages print shapes as tuples, corrupted tensor
bytes are detected (torch 2.13 loads them silently), and bytes items land
in the caller's dict with ``flatten_state_dict=False``.
"""

from __future__ import annotations

import os
import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shardstate.checkpoint as dcp
import torch
import torch.distributed.checkpoint as tdcp
from _dtypes import DTYPES, seeded
from shardstate import ChecksumError
from shardstate.checkpoint._pickle import loads_metadata

# torch's save/load without a process group warn that they run in one process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

WORLDS = (1, 2, 3, 4)

# ---------------------------------------------------------------------------
# The DTensor reshard matrix
# ---------------------------------------------------------------------------

# name -> (global shape, dtype); every size is uneven over 2, 3 and 4 ranks.
_GLOBALS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "a": ((7, 5), torch.float32),
    "b": ((13,), torch.float64),
    "c": ((6, 7), torch.int64),
    "h": ((5, 3), torch.bfloat16),
    "e": ((2, 3), torch.int16),  # empty shards on ranks 2 and 3 along dim 0
    "z": ((0, 4), torch.float32),  # no elements at all
    "k": ((3, 6), torch.bool),
}
# key -> (global tensor, placement saved, placement loaded)
_CASES: dict[str, tuple[str, str, str]] = {
    "a_s0": ("a", "s0", "s1"),
    "a_s1": ("a", "s1", "r"),
    "a_r": ("a", "r", "s0"),
    "b_s0": ("b", "s0", "r"),
    "b_r": ("b", "r", "s0"),
    "c_s1": ("c", "s1", "s0"),
    "h_s0": ("h", "s0", "s1"),
    "e_s0": ("e", "s0", "s1"),
    "e_s1": ("e", "s1", "s0"),
    "z_s0": ("z", "s0", "r"),
    "k_s1": ("k", "s1", "s0"),
    "a_t": ("a", "s0", "t"),  # "t": a plain tensor holding the whole value
    "b_t": ("b", "t", "s0"),
}


def _global(name: str) -> torch.Tensor:
    shape, dtype = _GLOBALS[name]
    n = 1
    for s in shape:
        n *= s
    values = torch.arange(n, dtype=torch.float64).reshape(shape)
    if dtype == torch.bool:
        return (values % 3) == 1
    return (values * 0.5 - 3).to(dtype)


def _placement(code: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if code == "r" else Shard(int(code[1:]))


def _rank_only(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32) + 100 * rank


def _dist_sd(world: int, rank: int, which: int, zero: bool) -> dict:
    """The reshard state dict; ``which`` 1 = saved placements, 2 = loaded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd: dict = {}
    for key, case in _CASES.items():
        g = _global(case[0])
        g = torch.zeros_like(g) if zero else g
        if case[which] == "t":
            sd[key] = g
            continue
        # src_data_rank=None: every rank cuts its own shard (gloo can't scatter bool)
        sd[key] = distribute_tensor(g, mesh, [_placement(case[which])], src_data_rank=None)
    # legacy ShardedTensor, chunked along dim 0 when saved and dim 1 when loaded
    sd["st"] = _sharded(world, which - 1, fill=not zero)
    plain = torch.arange(10, dtype=torch.int32)
    sd["plain"] = torch.zeros_like(plain) if zero else plain
    sd["nested"] = {"lr": None if zero else 0.25,
                    "bufs": [torch.zeros(3) if zero else torch.full((3,), 2.0),
                             torch.zeros(2, 2) if zero else torch.eye(2)]}
    sd["step"] = None if zero else 11
    return sd


def _check_loaded(sd: dict, where: str, which: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    for key, case in _CASES.items():
        got = sd[key]
        if case[which] == "t":
            want = _global(case[0])
            assert type(got) is torch.Tensor and got.dtype == want.dtype, f"{where}: {key}"
            assert torch.equal(got, want), f"{where}: {key}"
            continue
        want = distribute_tensor(_global(case[0]), got.device_mesh, got.placements,
                                 src_data_rank=None)
        assert got.placements == want.placements and got.shape == want.shape, f"{where}: {key}"
        got, want = got.to_local(), want.to_local()
        assert got.dtype == want.dtype and torch.equal(got, want), f"{where}: {key}"
    assert _sharded_equal(sd["st"]), f"{where}: st"
    assert torch.equal(sd["plain"], torch.arange(10, dtype=torch.int32)), where
    assert sd["nested"]["lr"] == 0.25 and sd["step"] == 11, where
    assert torch.equal(sd["nested"]["bufs"][0], torch.full((3,), 2.0)), where
    assert torch.equal(sd["nested"]["bufs"][1], torch.eye(2)), where


def _metadata_pair(path: Path) -> tuple[Any, Any]:
    raw = (path / ".metadata").read_bytes()
    return pickle.loads(raw), loads_metadata(raw)  # plain pickle: our own test output


def _compare_with_torch(ours: Path, theirs: Path) -> None:
    names = sorted(os.listdir(ours))
    assert names == sorted(os.listdir(theirs))
    for n in names:
        if n.endswith(".distcp"):
            assert (ours / n).read_bytes() == (theirs / n).read_bytes(), n
    (t_ours, s_ours), (t_theirs, s_theirs) = _metadata_pair(ours), _metadata_pair(theirs)
    # torch's classes (plain pickle) and ours (restricted reader) agree.
    for a, b in ((t_ours, t_theirs), (s_ours, s_theirs)):
        assert a.state_dict_metadata == b.state_dict_metadata
        assert a.storage_data == b.storage_data
        assert a.planner_data == b.planner_data
        assert a.version == b.version
    assert sorted(t_ours.state_dict_metadata) == sorted(s_ours.state_dict_metadata)
    assert str(s_ours.storage_meta.checkpoint_id) == str(ours)


# On a 2x2 mesh (world size 4): key -> placements saved.
_MESH2D: dict[str, tuple[str, str]] = {"m_ss": ("s0", "s1"), "m_rs": ("r", "s0"),
                                       "m_s1s1": ("s1", "s1")}


def _mesh2d_sd(zero: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    g = _global("a")
    return {k: distribute_tensor(torch.zeros_like(g) if zero else g, mesh,
                                 [_placement(p) for p in pl], src_data_rank=None)
            for k, pl in _MESH2D.items()}


def _load_mesh2d(world: int, root: str) -> None:
    """Loads the 2x2-mesh checkpoints into Shard(1) on a 1-D mesh, or on 2x2
    into (Shard(1), Replicate())."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2) if world == 4 else (world,))
    pl = [_placement("s1"), _placement("r")] if world == 4 else [_placement("s1")]
    want = distribute_tensor(_global("a"), mesh, pl, src_data_rank=None).to_local()
    for load, src in ((dcp.load, "ss"), (dcp.load, "t"), (tdcp.load, "ss")):
        out = {k: distribute_tensor(torch.zeros(7, 5), mesh, pl, src_data_rank=None)
               for k in _MESH2D}
        load(out, checkpoint_id=f"{root}/{src}_2d")
        for k in _MESH2D:
            assert torch.equal(out[k].to_local(), want), f"{src}_2d {k} loaded at {world}"


def _fsdp_model(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model under FSDP2 (fully_shard) on a CPU mesh, with Adam."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _fsdp_full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": v.full_tensor() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def _fsdp_save(rank: int, world: int, root: str) -> None:
    """Model and optimizer trained a step further than _fsdp_model's."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp_model(world)
    torch.manual_seed(1)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/fsdp_ss")
    tdcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/fsdp_t")
    full = _fsdp_full(model, opt)
    dist.barrier()
    if rank == 0:
        _compare_with_torch(Path(root, "fsdp_ss"), Path(root, "fsdp_t"))
        torch.save(full, f"{root}/fsdp_want.pt")


def _fsdp_load(world: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    want = torch.load(f"{root}/fsdp_want.pt", weights_only=True)
    for load, src in ((dcp.load, "fsdp_ss"), (dcp.load, "fsdp_t"), (tdcp.load, "fsdp_ss")):
        model, opt = _fsdp_model(world)
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        load(sd, checkpoint_id=f"{root}/{src}")
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        got = _fsdp_full(model, opt)
        assert got.keys() == want.keys(), src
        for k in want:
            assert torch.equal(got[k], want[k]), f"{src} loaded at {world}: {k}"


def _save_at(rank: int, world: int, root: str) -> list[str]:
    import torch.distributed as dist

    sd = _dist_sd(world, rank, 1, zero=False)
    sd[f"only_{rank}"] = _rank_only(rank)
    # The same key with a different value on each rank: torch keeps one
    # rank's copy; the byte comparison shows we keep the same one.
    sd["tag"] = f"rank{rank}"
    sd["diverged"] = torch.full((5,), float(rank))
    md = dcp.save(sd, checkpoint_id=f"{root}/ss_{world}")
    tdcp.save(sd, checkpoint_id=Path(root, f"t_{world}"))
    dist.barrier()
    if rank == 0:
        _compare_with_torch(Path(root, f"ss_{world}"), Path(root, f"t_{world}"))
    # Replicated items written by the lowest rank, and saves without
    # collectives (every rank writes its own __{rank}.metadata): as torch.
    for name, kw, tkw in (
            ("low", {"planner": dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)},
             {"planner": tdcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)}),
            ("nc", {"use_collectives": False}, {"use_collectives": False})):
        dcp.save(sd, checkpoint_id=f"{root}/ss_{name}_{world}", **kw)
        tdcp.save(sd, checkpoint_id=f"{root}/t_{name}_{world}", **tkw)
    dist.barrier()
    if rank == 0:
        _compare_with_torch(Path(root, f"ss_low_{world}"), Path(root, f"t_low_{world}"))
        ours, theirs = Path(root, f"ss_nc_{world}"), Path(root, f"t_nc_{world}")
        assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
        assert f"__{world - 1}.metadata" in os.listdir(ours)
        for n in os.listdir(ours):
            if n.endswith(".distcp"):
                assert (ours / n).read_bytes() == (theirs / n).read_bytes(), n
            else:
                a, b = (loads_metadata((d / n).read_bytes()) for d in (ours, theirs))
                assert a.state_dict_metadata == b.state_dict_metadata, n
                assert a.storage_data == b.storage_data, n
    for src in ("ss_nc", "t_nc"):  # each rank reads its own __{rank}.metadata
        out = _dist_sd(world, rank, 1, zero=True)
        out[f"only_{rank}"] = torch.zeros(6)
        dcp.load(out, checkpoint_id=f"{root}/{src}_{world}")
        _check_loaded(out, f"{src} at {world}", 1)
        assert torch.equal(out[f"only_{rank}"], _rank_only(rank))
    if world == 2:
        _fsdp_save(rank, world, root)
    if world == 4:
        sd2 = _mesh2d_sd(zero=False)
        dcp.save(sd2, checkpoint_id=f"{root}/ss_2d")
        tdcp.save(sd2, checkpoint_id=f"{root}/t_2d")
        dist.barrier()
        if rank == 0:
            _compare_with_torch(Path(root, "ss_2d"), Path(root, "t_2d"))
        out2 = _mesh2d_sd(zero=True)
        dcp.load(out2, checkpoint_id=f"{root}/ss_2d")
        for k, v in out2.items():
            assert torch.equal(v.to_local(), sd2[k].to_local()), k
    # Round trip at the same world size and placements.
    out = _dist_sd(world, rank, 1, zero=True)
    out[f"only_{rank}"] = torch.zeros(6)
    dcp.load(out, checkpoint_id=Path(root, f"ss_{world}"))
    _check_loaded(out, f"round trip at {world}", 1)
    assert torch.equal(out[f"only_{rank}"], _rank_only(rank))
    return sorted(md.state_dict_metadata)


def _load_at(rank: int, world: int, root: str) -> int:
    loads = 0
    for saved in WORLDS:
        src_rank = (rank + 1) % saved  # another rank's private tensor
        readers = (("ss", dcp.load), ("t", dcp.load), ("ss", tdcp.load))
        for src, load in readers:
            out = _dist_sd(world, rank, 2, zero=True)
            out[f"only_{src_rank}"] = torch.zeros(6)
            load(out, checkpoint_id=f"{root}/{src}_{saved}")
            where = f"{load.__module__} load of {src}_{saved} at {world}"
            _check_loaded(out, where, 2)
            assert torch.equal(out[f"only_{src_rank}"], _rank_only(src_rank)), where
            loads += 1
    _load_mesh2d(world, root)
    if world == 3:
        _fsdp_load(world, root)  # saved by 2 ranks
    return loads


@pytest.mark.distributed_timeout(150)
def test_reshard_matrix_against_torch(tmp_path, run_distributed):
    for world in reversed(WORLDS):  # the 2x2-mesh checkpoint is saved at 4
        keys = run_distributed(_save_at, world, str(tmp_path))
        assert all(k == keys[0] for k in keys)
        assert {f"only_{r}" for r in range(world)} <= set(keys[0])
        assert {"a_s0", "nested.bufs.0", "nested.lr", "step"} <= set(keys[0])
    for world in WORLDS:
        assert run_distributed(_load_at, world, str(tmp_path)) == [12] * world


# ---------------------------------------------------------------------------
# Failures across ranks, corruption, ShardedTensor, async_save, process
# groups (one world-3 run)
# ---------------------------------------------------------------------------

class _RaisingLoadPlanner(dcp.DefaultLoadPlanner):
    def create_local_plan(self):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("load planner refused on rank 1")
        return super().create_local_plan()


class _BrokenStateful(dcp.Stateful):
    def state_dict(self) -> dict:
        raise RuntimeError("state_dict broke on this rank")

    def load_state_dict(self, sd: dict) -> None:
        raise AssertionError("not reached")


def _failure(fn, *args, **kwargs) -> tuple[list[int], str]:
    try:
        fn(*args, **kwargs)
    except dcp.CheckpointException as e:
        return sorted(e.failures), str(e)
    raise AssertionError(f"{fn.__name__} did not raise CheckpointException")


def _sharded(world: int, dim: int, fill: bool) -> Any:
    from torch.distributed._shard.sharded_tensor import empty as st_empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = st_empty(spec, 7, 5)
    g = _global("a")
    for shard in st.local_shards():
        o, s = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(g[o[0]:o[0] + s[0], o[1]:o[1] + s[1]] if fill else 0)
    return st


def _sharded_equal(st: Any) -> bool:
    g = _global("a")
    for shard in st.local_shards():
        o, s = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if not torch.equal(shard.tensor, g[o[0]:o[0] + s[0], o[1]:o[1] + s[1]]):
            return False
    return True


def _errors(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    res: dict = {}
    ok = f"{root}/ok"
    dcp.save({"w": distribute_tensor(_global("a"), mesh, [Shard(0)]), "x": torch.ones(3),
              "st": _sharded(world, 0, True)}, checkpoint_id=ok)

    def w0() -> Any:
        return distribute_tensor(torch.zeros(7, 5), mesh, [Shard(1)])

    res["missing"] = _failure(dcp.load, {"w": w0(), "nope": torch.zeros(2)}, checkpoint_id=ok)
    res["shape"] = _failure(dcp.load, {"x": torch.zeros(4)}, checkpoint_id=ok)
    res["planner"] = _failure(dcp.load, {"w": w0()}, checkpoint_id=ok,
                              planner=_RaisingLoadPlanner())
    # A Stateful whose state_dict() raises on rank 2 only, saving and loading.
    app = _BrokenStateful() if rank == 2 else Counter(rank)
    res["stateful"] = [_failure(dcp.save, {"app": app}, checkpoint_id=f"{root}/app"),
                       _failure(dcp.load, {"app": app, "x": torch.zeros(3)}, checkpoint_id=ok,
                                planner=dcp.DefaultLoadPlanner(allow_partial_load=True))]

    # A value only rank 1 holds cannot be pickled: the write fails there, every
    # rank hears of it, and nothing is committed.
    bad = {"w": distribute_tensor(_global("a"), mesh, [Shard(0)])}
    if rank == 1:
        bad["lock_1"] = threading.Lock()
    res["unpicklable"] = _failure(dcp.save, bad, checkpoint_id=f"{root}/bad")
    dist.barrier()
    res["bad_committed"] = os.path.exists(f"{root}/bad/.metadata")
    # The same failure saving over a good checkpoint: the old .metadata is
    # gone (it would describe files now partly rewritten); async too.
    dcp.save({"w": bad["w"]}, checkpoint_id=f"{root}/over")
    dist.barrier()
    fut = dcp.async_save(bad, checkpoint_id=f"{root}/over")  # rank 1 can't stage it
    res["over"] = _failure(fut.result, timeout=60)
    res["over_staged"] = fut.staging_completion.exception() is None
    dist.barrier()
    res["over_committed"] = os.path.exists(f"{root}/over/.metadata")

    # ShardedTensor: ours -> torch and ours -> ours, resharded along dim 1.
    for load in (tdcp.load, dcp.load):
        st = _sharded(world, 1, False)
        load({"st": st}, checkpoint_id=ok)
        res[f"st_{load.__module__}"] = _sharded_equal(st)
    dcp.save({"st": _sharded(world, 1, True)}, checkpoint_id=f"{root}/st_t")
    st = _sharded(world, 0, False)
    dcp.load({"st": st}, checkpoint_id=f"{root}/st_t")
    res["st_resaved"] = _sharded_equal(st)

    # async_save of DTensors: the shards are changed once staging returns.
    live = {"w": distribute_tensor(_global("a"), mesh, [Shard(1)]), "step": 3}
    fut = dcp.async_save(live, checkpoint_id=f"{root}/async")
    assert fut.staging_completion.done()
    live["w"].to_local().add_(1000)
    live["step"] = 4
    fut.result(timeout=60)
    back = {"w": distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0)]), "step": None}
    tdcp.load(back, checkpoint_id=f"{root}/async")
    res["async"] = torch.equal(back["w"].full_tensor(), _global("a")) and back["step"] == 3
    # Saves started back to back, without waiting: all complete, in order.
    futs = [dcp.async_save({f"v{j}": torch.full((9, 4), float(i)) for j in range(8)} | {"i": i},
                           checkpoint_id=f"{root}/async{i}") for i in range(4)]
    for f in futs:
        f.result(timeout=60)
    for i in range(4):
        back = {"v7": torch.zeros(9, 4), "i": None}
        dcp.load(back, checkpoint_id=f"{root}/async{i}")
        res["async"] &= torch.equal(back["v7"], torch.full((9, 4), float(i))) and back["i"] == i

    # process_group: ranks 1 and 2 save and load as group ranks 0 and 1,
    # while rank 0 saves on its own (no_dist).
    group = dist.new_group([1, 2])
    if rank == 0:
        mine = {"x": torch.arange(4.0), "n": "solo"}
        dcp.save(mine, checkpoint_id=f"{root}/solo", no_dist=True)
        tdcp.save(mine, checkpoint_id=f"{root}/solo_t", no_dist=True)
        _compare_with_torch(Path(root, "solo"), Path(root, "solo_t"))
        back = {"x": torch.zeros(4), "n": None}
        dcp.load(back, checkpoint_id=f"{root}/solo", no_dist=True)
        res["group"] = torch.equal(back["x"], mine["x"]) and back["n"] == "solo"
    else:
        grank = rank - 1
        mine = {f"x{grank}": torch.full((4,), float(rank)), "shared": torch.arange(5)}
        dcp.save(mine, checkpoint_id=f"{root}/sub", process_group=group)
        tdcp.save(mine, checkpoint_id=f"{root}/sub_t", process_group=group)
        dist.barrier(group=group)
        if grank == 0:
            _compare_with_torch(Path(root, "sub"), Path(root, "sub_t"))
            assert sorted(os.listdir(f"{root}/sub")) == [".metadata", "__0_0.distcp",
                                                         "__1_0.distcp"]
        other = 1 - grank
        ok_all = True
        for load, src in ((dcp.load, "sub_t"), (tdcp.load, "sub"), (dcp.load, "sub")):
            back = {f"x{other}": torch.zeros(4), "shared": torch.zeros(5, dtype=torch.int64)}
            load(back, checkpoint_id=f"{root}/{src}", process_group=group)
            ok_all &= torch.equal(back[f"x{other}"], torch.full((4,), float(other + 1)))
            ok_all &= torch.equal(back["shared"], torch.arange(5))
        # async_save on the subgroup, which rank 0 takes no part in
        fut = dcp.async_save(mine, checkpoint_id=f"{root}/sub_async", process_group=group)
        fut.result(timeout=60)
        back = {f"x{other}": torch.zeros(4)}
        tdcp.load(back, checkpoint_id=f"{root}/sub_async", process_group=group)
        ok_all &= torch.equal(back[f"x{other}"], torch.full((4,), float(other + 1)))
        res["group"] = ok_all
    # every rank still agrees on new groups (a hang here means they don't)
    t = torch.ones(1)
    dist.all_reduce(t, group=dist.new_group([0, 1, 2]))
    res["group"] &= float(t) == 3.0
    dist.barrier()

    # Corrupt one byte of rank 1's shard of "w": every rank fails, naming it.
    dist.barrier()
    if rank == 0:
        md = pickle.loads(Path(ok, ".metadata").read_bytes())
        (idx, info), = [(i, s) for i, s in md.storage_data.items()
                        if i.fqn == "w" and i.offset[0] == 3]
        path = Path(ok, info.relative_path)
        raw = bytearray(path.read_bytes())
        data = _global("a")[3:6].numpy().tobytes()  # rank 1 holds rows 3..5
        pos = bytes(raw[info.offset:info.offset + info.length]).find(data)
        assert pos > 0
        raw[info.offset + pos + len(data) // 2] ^= 0x10
        path.write_bytes(bytes(raw))
        res["corrupted_file"] = info.relative_path
    dist.barrier()
    res["corrupt"] = _failure(dcp.load, {"w": w0()}, checkpoint_id=ok)
    return res


@pytest.mark.distributed_timeout(120)
def test_failures_reach_every_rank(tmp_path, run_distributed):
    results = run_distributed(_errors, 3, str(tmp_path))
    corrupted = results[0]["corrupted_file"]
    for rank, res in enumerate(results):
        ranks, text = res["missing"]
        assert ranks == [0, 1, 2] and "nope" in text, text
        ranks, text = res["shape"]
        assert ranks == [0, 1, 2] and "ValueError" in text, text
        assert "'x' with shape (3,), the destination has shape (4,)" in text, text
        ranks, text = res["planner"]
        assert ranks == [1] and "load planner refused on rank 1" in text, text
        for ranks, text in res["stateful"]:
            assert ranks == [2] and "state_dict broke on this rank" in text, text
        ranks, text = res["unpicklable"]
        assert ranks == [1] and "lock" in text.lower(), text
        assert not res["bad_committed"]
        ranks, text = res["over"]
        assert ranks == [1] and "lock" in text.lower(), text
        assert not res["over_committed"]
        assert res["over_staged"] == (rank != 1)
        assert res["st_torch.distributed.checkpoint.state_dict_loader"], rank
        assert res["st_shardstate.checkpoint.state_dict_loader"], rank
        assert res["st_resaved"], rank
        assert res["async"], rank
        assert res["group"], rank
        ranks, text = res["corrupt"]
        assert ranks and "ChecksumError" in text and "'w'" in text and corrupted in text, text


# ---------------------------------------------------------------------------
# Single process (no process group: no_dist is implied)
# ---------------------------------------------------------------------------



class Counter:
    """A Stateful object."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls: list[str] = []

    def state_dict(self) -> dict:
        self.calls.append("state_dict")
        return {"n": torch.tensor(self.n), "name": f"counter{self.n}"}

    def load_state_dict(self, sd: dict) -> None:
        self.calls.append("load_state_dict")
        self.n = int(sd["n"])
        assert sd["name"] == f"counter{self.n}"


def _rich_sd() -> dict:
    big = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    sd: dict = {f"t_{str(dt)[6:]}": seeded(dt, (4, 3), i) for i, dt in enumerate(DTYPES)}
    sd.update({f"s_{str(dt)[6:]}": seeded(dt, (), 50 + i) for i, dt in enumerate(DTYPES)})
    sd.update({
        "empty": torch.empty(0, 3),
        "empty_i": torch.empty(4, 0, dtype=torch.int16),
        "transposed": big.t(),
        "sliced": big[1:5, 2:7],
        "stepped": big[:, ::3],
        "c64": torch.randn(3, 2, dtype=torch.complex64),
        "param": torch.nn.Parameter(torch.linspace(0, 1, 6).reshape(2, 3)),
        "np": np.arange(12, dtype=np.float32).reshape(3, 4),
        "np_i": np.array([[1, 2], [3, 4]], dtype=np.int64),
        "np0": np.array(3.5, dtype=np.float32),
        "np_t": np.arange(12, dtype=np.float64).reshape(3, 4).T,  # written contiguous
        "np_b": np.array([True, False, True]),
        "np_scalar": np.float32(2.5),  # a bytes item
        "int": 7, "str": "adam", "list": [1, "two", 3.0], "path": Path("/data/x"),
        "dict": {"betas": (0.9, 0.999), "flag": True, "none": None},
        "nested": {"layers": [{"w": torch.ones(2, 3), "b": torch.zeros(3)},
                              {"w": torch.full((2, 3), 2.0), "tag": "L1"}],
                   "bufs": [torch.arange(4), [torch.tensor(1.5), "deep"]]},
    })
    return sd


def _as_torch(sd: dict) -> dict:
    """NumPy arrays as the contiguous torch tensors they are saved as."""
    return {k: (torch.from_numpy(np.asarray(v, order="C")) if isinstance(v, np.ndarray) else v)
            for k, v in sd.items()}


def _blank(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return torch.zeros(v.shape, dtype=v.dtype)
    if isinstance(v, np.ndarray):
        return np.zeros_like(v)
    if isinstance(v, dict):
        return {k: _blank(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_blank(x) for x in v]
    return None


def _same(a: Any, b: Any, key: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b), key
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), key
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), key
        for k in a:
            _same(a[k], b[k], f"{key}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), key
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{key}.{i}")
    else:
        assert type(a) is type(b) and a == b, key


def test_values_round_trip_and_match_torch_byte_for_byte(tmp_path):
    sd = _rich_sd()
    dcp.save(sd, checkpoint_id=tmp_path / "ours")
    torch_sd = _as_torch(sd)
    tdcp.save(torch_sd, checkpoint_id=tmp_path / "theirs")
    _compare_with_torch(tmp_path / "ours", tmp_path / "theirs")

    # ours -> ours (NumPy destinations come back as NumPy)
    out = _blank(sd)
    dcp.load(out, checkpoint_id=tmp_path / "ours")
    _same(out, sd)
    # torch -> ours and ours -> torch, torch tensors as destinations
    for load, src in ((dcp.load, "theirs"), (tdcp.load, "ours")):
        out = _blank(torch_sd)
        load(out, checkpoint_id=str(tmp_path / src))
        _same(out, torch_sd, src)
    # the non-contiguous sources were not disturbed
    assert not sd["transposed"].is_contiguous() and sd["stepped"].stride() == (10, 3)


def test_stateful_and_partial_load(tmp_path):
    c = Counter(41)
    dcp.save({"model": c, "w": torch.arange(5.0), "extra": torch.ones(2)},
             checkpoint_id=tmp_path)
    assert c.calls == ["state_dict"]

    dest = Counter(0)
    out = {"model": dest, "w": torch.zeros(5)}
    dcp.load(out, checkpoint_id=tmp_path)  # "extra" not asked for: fine
    assert dest.n == 41 and dest.calls == ["state_dict", "load_state_dict"]
    assert out["model"] is dest and torch.equal(out["w"], torch.arange(5.0))

    # torch's load also drives our Stateful through the same protocol
    dest2 = Counter(0)
    tdcp.load({"model": dest2}, checkpoint_id=tmp_path)
    assert dest2.n == 41

    # keys absent from the checkpoint: an error naming them, unless partial
    out = {"w": torch.zeros(5), "new_head": torch.full((3,), 9.0)}
    with pytest.raises(dcp.CheckpointException, match="new_head"):
        dcp.load(out, checkpoint_id=tmp_path)
    dcp.load(out, checkpoint_id=tmp_path,
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(out["w"], torch.arange(5.0))
    assert torch.equal(out["new_head"], torch.full((3,), 9.0))  # untouched


def test_wrong_shape_names_key_and_both_shapes(tmp_path):
    dcp.save({"w": torch.ones(3, 4)}, checkpoint_id=tmp_path)
    with pytest.raises(dcp.CheckpointException) as e:
        dcp.load({"w": torch.zeros(4, 3)}, checkpoint_id=tmp_path)
    (exc, _), = e.value.failures.values()
    assert isinstance(exc, ValueError) and "'w'" in str(exc), exc
    assert "(3, 4)" in str(exc) and "(4, 3)" in str(exc), exc


def test_corrupted_byte_is_detected(tmp_path):
    w = torch.arange(64, dtype=torch.float32)
    dcp.save({"w": w, "u": torch.ones(3)}, checkpoint_id=tmp_path)
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    (info,) = [s for i, s in md.storage_data.items() if i.fqn == "w"]
    path = tmp_path / info.relative_path
    raw = bytearray(path.read_bytes())
    # the tensor's bytes end just before the record's trailer; flip one in the middle
    pos = bytes(raw[info.offset:info.offset + info.length]).find(w.numpy().tobytes())
    assert pos > 0
    raw[info.offset + pos + 77] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(dcp.CheckpointException) as e:
        dcp.load({"w": torch.zeros(64)}, checkpoint_id=tmp_path)
    (exc, _), = e.value.failures.values()
    assert isinstance(exc, ChecksumError), exc
    assert "'w'" in str(exc) and info.relative_path in str(exc), exc
    # (torch 2.13's reader does not check: it loads the flipped value silently)
    back = {"w": torch.zeros(64)}
    tdcp.load(back, checkpoint_id=tmp_path)
    assert not torch.equal(back["w"], w)
    # the untouched item still loads
    out = {"u": torch.zeros(3)}
    dcp.load(out, checkpoint_id=tmp_path)
    assert torch.equal(out["u"], torch.ones(3))


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_no_flipped_byte_loads_wrong_values(tmp_path):
    # Every byte of a record flipped in turn: the load fails, or (for bytes
    # that carry no meaning: zip timestamps, memo indices, the random
    # serialization id) gives exactly the saved values. Every flip inside
    # the tensor's bytes fails.
    w = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    dcp.save({"w": w}, checkpoint_id=tmp_path)
    path = tmp_path / "__0_0.distcp"
    orig = path.read_bytes()
    data = orig.find(w.numpy().tobytes())
    caught = set()
    for i in range(len(orig)):
        raw = bytearray(orig)
        raw[i] ^= 0x10
        path.write_bytes(bytes(raw))
        out = {"w": torch.zeros(3, 5)}
        try:
            dcp.load(out, checkpoint_id=tmp_path)
        except dcp.CheckpointException:
            caught.add(i)
            continue
        assert torch.equal(out["w"], w), f"byte {i} flipped: wrong values loaded silently"
    assert set(range(data, data + 60)) <= caught
    assert len(caught) > len(orig) // 2


def test_metadata_that_runs_code_is_refused(tmp_path):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path)
    marker = tmp_path / "PWNED"
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    md.planner_data = _Evil(str(marker))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(dcp.CheckpointException) as e:
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=tmp_path)
    (exc, _), = e.value.failures.values()
    # the refusal is reported as a StorageFormatError naming the file and global
    assert isinstance(exc, dcp.StorageFormatError), exc
    assert isinstance(exc.__cause__, dcp.UnsafePickleError), exc.__cause__
    assert ".metadata" in str(exc) and "system" in str(exc), exc
    assert not marker.exists()


def test_async_save_keeps_staged_values(tmp_path):
    sd = {"w": torch.zeros(256, 64), "np": np.zeros(5), "meta": {"step": 1}}
    fut = dcp.async_save(sd, checkpoint_id=tmp_path)
    assert fut.staging_completion.done()
    sd["w"].add_(1.0)
    sd["np"] += 3
    sd["meta"]["step"] = 2
    md = fut.result(timeout=60)
    assert "w" in md.state_dict_metadata
    out = {"w": torch.full((256, 64), 5.0), "np": np.ones(5), "meta": {"step": None}}
    dcp.load(out, checkpoint_id=tmp_path)
    assert torch.equal(out["w"], torch.zeros(256, 64))
    assert np.array_equal(out["np"], np.zeros(5)) and out["meta"]["step"] == 1
    back = {"w": torch.ones(256, 64)}
    tdcp.load(back, checkpoint_id=tmp_path)
    assert torch.equal(back["w"], torch.zeros(256, 64))


def test_save_over_existing_checkpoint(tmp_path):
    dcp.save({"w": torch.ones(4), "old_only": torch.ones(2), "s": "old"}, checkpoint_id=tmp_path)
    with pytest.warns(UserWarning, match="overwriting"):  # as torch warns
        dcp.save({"w": torch.full((4,), 3.0), "s": "new"}, checkpoint_id=tmp_path)
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp"]
    out = {"w": torch.zeros(4), "s": None}
    dcp.load(out, checkpoint_id=tmp_path)
    assert torch.equal(out["w"], torch.full((4,), 3.0)) and out["s"] == "new"
    with pytest.raises(dcp.CheckpointException, match="old_only"):
        dcp.load({"old_only": torch.zeros(2)}, checkpoint_id=tmp_path)
    back = {"w": torch.zeros(4)}
    tdcp.load(back, checkpoint_id=tmp_path)
    assert torch.equal(back["w"], torch.full((4,), 3.0))


@pytest.mark.parametrize("single_file, threads", [(False, 1), (True, 3)])
def test_loads_torch_checkpoints_of_any_layout(tmp_path, single_file, threads):
    sd = _rich_sd()
    sd = _as_torch(sd)
    tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(
        tmp_path, single_file_per_rank=single_file, thread_count=threads))
    out = _blank(sd)
    out["param"] = torch.nn.Parameter(torch.zeros(2, 3))
    dest = out["param"]
    dcp.load(out, checkpoint_id=tmp_path)
    _same(out, sd)
    assert out["param"] is dest and dest.requires_grad  # filled in place


class AppState(dcp.Stateful):
    """The DCP tutorial's wrapper: model and optimizer through
    torch.distributed.checkpoint.state_dict."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])


def _trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_model_and_optimizer_through_app_state(tmp_path):
    model, opt = _trained(0, 3)
    dcp.save({"app": AppState(model, opt), "epoch": 2}, checkpoint_id=tmp_path / "ours")
    tdcp.save({"app": AppState(model, opt), "epoch": 2}, checkpoint_id=tmp_path / "theirs")
    _compare_with_torch(tmp_path / "ours", tmp_path / "theirs")

    for load, src in ((dcp.load, "ours"), (dcp.load, "theirs"), (tdcp.load, "ours")):
        fresh, fresh_opt = _trained(1, 1)  # other weights, other optimizer state
        sd = {"app": AppState(fresh, fresh_opt), "epoch": 0}
        load(sd, checkpoint_id=tmp_path / src)
        assert sd["epoch"] == 2
        for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
            assert torch.equal(a, b), (src, k)
        want, got = opt.state_dict(), fresh_opt.state_dict()
        assert want["param_groups"] == got["param_groups"], src
        for i, st in want["state"].items():
            for k, v in st.items():
                assert torch.equal(v, got["state"][i][k]), (src, i, k)


def test_unflattened_nested_values_are_bytes_items(tmp_path):
    sd = {"nested": {"a": torch.ones(2), "b": 1, "l": [torch.arange(3), "s"]}, "t": torch.ones(3)}
    dcp.save(sd, checkpoint_id=tmp_path / "ours",
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    tdcp.save(sd, checkpoint_id=tmp_path / "theirs",
              planner=tdcp.DefaultSavePlanner(flatten_state_dict=False))
    _compare_with_torch(tmp_path / "ours", tmp_path / "theirs")  # tensors inside a bytes item
    for src in ("ours", "theirs"):
        out = {"nested": None, "t": torch.zeros(3)}
        dcp.load(out, checkpoint_id=tmp_path / src,
                 planner=dcp.DefaultLoadPlanner(flatten_state_dict=False))
        _same(out, sd, src)
    # Documented difference: torch writes bytes items only into its own copy
    # of the state dict when not flattening, so the caller's value stays.
    out = {"nested": None, "t": torch.zeros(3)}
    tdcp.load(out, checkpoint_id=tmp_path / "ours",
              planner=tdcp.DefaultLoadPlanner(flatten_state_dict=False))
    assert out["nested"] is None and torch.equal(out["t"], torch.ones(3))


def test_damaged_checkpoints_name_the_file(tmp_path):
    def error(sd: dict) -> BaseException:
        with pytest.raises(dcp.CheckpointException) as e:
            dcp.load(sd, checkpoint_id=tmp_path)
        (exc, _), = e.value.failures.values()
        return exc

    dcp.save({"w": torch.ones(100), "s": "x"},
             storage_writer=dcp.FileSystemWriter(tmp_path, single_file_per_rank=False))
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    (info,) = [s for i, s in md.storage_data.items() if i.fqn == "w"]
    path = tmp_path / info.relative_path
    path.write_bytes(path.read_bytes()[:info.length // 2])
    exc = error({"w": torch.zeros(100)})
    assert isinstance(exc, dcp.StorageFormatError) and "'w'" in str(exc), exc
    assert str(path) in str(exc) and "past the end" in str(exc), exc
    path.unlink()
    exc = error({"w": torch.zeros(100)})
    assert isinstance(exc, FileNotFoundError) and str(path) in str(exc), exc
    out = {"s": None}  # the other file is intact
    dcp.load(out, checkpoint_id=tmp_path)
    assert out["s"] == "x"
    (tmp_path / ".metadata").write_bytes((tmp_path / ".metadata").read_bytes()[:50])
    exc = error({"s": None})
    assert isinstance(exc, dcp.StorageFormatError) and ".metadata" in str(exc), exc
