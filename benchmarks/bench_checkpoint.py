"""shardstate.checkpoint against torch.distributed.checkpoint, side by side.

    python benchmarks/bench_checkpoint.py [--gib 2] [--repeat 3] [--dirs /dev/shm build/bench]

A state dict shaped like a transformer with its Adam state (a few large and
many small tensors; weights and both moments sharded as DTensor Shard(0)
over the ranks, plus replicated scalars), about --gib GiB in total over 2
ranks. For each directory, in one run, torch DCP and shardstate take turns:

  save            2 ranks save                       (median wall time)
  load            2 ranks load what they saved
  reshard 2->1    saved by 2 ranks, loaded by 1
  reshard 2->3    saved by 2 ranks, loaded by 3
  async block     time async_save takes to return (staging), 2 ranks, in
                  a loop of 4 saves: the median of saves 2-4 (steady
                  state), and the first save's ("async block 1st")
  load extra RSS  peak RSS during load above the state dict's own size

and prints a table with one ratio line per target. Each measurement runs in
fresh processes (gloo) through shardstate.testing.run_distributed.

Every timed region, torch's, shardstate's and the raw lines alike, starts
from the same page conditions: each rank first writes to and frees 1.5x the
bytes it is about to move (benchmarks/_pages.py says why; --cold turns it
off). The table gives the median and the range of the runs.
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

from _pages import describe, set_cold, warm  # noqa: E402
from shardstate.testing import run_distributed  # noqa: E402


def _impl(name: str):
    if name == "torch":
        import torch.distributed.checkpoint as dcp
    else:
        import shardstate.checkpoint as dcp
    return dcp


def _shapes(total_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter shapes of a small transformer scaled to total_bytes with Adam
    (weights + 2 moments, float32)."""
    d = 1024
    vocab = 32000
    per_layer = [("attn.qkv", (3 * d, d)), ("attn.out", (d, d)), ("mlp.up", (4 * d, d)),
                 ("mlp.down", (d, 4 * d)), ("ln1.weight", (d,)), ("ln1.bias", (d,)),
                 ("ln2.weight", (d,)), ("ln2.bias", (d,)), ("mlp.up_bias", (4 * d,))]
    layer_bytes = sum(4 * _numel(s) for _, s in per_layer) * 3
    embed_bytes = 4 * vocab * d * 3
    layers = max(1, (total_bytes - 2 * embed_bytes) // layer_bytes)
    shapes = [("embed.weight", (vocab, d)), ("lm_head.weight", (vocab, d))]
    for i in range(layers):
        shapes += [(f"layers.{i}.{n}", s) for n, s in per_layer]
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _state(total_bytes: int, seed: int, empty: bool = False) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(seed)
    model, optim = {}, {}
    for name, shape in _shapes(total_bytes):
        def make() -> torch.Tensor:
            full = torch.zeros(shape) if empty else torch.randn(shape, generator=g)
            return distribute_tensor(full, mesh, [Shard(0)])
        model[name] = make()
        optim[name] = {"exp_avg": make(), "exp_avg_sq": make(), "step": torch.tensor(10.0)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-3}]}}


def _local_bytes(sd: dict) -> int:
    import torch

    total = 0
    stack = [sd]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v
            total += local.numel() * local.element_size()
    return total


def _rss_peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _rss_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _do_save(rank, world, impl, path, total_bytes, use_async):
    import torch.distributed as dist

    dcp = _impl(impl)
    sd = _state(total_bytes, seed=1)
    share = _local_bytes(sd)
    warm(share)
    dist.barrier()
    t0 = time.perf_counter()
    if use_async:
        # A training loop checkpoints again and again: the first save and
        # the steady state (the median of the next ones) are both reported.
        blocked = []
        for i in range(_ASYNC_SAVES):
            if i:
                warm(share)
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=f"{path}-{i}")
            blocked.append(time.perf_counter() - t0)
            _touch(sd)  # the training step that follows modifies the tensors
            fut.result()
            dist.barrier()
        return blocked[0], statistics.median(blocked[1:])
    dcp.save(sd, checkpoint_id=path)
    dist.barrier()
    return time.perf_counter() - t0


_ASYNC_SAVES = 4


def _touch(sd: dict) -> None:
    for group in (sd["model"], sd["optim"]["state"]):
        for v in group.values():
            for t in (v.values() if isinstance(v, dict) else [v]):
                local = t.to_local() if hasattr(t, "to_local") else t
                local.mul_(1.0)


def _do_load(rank, world, impl, path, total_bytes, check):
    import torch
    import torch.distributed as dist

    dcp = _impl(impl)
    sd = _state(total_bytes, seed=0, empty=True)
    state_bytes = _local_bytes(sd)
    warm(state_bytes)
    dist.barrier()
    base = _rss_now()
    _rss_peak_reset()
    t0 = time.perf_counter()
    dcp.load(sd, checkpoint_id=path)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    extra = max(0, _rss_peak() - base)
    if check:
        ref = _state(total_bytes, seed=1)
        for name, t in sd["model"].items():
            if not torch.equal(t.to_local(), ref["model"][name].to_local()):
                raise AssertionError(f"{impl}: {name} differs after load")
    return elapsed, extra, state_bytes


def _raw_bandwidth(d: str, nbytes: int, repeat: int) -> tuple[float, float]:
    """Raw single-stream bandwidth (bytes/s) of directory d: a plain C pwrite
    loop then fsync (as a save syncs its files), and a plain pread loop; no
    checksum (benchmarks/bench_io.py's raw limit)."""
    import numpy as np
    from shardstate import _core

    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "shardstate-bench-raw.bin")
    buf = np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype=np.uint8).copy()
    w, r = [], []
    for _ in range(repeat):
        if os.path.exists(path):
            os.unlink(path)
        warm(nbytes)
        t0 = time.perf_counter()
        _core._raw_pwrite(path, buf, 32 << 20)
        fd = os.open(path, os.O_RDONLY)  # saves fsync their files (sync_files=True)
        os.fsync(fd)
        os.close(fd)
        w.append(time.perf_counter() - t0)
        warm(nbytes)
        t0 = time.perf_counter()
        _core._raw_pread(path, buf, 32 << 20)
        r.append(time.perf_counter() - t0)
    os.unlink(path)
    return nbytes / statistics.median(w), nbytes / statistics.median(r)


def _raw_ranks(rank, world, d, nbytes, repeat):
    """Each of `world` ranks writes (pwrite loop + fsync) then reads (pread
    loop) its own nbytes // world bytes at once, no checksum: the least time
    any implementation needs to move this state on this machine."""
    import numpy as np
    import torch.distributed as dist
    from shardstate import _core

    n = nbytes // world
    path = os.path.join(d, f"shardstate-bench-raw-{rank}.bin")
    buf = np.frombuffer(np.random.default_rng(rank).bytes(n), dtype=np.uint8).copy()
    w, r = [], []
    for _ in range(repeat):
        if os.path.exists(path):
            os.unlink(path)
        warm(n)
        dist.barrier()
        t0 = time.perf_counter()
        _core._raw_pwrite(path, buf, 32 << 20)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        dist.barrier()
        w.append(time.perf_counter() - t0)
        warm(n)
        dist.barrier()
        t0 = time.perf_counter()
        _core._raw_pread(path, buf, 32 << 20)
        dist.barrier()
        r.append(time.perf_counter() - t0)
    os.unlink(path)
    return statistics.median(w), statistics.median(r)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dirs", nargs="+",
                    default=["/dev/shm", os.path.join(HERE, "..", "build", "bench")])
    ap.add_argument("--cold", action="store_true",
                    help="do not warm the pages before each timed region")
    args = ap.parse_args()
    set_cold(args.cold)
    total = int(args.gib * (1 << 30))
    impls = ["torch", "shardstate"]
    state_bytes = sum(_numel(s) for _, s in _shapes(total)) * 4 * 3
    print(f"state: {len(_shapes(total))} parameters + Adam, {state_bytes / 2**30:.2f} GiB over "
          f"2 ranks; median of {args.repeat}; pages {describe()}")

    for d in args.dirs:
        base = os.path.abspath(os.path.join(d, "shardstate-bench-ckpt"))
        res: dict[str, dict[str, list[float]]] = {i: {} for i in impls}
        for _ in range(args.repeat):
            for impl in impls:
                path = f"{base}-{impl}"
                shutil.rmtree(path, ignore_errors=True)
                r = res[impl]
                r.setdefault("save", []).append(max(run_distributed(
                    _do_save, 2, impl, path, total, False, timeout=900)))
                out = run_distributed(_do_load, 2, impl, path, total, False, timeout=900)
                r.setdefault("load", []).append(max(o[0] for o in out))
                r.setdefault("load extra RSS / state", []).append(
                    max(o[1] / o[2] for o in out))
                for m in (1, 3):
                    out = run_distributed(_do_load, m, impl, path, total, False, timeout=900)
                    r.setdefault(f"reshard 2->{m}", []).append(max(o[0] for o in out))
                shutil.rmtree(path, ignore_errors=True)
                out = run_distributed(_do_save, 2, impl, path, total, True, timeout=900)
                r.setdefault("async block", []).append(max(o[1] for o in out))
                r.setdefault("async block 1st", []).append(max(o[0] for o in out))
                for i in range(_ASYNC_SAVES):
                    shutil.rmtree(f"{path}-{i}", ignore_errors=True)
        # one verified load per implementation, outside the timings
        for impl in impls:
            path = f"{base}-{impl}"
            run_distributed(_do_save, 2, impl, path, total, False, timeout=900)
            run_distributed(_do_load, 3, impl, path, total, True, timeout=900)
            shutil.rmtree(path, ignore_errors=True)

        print(f"\n{os.path.abspath(d)}")
        print(f"  {'':<24}{'torch':>10}{'shardstate':>12}{'speedup':>10}    "
              "range: torch | shardstate")
        med = {i: {k: statistics.median(v) for k, v in res[i].items()} for i in impls}
        for k in med["torch"]:
            t, s = med["torch"][k], med["shardstate"][k]
            unit = "" if "RSS" in k else " s"
            sp = (t / s) if s > 0 else float("inf")
            spread = " | ".join(f"{min(res[i][k]):.3f}-{max(res[i][k]):.3f}" for i in impls)
            print(f"  {k + unit:<24}{t:>10.3f}{s:>12.3f}{sp:>9.2f}x    {spread}")
        for k, target in (("save", 3), ("load", 3), ("reshard 2->1", 3), ("reshard 2->3", 3),
                          ("async block", 3)):
            ratio = med["torch"][k] / med["shardstate"][k]
            print(f"  ratio {k:<14} torch/shardstate {ratio:6.2f}  (target >= {target}) "
                  f"{'ok' if ratio >= target else 'MISS'}")
        # Aggregate throughput against this directory's raw limit.
        raw_w, raw_r = _raw_bandwidth(d, state_bytes, args.repeat)
        for k, raw in (("save", raw_w), ("load", raw_r)):
            rate = state_bytes / med["shardstate"][k]
            frac = rate / raw
            print(f"  shardstate {k} {rate / 2**30:6.2f} GiB/s = {frac:5.2f} of raw "
                  f"{'pwrite+fsync' if k == 'save' else 'pread'} {raw / 2**30:.2f} GiB/s "
                  f"(target on the work disk >= 0.80) {'ok' if frac >= 0.8 else 'MISS'}")
        # The ceiling: torch's time over the raw time of 2 ranks moving the
        # same bytes at once with plain pwrite/pread (no format, no CRC).
        # No implementation can beat torch by more than this here.
        raw2_w, raw2_r = run_distributed(_raw_ranks, 2, d, state_bytes, args.repeat,
                                         timeout=900)[0]
        for k, raw_t in (("save", raw2_w), ("load", raw2_r)):
            raw_op = "pwrite+fsync" if k == "save" else "pread"
            print(f"  ceiling {k:<5} torch / raw 2-rank {raw_op}"
                  f" = {med['torch'][k] / raw_t:5.2f}x (raw {raw_t:.3f} s, "
                  f"{state_bytes / raw_t / 2**30:.2f} GiB/s); shardstate reaches "
                  f"{raw_t / med['shardstate'][k]:5.2f} of raw")
        extra = med["shardstate"]["load extra RSS / state"]
        print(f"  shardstate load extra RSS {extra:6.1%} of the state (target <= 10%) "
              f"{'ok' if extra <= 0.10 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
