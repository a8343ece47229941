"""shardstate.checkpoint.format_utils and the private loader/planner names
real code imports, against torch 2.13's own on the same inputs.

In this process (no process group): ``dcp_to_torch_save`` of checkpoints
written by torch and by shardstate, ``torch_save_to_dcp`` (the same
checkpoint files as torch's, byte for byte), every round trip through
both libraries' converters, ``_load_state_dict_from_keys``,
``_EmptyStateDictLoadPlanner``, ``_create_default_local_metadata`` and the
command line; bytes items of many kinds throughout. Error cases: missing
inputs, a torch.save file or a bytes item holding an object a safe loader
refuses (refused before any of its code runs, where torch runs it), and an
output left as it was when a conversion fails.

On two gloo processes: ``BroadcastingTorchSaveReader`` with
``DynamicMetaLoadPlanner`` against torch's pair on plain tensors (and a
coordinator_rank the load's coordinator is not, refused alike), then what
torch's pair gets wrong: a destination of another dtype than the file's,
DTensors and a ShardedTensor (torch's hangs on those); failures raised on
every rank with no rank left in a broadcast; and the distributed forms of
the private names.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import shardstate.checkpoint as dcp
import torch
import torch.distributed.checkpoint as tdcp
from _child_env import package_env
from _dtypes import DTYPES, seeded
from shardstate.checkpoint import format_utils as sfu
from shardstate.checkpoint.default_planner import (
    _create_default_local_metadata,
    _EmptyStateDictLoadPlanner,
)
from shardstate.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.checkpoint import format_utils as tfu
from torch.distributed.checkpoint.default_planner import (
    _create_default_local_metadata as t_create_default_local_metadata,
)
from torch.distributed.checkpoint.default_planner import (
    _EmptyStateDictLoadPlanner as TEmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.state_dict_loader import (
    _load_state_dict_from_keys as t_load_state_dict_from_keys,
)

pytestmark = [
    # torch's save/load without a process group say they run in one process.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:torch.distributed is unavailable or uninitialized"),
]


def _state() -> dict[str, Any]:
    """Tensors of every dtype, 0-d, empty and non-contiguous ones, and
    values of many kinds that become bytes items."""
    model: dict[str, Any] = {f"w_{i}": seeded(dt, (3, 4), i) for i, dt in enumerate(DTYPES)}
    model["scalar"] = torch.tensor(2.5)
    model["empty"] = torch.zeros(0, 3)
    model["view"] = torch.arange(24.0).reshape(4, 6)[:, 1:4]
    return {
        "model": model,
        "step": 7,
        "name": "run-1",
        "lr": 0.25,
        "flags": [True, None, 3],  # no tensor inside: one bytes item
        "mixed": [torch.ones(2), {"k": 1, "t": torch.arange(3)}],
        "shape": (2, 3),
        "opt": {"param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        "raw": b"\x00\x01bytes",
        "none": None,
    }


def assert_same(ours: Any, theirs: Any, path: str = "sd") -> None:
    """Equal structure, key order, types, dtypes, shapes and values."""
    assert type(ours) is type(theirs), f"{path}: {type(ours).__name__} != {type(theirs).__name__}"
    if isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), path
        assert torch.equal(ours, theirs), f"{path}: values differ"
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), f"{path}: keys {list(ours)} != {list(theirs)}"
        for k in theirs:
            assert_same(ours[k], theirs[k], f"{path}[{k!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{path}: length"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"


def _load_pt(path: Any) -> Any:
    return torch.load(path, weights_only=True)


def _metadata(path: Path) -> Any:
    return tdcp.FileSystemReader(path).read_metadata()


def _same_checkpoint(ours: Path, theirs: Path) -> None:
    """The same files, the .distcp ones byte for byte, and the same metadata
    (the save's id and path aside)."""
    names = sorted(os.listdir(ours))
    assert names == sorted(os.listdir(theirs))
    for n in names:
        if n.endswith(".distcp"):
            assert (ours / n).read_bytes() == (theirs / n).read_bytes(), n
    a, b = _metadata(ours), _metadata(theirs)
    assert a.state_dict_metadata == b.state_dict_metadata
    assert a.storage_data == b.storage_data
    assert a.planner_data == b.planner_data


# ---------------------------------------------------------------------------
# dcp_to_torch_save / torch_save_to_dcp
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("saver", ["torch", "shardstate"])
def test_dcp_to_torch_save_matches_torch(tmp_path, saver):
    sd = _state()
    ckpt = tmp_path / "ckpt"
    (tdcp if saver == "torch" else dcp).save(sd, checkpoint_id=ckpt)
    sfu.dcp_to_torch_save(ckpt, tmp_path / "ours.pt")
    tfu.dcp_to_torch_save(ckpt, tmp_path / "theirs.pt")
    ours, theirs = _load_pt(tmp_path / "ours.pt"), _load_pt(tmp_path / "theirs.pt")
    assert_same(ours, theirs)
    assert_same(ours, _state())
    # a file object as the destination, as torch.save takes
    buf = io.BytesIO()
    sfu.dcp_to_torch_save(str(ckpt), buf)
    buf.seek(0)
    assert_same(_load_pt(buf), theirs)
    # created as torch.save creates a file (not a private temporary's mode)
    assert os.stat(tmp_path / "ours.pt").st_mode == os.stat(tmp_path / "theirs.pt").st_mode
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ours.pt", "theirs.pt"]


def test_torch_save_to_dcp_writes_torchs_files(tmp_path):
    torch.save(_state(), tmp_path / "in.pt")
    sfu.torch_save_to_dcp(tmp_path / "in.pt", tmp_path / "ours")
    tfu.torch_save_to_dcp(tmp_path / "in.pt", tmp_path / "theirs")
    _same_checkpoint(tmp_path / "ours", tmp_path / "theirs")


@pytest.mark.parametrize("to_dcp", ["torch", "shardstate"])
@pytest.mark.parametrize("to_pt", ["torch", "shardstate"])
def test_round_trips_through_both_libraries(tmp_path, to_dcp, to_pt):
    torch.save(_state(), tmp_path / "in.pt")
    (tfu if to_dcp == "torch" else sfu).torch_save_to_dcp(tmp_path / "in.pt", tmp_path / "ckpt")
    (tfu if to_pt == "torch" else sfu).dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "out.pt")
    assert_same(_load_pt(tmp_path / "out.pt"), _state())


class _Payload:
    """Unpickling it calls _touch(path): a stand-in for code in a file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (_touch, (self.marker,))


def _touch(path: str) -> str:
    Path(path).write_text("ran")
    return path


def test_torch_save_to_dcp_refuses_what_weights_only_refuses(tmp_path):
    marker = tmp_path / "marker"
    torch.save({"w": torch.ones(2), "evil": _Payload(str(marker))}, tmp_path / "in.pt")
    with pytest.raises(dcp.UnsafePickleError) as info:
        sfu.torch_save_to_dcp(tmp_path / "in.pt", tmp_path / "ours")
    assert isinstance(info.value, pickle.UnpicklingError)
    msg = str(info.value)
    assert str(tmp_path / "in.pt") in msg and "_touch" in msg and "add_safe_globals" in msg
    assert not marker.exists()  # nothing from the file ran
    assert not (tmp_path / "ours").exists()
    # torch's converter unpickles it fully: the file's code runs
    tfu.torch_save_to_dcp(tmp_path / "in.pt", tmp_path / "theirs")
    assert marker.read_text() == "ran"


def test_dcp_to_torch_save_refuses_an_unsafe_bytes_item(tmp_path):
    marker = tmp_path / "marker"
    tdcp.save({"w": torch.ones(2), "evil": _Payload(str(marker))}, checkpoint_id=tmp_path / "c")
    assert not marker.exists()  # saving pickles it; loading must not run it
    with pytest.raises(dcp.CheckpointException) as info:
        sfu.dcp_to_torch_save(tmp_path / "c", tmp_path / "ours.pt")
    assert "item 'evil'" in str(info.value) and "_touch" in str(info.value)
    assert not marker.exists()
    assert not (tmp_path / "ours.pt").exists()


def test_missing_inputs(tmp_path):
    with pytest.raises(FileNotFoundError):
        sfu.torch_save_to_dcp(tmp_path / "none.pt", tmp_path / "ours")
    with pytest.raises(FileNotFoundError):
        tfu.torch_save_to_dcp(tmp_path / "none.pt", tmp_path / "theirs")
    assert not (tmp_path / "ours").exists()
    # A failed conversion leaves an existing output as it was.
    (tmp_path / "out.pt").write_bytes(b"old")
    with pytest.raises(tdcp.api.CheckpointException) as ours:
        sfu.dcp_to_torch_save(tmp_path / "none", tmp_path / "out.pt")
    with pytest.raises(tdcp.api.CheckpointException) as theirs:
        tfu.dcp_to_torch_save(tmp_path / "none", tmp_path / "out2.pt")
    (exc, _), = ours.value.failures.values()
    assert isinstance(exc, FileNotFoundError)
    (exc, _), = theirs.value.failures.values()  # torch: an AssertionError saying so
    assert "No such file or directory" in str(exc)
    assert (tmp_path / "out.pt").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["out.pt"]


def test_command_line(tmp_path, capsys):
    torch.save(_state(), tmp_path / "in.pt")
    sfu._main(["torch_to_dcp", str(tmp_path / "in.pt"), str(tmp_path / "ours")])
    tfu.torch_save_to_dcp(tmp_path / "in.pt", tmp_path / "theirs")
    _same_checkpoint(tmp_path / "ours", tmp_path / "theirs")
    sfu._main(["dcp_to_torch", str(tmp_path / "ours"), str(tmp_path / "out.pt")])
    assert_same(_load_pt(tmp_path / "out.pt"), _state())
    sfu._main(["dcp_to_torch", str(tmp_path / "nothing"), str(tmp_path / "x.pt")])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"Converting checkpoint from {tmp_path / 'in.pt'} to {tmp_path / 'ours'} "
                      "using method: 'torch_to_dcp'")
    assert out[-1] == f"No checkpoint found at {tmp_path / 'nothing'}. Skipping conversion."
    assert not (tmp_path / "x.pt").exists()
    # as a module, like torch's
    env = package_env()
    subprocess.run([sys.executable, "-W", "error", "-m", "shardstate.checkpoint.format_utils",
                    "dcp_to_torch", str(tmp_path / "theirs"), str(tmp_path / "m.pt")],
                   check=True, env=env, capture_output=True, timeout=300)
    assert_same(_load_pt(tmp_path / "m.pt"), _state())


# ---------------------------------------------------------------------------
# The private names
# ---------------------------------------------------------------------------

_KEYS = [None, "model", "model.w_3", {"model.w_0", "mixed", "step"}, {"nothing"},
         "opt.param_groups"]


@pytest.mark.parametrize("saver", ["torch", "shardstate"])
def test_load_state_dict_from_keys_matches_torch(tmp_path, saver):
    (tdcp if saver == "torch" else dcp).save(_state(), checkpoint_id=tmp_path / "c")
    for keys in _KEYS:
        ours = _load_state_dict_from_keys(keys, checkpoint_id=tmp_path / "c")
        theirs = t_load_state_dict_from_keys(keys, checkpoint_id=tmp_path / "c")
        assert_same(ours, theirs, f"keys={keys}")
    assert_same(_load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(tmp_path / "c")),
                _state())
    with pytest.raises(RuntimeError, match="checkpoint_id"):
        _load_state_dict_from_keys("model")


def test_empty_state_dict_planner_under_both_loaders(tmp_path):
    """Ours under torch's loader and torch's under ours (the public load
    copies back only the keys it was given: the planner is for the loader
    itself, as format_utils and _load_state_dict_from_keys use it)."""
    from shardstate.checkpoint._setup import _coordinator
    from shardstate.checkpoint.state_dict_loader import _load_state_dict
    from torch.distributed.checkpoint.state_dict_loader import (
        _load_state_dict as t_load_state_dict,
    )

    tdcp.save(_state(), checkpoint_id=tmp_path / "c")
    sd: dict[str, Any] = {}
    t_load_state_dict(sd, tdcp.FileSystemReader(tmp_path / "c"), no_dist=True,
                      planner=_EmptyStateDictLoadPlanner())
    assert_same(sd, _state())
    sd = {}
    _load_state_dict(sd, dcp.FileSystemReader(tmp_path / "c"), _coordinator(None, True),
                     TEmptyStateDictLoadPlanner())
    assert_same(sd, _state())
    md = _metadata(tmp_path / "c")
    for cls in (_EmptyStateDictLoadPlanner, TEmptyStateDictLoadPlanner):
        with pytest.raises(AssertionError, match="not state_dict"):
            cls().set_up_planner({"x": torch.ones(1)}, md)
        with pytest.raises(AssertionError, match="metadata is not None"):
            cls().set_up_planner({}, None)
    # DefaultLoadPlanner's arguments pass through
    planner = _EmptyStateDictLoadPlanner({"model"}, True, True, False, loads=pickle.loads)
    assert planner.keys == {"model"} and planner.loads is pickle.loads


def test_create_default_local_metadata_matches_torch():
    sd = {"a": seeded(torch.float32, (2, 3), 0), "b": 5, "c": torch.tensor(1, dtype=torch.int8),
          "d": {"nested": torch.ones(2)}, "e": torch.zeros(0, 2).bfloat16()}
    assert _create_default_local_metadata(sd) == t_create_default_local_metadata(sd)


# ---------------------------------------------------------------------------
# BroadcastingTorchSaveReader and DynamicMetaLoadPlanner
# ---------------------------------------------------------------------------


def _file_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"a": torch.randn(7, 5), "n": {"b": torch.randn(3), "c": torch.arange(10)},
            "h": torch.randn(4, 3).bfloat16(), "d": torch.arange(35.0).reshape(7, 5),
            "z": torch.zeros(0, 3)}


def _plain_dest(h_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The file's "h" is bfloat16: loaded into float32 by default."""
    return {"a": torch.zeros(7, 5), "n": {"b": torch.zeros(3), "c": torch.zeros(10).long()},
            "h": torch.zeros(4, 3, dtype=h_dtype), "z": torch.zeros(0, 3)}


def _plain_want(h_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    f = _file_state()
    return {"a": f["a"], "n": f["n"], "h": f["h"].to(h_dtype), "z": f["z"]}


def test_broadcasting_reader_in_one_process(tmp_path):
    torch.save(_file_state(), tmp_path / "in.pt")
    sd = _plain_dest()
    dcp.load(sd, storage_reader=sfu.BroadcastingTorchSaveReader(),
             planner=sfu.DynamicMetaLoadPlanner(), checkpoint_id=tmp_path / "in.pt")
    assert_same(sd, _plain_want())
    assert sfu.BroadcastingTorchSaveReader.validate_checkpoint_id(tmp_path / "in.pt")
    assert not sfu.BroadcastingTorchSaveReader.validate_checkpoint_id(tmp_path)
    for cls in (sfu.DynamicMetaLoadPlanner, tfu.DynamicMetaLoadPlanner):
        with pytest.raises(RuntimeError, match="Non-tensor value identified at n.s. At this time "
                                               f"{cls.__name__} only supports loading Tensors."):
            cls().set_up_planner({"n": {"s": "text"}}, dcp.Metadata({}))
    reader = sfu.BroadcastingTorchSaveReader(checkpoint_id="x.pt", coordinator_rank=0)
    assert reader.read_metadata() == tfu.BroadcastingTorchSaveReader().read_metadata()
    reader.reset()
    assert reader.checkpoint_id is None
    with pytest.raises(AssertionError, match="checkpoint_id must be set"):
        reader.set_up_storage_reader(dcp.Metadata({}), True)


def _error_of(fn: Any) -> str:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - what each rank raised (CheckpointException too)
        return f"{type(e).__name__}: {e}"
    raise AssertionError("expected a failure")


def _bcast(rank: int, world: int, root: str) -> int:
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import zeros as st_zeros
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    path = f"{root}/in.pt"
    want = _plain_want()
    checks = 0
    # torch's pair and ours, on plain tensors (the file's dtypes: torch's
    # other ranks receive a converted tensor's bytes into a buffer of the
    # destination's dtype, and get garbage)
    results = []
    for load, mod in ((tdcp.load, tfu), (dcp.load, sfu)):
        sd = _plain_dest(torch.bfloat16)
        load(sd, storage_reader=mod.BroadcastingTorchSaveReader(),
             planner=mod.DynamicMetaLoadPlanner(), checkpoint_id=path)
        results.append(sd)
    assert_same(results[1], results[0])
    assert_same(results[1], _plain_want(torch.bfloat16))
    # ours converts to the destination's dtype on every rank
    sd = _plain_dest()
    dcp.load(sd, storage_reader=sfu.BroadcastingTorchSaveReader(),
             planner=sfu.DynamicMetaLoadPlanner(), checkpoint_id=path)
    assert_same(sd, want)
    # the reader's coordinator must be the load's (rank 0 for load)
    for load, mod in ((tdcp.load, tfu), (dcp.load, sfu)):
        msg = _error_of(lambda: load(  # noqa: B023 - called at once
            _plain_dest(), storage_reader=mod.BroadcastingTorchSaveReader(coordinator_rank=1),
            planner=mod.DynamicMetaLoadPlanner(), checkpoint_id=path))
        assert "Coordinator rank mismatch: expected 1, got 0" in msg, msg
    checks += 1
    # sharded destinations (torch's pair broadcasts mismatched sizes there and hangs)
    mesh = init_device_mesh("cpu", (world,))
    full = _file_state()["d"]
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    with_st = {"s0": [Shard(0)], "s1": [Shard(1)], "r": [Replicate()]}
    sd = {k: distribute_tensor(torch.zeros(7, 5), mesh, p) for k, p in with_st.items()}
    st = st_zeros(spec, 7, 5)
    dest = {"m": sd, "st": st}
    file = {"m": {k: full for k in with_st}, "st": full}
    if rank == 0:
        torch.save(file, f"{root}/sharded.pt")
    dist.barrier()
    dcp.load(dest, storage_reader=sfu.BroadcastingTorchSaveReader(),
             planner=sfu.DynamicMetaLoadPlanner(), checkpoint_id=f"{root}/sharded.pt")
    for k in with_st:
        assert torch.equal(dest["m"][k].full_tensor(), full), k
    shard = st.local_shards()[0]
    lo = shard.metadata.shard_offsets[0]
    assert torch.equal(shard.tensor, full[lo:lo + shard.metadata.shard_sizes[0]])
    checks += 1
    # failures: every rank raises, none is left in a broadcast
    cases = {
        "missing key": (f"{root}/in.pt", {**_plain_dest(), "extra": torch.zeros(2)},
                        "'extra' is not in the torch.save file"),
        "shape": (f"{root}/in.pt", {"a": torch.zeros(5, 7)},
                  "Size mismatch for a: the torch.save file"),
        "no file": (f"{root}/none.pt", _plain_dest(), "No such file"),
        "unsafe": (f"{root}/unsafe.pt", _plain_dest(), "torch.load(weights_only=True) refused"),
        "non-tensor": (f"{root}/text.pt", {"a": torch.zeros(2)},
                       "Non-tensor value identified at a"),
    }
    if rank == 0:
        torch.save({"a": torch.ones(2), "x": _Payload(f"{root}/marker")}, f"{root}/unsafe.pt")
        torch.save({"a": "text"}, f"{root}/text.pt")
    dist.barrier()
    for name, (file_path, dest, expected) in cases.items():
        msg = _error_of(lambda: dcp.load(  # noqa: B023 - called at once
            dest, storage_reader=sfu.BroadcastingTorchSaveReader(),
            planner=sfu.DynamicMetaLoadPlanner(), checkpoint_id=file_path))
        assert msg.startswith("CheckpointException") and expected in msg, (name, msg)
        checks += 1
    assert not os.path.exists(f"{root}/marker")
    sd = _plain_dest()  # the group still works
    dcp.load(sd, storage_reader=sfu.BroadcastingTorchSaveReader(),
             planner=sfu.DynamicMetaLoadPlanner(), checkpoint_id=path)
    assert_same(sd, want)
    # the private names, distributed
    dist_sd = {"dt": _dtensor(mesh), "st": st, "t": torch.ones(3), "b": [1, 2]}
    assert _create_default_local_metadata(dist_sd) == t_create_default_local_metadata(dist_sd)
    tdcp.save(_state(), checkpoint_id=f"{root}/c")
    for keys in _KEYS:
        ours = _load_state_dict_from_keys(keys, checkpoint_id=f"{root}/c")
        assert_same(ours, t_load_state_dict_from_keys(keys, checkpoint_id=f"{root}/c"), str(keys))
    return checks + 2


def _dtensor(mesh: Any) -> Any:
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(torch.arange(15.0).reshape(5, 3), mesh, [Shard(0)])


@pytest.mark.distributed_timeout(240)
def test_broadcasting_reader_on_two_ranks(tmp_path, run_distributed):
    torch.save(_file_state(), tmp_path / "in.pt")
    assert run_distributed(_bcast, 2, str(tmp_path)) == [9, 9]


def test_private_names_and_modules_without_torch(tmp_path):
    """NumPy-only: _load_state_dict_from_keys builds ndarrays from the
    metadata; format_utils and optimizer import (torch is needed only
    when they are called)."""
    code = textwrap.dedent(f"""
        import sys

        class NoTorch:  # as if torch were not installed: importing it fails
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torch":
                    raise ImportError("torch is not installed here")

        sys.meta_path.insert(0, NoTorch())
        import numpy as np
        import shardstate.checkpoint as dcp
        import shardstate.checkpoint.format_utils, shardstate.checkpoint.optimizer
        from shardstate.checkpoint.state_dict_loader import _load_state_dict_from_keys
        sd = {{"w": np.arange(6, dtype=np.float32).reshape(2, 3),
              "n": {{"x": [np.arange(2, dtype=np.int16), 3], "s": "hi"}}}}
        dcp.save(sd, checkpoint_id={str(tmp_path / "c")!r})
        out = _load_state_dict_from_keys(checkpoint_id={str(tmp_path / "c")!r})
        assert out["w"].dtype == np.float32 and out["w"].tolist() == sd["w"].tolist()
        assert out["n"]["x"][0].dtype == np.int16 and out["n"]["x"][0].tolist() == [0, 1]
        assert out["n"]["x"][1] == 3 and out["n"]["s"] == "hi"
        assert list(_load_state_dict_from_keys("n.s", checkpoint_id={str(tmp_path / "c")!r})) \\
            == ["n"]
        assert not any(m.split(".")[0] == "torch" for m in sys.modules)
        print("ok")
    """)
    env = package_env()
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
