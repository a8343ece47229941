"""The main job (`make demo`): a multi-process save, then a resume at another world size.

    torchrun --standalone --nproc_per_node=2 scripts/demo.py save   --dir D [--gib 1.5]
    torchrun --standalone --nproc_per_node=3 scripts/demo.py resume --dir D [--gib 1.5]

`save` builds a model-sized state dict (a transformer's weights and Adam
moments, sharded across the ranks as DTensor Shard(0), plus step counters and
a bytes item) and saves it with shardstate.checkpoint (parallel C writes,
CRC-32 computed in the same pass, fsync, .metadata published atomically
last). `resume` runs at a different world size and placement (Shard(1) over
the new ranks, so every rank reads pieces of chunks other ranks wrote),
loads the checkpoint with shardstate.checkpoint (reads straight into place,
CRC-verified), checks that every element of every tensor equals what was
saved, and then has torch's own DCP load part of the same checkpoint, to
show the files are torch's format. Throughput is printed.

Every value is a function of its global position, so any rank can check
any shard without the original data.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import shardstate
import shardstate.checkpoint as dcp


def shapes(total_bytes: int) -> list[tuple[str, tuple[int, int]]]:
    """2-D parameter shapes of a transformer whose weights + Adam moments
    (float32) take about total_bytes."""
    d, vocab = 1024, 16384
    layer = [("attn.qkv", (3 * d, d)), ("attn.out", (d, d)),
             ("mlp.up", (4 * d, d)), ("mlp.down", (d, 4 * d)), ("norm", (2, d))]
    per_layer = sum(a * b for _, (a, b) in layer) * 4 * 3
    n = max(1, (total_bytes - vocab * d * 4 * 3) // per_layer)
    out = [("embed", (vocab, d))]
    for i in range(n):
        out += [(f"layers.{i}.{k}", s) for k, s in layer]
    return out


def expected(name: str, kind: int, shape: tuple[int, int], mesh, placement) -> DTensor:
    """The tensor `name` (kind 0 weight, 1 exp_avg, 2 exp_avg_sq): values
    derived from the global element index, built shard by shard."""
    seed = (sum(map(ord, name)) * 31 + kind) % 9973
    full_meta = torch.empty(shape, device="meta")
    local_shape, offset = _local_box(full_meta, mesh, placement)
    rows = torch.arange(offset[0], offset[0] + local_shape[0], dtype=torch.int64)
    cols = torch.arange(offset[1], offset[1] + local_shape[1], dtype=torch.int64)
    idx = rows[:, None] * shape[1] + cols[None, :]
    local = ((idx * 2654435761 + seed) % 1000003).to(torch.float32) / 1000003.0
    return DTensor.from_local(local, mesh, [placement], run_check=False,
                              shape=torch.Size(shape), stride=(shape[1], 1))


def _local_box(meta: torch.Tensor, mesh, placement):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(meta.shape, mesh, [placement])


def state(total: int, mesh, placement, fill: bool) -> dict:
    model, optim = {}, {}
    for name, shape in shapes(total):
        if fill:
            w, m, v = (expected(name, k, shape, mesh, placement) for k in range(3))
        else:
            w, m, v = (distribute_tensor(torch.zeros(shape), mesh, [placement]) for _ in range(3))
        model[name] = w
        optim[name] = {"exp_avg": m, "exp_avg_sq": v, "step": torch.tensor(1000.0 if fill else 0.0)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 3e-4}]},
            "trainer": {"step": 1000 if fill else 0, "run": "shardstate-demo" if fill else ""}}


def tensor_bytes(sd: dict) -> int:
    total, stack = 0, [sd]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, torch.Tensor):
            loc = v.to_local() if isinstance(v, DTensor) else v
            total += loc.numel() * loc.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=["save", "resume"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--gib", type=float, default=1.5, help="weights + Adam state, GiB")
    args = ap.parse_args()
    total = int(args.gib * (1 << 30))

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    ckpt = os.path.abspath(args.dir)

    if args.phase == "save":
        sd = state(total, mesh, Shard(0), fill=True)
        mine = tensor_bytes(sd)
        everyone = [0] * world
        dist.all_gather_object(everyone, mine)
        say(f"save: {world} ranks, {len(shapes(total))} parameters + Adam as DTensor Shard(0), "
            f"{sum(everyone) / 2**30:.2f} GiB in all, CRC-32 {shardstate.crc_implementation()['crc32']}")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(sd, checkpoint_id=ckpt)
        dist.barrier()
        dt = time.perf_counter() - t0
        files = sorted(os.listdir(ckpt))
        say(f"  saved to {ckpt} in {dt:.2f} s -> {sum(everyone) / dt / 2**30:.2f} GiB/s "
            f"aggregate; files: {', '.join(files)}")
    else:
        sd = state(total, mesh, Shard(1), fill=False)
        mine = tensor_bytes(sd)
        everyone = [0] * world
        dist.all_gather_object(everyone, mine)
        say(f"resume: {world} ranks, DTensor Shard(1) (saved as Shard(0) by another world size)")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(sd, checkpoint_id=ckpt)
        dist.barrier()
        dt = time.perf_counter() - t0
        say(f"  loaded in {dt:.2f} s -> {sum(everyone) / dt / 2**30:.2f} GiB/s aggregate")
        bad = 0
        checked = 0
        for name, shape in shapes(total):
            got = [sd["model"][name], sd["optim"]["state"][name]["exp_avg"],
                   sd["optim"]["state"][name]["exp_avg_sq"]]
            for k, t in enumerate(got):
                want = expected(name, k, shape, mesh, Shard(1)).to_local()
                checked += want.numel()
                if not torch.equal(t.to_local(), want):
                    bad += 1
                    print(f"rank {rank}: {name}[{k}] differs", flush=True)
            if float(sd["optim"]["state"][name]["step"]) != 1000.0:
                bad += 1
        if sd["trainer"] != {"step": 1000, "run": "shardstate-demo"}:
            bad += 1
        counts = [None] * world
        dist.all_gather_object(counts, (checked, bad))
        total_checked = sum(c for c, _ in counts)
        total_bad = sum(b for _, b in counts)
        say(f"  verified {total_checked:,} elements on {world} ranks: "
            f"{'all equal' if total_bad == 0 else f'{total_bad} MISMATCHES'}")

        # torch's own DCP reads the same files (the on-disk format is torch's).
        import torch.distributed.checkpoint as tdcp

        name, shape = shapes(total)[1]
        probe = {"model": {name: distribute_tensor(torch.zeros(shape), mesh, [Shard(0)])}}
        tdcp.load(probe, checkpoint_id=ckpt)
        same = torch.equal(probe["model"][name].to_local(),
                           expected(name, 0, shape, mesh, Shard(0)).to_local())
        flags = [None] * world
        dist.all_gather_object(flags, same)
        say(f"  torch.distributed.checkpoint.load of {name!r} from the same files: "
            f"{'equal' if all(flags) else 'DIFFERENT'}")
        if total_bad or not all(flags):
            raise SystemExit(1)
        say("demo OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
