"""DCP <-> torch.save conversion: shardstate's format_utils against torch's, side by side.

    python benchmarks/bench_torchsave.py [--gib 1] [--repeat 3] [--dir /dev/shm]

A state of about --gib GiB (float32 and bfloat16 matrices of 4-64 MiB, a
few shared-storage views, small int64 tensors and plain values). In one
run, torch's and shardstate's take turns (each timed region starts from a
fresh output path; the inputs stay in the page cache):

  dcp_to_torch_save   a DCP checkpoint (written once) into one torch.save file
  torch_save_to_dcp   a torch.save file (written once) into a DCP checkpoint
  torch.save / load   the file step alone: torch.save / torch.load(weights_only)
                      against _torchsave.save / _torchsave.load

Prints the median and range of --repeat runs and shardstate's speed-up
(torch's median / shardstate's median).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402
import torch.distributed.checkpoint as tdcp  # noqa: E402
from shardstate.checkpoint import _torchsave  # noqa: E402
from shardstate.checkpoint import format_utils as sfu  # noqa: E402
from torch.distributed.checkpoint import format_utils as tfu  # noqa: E402


def _state(gib: float) -> dict:
    g = torch.Generator().manual_seed(0)
    sd: dict = {"layers": {}, "step": 1000, "name": "bench", "lr": [1e-4, 3e-4]}
    total, i = 0, 0
    while total < gib * (1 << 30):
        rows = (256, 1024, 4096)[i % 3]
        dt = torch.bfloat16 if i % 4 == 3 else torch.float32
        t = torch.randn(rows, 4096, generator=g).to(dt)
        sd["layers"][f"{i}.weight"] = t
        sd["layers"][f"{i}.bias"] = torch.arange(4096, dtype=torch.int64)
        total += t.nbytes + 4096 * 8
        i += 1
    return sd


def _time(fn, out: str, repeat: int) -> list[float]:
    runs = []
    for _ in range(repeat):
        shutil.rmtree(out, ignore_errors=True)
        if os.path.exists(out):
            os.unlink(out)
        t0 = time.perf_counter()
        fn(out)
        runs.append(time.perf_counter() - t0)
    shutil.rmtree(out, ignore_errors=True)
    if os.path.exists(out):
        os.unlink(out)
    return runs


def _row(name: str, theirs: list[float], ours: list[float]) -> None:
    t, o = statistics.median(theirs), statistics.median(ours)
    print(f"{name:20s} torch {t:7.3f} s [{min(theirs):.3f}-{max(theirs):.3f}]   "
          f"shardstate {o:7.3f} s [{min(ours):.3f}-{max(ours):.3f}]   {t / o:5.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench_torchsave_", dir=args.dir)
    try:
        sd = _state(args.gib)
        nbytes = sum(t.nbytes for t in sd["layers"].values())
        print(f"state: {len(sd['layers'])} tensors, {nbytes / (1 << 30):.2f} GiB; dir {root}; "
              f"{os.cpu_count()} CPUs; medians of {args.repeat}", flush=True)
        ckpt, pt = os.path.join(root, "ckpt"), os.path.join(root, "in.pt")
        tdcp.save(sd, checkpoint_id=ckpt)
        torch.save(sd, pt)
        out = os.path.join(root, "out")
        theirs, ours = [], []
        for _ in range(args.repeat):  # interleaved: both see the same machine load
            theirs += _time(lambda o: tfu.dcp_to_torch_save(ckpt, o), out, 1)
            ours += _time(lambda o: sfu.dcp_to_torch_save(ckpt, o), out, 1)
        _row("dcp_to_torch_save", theirs, ours)
        theirs, ours = [], []
        for _ in range(args.repeat):
            theirs += _time(lambda o: tfu.torch_save_to_dcp(pt, o), out, 1)
            ours += _time(lambda o: sfu.torch_save_to_dcp(pt, o), out, 1)
        _row("torch_save_to_dcp", theirs, ours)
        theirs, ours = [], []
        for _ in range(args.repeat):
            theirs += _time(lambda o: torch.save(sd, o), out, 1)
            ours += _time(lambda o: _torchsave.save(sd, o), out, 1)
        _row("  torch.save", theirs, ours)
        theirs, ours = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            torch.load(pt, weights_only=True)
            theirs.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _torchsave.load(pt)
            ours.append(time.perf_counter() - t0)
        _row("  torch.load", theirs, ours)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
