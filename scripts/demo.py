"""The main job (`make demo`): a real multi-process write, reshard and verified read.

Run under torchrun (gloo on CPU):

    torchrun --standalone --nproc_per_node=2 scripts/demo.py [--gib-per-rank 1.5]

Each rank owns a set of buffers (deterministic pseudo-random bytes, so any
rank can recompute what a buffer must hold) and writes them with the C
engine's parallel writer into its own data file, CRC-32 computed in the same
pass and the file fsynced. The ranks' manifests (file, offset, length, CRC of
every buffer) are gathered and rank 0 publishes them atomically, last, as the
commit point. Then the buffers are re-partitioned across the ranks, as a
resume at a different layout would, so every rank reads data another rank
wrote: straight into preallocated arrays, CRC-verified by the engine, and
compared byte for byte with the recomputed content. Throughput is printed.

Until shardstate.checkpoint exists this is the largest real thing the core
does; later it becomes a full save, reshard and resume of a training run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import numpy as np
import torch.distributed as dist

import shardstate
from shardstate import io as ssio

ALIGN = 64


def buffer_bytes(owner: int, index: int, nbytes: int) -> np.ndarray:
    """The content of buffer (owner, index): reproducible on any rank."""
    rng = np.random.default_rng([owner, index, 20261129])
    return np.frombuffer(rng.bytes(nbytes), dtype=np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib-per-rank", type=float, default=1.5)
    ap.add_argument("--buffer-mib", type=int, default=64)
    ap.add_argument("--threads", type=int, default=max(2, os.cpu_count() or 2))
    ap.add_argument("--dir", default=os.path.join("build", "demo-checkpoint"))
    ap.add_argument("--keep", action="store_true", help="keep the files afterwards")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    buf_bytes = args.buffer_mib << 20
    nbuf = max(1, int(args.gib_per_rank * (1 << 30)) // buf_bytes)
    ckpt = os.path.abspath(args.dir)
    if rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
        os.makedirs(ckpt)
    dist.barrier()
    say(f"shardstate {shardstate.__version__}: {world} ranks, {nbuf} x {args.buffer_mib} MiB "
        f"per rank ({world * nbuf * buf_bytes / 2**30:.2f} GiB in all), {args.threads} I/O "
        f"threads per rank, CRC-32 implementation {shardstate.crc_implementation()['crc32']}")
    say(f"checkpoint directory: {ckpt}")

    # ---- save: every rank writes its own buffers into its own file.
    mine = [buffer_bytes(rank, i, buf_bytes) for i in range(nbuf)]
    path = os.path.join(ckpt, f"__{rank}_0.distcp")
    offsets = [i * ((buf_bytes + ALIGN - 1) // ALIGN * ALIGN) for i in range(nbuf)]
    dist.barrier()
    t0 = time.perf_counter()
    crcs = ssio.write(
        [ssio.WriteJob(path, off, buf) for off, buf in zip(offsets, mine)],
        threads=args.threads, fsync=True,
    )
    t_write = time.perf_counter() - t0
    entries = [
        {"owner": rank, "index": i, "file": os.path.basename(path), "offset": off,
         "length": buf_bytes, "crc32": crc}
        for i, (off, crc) in enumerate(zip(offsets, crcs))
    ]
    del mine
    gathered: list = [None] * world
    dist.all_gather_object(gathered, entries)
    manifest = [e for part in gathered for e in part]
    if rank == 0:  # the commit point: published atomically, after all data
        ssio.atomic_publish(os.path.join(ckpt, "manifest.json"),
                            json.dumps(manifest).encode())
    dist.barrier()
    write_times: list = [None] * world
    dist.all_gather_object(write_times, t_write)
    total = world * nbuf * buf_bytes
    say(f"save:    {total / 2**30:.2f} GiB in {max(write_times):.2f} s  "
        f"-> {total / max(write_times) / 2**30:.2f} GiB/s aggregate (fsynced)")

    # ---- reshard: a different assignment, so each rank reads others' data.
    with open(os.path.join(ckpt, "manifest.json"), "rb") as f:
        committed = json.loads(f.read())
    assert committed == manifest, "published manifest differs from the gathered one"
    assigned = [e for k, e in enumerate(committed) if (k + 1) % world == rank]
    outs = [np.empty(e["length"], dtype=np.uint8) for e in assigned]
    dist.barrier()
    t0 = time.perf_counter()
    ssio.read(
        [ssio.ReadJob(os.path.join(ckpt, e["file"]), e["offset"], out, e["crc32"])
         for e, out in zip(assigned, outs)],
        threads=args.threads, verify=True,
    )
    t_read = time.perf_counter() - t0
    foreign = sum(1 for e in assigned if e["owner"] != rank)
    for e, out in zip(assigned, outs):
        expected = buffer_bytes(e["owner"], e["index"], e["length"])
        if not np.array_equal(out, expected):
            raise SystemExit(f"rank {rank}: buffer {e['owner']}/{e['index']} differs")
    read_times: list = [None] * world
    dist.all_gather_object(read_times, (t_read, foreign, len(assigned)))
    t_max = max(t for t, _, _ in read_times)
    say(f"resume:  {total / 2**30:.2f} GiB read back in {t_max:.2f} s  -> "
        f"{total / t_max / 2**30:.2f} GiB/s aggregate, CRC-verified and compared byte for byte")
    for r, (t, nf, n) in enumerate(read_times):
        say(f"  rank {r}: read {n} buffers, {nf} of them written by another rank, {t:.2f} s")

    dist.barrier()
    if rank == 0 and not args.keep:
        shutil.rmtree(ckpt, ignore_errors=True)
    say("demo OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
