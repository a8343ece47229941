"""The load and async_save fast paths, checked for what they must not change.

* Shared verification: when a load at another world size splits a saved
  record between ranks, each rank checksums only the part it reads and the
  ranks combine the parts' CRC-32s (instead of each re-reading the rest of
  the record). A corrupted byte must still be found, on every rank, whichever
  rank read it; the coverage rule must refuse overlaps and gaps.
* Staging pool: async_save copies into reused arenas; the staged values must
  be the values at the call even when the caller modifies its tensors right
  away, the pool must stay bounded, and views must be saved as torch saves
  their clones (byte for byte).
"""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
import shardstate.checkpoint as dcp
import torch
import torch.distributed.checkpoint as tdcp
from shardstate.checkpoint import _fs_verify as fsv
from shardstate.checkpoint import _staging

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROWS, COLS = 11, 37


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name))
    return torch.randn(ROWS, COLS, generator=g)


def _save_sharded(rank: int, world: int, root: str, use_torch: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {n: distribute_tensor(_full(n), mesh, [Shard(0)]) for n in ("w", "v")}
    (tdcp if use_torch else dcp).save(sd, checkpoint_id=root)


def _load_sharded(rank: int, world: int, root: str) -> dict:
    """Loads into Shard(0), Shard(1) and Replicate() DTensors; per placement
    either {"equal": ...} or {"failed": (ranks, text)}, and the number of
    pieces verified together."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    results: dict = {}
    for placement, place in (("shard0", Shard(0)), ("shard1", Shard(1)),
                             ("replicate", Replicate())):
        sd = {n: distribute_tensor(torch.zeros(ROWS, COLS), mesh, [place]) for n in ("w", "v")}
        seen: list[list] = []
        real = fsv.verify_pieces

        def spy(gathered, real=real, seen=seen):
            seen.append(gathered)
            return real(gathered)

        fsv.verify_pieces = spy
        out: dict = {}
        try:
            dcp.load(sd, checkpoint_id=root)
            out["equal"] = all(torch.equal(sd[n].full_tensor(), _full(n)) for n in sd)
        except dcp.CheckpointException as e:
            out["failed"] = (sorted(e.failures), str(e))
        finally:
            fsv.verify_pieces = real
        out["pieces"] = sum(len(p or ()) for g in seen for p in g)
        results[placement] = out
    return results


@pytest.mark.parametrize("writer", ["shardstate", "torch"])
def test_reshard_2_to_3_verifies_split_records_together(tmp_path, run_distributed, writer):
    root = str(tmp_path / "ckpt")
    run_distributed(_save_sharded, 2, root, writer == "torch")
    res = run_distributed(_load_sharded, 3, root)
    for r in res:
        for placement, out in r.items():
            assert out.get("equal") is True, (placement, out)
    # row slabs of the saved chunks: verified in parts across ranks
    assert res[0]["shard0"]["pieces"] > 0

    # Flip a byte in the middle of the second saved chunk of "w" (rows 6..10,
    # split at 3 ranks between rank 1 (rows 6..7) and rank 2 (rows 8..10)).
    md = pickle.loads(Path(root, ".metadata").read_bytes())
    (info,) = [s for i, s in md.storage_data.items() if i.fqn == "w" and i.offset[0] == 6]
    path = Path(root, info.relative_path)
    raw = bytearray(path.read_bytes())
    row9 = _full("w")[9].numpy().tobytes()
    pos = bytes(raw[info.offset:info.offset + info.length]).find(row9)
    assert pos > 0
    raw[info.offset + pos + 5] ^= 0x01
    path.write_bytes(bytes(raw))
    res = run_distributed(_load_sharded, 3, root)
    for placement in ("shard0", "shard1", "replicate"):
        for r in res:
            assert "failed" in r[placement], (placement, r[placement])
            ranks, text = r[placement]["failed"]
            assert ranks and "ChecksumError" in text and "'w'" in text, text
            assert info.relative_path in text, text
        # the same report on every rank
        assert len({tuple(r[placement]["failed"][0]) for r in res}) == 1


def test_covers_rule():
    size = (6, 4)
    whole = ((0, 0), (6, 4))
    assert fsv._covers({whole}, size)
    assert fsv._covers({((0, 0), (2, 4)), ((2, 0), (4, 4))}, size)
    assert fsv._covers({((0, 0), (6, 1)), ((0, 1), (6, 3))}, size)
    assert fsv._covers({((0, 0), (3, 4)), whole}, size)  # one rank reads it all
    assert not fsv._covers({((0, 0), (2, 4)), ((3, 0), (3, 4))}, size)  # gap at row 2
    # overlapping regions whose volumes happen to add up
    assert not fsv._covers({((0, 0), (4, 4)), ((3, 0), (2, 4))}, size)
    assert not fsv._covers({((0, 0), (4, 4)), ((4, 0), (3, 4))}, size)  # runs past the chunk
    assert not fsv._covers(set(), size)


def _piece(rank_key, start, count, data, crc_all):
    import zlib

    return (rank_key, "/f", 64, len(data), crc_all, start, count,
            zlib.crc32(data[start:start + count]), "item 'w' in /f at offset 0")


def test_verify_pieces_combines_and_names_ranks():
    import zlib

    data = bytes(range(256)) * 10
    good = zlib.crc32(data)
    key = ("w", (0,))
    parts = [[_piece(key, 0, 1000, data, good)], [_piece(key, 1000, 1560, data, good)], []]
    fsv.verify_pieces(parts)  # combines to the record's CRC
    bad = data[:1500] + b"\x00" + data[1501:]
    parts = [[_piece(key, 0, 1000, data, good)], [_piece(key, 1000, 1560, bad, good)], []]
    with pytest.raises(dcp.CheckpointException) as ei:
        fsv.verify_pieces(parts)
    assert sorted(ei.value.failures) == [0, 1]
    assert "ChecksumError" in str(ei.value) and "read in parts by ranks [0, 1]" in str(ei.value)
    gap = [[_piece(key, 0, 1000, data, good)], [_piece(key, 1200, 1360, data, good)]]
    with pytest.raises(dcp.CheckpointException, match="do not tile"):
        fsv.verify_pieces(gap)
    # a rank that read (and itself verified) the whole record settles it
    fsv.verify_pieces([[_piece(key, 0, 1000, bad, good)], [_piece(key, 0, 2560, data, good)]])


# ---------------------------------------------------------------------------
# Staging pool
# ---------------------------------------------------------------------------


def test_async_save_reuses_a_bounded_pool(tmp_path):
    base = torch.arange(5000, dtype=torch.float32).reshape(50, 100)
    sd = {
        "w": base.clone(),
        "view": base[10:20],          # contiguous view of a larger storage
        "col": base[:, 3:4],          # contiguous by size, odd strides
        "t": base.t(),                # not contiguous: staged contiguous
        "bf": torch.randn(9).to(torch.bfloat16),
        "zero": torch.empty(0, 4),
        "scalar": torch.tensor(7, dtype=torch.int8),
        "np": np.arange(12, dtype=np.int16).reshape(3, 4),
        "nested": {"list": [torch.ones(3), "text", 4]},
    }
    refs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    refs["np"] = sd["np"].copy()
    arenas = set()
    futures = []
    for i in range(4):
        fut = dcp.async_save(sd, checkpoint_id=str(tmp_path / f"s{i}"))
        assert fut.staging_completion.done()
        sd["w"].add_(1.0)  # the caller trains on at once
        sd["np"] += 1
        futures.append(fut)
        fut.result(timeout=60)
        arenas |= {id(a) for a in _staging._pool._free}
        assert _staging._pool._busy == 0
        assert len(_staging._pool._free) <= _staging._SLOTS
    assert len(arenas) == 1  # one arena, reused by every save
    for i in range(4):
        back = {
            "w": torch.zeros(50, 100), "view": torch.zeros(10, 100), "col": torch.zeros(50, 1),
            "t": torch.zeros(100, 50), "bf": torch.zeros(9, dtype=torch.bfloat16),
            "zero": torch.empty(0, 4), "scalar": torch.tensor(0, dtype=torch.int8),
            "np": np.zeros((3, 4), np.int16), "nested": {"list": [torch.zeros(3), "", 0]},
        }
        dcp.load(back, checkpoint_id=str(tmp_path / f"s{i}"))
        assert torch.equal(back["w"], refs["w"] + i)
        assert np.array_equal(back["np"], refs["np"] + i)
        for k in ("view", "col", "t", "bf", "zero", "scalar"):
            assert torch.equal(back[k], refs[k]) and back[k].dtype == refs[k].dtype, k
        assert back["nested"]["list"][1:] == ["text", 4]


def test_staged_views_are_saved_as_torch_saves_them(tmp_path):
    base = torch.randn(12, 9)
    sd = {"view": base[2:7], "col": base[:, 4:5], "row": base[3], "t": base.t()[1:3]}
    fut = dcp.async_save(sd, checkpoint_id=str(tmp_path / "ours"))
    fut.result(timeout=60)
    tdcp.save(sd, checkpoint_id=str(tmp_path / "torch"))
    dcp.save(sd, checkpoint_id=str(tmp_path / "ours_sync"))
    for d in ("ours", "ours_sync"):
        ours = Path(tmp_path, d, "__0_0.distcp").read_bytes()
        theirs = Path(tmp_path, "torch", "__0_0.distcp").read_bytes()
        assert ours == theirs, d


def test_staging_waits_when_every_slot_is_busy():
    pool = _staging._StagingPool(2)
    a = pool.acquire(100)
    b = pool.acquire(100)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(50)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not got  # bounded: the third waits
    pool.release(a)
    t.join(10)
    assert got and got[0] is a  # and reuses the released arena
    pool.release(b)
    pool.release(got[0])
    assert pool._busy == 0 and len(pool._free) == 2


# ---------------------------------------------------------------------------
# Plan caching (on by default in save)
# ---------------------------------------------------------------------------


def _cached_saves(rank: int, world: int, root: str) -> list[int]:
    from shardstate.checkpoint import default_planner as dpm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    planned: list[int] = []
    real = dpm.DefaultSavePlanner._create_global_plan

    def spy(self, plans):
        planned.append(sum(len(p.items) for p in plans))
        return real(self, plans)

    dpm.DefaultSavePlanner._create_global_plan = spy
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(_full("w"), mesh, [Shard(0)]),
          "r": distribute_tensor(_full("r"), mesh, [Replicate()]),
          "step": 3, "own": torch.full((2,), float(rank))}
    names = []
    for i in range(3):
        sd["w"].to_local().add_(1.0)  # new values, same structure
        names.append(f"same{i}")
        dcp.save(sd, checkpoint_id=f"{root}/ss_{names[-1]}")
        tdcp.save(sd, checkpoint_id=f"{root}/t_{names[-1]}")
    # A save whose global plan fails must leave the caches in step.
    bad = dict(sd, w=torch.zeros(3) if rank == 0 else sd["w"])
    try:
        dcp.save(bad, checkpoint_id=f"{root}/ss_bad")
    except dcp.CheckpointException:
        pass
    else:
        raise AssertionError("a key saved as a DTensor and a tensor should not plan")
    sd["extra"] = torch.arange(4)  # the structure changes
    for name in ("changed", "again"):
        names.append(name)
        dcp.save(sd, checkpoint_id=f"{root}/ss_{name}")
        tdcp.save(sd, checkpoint_id=f"{root}/t_{name}")
    dpm.DefaultSavePlanner._create_global_plan = real
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        for name in names:
            ours, theirs = Path(root, f"ss_{name}"), Path(root, f"t_{name}")
            assert sorted(p.name for p in ours.iterdir()) == \
                sorted(p.name for p in theirs.iterdir()), name
            for p in ours.iterdir():
                if p.suffix == ".distcp":
                    assert p.read_bytes() == (theirs / p.name).read_bytes(), (name, p.name)
            a = pickle.loads((ours / ".metadata").read_bytes())
            b = pickle.loads((theirs / ".metadata").read_bytes())
            assert a.state_dict_metadata == b.state_dict_metadata, name
            assert a.storage_data == b.storage_data, name
    back = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]),
            "extra": torch.zeros(4, dtype=torch.int64), "step": 0}
    tdcp.load(back, checkpoint_id=f"{root}/ss_again")
    assert torch.equal(back["w"].full_tensor(), sd["w"].full_tensor())
    assert torch.equal(back["extra"], torch.arange(4)) and back["step"] == 3
    return planned


def test_save_caches_plans_of_the_same_structure(tmp_path, run_distributed):
    planned = run_distributed(_cached_saves, 3, str(tmp_path))
    # The coordinator planned the first save, the failed one, the changed
    # structure; the repeats of an unchanged structure planned nothing.
    assert len(planned[0]) == 3, planned[0]
    assert planned[1] == planned[2] == []
