"""torch 2.13's DCP helper modules under shardstate.checkpoint, against torch's own:
_traverse.print_tensor, _dedup_tensors, _dedup_save_plans, resharding, utils
(find_*, the file view, the positional-argument shim, _DistWrapper), logger,
and planner_helpers on plain tensors, bytes, DTensors and ShardedTensors."""

from __future__ import annotations

import io
import logging
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import shardstate.checkpoint as ss
import torch
import torch.distributed.checkpoint as tdcp
from shardstate.checkpoint import (
    _dedup_save_plans,
    _dedup_tensors,
    _traverse,
    logger,
    planner_helpers,
    resharding,
    utils,
)
from torch.distributed.checkpoint import _dedup_tensors as t_dedup_tensors
from torch.distributed.checkpoint import _traverse as t_traverse
from torch.distributed.checkpoint import planner_helpers as t_helpers
from torch.distributed.checkpoint import resharding as t_resharding
from torch.distributed.checkpoint import utils as t_utils
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_print_tensor_prints_as_torch() -> None:
    sd = {"a": torch.zeros(2, 3), "b": {"c": [torch.ones(1), 5]}, "d": "text"}
    ours: list[str] = []
    theirs: list[str] = []
    _traverse.traverse_state_dict(sd, lambda p, v: _traverse.print_tensor(p, v, ours.append))
    t_traverse.traverse_state_dict(sd, lambda p, v: t_traverse.print_tensor(p, v, theirs.append))
    assert ours == theirs and len(ours) == 4


def _random_plans(rng: random.Random, ranks: int) -> list[SavePlan]:
    keys = [MetadataIndex(f"k{i}", torch.Size([0])) for i in range(12)]
    plans = []
    for _ in range(ranks):
        chosen = rng.sample(keys, rng.randint(0, len(keys)))
        plans.append(SavePlan([WriteItem(index=k, type=WriteItemType.BYTE_IO) for k in chosen]))
    return plans


@pytest.mark.parametrize("seed", range(20))
def test_dedup_tensors_matches_torch(seed: int) -> None:
    plans = _random_plans(random.Random(seed), 4)
    ours = _dedup_tensors.dedup_tensors(plans)
    theirs = t_dedup_tensors.dedup_tensors(plans)
    assert [p.items for p in ours] == [p.items for p in theirs]
    assert _dedup_save_plans.dedup_save_plans is ss.default_planner.dedup_save_plans


@pytest.mark.parametrize("seed", range(30))
def test_resharding_overlaps_match_torch(seed: int) -> None:
    rng = random.Random(seed)
    ndim = rng.randint(1, 3)

    def chunk() -> ChunkStorageMetadata:
        return ChunkStorageMetadata(torch.Size([rng.randint(0, 6) for _ in range(ndim)]),
                                    torch.Size([rng.randint(1, 5) for _ in range(ndim)]))

    a, b = chunk(), chunk()
    assert (resharding._check_shard_metadata_pair_overlap(a, b)
            == t_resharding._check_shard_metadata_pair_overlap(a, b))
    if t_resharding._check_shard_metadata_pair_overlap(a, b):
        assert (resharding._shards_get_overlap_region_wrt_saved_tensor(a, b)
                == t_resharding._shards_get_overlap_region_wrt_saved_tensor(a, b))


def test_find_state_dict_object_matches_torch() -> None:
    sd = {"t": torch.arange(6.0).reshape(2, 3), "n": 7}
    for idx in (MetadataIndex("t"), MetadataIndex("t", torch.Size([0, 0])), MetadataIndex("n")):
        got, want = utils.find_state_dict_object(sd, idx), t_utils.find_state_dict_object(sd, idx)
        assert got is want
    for idx in (MetadataIndex("t", torch.Size([1, 0])), MetadataIndex("n", torch.Size([0])),
                MetadataIndex("missing")):
        with pytest.raises(ValueError) as ours:
            utils.find_state_dict_object(sd, idx)
        with pytest.raises(ValueError) as theirs:
            t_utils.find_state_dict_object(sd, idx)
        assert str(ours.value) == str(theirs.value)
    assert utils.find_tensor_shard(sd["t"], MetadataIndex("t")) is sd["t"]


def test_file_view_reads_as_torchs() -> None:
    data = bytes(range(200))
    for offset, length in ((0, 200), (10, 50), (199, 1), (50, 0)):
        ours = utils._create_file_view(io.BytesIO(data), offset, length)
        theirs = t_utils._create_file_view(io.BytesIO(data), offset, length)
        assert ours.read(7) == theirs.read(7)
        assert ours.tell() == theirs.tell()
        assert ours.read() == theirs.read() == data[offset + min(7, length):offset + length]
        buf_o, buf_t = bytearray(300), bytearray(300)
        ours.seek(0)
        theirs.seek(0)
        assert ours.readinto(buf_o) == theirs.readinto(buf_t)
        assert buf_o == buf_t


def test_positional_save_and_load(tmp_path: Path) -> None:
    sd = {"w": torch.arange(4.0), "step": 3}
    with pytest.warns(UserWarning, match="argument order of save"):
        ss.save(sd, ss.FileSystemWriter(str(tmp_path / "a")))  # torch's old form
    with pytest.warns(UserWarning, match="argument order of save"):
        ss.save(sd, str(tmp_path / "b"))  # a path: taken as checkpoint_id
    for path in ("a", "b"):
        out = {"w": torch.zeros(4), "step": 0}
        with pytest.warns(UserWarning, match="argument order of load"):
            ss.load(out, ss.FileSystemReader(str(tmp_path / path)))
        assert torch.equal(out["w"], sd["w"]) and out["step"] == 3
        out = {"w": torch.zeros(4), "step": 0}
        tdcp.load(out, checkpoint_id=str(tmp_path / path))
        assert torch.equal(out["w"], sd["w"])
    with pytest.raises(TypeError, match="both positionally and by keyword"), \
            pytest.warns(UserWarning, match="argument order of save"):
        ss.save(sd, str(tmp_path / "c"), checkpoint_id=str(tmp_path / "c"))


def test_save_and_load_log_events(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dcp_logger = logger._dcp_logger
    old = dcp_logger.level
    dcp_logger.setLevel(logging.DEBUG)
    dcp_logger.propagate, prop = True, dcp_logger.propagate
    try:
        with caplog.at_level(logging.DEBUG, logger=dcp_logger.name):
            ss.save({"x": torch.ones(2)}, checkpoint_id=str(tmp_path))
            ss.load({"x": torch.zeros(2)}, checkpoint_id=str(tmp_path))
            with pytest.raises(ss.CheckpointException):
                ss.load({"y": torch.zeros(2)}, checkpoint_id=str(tmp_path))
        # (pytest may capture a record through more than one handler)
        seen = dict.fromkeys((r.msg["uuid"], r.msg["func_name"], r.msg["event"])
                             for r in caplog.records if isinstance(r.msg, dict)
                             and r.msg.get("func_name") in ("save", "load"))
        events = [(f, e) for _, f, e in seen]
        assert events == [("save", "start"), ("save", "end"), ("load", "start"),
                          ("load", "end"), ("load", "start"), ("load", "exception")]
        ends = [r.msg for r in caplog.records if isinstance(r.msg, dict)
                and r.msg.get("event") == "end" and r.msg.get("func_name") == "save"]
        assert ends[0]["checkpoint_id"] == str(tmp_path) and ends[0]["times_spent"] > 0
    finally:
        dcp_logger.setLevel(old)
        dcp_logger.propagate = prop


def _dist_wrapper_body(rank: int, world: int) -> Any:
    import torch.distributed as dist
    from shardstate.checkpoint import utils

    w = utils._DistWrapper(dist.group.WORLD, True, 0)
    got = w.all_gather("gather", map_fun=lambda: rank * 10)
    mine = w.reduce_scatter("rs", map_fun=lambda: rank, reduce_fun=lambda xs: [x + 1 for x in xs])
    try:
        w.all_reduce("fail", map_fun=lambda: 1 / (rank - 1), reduce_fun=lambda xs: sum(xs))
        failed = None
    except utils.CheckpointException as e:
        failed = sorted(e.failures)
    return w.get_rank(), w.get_world_size(), got, mine, failed


def test_dist_wrapper_has_torchs_interface(run_distributed: Any) -> None:
    out = run_distributed(_dist_wrapper_body, 2)
    assert out == [(0, 2, [0, 10], 1, [1]), (1, 2, [0, 10], 2, [1])]


def _helpers_body(rank: int, world: int) -> dict[str, bool]:
    import torch
    import torch.distributed as dist
    from shardstate.checkpoint import planner_helpers
    from torch.distributed._shard.sharded_tensor import empty as st_empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.checkpoint import planner_helpers as t_helpers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(torch.arange(35.0).reshape(7, 5), mesh, [Shard(0)])
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = st_empty(spec, 9, 2)
    values = {"plain": torch.ones(3, 2), "obj": {"a": 1}, "dt": dt, "st": st}
    out = {}
    for fqn, v in values.items():
        out[f"write {fqn}"] = (planner_helpers._create_write_items(fqn, v)
                               == t_helpers._create_write_items(fqn, v))
        if fqn != "obj":
            out[f"chunks {fqn}"] = (planner_helpers._create_chunk_list(v)
                                    == t_helpers._create_chunk_list(v))
    out["metadata-only plan"] = (planner_helpers._create_default_metadata_only_plan(values)
                                 == t_helpers._create_default_metadata_only_plan(values))
    dist.barrier()
    return out


def test_planner_helpers_match_torch(run_distributed: Any) -> None:
    for result in run_distributed(_helpers_body, 2):
        assert all(result.values()), result


def test_read_items_match_torch() -> None:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    md = TensorStorageMetadata(TensorProperties(), torch.Size([4, 4]),
                               [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4])),
                                ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 4]))])
    t = torch.zeros(4, 4)
    assert (planner_helpers._create_read_items("t", md, t)
            == t_helpers._create_read_items("t", md, t))
    b = BytesStorageMetadata()
    assert planner_helpers._create_read_items("b", b, 1) == t_helpers._create_read_items("b", b, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (planner_helpers.create_read_items_for_chunk_list("t", md, md.chunks[1:])
                == t_helpers.create_read_items_for_chunk_list("t", md, md.chunks[1:]))


def test_filesystem_classes(tmp_path: Path) -> None:
    from shardstate.checkpoint import _torchfree, filesystem
    from torch.distributed.checkpoint import filesystem as t_fs

    assert filesystem.FileSystem is t_fs.FileSystem  # torch's own, torch being installed
    assert issubclass(filesystem.FileSystem, filesystem.FileSystemBase)
    assert isinstance(ss.FileSystemWriter(str(tmp_path)).fs, t_fs.FileSystem)
    # the torch-free stand-in does what torch's does, step for step
    results = []
    for fs, root in ((_torchfree.FileSystem(), tmp_path / "a"),
                     (t_fs.FileSystem(), tmp_path / "b")):
        fs.mkdir(root / "sub")
        p = fs.concat_path(fs.init_path(root), "x.bin")
        with fs.create_stream(p, "wb") as f:
            f.write(b"payload")
        fs.rename(p, root / "y.bin")
        with fs.create_stream(root / "y.bin", "rb") as f:
            data = f.read()
        listing = sorted(Path(x).name for x in fs.ls(root))
        exists = (fs.exists(root / "y.bin"), fs.exists(p))
        fs.rm_file(root / "y.bin")
        results.append((data, listing, exists, fs.exists(root / "y.bin"),
                        type(fs).validate_checkpoint_id(str(root / "new")),
                        type(fs).validate_checkpoint_id("s3://bucket/x")))
    assert results[0] == results[1]
    assert results[0][:2] == (b"payload", ["sub", "y.bin"])


def test_version_global_picks_the_walk_as_torch() -> None:
    # torch's _version._derived_version = "2_3" makes flatten_state_dict walk
    # as torch 2.3 did; setting shardstate's does the same to its flatten.
    import shardstate.checkpoint as ss
    import torch.distributed.checkpoint._nested_dict as tnested
    import torch.distributed.checkpoint._version as tversion
    from shardstate.checkpoint import _nested_dict

    states = [
        {"a": [torch.ones(1), torch.zeros(2)], "b": {"c": 3}},
        {"a": [{"b": torch.ones(1)}, [torch.zeros(1), 4]], "s": "x"},
        {"l": [[1, 2], [torch.ones(2)]], "d": {"e": [torch.ones(1)]}},
    ]
    seen = set()
    try:
        for version in (None, "2_3"):
            ss._version._derived_version = version
            tversion._derived_version = version
            for sd in states:
                ours, theirs = _nested_dict.flatten_state_dict(sd), tnested.flatten_state_dict(sd)
                assert ours[1] == theirs[1], (version, sd)
                assert list(ours[0]) == list(theirs[0])
                seen.add((version, tuple(ours[0])))
    finally:
        ss._version._derived_version = None
        tversion._derived_version = None
    assert len(seen) > len(states)  # the global changed at least one walk


def test_storage_transforms_have_torchs_interface() -> None:
    # torch's private _StorageWriterTransforms/_StorageReaderTransforms: a
    # stream through every extension whose close leaves the raw stream open,
    # and back; both ways with torch's classes.
    import io

    import torch.distributed.checkpoint.filesystem as tfs
    from shardstate.checkpoint._extension import ZStandard
    from shardstate.checkpoint.filesystem import _StorageReaderTransforms, _StorageWriterTransforms

    payload = bytes(range(256)) * 50
    for W, R in ((_StorageWriterTransforms, tfs._StorageReaderTransforms),
                 (tfs._StorageWriterTransforms, _StorageReaderTransforms),
                 (_StorageWriterTransforms, _StorageReaderTransforms)):
        raw = io.BytesIO()
        stream, descriptors = W(extensions=[ZStandard()]).transform_save_stream(None, raw)
        stream.write(payload)
        stream.close()
        assert not raw.closed and descriptors == ["stream.zstd/1"]
        assert 0 < len(raw.getvalue()) < len(payload)
        raw.seek(0)
        assert R().transform_load_stream(None, descriptors, raw).read() == payload
    raw = io.BytesIO()
    stream, descriptors = _StorageWriterTransforms().transform_save_stream(None, raw)
    stream.write(b"plain")
    stream.close()
    assert descriptors == [] and raw.getvalue() == b"plain" and not raw.closed
