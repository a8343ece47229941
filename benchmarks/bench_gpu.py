"""CUDA save/load against torch DCP on one GPU, side by side in one run.

    python benchmarks/bench_gpu.py [--gb 20] [--dir /dev/shm] [--repeat 1]

A state dict of --gb gigabytes of CUDA tensors (a few large and many small,
bf16 and fp32, like a model with its Adam state) is saved and loaded by
torch.distributed.checkpoint and by shardstate.checkpoint (no process group:
one rank). Printed: the device-to-host copy bandwidth into pinned memory
measured in the same run (the ceiling for a save), each implementation's
save and load time and throughput, the ratios, async_save's blocking time,
and the pinned host memory shardstate's staging holds. Run by
benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time


def _state(total: int, torch):
    g = torch.Generator(device="cuda").manual_seed(0)
    sd, left, i = {}, total, 0
    sizes = [512 << 20] * 8 + [64 << 20] * 16 + [1 << 20] * 64
    while left > 0:
        n = min(sizes[i % len(sizes)], left)
        dt = torch.bfloat16 if i % 3 == 0 else torch.float32
        numel = max(1, n // torch.tensor([], dtype=dt).element_size())
        sd[f"p{i:04d}"] = torch.randn(numel, device="cuda", generator=g, dtype=torch.float32).to(dt)
        left -= numel * sd[f"p{i:04d}"].element_size()
        i += 1
    torch.cuda.synchronize()
    return sd


def _d2h_bandwidth(torch) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    ts = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return (1 << 30) / statistics.median(ts)


def _timed(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=20.0)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()

    import shardstate.checkpoint as sdcp
    import torch
    import torch.distributed.checkpoint as tdcp
    from shardstate.checkpoint import _fs_write

    total = int(args.gb * 1e9)
    sd = _state(total, torch)
    nbytes = sum(t.nbytes for t in sd.values())
    bw = _d2h_bandwidth(torch)
    print(f"state: {len(sd)} CUDA tensors, {nbytes / 1e9:.2f} GB on {torch.cuda.get_device_name()}")
    print(f"d2h copy bandwidth into pinned memory: {bw / 1e9:.2f} GB/s")

    res: dict[str, dict[str, list[float]]] = {"torch": {}, "shardstate": {}}
    for rep in range(args.repeat):
        for name, dcp in (("torch", tdcp), ("shardstate", sdcp)):
            path = os.path.join(args.dir, f"bench_gpu_{name}")
            shutil.rmtree(path, ignore_errors=True)
            res[name].setdefault("save", []).append(
                _timed(lambda: dcp.save(sd, checkpoint_id=path)))
            dest: dict = {k: torch.empty_like(v) for k, v in sd.items()}
            res[name].setdefault("load", []).append(
                _timed(lambda: dcp.load(dest, checkpoint_id=path)))
            if rep == 0:
                bad = [k for k in sd if not torch.equal(sd[k], dest[k])]
                assert not bad, f"{name}: {len(bad)} tensors differ after load, e.g. {bad[:3]}"
            dest.clear()  # frees the loaded tensors before the next run
            shutil.rmtree(path, ignore_errors=True)
            apath = path + "_async"
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=apath)
            res[name].setdefault("async block", []).append(time.perf_counter() - t0)
            fut.result()
            shutil.rmtree(apath, ignore_errors=True)

    print(f"\n{'':14}{'torch s':>10}{'shardstate s':>14}{'ratio':>8}")
    for k in ("save", "load", "async block"):
        a, b = statistics.median(res["torch"][k]), statistics.median(res["shardstate"][k])
        print(f"{k:14}{a:10.3f}{b:14.3f}{a / b:8.2f}x")
    save = statistics.median(res["shardstate"]["save"])
    print(f"\nshardstate save throughput {nbytes / save / 1e9:.2f} GB/s = "
          f"{nbytes / save / bw:.2f} of the d2h bandwidth (target >= 0.80 on /dev/shm)")
    t_save = statistics.median(res["torch"]["save"])
    t_load = statistics.median(res["torch"]["load"])
    print(f"torch save throughput {nbytes / t_save / 1e9:.2f} GB/s")
    pinned = sum(s.buffers * s.buffer_size
                 for s in _fs_write._cuda_stages.values() if s is not None)
    print(f"pinned host memory held by shardstate's staging: {pinned / 2**20:.0f} MiB")
    a, b = (statistics.median(res[n]["async block"]) for n in ("torch", "shardstate"))
    load = statistics.median(res["shardstate"]["load"])
    print(f"targets: save >= 3x: {'ok' if t_save / save >= 3 else 'MISS'}; "
          f"load >= 3x: {'ok' if t_load / load >= 3 else 'MISS'}; "
          f"async block <= 1/5: {'ok' if b <= a / 5 else 'MISS'}")


if __name__ == "__main__":
    main()
