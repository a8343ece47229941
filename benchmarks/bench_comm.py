"""shardstate.comm's CPU transfers against torch.distributed's gloo collectives, side by side.

    python benchmarks/bench_comm.py [--mib 64] [--world 2] [--repeat 5]

Each rank contributes --mib MiB of float32. In one run, on the same gloo
group and buffers, taking turns:

  all-gather   torch: all_gather_single        ours: comm.all_gather_into
  gather       torch: gather to rank 0         ours: comm.gather
  exchange     torch: all_to_all_single        ours: comm.exchange, one message
               of equal blocks                 per block (what the FSDP chunk
                                               exchange sends)

Time is the slowest rank's (a barrier before and after), median of
--repeat. Results are checked equal to torch's every time. Prints one
speedup line per transfer (torch s / ours s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

from shardstate.testing import run_distributed  # noqa: E402

OPS = ("all-gather", "gather", "exchange")


def _bench(rank: int, world: int, mib: int, repeat: int) -> dict:
    import torch
    import torch.distributed as dist
    from shardstate import comm

    n = mib * 2**20 // 4 // world * world  # equal blocks for the exchange
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    theirs, ours = torch.empty(world * n), torch.empty(world * n)
    blocks = list(x.chunk(world))
    sizes = [b.numel() for b in blocks]

    def run(name: str, op: str, out: torch.Tensor) -> None:
        if op == "all-gather":
            if name == "torch":
                dist.all_gather_single(out, x)
            else:
                comm.all_gather_into(out, x)
        elif op == "gather":
            if name == "torch":
                dist.gather(x, list(out.split(n)) if rank == 0 else None, group_dst=0)
            else:
                comm.gather(out if rank == 0 else None, x, 0)
        else:  # every rank's block r goes to rank r
            recv = out[: sum(sizes)]
            if name == "torch":
                dist.all_to_all_single(recv, x, sizes, sizes)
            else:
                parts = list(recv.split(sizes))
                parts[rank].copy_(blocks[rank])
                others = [r for r in range(world) if r != rank]
                comm.exchange([(blocks[r], r) for r in others], [(parts[r], r) for r in others])

    res: dict = {}
    for i in range(repeat):
        for op in OPS:
            order = ("torch", "shardstate") if i % 2 == 0 else ("shardstate", "torch")
            for name in order:
                out = theirs if name == "torch" else ours
                out.zero_()
                dist.barrier()
                t0 = time.perf_counter()
                run(name, op, out)
                dist.barrier()
                res.setdefault((name, op), []).append(time.perf_counter() - t0)
            if (op != "gather" or rank == 0) and not torch.equal(theirs, ours):
                raise AssertionError(f"{op}: shardstate's result differs from torch's")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    per_rank = run_distributed(_bench, args.world, args.mib, args.repeat, timeout=1800)
    print(f"gloo, world {args.world}, {args.mib} MiB float32 per rank, median of {args.repeat}")
    print(f"{'transfer':12s} {'torch s':>8s} {'ours s':>8s} {'speedup':>8s}")
    for op in OPS:
        t = {
            n: statistics.median(
                max(r[(n, op)][i] for r in per_rank) for i in range(args.repeat)
            )
            for n in ("torch", "shardstate")
        }
        print(f"{op:12s} {t['torch']:8.3f} {t['shardstate']:8.3f} "
              f"{t['torch'] / t['shardstate']:7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
