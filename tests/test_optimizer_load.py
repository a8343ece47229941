"""shardstate.checkpoint.load_sharded_optimizer_state_dict against torch 2.13's.

Real processes on gloo. An FSDP1 model (nested units, Adam with two param
groups, trained two steps) saves its SHARDED_STATE_DICT model and optimizer
state at world 2, once with torch's DCP and once with shardstate's. Both
checkpoints are loaded at world 2 and at world 3 with torch's function and
with ours (each on its own library's FileSystemReader, and ours on torch's
reader too): the results must be equal, down to every ShardedTensor's
metadata and local shards, and must restore the optimizer through
``FSDP.optim_state_dict_to_load`` to the state that was saved. A 2-D
model state dict (tensor-parallel DTensors chunked by FSDP1's extension
into ShardedTensors of ShardedTensors) takes the offset-reading path.
Ours must not warn (torch's prints two deprecation warnings).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import shardstate.checkpoint as dcp
import torch
import torch.distributed.checkpoint as tdcp
from torch import nn

pytestmark = pytest.mark.slow


def _model(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Linear(3, 4))
    kw: dict[str, Any] = dict(device_id=torch.device("cpu"), use_orig_params=False)
    model[0] = FSDP(model[0], **kw)
    model[2] = FSDP(model[2], **kw)
    fsdp = FSDP(model, **kw)
    params = list(fsdp.parameters())
    optim = torch.optim.Adam([{"params": params[:1]}, {"params": params[1:], "lr": 0.03}],
                             lr=0.01)
    return fsdp, optim


def _train(model: nn.Module, optim: torch.optim.Optimizer, rank: int) -> None:
    gen = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):
        model(torch.randn(4, 5, generator=gen)).square().mean().backward()
        optim.step()
        optim.zero_grad()


def _sharded(model: nn.Module) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)


def _full_optim(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                  FullOptimStateDictConfig(rank0_only=False)):
            return FSDP.optim_state_dict(model, optim)


def assert_same(ours: Any, theirs: Any, path: str = "osd") -> None:
    """Equal structure, key order, types, dtypes and bits; ShardedTensors
    with equal global metadata and local shards."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    assert type(ours) is type(theirs), f"{path}: {type(ours).__name__} != {type(theirs).__name__}"
    if isinstance(theirs, ShardedTensor):
        assert ours.metadata() == theirs.metadata(), f"{path}: metadata"
        a, b = ours.local_shards(), theirs.local_shards()
        assert len(a) == len(b), f"{path}: {len(a)} local shards != {len(b)}"
        for i, (sa, sb) in enumerate(zip(a, b)):
            assert sa.metadata == sb.metadata, f"{path}[{i}]: shard metadata"
            assert_same(sa.tensor, sb.tensor, f"{path}.shard{i}")
    elif isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.shape, ours.device, ours.requires_grad) == (
            theirs.dtype, theirs.shape, theirs.device, theirs.requires_grad), path
        assert torch.equal(ours, theirs), f"{path}: values differ\n{ours}\n{theirs}"
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


def _torch_load(model_sd: dict, key: str, reader: Any) -> dict:
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

    with warnings.catch_warnings():
        # torch calls its deprecated load_state_dict and _get_pg_default_device.
        warnings.simplefilter("ignore")
        return load_sharded_optimizer_state_dict(model_sd, key, reader)


def _ours_load(model_sd: dict, key: str, reader: Any, planner: Any = None) -> dict:
    with warnings.catch_warnings():
        # Ours warns about nothing but what ShardedTensor itself says when used.
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
        return dcp.load_sharded_optimizer_state_dict(model_sd, key, reader, planner)


def _save(rank: int, world: int, root: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model, optim = _model(world)
    _train(model, optim, rank)
    _sharded(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        sd = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
    tdcp.save(sd, checkpoint_id=f"{root}/t")
    dcp.save(sd, checkpoint_id=f"{root}/s")
    full = _full_optim(model, optim)
    if rank == 0:
        torch.save(full, f"{root}/full_optim.pt")


def _load(rank: int, world: int, root: str) -> int:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    want = torch.load(f"{root}/full_optim.pt", weights_only=True)
    checked = 0
    for src in ("t", "s"):
        path = f"{root}/{src}"
        model, optim = _model(world)
        _sharded(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model_sd = model.state_dict()
        theirs = _torch_load(model_sd, "optim", tdcp.FileSystemReader(path))
        ours = _ours_load(model_sd, "optim", dcp.FileSystemReader(path))
        assert_same(ours, theirs, f"{src}@{world}")
        # torch's reader, and an explicit planner, under our function
        assert_same(_ours_load(model_sd, "optim", tdcp.FileSystemReader(path),
                               dcp.DefaultLoadPlanner()), theirs, f"{src}@{world} torch reader")
        states = ours["optim"]["state"]
        assert any(isinstance(v, ShardedTensor) for s in states.values() for v in s.values())
        # The loaded state restores the optimizer to what was saved.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, ours["optim"]))
        assert_same(_full_optim(model, optim), want, f"{src}@{world} restored")
        checked += 1
    return checked


@pytest.mark.distributed_timeout(300)
def test_fsdp1_sharded_optimizer_load_matches_torch(tmp_path, run_distributed):
    run_distributed(_save, 2, str(tmp_path))
    assert run_distributed(_load, 2, str(tmp_path)) == [2, 2]
    assert run_distributed(_load, 3, str(tmp_path)) == [2, 2, 2]


# ---------------------------------------------------------------------------
# A 2-D model state dict: nested ShardedTensors with tensor-parallel offsets
# ---------------------------------------------------------------------------


def _two_d(rank: int, world: int, root: str) -> None:
    """Tensor parallel and data parallel both over ranks 0..world-1: torch's
    2-D path names data-parallel ranks by their group rank as if global, so
    it loads only where the data-parallel group's ranks are 0..n-1 (a real
    2x2 layout fails under torch on ranks 1 and 3). Each rank's
    tensor-parallel slice (rows at offset slice*rank) is chunked again over
    the data-parallel ranks."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel.fsdp import _chunk_tensor

    torch.manual_seed(3)
    # even tensor-parallel splits (torch's _chunk_tensor needs them); "v"'s
    # 3-row slices split 2 + 1 over the data-parallel ranks
    full = {"w": torch.randn(8, 6), "v": torch.randn(6, 2)}
    osd = {"optim": {
        "state": {"w": {"exp_avg": full["w"] * 2, "step": torch.tensor(3.0)},
                  "v": {"exp_avg": full["v"] - 1, "step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": ["w", "v"]}],
    }}
    dcp.save(osd, checkpoint_id=f"{root}/s2d")
    tdcp.save(osd, checkpoint_id=f"{root}/t2d")
    tp = init_device_mesh("cpu", (world,))
    dp = dist.new_group(list(range(world)))
    model_sd = {k: _chunk_tensor(distribute_tensor(v, tp, [Shard(0)]), rank, world, 1, dp)
                for k, v in full.items()}
    assert isinstance(model_sd["w"].local_shards()[0].tensor, ShardedTensor)
    # (tensor-parallel slice rows, rows of it this rank holds)
    rows = {"w": (4, [(0, 2), (2, 4)][rank]), "v": (3, [(0, 2), (2, 3)][rank])}
    for src in ("s2d", "t2d"):
        path = f"{root}/{src}"
        theirs = _torch_load(model_sd, "optim", tdcp.FileSystemReader(path))
        ours = _ours_load(model_sd, "optim", dcp.FileSystemReader(path))
        assert_same(ours, theirs, src)
        for name, (tp_rows, (lo, hi)) in rows.items():
            (shard,) = ours["optim"]["state"][name]["exp_avg"].local_shards()
            saved = osd["optim"]["state"][name]["exp_avg"]
            want = saved[tp_rows * rank + lo:tp_rows * rank + hi]
            assert torch.equal(shard.tensor, want), (src, name)
        assert ours["optim"]["param_groups"] == osd["optim"]["param_groups"]


@pytest.mark.distributed_timeout(200)
def test_two_d_layout_reads_the_tensor_parallel_slice(tmp_path, run_distributed):
    run_distributed(_two_d, 2, str(tmp_path))
