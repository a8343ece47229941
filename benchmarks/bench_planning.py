"""Checkpoint planning at 1,024 and 4,096 simulated ranks: shardstate's planners against torch's.

    python benchmarks/bench_planning.py [--ranks 1024 4096] [--layers 2] [--repeat 3]

Simulates, in one process and without collectives, a save and a load of a
GPT-like model (``--layers`` blocks of 12 parameters, tied embeddings, a final
layer norm; ``--hidden`` wide) sharded FSDP2-style (every parameter a
``Shard(0)`` DTensor over all ranks) with its Adam state (``exp_avg`` and
``exp_avg_sq`` DTensors, a 0-d ``step`` tensor on every rank, one param
group), as ``{"model": ..., "optim": ...}``:

  local    one rank's (the middle rank's) ``set_up_planner`` +
           ``create_local_plan`` on real DTensors (a fake process group of the
           full world size; local shards are uninitialised CPU tensors)
  global   the coordinator's ``create_global_plan`` over every rank's plan:
           dedup of the replicated items, the Metadata, index hints and the
           validation of every tensor's chunks. The other ranks' plans are
           built item by item the way ``create_local_plan`` builds them
           (boxes from torch's DTensor helper); the sample rank's real plan is
           checked equal to its built one.
  finish   one rank's ``finish_plan`` of its part of the global plan
  load     one rank's ``DefaultLoadPlanner`` ``set_up_planner`` +
           ``create_local_plan`` (same DTensors) against the global Metadata
           as each side's reader returns it from the ``.metadata`` bytes, as
           in a load: torch's ``pickle.loads``, shardstate's
           ``_pickle.loads_metadata`` (at this size its chunk lists are int64
           arrays, which the planner reads directly)
  load/md  the same against the Metadata object the save built (lists of
           ChunkStorageMetadata: shardstate reads their boxes in C)

Both sides run on the same inputs in one run; their outputs are checked equal
(plans item for item with index hints, Metadata field for field, load plans
read for read) before anything is timed. Prints medians of ``--repeat`` runs,
the ratio torch / shardstate (> 1: shardstate is faster) and the peak memory
each step allocates (tracemalloc, in one extra untimed run; C allocations are
not seen by it). Runs on the CPU; torch must be installed.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))


def _params(layers: int, hidden: int, vocab: int, block: int) -> list[tuple[str, tuple]]:
    """(name, global shape) of a GPT-2-like model's parameters."""
    h = hidden
    out = [("wte.weight", (vocab, h)), ("wpe.weight", (block, h))]
    for i in range(layers):
        p = f"h.{i}."
        out += [
            (p + "ln_1.weight", (h,)), (p + "ln_1.bias", (h,)),
            (p + "attn.c_attn.weight", (3 * h, h)), (p + "attn.c_attn.bias", (3 * h,)),
            (p + "attn.c_proj.weight", (h, h)), (p + "attn.c_proj.bias", (h,)),
            (p + "ln_2.weight", (h,)), (p + "ln_2.bias", (h,)),
            (p + "mlp.c_fc.weight", (4 * h, h)), (p + "mlp.c_fc.bias", (4 * h,)),
            (p + "mlp.c_proj.weight", (h, 4 * h)), (p + "mlp.c_proj.bias", (h,)),
        ]
    return out + [("ln_f.weight", (h,)), ("ln_f.bias", (h,))]


class _Boxes:
    """Shard(0) boxes per (global shape, rank), from torch's DTensor helper."""

    def __init__(self, world: int) -> None:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        self.world = world
        self._fn = _compute_local_shape_and_global_offset
        self._placements = [Shard(0)]
        self._cache: dict[tuple, tuple] = {}

    def __call__(self, shape: tuple, rank: int) -> tuple[tuple, tuple]:
        key = (shape, rank)
        hit = self._cache.get(key)
        if hit is None:
            sizes, offsets = self._fn(shape, (self.world,), [rank], self._placements)
            hit = self._cache[key] = (tuple(offsets), tuple(sizes))
        return hit


def _state_dict(params: list[tuple[str, tuple]], mesh: Any, boxes: _Boxes, rank: int) -> dict:
    """The sample rank's {"model", "optim"} state dict of DTensors."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    def dt(shape: tuple) -> Any:
        _, sizes = boxes(shape, rank)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(torch.empty(sizes), mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    model = {name: dt(shape) for name, shape in params}
    state = {name: {"step": torch.tensor(10.0), "exp_avg": dt(shape), "exp_avg_sq": dt(shape)}
             for name, shape in params}
    group = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
             "amsgrad": False, "foreach": None, "maximize": False, "capturable": False,
             "differentiable": False, "fused": None, "decoupled_weight_decay": False,
             "params": [name for name, _ in params]}
    return {"model": model, "optim": {"state": state, "param_groups": [group]}}


def _rank_plan(sample: Any, boxes: _Boxes, rank: int) -> Any:
    """Rank ``rank``'s local plan, built from the sample rank's the way
    create_local_plan builds it: each SHARD item with that rank's box, every
    other item (replicated values) as the sample's; a fresh copy of every
    object, as the coordinator's unpickled plans would be."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem

    items = []
    for it in sample.items:
        td = it.tensor_data
        if td is None:
            items.append(WriteItem(index=MetadataIndex(it.index.fqn), type=it.type))
            continue
        size = td.size
        if it.type.name == "SHARD":
            offsets, sizes = boxes(tuple(size), rank)
        else:
            offsets, sizes = tuple(td.chunk.offsets), tuple(td.chunk.sizes)
        p = td.properties
        offsets = type(size)(offsets)
        items.append(WriteItem(
            index=MetadataIndex(it.index.fqn, offsets), type=it.type,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=type(size)(sizes)),
                properties=TensorProperties(
                    dtype=p.dtype, layout=p.layout, requires_grad=p.requires_grad,
                    memory_format=p.memory_format, pin_memory=p.pin_memory),
                size=type(size)(size)),
        ))
    return SavePlan(items, planner_data=dict(sample.planner_data))


def _same_plans(a: list, b: list) -> bool:
    """Equal items, index hints included (MetadataIndex's == ignores them)."""
    if len(a) != len(b):
        return False
    for pa, pb in zip(a, b):
        if pa.items != pb.items or pa.planner_data != pb.planner_data:
            return False
        if [i.index.index for i in pa.items] != [i.index.index for i in pb.items]:
            return False
    return True


def _median(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return statistics.median(times)


def _peak(fn: Callable[[], Any]) -> int:
    """Bytes allocated at the peak of one call (its result included)."""
    gc.collect()
    tracemalloc.start()
    try:
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del out
    return peak


def _init_world(world: int, rank: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def _steps(world: int, args: argparse.Namespace) -> list[tuple[str, Callable, Callable]]:
    """(step, torch's call, shardstate's call) on one world size's inputs,
    after checking that both produce the same outputs."""
    import shardstate.checkpoint.default_planner as sdp
    import torch.distributed.checkpoint.default_planner as tdp

    rank = world // 2
    mesh = _init_world(world, rank)
    boxes = _Boxes(world)
    params = _params(args.layers, args.hidden, args.vocab, args.block)
    sd = _state_dict(params, mesh, boxes, rank)

    def local(mod: Any) -> Callable[[], Any]:
        def run() -> Any:
            p = mod.DefaultSavePlanner()
            p.set_up_planner(sd, is_coordinator=False)
            return p.create_local_plan()
        return run

    sample = local(tdp)()
    if local(sdp)() != sample:
        raise AssertionError("the local save plans differ")
    plans = [_rank_plan(sample, boxes, r) for r in range(world)]
    if plans[rank] != sample:
        raise AssertionError("the built plan of the sample rank differs from its real plan")

    def global_(mod: Any) -> Callable[[], Any]:
        return lambda: mod.DefaultSavePlanner().create_global_plan(plans)

    t_plans, t_md = global_(tdp)()
    s_plans, s_md = global_(sdp)()
    if s_md != t_md or not _same_plans(s_plans, t_plans):
        raise AssertionError("the global plans or the metadata differ")

    mine = t_plans[rank]

    def finish(mod: Any) -> Callable[[], Any]:
        return lambda: mod.DefaultSavePlanner().finish_plan(mine)

    def load(mod: Any, md: Any = t_md) -> Callable[[], Any]:
        def run() -> Any:
            p = mod.DefaultLoadPlanner()
            p.set_up_planner(sd, md, is_coordinator=False)
            return p.create_local_plan()
        return run

    import pickle

    from shardstate.checkpoint import _pickle

    t_read = pickle.loads(pickle.dumps(t_md))
    s_read = _pickle.loads_metadata(_pickle.dumps_metadata(t_md))
    t_load, s_load = load(tdp)(), load(sdp)()
    if s_load.items != t_load.items or not s_load.items:
        raise AssertionError("the load plans differ")
    if load(sdp, s_read)().items != t_load.items or load(tdp, t_read)().items != t_load.items:
        raise AssertionError("the load plans over the metadata read back differ")
    items = sum(len(p.items) for p in plans)
    chunks = sum(len(v.chunks) for v in t_md.state_dict_metadata.values()
                 if hasattr(v, "chunks"))
    print(f"# {world} ranks: {len(params)} parameters, {items} planned items, {chunks} chunks "
          f"in the metadata, {len(t_load.items)} reads for rank {rank}")
    del t_plans, s_plans, s_md, s_load, t_load
    return [
        ("local", local(tdp), local(sdp)),
        ("global", global_(tdp), global_(sdp)),
        ("finish", finish(tdp), finish(sdp)),
        ("load", load(tdp, t_read), load(sdp, s_read)),
        ("load/md", load(tdp), load(sdp)),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--block", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc runs")
    args = ap.parse_args()

    import torch.distributed as dist

    print(f"{'ranks':>6} {'step':<8}{'torch s':>10}{'shardstate s':>14}{'ratio':>8}"
          f"{'torch MB':>10}{'ss MB':>8}")
    try:
        for world in args.ranks:
            for step, theirs, ours in _steps(world, args):
                t = _median(theirs, args.repeat)
                s = _median(ours, args.repeat)
                mem = "" if args.no_memory else \
                    f"{_peak(theirs) / 1e6:>10.1f}{_peak(ours) / 1e6:>8.1f}"
                print(f"{world:>6} {step:<8}{t:>10.4f}{s:>14.4f}{t / s:>7.1f}x{mem}", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
