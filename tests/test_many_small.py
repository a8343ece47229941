"""Saves and loads of many small tensors: the per-item shortcuts keep the
reference behaviour.

* ``is_stateful`` answers as ``isinstance(v, Stateful)`` does, including
  for a plain tensor made Stateful through its own attributes.
* The collector pause of a synchronous save/load ends with the collector
  as the caller had it (enabled, or disabled by the caller), also when the
  call fails, and counts nested and concurrent pauses.
* A state dict of many small top-level tensors saved by shardstate loads in
  torch DCP and back, values equal.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import shardstate.checkpoint as dcp
import torch
import torch.distributed.checkpoint as tdcp
from shardstate._util import gc_paused
from shardstate.checkpoint.stateful import Stateful, is_stateful

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Model:
    def __init__(self) -> None:
        self.w = torch.ones(3)

    def state_dict(self) -> dict:
        return {"w": self.w}

    def load_state_dict(self, sd: dict) -> None:
        self.w = sd["w"]


def test_is_stateful_agrees_with_the_protocol() -> None:
    odd = torch.zeros(2)
    odd.state_dict = lambda: {}  # type: ignore[attr-defined]
    odd.load_state_dict = lambda sd: None  # type: ignore[attr-defined]
    half = torch.zeros(2)
    half.state_dict = lambda: {}  # type: ignore[attr-defined]
    values = [torch.zeros(2), torch.nn.Parameter(torch.zeros(2)), np.zeros(2), 1, 2.0, True,
              "s", b"b", None, {"a": 1}, [1], (1,), _Model(), torch.nn.Linear(2, 2), odd, half]
    got = [is_stateful(v) for v in values]
    assert got == [isinstance(v, Stateful) for v in values]
    assert got[-4:] == [True, True, True, False]
    assert not any(got[:-4])


def test_gc_pause_restores_the_callers_setting(tmp_path) -> None:
    sd = {f"t{i}": torch.full((2,), float(i)) for i in range(5)}
    assert gc.isenabled()
    seen = []
    with gc_paused():
        seen.append(gc.isenabled())
        with gc_paused():
            seen.append(gc.isenabled())
        seen.append(gc.isenabled())
    assert seen == [False, False, False] and gc.isenabled()

    dcp.save(sd, checkpoint_id=tmp_path)
    assert gc.isenabled()
    with pytest.raises(dcp.api.CheckpointException):
        dcp.load({"missing": torch.zeros(2)}, checkpoint_id=tmp_path)
    assert gc.isenabled()

    gc.disable()
    try:
        dest = {k: torch.zeros(2) for k in sd}
        dcp.load(dest, checkpoint_id=tmp_path)
        assert not gc.isenabled()
        assert all(torch.equal(dest[k], sd[k]) for k in sd)
    finally:
        gc.enable()


def test_gc_pause_counts_concurrent_pauses() -> None:
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with gc_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(10)
    with gc_paused():
        pass
    still = gc.isenabled()  # the other pause is still on
    release.set()
    t.join(10)
    assert not still and gc.isenabled()


@pytest.mark.parametrize("writer", ["shardstate", "torch"])
def test_many_small_tensors_cross_load(tmp_path, writer) -> None:
    g = torch.Generator().manual_seed(1)
    sd = {f"layers.{i}.w": torch.randn(4, 4, generator=g) for i in range(500)}
    sd["model"] = _Model()
    (dcp if writer == "shardstate" else tdcp).save(sd, checkpoint_id=tmp_path)
    dest = {k: torch.zeros(4, 4) for k in sd if k != "model"}
    dest["model"] = _Model()
    dest["model"].w = torch.zeros(3)
    (tdcp if writer == "shardstate" else dcp).load(dest, checkpoint_id=tmp_path)
    assert all(torch.equal(dest[k], sd[k]) for k in sd if k != "model")
    assert torch.equal(dest["model"].w, torch.ones(3))


def test_packed_runs_are_torchs_bytes(tmp_path, monkeypatch) -> None:
    """Runs of small records written as one job each (split at a tiny
    segment size, broken by a record too big to pack and by views of a
    larger storage) hold the bytes torch's writer writes."""
    from shardstate.checkpoint import _fs_write

    monkeypatch.setattr(_fs_write, "_PACK_SEGMENT", 3000)
    g = torch.Generator().manual_seed(2)
    big = torch.arange(100, dtype=torch.float32)
    sd = {f"s{i}": torch.randn(3, 5, generator=g) for i in range(7)}
    sd.update({"large": torch.randn(200, 100, generator=g), "view": big[10:17],
               "empty": torch.empty(0, 3), "scalar": torch.tensor(1.5),
               "half": torch.randn(4, 4, generator=g).half(), "step": 3})
    dcp.save(sd, checkpoint_id=tmp_path / "ours")
    tdcp.save(sd, checkpoint_id=tmp_path / "torch")
    files = sorted(p.name for p in (tmp_path / "torch").glob("*.distcp"))
    assert files and files == sorted(p.name for p in (tmp_path / "ours").glob("*.distcp"))
    for f in files:
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "torch" / f).read_bytes()
    dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    dcp.load(dest, checkpoint_id=tmp_path / "ours")
    assert all(torch.equal(dest[k], sd[k]) for k in sd if isinstance(sd[k], torch.Tensor))


@pytest.mark.parametrize("shape", [(16, 16), (), (5,), (0, 4), (3, 0)])
def test_same_box_read_is_the_general_plans(shape, monkeypatch) -> None:
    """A whole saved chunk read into the same box: the shortcut's ReadItems
    are the general overlap path's (none for an empty box)."""
    from shardstate.checkpoint import _plan_reads
    from shardstate.checkpoint import default_planner as dp
    from shardstate.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    zeros, size = torch.Size([0] * len(shape)), torch.Size(shape)
    md = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=size,
                               chunks=[ChunkStorageMetadata(offsets=zeros, sizes=size)])
    local = [ChunkStorageMetadata(offsets=zeros, sizes=size)]
    fast = dp.create_read_items_for_chunk_list("k", md, local)
    bypassed: list[object] = []  # the patch must reach the code (where it looks the name up)
    monkeypatch.setattr(_plan_reads, "_same_box_read", lambda *a: bypassed.append(a))
    general = dp.create_read_items_for_chunk_list("k", md, local)
    assert len(bypassed) == 1
    assert fast == general
    assert len(fast) == (1 if all(n > 0 for n in shape) else 0)
    for a, b in zip(fast, general):
        assert [type(a.dest_offsets), type(a.storage_offsets), type(a.lengths)] == \
            [type(b.dest_offsets), type(b.storage_offsets), type(b.lengths)]
