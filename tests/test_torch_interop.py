"""torch's DCP pieces under shardstate's save/load, and shardstate's under torch's.

With torch installed, shardstate's planner, metadata and storage types are
torch's own classes, so torch's FileSystemWriter/Reader, torch's planners,
and user subclasses of any of them plug into ``shardstate.checkpoint.save``
and ``load`` (and shardstate's into torch's) with nothing converted. Each
case checks the loaded values and that the other library reads the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import shardstate.checkpoint as ss
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint import default_planner as tdp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(6, 4, generator=g),
        "b": torch.arange(5, dtype=torch.int64),
        "h": torch.randn(3, 3, generator=g).to(torch.bfloat16),
        "cfg": {"lr": 0.25, "name": "run-7", "steps": [1, 2, 3]},
        "blob": b"opaque bytes",
    }


def _empty_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        "w": torch.zeros(6, 4), "b": torch.zeros(5, dtype=torch.int64),
        "h": torch.zeros(3, 3, dtype=torch.bfloat16),
        "cfg": {"lr": 0.0, "name": "", "steps": []}, "blob": b"",
    }


def _check(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k in ("w", "b", "h"):
        assert torch.equal(got[k], want[k]), k
    assert got["cfg"] == want["cfg"]
    assert got["blob"] == b"opaque bytes"


def test_types_are_torchs() -> None:
    from shardstate.checkpoint import metadata, planner, storage

    tm, tp, ts = tdcp.metadata, tdcp.planner, tdcp.storage
    for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "StorageMeta"):
        assert getattr(metadata, name) is getattr(tm, name), name
    for name in ("WriteItem", "WriteItemType", "ReadItem", "LoadItemType", "SavePlan",
                 "LoadPlan", "SavePlanner", "LoadPlanner", "TensorWriteData", "BytesIOWriteData"):
        assert getattr(planner, name) is getattr(tp, name), name
    for name in ("StorageWriter", "StorageReader", "WriteResult"):
        assert getattr(storage, name) is getattr(ts, name), name
    assert issubclass(ss.DefaultSavePlanner, tp.SavePlanner)
    assert issubclass(ss.FileSystemWriter, ts.StorageWriter)
    assert issubclass(ss.FileSystemReader, ts.StorageReader)
    assert issubclass(ss.CheckpointException, tdcp.api.CheckpointException)


class _CountingTorchWriter(tdcp.FileSystemWriter):
    """A user's subclass of torch's writer."""

    calls = 0

    def write_data(self, plan: Any, planner: Any) -> Any:
        type(self).calls += 1
        return super().write_data(plan, planner)


class _CountingTorchReader(tdcp.FileSystemReader):
    calls = 0

    def read_data(self, plan: Any, planner: Any) -> Any:
        type(self).calls += 1
        return super().read_data(plan, planner)


@pytest.mark.parametrize("writer_cls", [tdcp.FileSystemWriter, _CountingTorchWriter])
def test_torch_writer_under_shardstate_save(tmp_path: Path, writer_cls: type) -> None:
    sd = _state()
    _CountingTorchWriter.calls = 0
    ss.save(sd, storage_writer=writer_cls(str(tmp_path)))
    if writer_cls is _CountingTorchWriter:
        assert _CountingTorchWriter.calls == 1
    # torch reads what its own writer wrote under our save, and so do we
    for load in (tdcp.load, ss.load):
        out = _empty_like(sd)
        load(out, checkpoint_id=str(tmp_path))
        _check(out, sd)


@pytest.mark.parametrize("reader_cls", [tdcp.FileSystemReader, _CountingTorchReader])
def test_torch_reader_under_shardstate_load(tmp_path: Path, reader_cls: type) -> None:
    sd = _state()
    ss.save(sd, checkpoint_id=str(tmp_path))
    _CountingTorchReader.calls = 0
    out = _empty_like(sd)
    ss.load(out, storage_reader=reader_cls(str(tmp_path)))
    _check(out, sd)
    if reader_cls is _CountingTorchReader:
        assert _CountingTorchReader.calls == 1


class _OursSubWriter(ss.FileSystemWriter):
    calls = 0

    def write_data(self, plan: Any, planner: Any) -> Any:
        type(self).calls += 1
        return super().write_data(plan, planner)


@pytest.mark.parametrize("writer_cls", [ss.FileSystemWriter, _OursSubWriter])
def test_shardstate_storage_under_torch(tmp_path: Path, writer_cls: type) -> None:
    sd = _state()
    tdcp.save(sd, storage_writer=writer_cls(str(tmp_path)))
    for load in (tdcp.load, ss.load):
        out = _empty_like(sd)
        load(out, checkpoint_id=str(tmp_path))
        _check(out, sd)
    out = _empty_like(sd)
    tdcp.load(out, storage_reader=ss.FileSystemReader(str(tmp_path)))
    _check(out, sd)


class _TorchPlannerSub(tdp.DefaultSavePlanner):
    """A user's save planner on torch's: renames nothing, counts items."""

    items = 0

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        type(self).items = len(plan.items)
        return plan


class _TorchLoadPlannerSub(tdp.DefaultLoadPlanner):
    loaded = 0

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        type(self).loaded += 1
        super().commit_tensor(read_item, tensor)


def test_torch_planners_under_shardstate(tmp_path: Path) -> None:
    sd = _state()
    ss.save(sd, checkpoint_id=str(tmp_path / "a"), planner=_TorchPlannerSub())
    assert _TorchPlannerSub.items == 7  # w, b, h, cfg.lr, cfg.name, cfg.steps, blob
    _TorchLoadPlannerSub.loaded = 0
    out = _empty_like(sd)
    ss.load(out, checkpoint_id=str(tmp_path / "a"), planner=_TorchLoadPlannerSub())
    _check(out, sd)
    assert _TorchLoadPlannerSub.loaded == 3
    out = _empty_like(sd)
    tdcp.load(out, checkpoint_id=str(tmp_path / "a"))
    _check(out, sd)


def test_shardstate_planners_under_torch(tmp_path: Path) -> None:
    sd = _state()
    tdcp.save(sd, checkpoint_id=str(tmp_path), planner=ss.DefaultSavePlanner())
    out = _empty_like(sd)
    tdcp.load(out, checkpoint_id=str(tmp_path), planner=ss.DefaultLoadPlanner())
    _check(out, sd)
    out = _empty_like(sd)
    ss.load(out, checkpoint_id=str(tmp_path))
    _check(out, sd)


def _two_ranks(rank: int, world: int, path: str, torch_writer: bool, torch_reader: bool) -> bool:
    import shardstate.checkpoint as ss
    import torch
    import torch.distributed.checkpoint as tdcp

    sd = {"r": torch.full((4,), float(rank)), "shared": torch.arange(6.0), "step": 11}
    writer = (tdcp.FileSystemWriter if torch_writer else ss.FileSystemWriter)(path)
    ss.save({f"rank{rank}": sd["r"], "shared": sd["shared"], "step": sd["step"]},
            storage_writer=writer)
    out = {f"rank{1 - rank}": torch.zeros(4), "shared": torch.zeros(6), "step": 0}
    reader = (tdcp.FileSystemReader if torch_reader else ss.FileSystemReader)(path)
    ss.load(out, storage_reader=reader)
    return (bool(torch.equal(out[f"rank{1 - rank}"], torch.full((4,), float(1 - rank))))
            and bool(torch.equal(out["shared"], torch.arange(6.0))) and out["step"] == 11)


@pytest.mark.parametrize("torch_writer,torch_reader", [(True, False), (False, True)])
def test_two_ranks_torch_storage_under_shardstate(run_distributed: Any, tmp_path: Path,
                                                  torch_writer: bool, torch_reader: bool) -> None:
    assert run_distributed(_two_ranks, 2, str(tmp_path), torch_writer, torch_reader) == [True, True]
