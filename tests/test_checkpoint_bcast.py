"""Load once, broadcast: a saved chunk several ranks need is read from storage
by one rank and broadcast over the load's process group
(``FileSystemReader(broadcast_shared_reads=True)``; off by default on CPU).

Real gloo processes at world sizes 1-4 load checkpoints written by
shardstate and by torch 2.13 DCP (Shard(0) and Shard(1) over 2 ranks, and
plain tensors from one process) into Replicate(), Shard(0), Shard(1) DTensors
and plain tensors, with the option off (auto), on, and on with rounds so
small that every chunk gets its own broadcast (so chunks are received
straight into their destinations). Each load must give the saved values bit
for bit, and the reader's ``read_stats`` must show the storage bytes: with
broadcasting, every chunk's bytes read once over all ranks; without it, once
per rank for replicated targets. Failures - a corrupted record, an exception
on one rank before, during and after the broadcast rounds - must reach every
rank as one CheckpointException, with no hang and with the group still in
step for the next load.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import shardstate.checkpoint as dcp
import torch
import torch.distributed.checkpoint as tdcp
from _dtypes import seeded
from shardstate.checkpoint import _fs_bcast
from shardstate.checkpoint import filesystem as fs

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# name -> (shape, dtype); sizes uneven over 2, 3 and 4 ranks.
_SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w": ((64, 33), torch.float32),
    "h": ((40, 17), torch.bfloat16),
    "i": ((37,), torch.int64),
    "b": ((9, 12), torch.bool),
    "m": ((3, 1000), torch.float64),
    "e": ((0, 5), torch.float32),
}
_SCALAR = "z"  # a 0-d tensor: a plain tensor except in Replicate() loads
# checkpoint name -> (writer, saved placement)
_CKPTS = {
    "ss_s0": ("shardstate", "s0"),
    "ss_s1": ("shardstate", "s1"),
    "torch_s0": ("torch", "s0"),
    "torch_s1": ("torch", "s1"),
    "ss_full": ("shardstate", "t"),
    "torch_full": ("torch", "t"),
}
_TARGETS = ("r", "s0", "s1", "t")


def _full(name: str) -> torch.Tensor:
    if name == _SCALAR:
        return torch.tensor(2.5)
    shape, dtype = _SHAPES[name]
    return seeded(dtype, shape, seed=len(name) * 7 + ord(name))


def _nbytes(name: str) -> int:
    t = _full(name)
    return t.numel() * t.element_size()


def _names(target: str) -> list[str]:
    return [*_SHAPES, _SCALAR]


def _state(mesh: Any, target: str, zero: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    sd: dict = {}
    for n in _names(target):
        g = _full(n)
        g = torch.zeros_like(g) if zero else g
        if target == "t" or (n == _SCALAR and target != "r"):
            sd[n] = g
            continue
        dim = int(target[1:]) if target != "r" else 0
        place = Replicate() if target == "r" else Shard(min(dim, g.dim() - 1))
        sd[n] = distribute_tensor(g, mesh, [place], src_data_rank=None)
    return sd


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (dtype, shape and bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def _value(v: Any) -> torch.Tensor:
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def _save(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for name, (writer, placement) in _CKPTS.items():
        if placement == "t":
            continue
        sd = _state(mesh, placement, zero=False)
        (tdcp if writer == "torch" else dcp).save(sd, checkpoint_id=f"{root}/{name}")


def _load(rank: int, world: int, root: str) -> dict:
    """Every checkpoint into every target, with broadcasting off (auto), on,
    and on with one chunk per round: (ok, read_stats) per case."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for ck in _CKPTS:
        for target in _TARGETS:
            for mode, option, round_bytes in (("off", None, None), ("on", True, None),
                                              ("on1", True, 1)):
                sd = _state(mesh, target, zero=True)
                reader = fs.FileSystemReader(f"{root}/{ck}", broadcast_shared_reads=option)
                saved = _fs_bcast._BCAST_ROUND
                if round_bytes is not None:
                    _fs_bcast._BCAST_ROUND = round_bytes
                try:
                    dcp.load(sd, storage_reader=reader)
                finally:
                    _fs_bcast._BCAST_ROUND = saved
                ok = {n: _same(_value(sd[n]), _full(n)) for n in _names(target)}
                out[(ck, target, mode)] = (ok, dict(reader.read_stats))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    from shardstate.testing import run_distributed

    root = str(tmp_path_factory.mktemp("bcast"))
    run_distributed(_save, 2, root)
    plain = {n: _full(n) for n in _names("t")}
    dcp.save(plain, checkpoint_id=f"{root}/ss_full")
    tdcp.save(plain, checkpoint_id=f"{root}/torch_full")
    return root


@pytest.mark.distributed_timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_values_and_storage_bytes(checkpoints, run_distributed, world):
    results = run_distributed(_load, world, checkpoints)
    biggest = max(_nbytes(n) for n in _names("r"))
    for case, _ in results[0].items():
        ck, target, mode = case
        total = sum(_nbytes(n) for n in _names(target))
        for rank, res in enumerate(results):
            ok, _stats = res[case]
            assert all(ok.values()), (case, rank, ok)
        stats = [res[case][1] for res in results]
        read = [s["storage_bytes"] for s in stats]
        if mode == "off" or world == 1:
            assert all(s["broadcast_sent"] == s["broadcast_received"] == 0 for s in stats)
            if target in ("r", "t"):
                # every rank reads every chunk itself
                assert read == [total] * world, (case, read)
            continue
        # each chunk's bytes read from storage once, over all ranks
        assert sum(read) == total, (case, read, total)
        if target in ("r", "t"):
            # every rank gets from the others what it did not read
            for s in stats:
                assert s["broadcast_received"] == total - s["storage_bytes"], (case, stats)
                assert s["broadcast_sent"] == s["storage_bytes"], (case, stats)
            # the reads are balanced over the ranks (to within one chunk)
            if world <= 2:
                assert max(read) - min(read) <= biggest, (case, read)
        elif target == "s0" and ck.endswith("s0"):
            # disjoint row slabs are read once without broadcasting; only the
            # plain scalar every rank loads is
            assert sum(s["broadcast_sent"] for s in stats) == _nbytes(_SCALAR), (case, stats)
    if world > 1:
        # the resharding case broadcasting exists for: Shard(0) saved, Shard(1)
        # loaded; each rank would read every saved chunk whole
        off = sum(r[("ss_s0", "s1", "off")][1]["storage_bytes"] for r in results)
        on = sum(r[("ss_s0", "s1", "on")][1]["storage_bytes"] for r in results)
        assert off > on == sum(_nbytes(n) for n in _names("s1")), (off, on)


# ---------------------------------------------------------------------------
# Failures
# ---------------------------------------------------------------------------


def _failure(fn: Any, *args: Any, **kwargs: Any) -> tuple[list[int], str]:
    try:
        fn(*args, **kwargs)
    except dcp.CheckpointException as e:
        return sorted(e.failures), str(e)
    raise AssertionError("the load did not raise CheckpointException")


class _FailingPlanner(dcp.DefaultLoadPlanner):
    """Raises on one rank at one point of the load."""

    def __init__(self, rank: int, where: str, key: str) -> None:
        super().__init__()
        self.rank, self.where, self.key = rank, where, key

    def _maybe(self, where: str, fqn: str) -> None:
        import torch.distributed as dist

        if where == self.where and fqn == self.key and dist.get_rank() == self.rank:
            raise RuntimeError(f"planner refused {fqn!r} in {where} on rank {self.rank}")

    def finish_plan(self, plan: Any) -> Any:
        self._maybe("finish_plan", self.key)
        return super().finish_plan(plan)

    def resolve_tensor(self, read_item: Any) -> Any:
        self._maybe("resolve_tensor", read_item.dest_index.fqn)
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        self._maybe("commit_tensor", read_item.dest_index.fqn)
        super().commit_tensor(read_item, tensor)


def _errors(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    res: dict = {}

    def load(ck: str, target: str = "r", planner: Any = None, round_bytes: int | None = None,
             sd: dict | None = None) -> dict:
        sd = _state(mesh, target, zero=True) if sd is None else sd
        reader = fs.FileSystemReader(f"{root}/{ck}", broadcast_shared_reads=True)
        saved = _fs_bcast._BCAST_ROUND
        if round_bytes is not None:
            _fs_bcast._BCAST_ROUND = round_bytes
        try:
            dcp.load(sd, storage_reader=reader, planner=planner)
        finally:
            _fs_bcast._BCAST_ROUND = saved
        res.setdefault("stats", []).append(dict(reader.read_stats))
        return sd

    def good(ck: str = "ss_s0") -> bool:
        sd = load(ck, round_bytes=1)
        return all(_same(_value(sd[n]), _full(n)) for n in _names("r"))

    # An exception on one rank before the rounds (resolve_tensor, finish_plan),
    # and during them (commit_tensor after a chunk arrived, with one chunk per
    # round so rounds follow the failure), each followed by a good load: the
    # ranks must still issue the same collectives.
    for where, bad_rank, key in (("resolve_tensor", 1, "w"), ("finish_plan", 2, "w"),
                                 ("commit_tensor", 1, "h"), ("commit_tensor", 0, "m")):
        for round_bytes in (None, 1):
            res[(where, bad_rank, round_bytes)] = _failure(
                load, "ss_s0", planner=_FailingPlanner(bad_rank, where, key),
                round_bytes=round_bytes)
            res[(where, bad_rank, round_bytes, "after")] = good()

    # partial load: a key that is not in the checkpoint is left alone
    sd = _state(mesh, "r", zero=True)
    extra = torch.full((3,), 7.0)
    sd["not_saved"] = extra
    load("torch_s0", sd=sd, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    res["partial"] = (all(_same(_value(sd[n]), _full(n)) for n in _names("r"))
                      and sd["not_saved"] is extra and torch.equal(extra, torch.full((3,), 7.0)))
    res["partial_read"] = res["stats"][-1]["storage_bytes"]

    # torch's own load never runs the broadcast rounds (its loader cannot):
    # the option is inert there, and the load still correct.
    sd = _state(mesh, "r", zero=True)
    reader = fs.FileSystemReader(f"{root}/ss_s0", broadcast_shared_reads=True)
    tdcp.load(sd, storage_reader=reader)
    res["torch_load"] = (all(_same(_value(sd[n]), _full(n)) for n in _names("r")),
                         dict(reader.read_stats))

    # A flipped byte in a chunk of "w" (the one that starts at row 32, read by
    # one rank and broadcast): every rank fails the same way, naming it.
    bad = f"{root}/corrupt"
    if rank == 0:
        shutil.copytree(f"{root}/ss_s0", bad)
        md = pickle.loads(Path(bad, ".metadata").read_bytes())
        (info,) = [s for i, s in md.storage_data.items() if i.fqn == "w" and i.offset[0] == 32]
        path = Path(bad, info.relative_path)
        raw = bytearray(path.read_bytes())
        row = _full("w")[40].numpy().tobytes()
        pos = bytes(raw[info.offset:info.offset + info.length]).find(row)
        assert pos > 0
        raw[info.offset + pos + 3] ^= 0x20
        path.write_bytes(bytes(raw))
        res["corrupt_file"] = info.relative_path
    dist.barrier()
    for round_bytes in (None, 1):
        res[("corrupt", round_bytes)] = _failure(load, "corrupt", round_bytes=round_bytes)
        res[("corrupt", round_bytes, "after")] = good()
    dist.barrier()
    return res


@pytest.mark.distributed_timeout(240)
def test_failures_reach_every_rank(checkpoints, run_distributed):
    results = run_distributed(_errors, 3, checkpoints)
    for where, bad_rank in (("resolve_tensor", 1), ("finish_plan", 2),
                            ("commit_tensor", 1), ("commit_tensor", 0)):
        for round_bytes in (None, 1):
            seen = [r[(where, bad_rank, round_bytes)] for r in results]
            for ranks, text in seen:
                assert ranks == [bad_rank], (where, round_bytes, ranks, text)
                assert f"in {where} on rank {bad_rank}" in text, text
            for r in results:
                assert r[(where, bad_rank, round_bytes, "after")] is True, (where, round_bytes)
    total = sum(_nbytes(n) for n in _names("r"))
    for r in results:
        assert r["partial"] is True
        ok, stats = r["torch_load"]
        assert ok and stats["storage_bytes"] == total and stats["broadcast_sent"] == 0, stats
    assert sum(r["partial_read"] for r in results) == total
    rel = results[0]["corrupt_file"]
    for round_bytes in (None, 1):
        seen = [r[("corrupt", round_bytes)] for r in results]
        assert len({tuple(ranks) for ranks, _text in seen}) == 1, seen
        for ranks, text in seen:
            assert len(ranks) == 1, (ranks, text)  # the rank that read it
            assert "ChecksumError" in text and "'w'" in text and rel in text, text
            assert "at offset" in text and "does not match the CRC" in text, text
        for r in results:
            assert r[("corrupt", round_bytes, "after")] is True


def test_option_is_checked_and_off_by_default(tmp_path):
    with pytest.raises(TypeError, match="broadcast_shared_reads"):
        fs.FileSystemReader(tmp_path, broadcast_shared_reads="yes")  # type: ignore[arg-type]
    reader = fs.FileSystemReader(tmp_path)
    assert reader.broadcast_shared_reads is None
    # without a process group there is nothing to broadcast to, even when on
    sd = {n: _full(n) for n in _names("t")}
    dcp.save(sd, checkpoint_id=tmp_path)
    back = {n: torch.zeros_like(v) for n, v in sd.items()}
    reader = fs.FileSystemReader(tmp_path, broadcast_shared_reads=True)
    dcp.load(back, storage_reader=reader)
    assert all(_same(back[n], sd[n]) for n in sd)
    assert reader.read_stats == {"storage_bytes": sum(_nbytes(n) for n in sd),
                                 "broadcast_sent": 0, "broadcast_received": 0}


def test_schedule_balances_and_bounds_rounds(tmp_path, monkeypatch):
    """The coordinator's plan, without processes: replicated chunks go to the
    needing rank with the least to read, largest first; rounds stay within
    _BCAST_ROUND except for a chunk bigger than it, alone in its round."""
    from types import SimpleNamespace

    sizes = {"a": 4000, "b": 3000, "c": 2000, "d": 1000, "e": 1000}
    sd = {n: torch.zeros(k // 4) for n, k in sizes.items()}
    dcp.save(sd, checkpoint_id=tmp_path)
    planner = dcp.DefaultLoadPlanner()
    reader = fs.FileSystemReader(tmp_path, broadcast_shared_reads=True)
    md = reader.read_metadata()
    planner.set_up_planner({n: torch.zeros_like(v) for n, v in sd.items()}, md, True)
    reader.set_up_storage_reader(md, True)
    plan = planner.create_local_plan()
    reader.load_collectives(SimpleNamespace(use_dist=True, world_size=3, rank=0))
    monkeypatch.setattr(_fs_bcast, "_BCAST_ROUND", 3500)
    out = reader.prepare_global_plan([plan, plan, plan])
    sched = out[0].storage_data.bcast
    assert all(p.storage_data.bcast == sched for p in out)
    assert sched.keys == {(n, (0,)) for n in sizes}
    src = {e.key[0]: s for rnd in sched.rounds for s, entries in rnd for e in entries}
    # a -> 0, b -> 1, c -> 2, d -> 2 (2000 < 3000), e -> 1 (3000 < 4000, 3000)
    assert src == {"a": 0, "b": 1, "c": 2, "d": 2, "e": 1}, src
    for rnd in sched.rounds:
        n = sum(e.rec.data_length for _s, entries in rnd for e in entries)
        assert n <= 3500 or sum(len(entries) for _s, entries in rnd) == 1, sched.rounds
        assert [s for s, _e in rnd] == sorted({s for s, _e in rnd})
    # disjoint regions of one chunk are not broadcast
    halves = []
    for r in range(2):
        items = [dataclasses_replace(it, r) for it in plan.items if it.dest_index.fqn == "a"]
        halves.append(SimpleNamespace(items=items, storage_data=None, planner_data=None))
    assert _fs_bcast.plan_broadcast(halves, reader._records) is None


def dataclasses_replace(item: Any, half: int) -> Any:
    """A ReadItem for half of a 1-d chunk."""
    import dataclasses

    n = int(item.lengths[0]) // 2
    return dataclasses.replace(item, storage_offsets=torch.Size([half * n]),
                               dest_offsets=torch.Size([0]), lengths=torch.Size([n]))


def test_collectives_end_with_the_load(tmp_path):
    """Shared verification is planned only while shardstate's load holds the
    reader's collectives: after done(), a load by torch's loader (which never
    gathers the pieces) with the same reader checks every record alone."""
    from types import SimpleNamespace

    dcp.save({"a": torch.arange(64.0)}, checkpoint_id=tmp_path)
    planner = dcp.DefaultLoadPlanner()
    reader = fs.FileSystemReader(tmp_path)
    md = reader.read_metadata()
    planner.set_up_planner({"a": torch.zeros(64)}, md, True)
    reader.set_up_storage_reader(md, True)
    import dataclasses

    plan = planner.create_local_plan()
    halves = [dataclasses.replace(plan, items=[dataclasses_replace(plan.items[0], r)])
              for r in range(2)]
    col = reader.load_collectives(SimpleNamespace(use_dist=True, world_size=2, rank=0))
    out = reader.prepare_global_plan(halves)
    assert [p.storage_data.shared for p in out] == [{("a", (0,))}] * 2
    assert out[0].storage_data.bcast is None  # broadcasting is off by default
    col.done()
    assert reader.prepare_global_plan(halves) == halves
