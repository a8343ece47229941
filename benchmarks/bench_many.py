"""Many small tensors: shardstate.checkpoint against torch DCP, one process.

    python benchmarks/bench_many.py [--tensors 20000] [--shape 16 16] [--repeat 3] [--dir /dev/shm]
                                    [--profile]

A flat state dict of --tensors float32 tensors of --shape (20,000 of 16x16
by default: 20 MiB in 20,000 records), saved and loaded by one process with
no process group, so the time is per-item work (planning, metadata, record
framing, one engine job per item) rather than bandwidth. torch DCP and
shardstate take turns in one run, each --repeat times:

  save   dcp.save(state, checkpoint_id=dir)            (median wall time)
  load   dcp.load(dest, checkpoint_id=dir) into zeroed tensors of the
         same shapes; after each load every tensor is checked equal to
         the saved one

and prints the medians and the ratio torch / shardstate (> 1: shardstate
is faster). --profile adds one cProfile run of shardstate's save and load
and prints each one's top functions by own time (the per-phase split).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import shardstate.checkpoint as sdcp  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as tdcp  # noqa: E402


def _state(n: int, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(shape, generator=g) for i in range(n)}


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _check(dest: dict[str, torch.Tensor], state: dict[str, torch.Tensor], who: str) -> None:
    for k, v in state.items():
        if not torch.equal(dest[k], v):
            raise SystemExit(f"{who}: {k} differs after load")


def _fresh(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def _save(dcp, state, path: str) -> float:
    _fresh(path)
    t = time.perf_counter()
    dcp.save(state, checkpoint_id=path)
    return time.perf_counter() - t


def _load(dcp, state, path: str) -> float:
    dest = _zeros(state)
    t = time.perf_counter()
    dcp.load(dest, checkpoint_id=path)
    dt = time.perf_counter() - t
    _check(dest, state, dcp.__name__)
    return dt


def _profile(state, path: str, top: int) -> None:
    for phase in ("save", "load"):
        prof = cProfile.Profile()
        if phase == "save":
            _fresh(path)
            prof.enable()
            sdcp.save(state, checkpoint_id=path)
        else:
            dest = _zeros(state)
            prof.enable()
            sdcp.load(dest, checkpoint_id=path)
        prof.disable()
        print(f"\nshardstate {phase}: top {top} by own time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=20000)
    ap.add_argument("--shape", type=int, nargs="+", default=[16, 16])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--profile", action="store_true", help="add one cProfile run of shardstate")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()

    state = _state(args.tensors, tuple(args.shape))
    root = tempfile.mkdtemp(prefix="bench_many_", dir=args.dir)
    times: dict[tuple[str, str], list[float]] = {}
    try:
        paths = {"torch": os.path.join(root, "torch"), "shardstate": os.path.join(root, "ss")}
        impls = {"torch": tdcp, "shardstate": sdcp}
        for _ in range(args.repeat):
            for name in ("torch", "shardstate"):
                times.setdefault((name, "save"), []).append(_save(impls[name], state, paths[name]))
                times.setdefault((name, "load"), []).append(_load(impls[name], state, paths[name]))
        print(f"{args.tensors} tensors of {tuple(args.shape)} float32, 1 process, {args.dir}, "
              f"median of {args.repeat}")
        print(f"{'':6} {'torch s':>9} {'shardstate s':>13} {'ratio':>7}")
        for phase in ("save", "load"):
            t = statistics.median(times[("torch", phase)])
            s = statistics.median(times[("shardstate", phase)])
            print(f"{phase:6} {t:9.3f} {s:13.3f} {t / s:6.2f}x")
        if args.profile:
            _profile(state, paths["shardstate"], args.top)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
