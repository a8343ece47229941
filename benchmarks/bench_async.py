"""async_save's checkpointers side by side: THREAD and PROCESS, shardstate's
and torch's.

    python benchmarks/bench_async.py [--mib 256] [--dir /dev/shm/bench_async]

2 ranks (gloo, fresh processes), each saving --mib MiB of float32 tensors
in a loop of 4 async saves; the first starts what the checkpointer needs
(torch's and shardstate's checkpoint processes), the next 3 are measured:

  block       how long async_save takes to return (staging), median of 3
  done        until the checkpoint is committed, median of 3
  py during   the pure-Python work the training process gets done while the
              save is written, against the same loop idle: what the write
              leaves of this process's GIL (1.00: nothing taken)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

from shardstate.testing import run_distributed  # noqa: E402

_SAVES = 4


def _spin(seconds: float) -> int:
    """Pure-Python iterations done in ``seconds``."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            n += 1
    return n


def _run(rank: int, world: int, impl: str, mode: str, path: str, mib: int) -> tuple:
    import multiprocessing

    import torch
    import torch.distributed as dist

    if impl == "torch":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    else:
        import shardstate.checkpoint as dcp
        from shardstate.checkpoint.state_dict_saver import AsyncCheckpointerType
    # torch's checkpoint process is a multiprocessing child, which a
    # daemonic process (these ranks) may not have
    multiprocessing.current_process().daemon = False
    n = mib * (1 << 20) // 4 // 8
    sd = {f"layer{i}": torch.randn(n) for i in range(8)}
    idle = _spin(0.2) / 0.2
    blocked, done, share = [], [], []
    for i in range(_SAVES):
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=f"{path}/{i}",
                             async_checkpointer_type=getattr(AsyncCheckpointerType, mode))
        t1 = time.perf_counter()
        work, spun = 0, 0.0
        while not fut.done():
            s0 = time.perf_counter()
            work += _spin(0.01)
            spun += time.perf_counter() - s0
        fut.result()
        t2 = time.perf_counter()
        if i:
            blocked.append(t1 - t0)
            done.append(t2 - t0)
            share.append(work / spun / idle if spun else float("nan"))
        dist.barrier()
    return statistics.median(blocked), statistics.median(done), statistics.median(share)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB saved per rank")
    ap.add_argument("--dir", default="/dev/shm/bench_async" if os.path.isdir("/dev/shm")
                    else "build/bench_async")
    args = ap.parse_args()
    print(f"async_save, 2 ranks, {args.mib} MiB per rank, {args.dir}; "
          f"medians of saves 2-{_SAVES}")
    print(f"{'':22}{'block':>10}{'done':>10}{'py during':>11}")
    for impl, mode in (("shardstate", "THREAD"), ("shardstate", "PROCESS"),
                       ("torch", "THREAD"), ("torch", "PROCESS")):
        path = os.path.join(args.dir, f"{impl}-{mode}")
        shutil.rmtree(path, ignore_errors=True)
        res = run_distributed(_run, 2, impl, mode, path, args.mib, timeout=600)
        blocked = max(r[0] for r in res)
        done = max(r[1] for r in res)
        share = min(r[2] for r in res)
        print(f"{impl + ' ' + mode:22}{blocked * 1e3:8.1f}ms{done:9.2f}s{share:11.2f}")
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
