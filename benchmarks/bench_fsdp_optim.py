"""shardstate.fsdp's optimizer-state functions against torch's FSDP1 static methods, side by side.

    python benchmarks/bench_fsdp_optim.py [--params 100e6] [--world 2] [--repeat 3] [--orig]
                                          [--cold]

A transformer-like stack of FSDP1 units (one unit per block, CPU, gloo) of
about --params parameters with Adam state after one step, on --world
ranks. In one run, torch and shardstate take turns (order alternating per
repeat) on:

  full gather   optim_state_dict, FULL_STATE_DICT, rank0_only=True, offload
  sharded save  optim_state_dict, SHARDED_STATE_DICT
  full load     optim_state_dict_to_load of a full state held by every rank
  sharded load  optim_state_dict_to_load of a SHARDED state (dim-0 ShardedTensors)

Time is the slowest rank's wall time (median of --repeat). Peak memory is
each rank's peak RSS above its RSS before the call (VmHWM after a reset),
the largest over ranks; the result itself counts. Buffers are mmapped
(MALLOC_MMAP_THRESHOLD_) so that memory freed by one call is not reused
unseen by the next. Before each call every rank writes to and frees a
little more memory than the call's result takes, so that torch's calls and
ours all start on pages just freed (benchmarks/_pages.py says why; --cold
turns it off). Prints one ratio line per operation against the targets
(>= 2x faster, <= 0.6x peak memory).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

from _pages import describe, set_cold, warm  # noqa: E402
from shardstate.testing import run_distributed  # noqa: E402

OPS = ("full gather", "sharded save", "full load", "sharded load")


def _rss_peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _model(params: float, use_orig_params: bool):
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    d = 512
    per_block = 2 * 4 * d * d + 4 * d + d + 2 * d  # up, down, biases, norm
    blocks = max(1, int(params) // per_block)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

    torch.manual_seed(0)
    root = nn.Sequential(*[Block() for _ in range(blocks)])
    nparams = sum(p.numel() for p in root.parameters())
    kw = dict(device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    for i in range(blocks):
        root[i] = FSDP(root[i], **kw)
    model = FSDP(root, **kw)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        if p.numel():
            p.grad = torch.randn(p.shape, generator=g)
    optim.step()
    optim.zero_grad()
    return model, optim, nparams


def _set(model, kind: str) -> None:
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if kind == "sharded":
        FSDP.set_state_dict_type(
            model,
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(),
            ShardedOptimStateDictConfig(),
        )
    else:
        FSDP.set_state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(),
            FullOptimStateDictConfig(rank0_only=kind == "rank0"),
        )


def _measure(fn, warm_bytes: int):
    import ctypes

    import torch.distributed as dist

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    warm(warm_bytes)
    dist.barrier()
    base = _status("VmRSS:")
    _rss_peak_reset()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    peak = max(0, _status("VmHWM:") - base)
    dist.barrier()
    return out, dt, peak, _result_bytes(out)


def _result_bytes(obj, seen=None) -> int:
    """Bytes of the distinct storages a result holds (a ShardedTensor by its local shards)."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    seen = set() if seen is None else seen
    if isinstance(obj, ShardedTensor):
        return sum(_result_bytes(s.tensor, seen) for s in obj.local_shards())
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()
    if isinstance(obj, dict):
        return sum(_result_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_result_bytes(v, seen) for v in obj)
    return 0


def _bench(rank: int, world: int, params: float, repeat: int, use_orig_params: bool) -> dict:
    import warnings

    import shardstate.fsdp as ssf
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    warnings.simplefilter("ignore")
    model, optim, nparams = _model(params, use_orig_params)
    impls = {"torch": FSDP, "shardstate": ssf}
    _set(model, "full")
    full = ssf.optim_state_dict(model, optim)  # the input of "full load", on every rank
    _set(model, "sharded")
    sharded = ssf.optim_state_dict(model, optim)  # the input of "sharded load"
    res: dict = {"params": nparams}
    share = nparams * 8 // world  # this rank's Adam state (exp_avg, exp_avg_sq)
    for r in range(repeat):
        order = ("torch", "shardstate") if r % 2 == 0 else ("shardstate", "torch")
        for name in order:
            impl = impls[name]
            for op in OPS:
                if op == "full gather":
                    _set(model, "rank0")
                    fn = lambda: impl.optim_state_dict(model, optim)  # noqa: E731
                elif op == "sharded save":
                    _set(model, "sharded")
                    fn = lambda: impl.optim_state_dict(model, optim)  # noqa: E731
                elif op == "full load":
                    _set(model, "full")
                    fn = lambda: impl.optim_state_dict_to_load(model, optim, full)  # noqa: E731
                else:
                    _set(model, "sharded")
                    fn = lambda: impl.optim_state_dict_to_load(model, optim, sharded)  # noqa: E731
                # what the call's result takes: the full state on rank 0 for
                # the rank-0 gather, this rank's share otherwise
                full_here = op == "full gather" and rank == 0
                out, dt, peak, nbytes = _measure(fn, share * world if full_here else share)
                del out
                res.setdefault((name, op, "s"), []).append(dt)
                res.setdefault((name, op, "peak"), []).append(peak)
                res.setdefault((name, op, "above"), []).append(max(0, peak - nbytes))
    dist.barrier()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--orig", action="store_true", help="use_orig_params=True")
    ap.add_argument("--cold", action="store_true",
                    help="do not warm the pages before each call (benchmarks/_pages.py)")
    args = ap.parse_args()
    set_cold(args.cold)
    # Every tensor buffer mmapped, so a freed one leaves RSS and the next
    # call's peak is its own (glibc otherwise raises the threshold after a free).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    per_rank = run_distributed(
        _bench, args.world, args.params, args.repeat, args.orig, timeout=3600
    )
    nparams = per_rank[0]["params"]
    print(
        f"FSDP1 optimizer state, Adam, {nparams / 1e6:.1f}M params "
        f"({nparams * 8 / 2**20:.0f} MiB of state), world {args.world}, "
        f"use_orig_params={args.orig}, median of {args.repeat}, pages {describe()}"
    )
    print(
        f"{'operation':14s} {'torch s':>8s} {'ours s':>8s} {'speedup':>8s}  "
        f"{'torch MiB':>9s} {'ours MiB':>8s} {'ratio':>6s}  "
        f"{'above result MiB: torch':>23s} {'ours':>5s}  {'targets':9s} "
        "per-rank peak MiB (torch | ours)"
    )
    ok = True
    names = ("torch", "shardstate")
    for op in OPS:
        t = {
            n: statistics.median(
                max(r[(n, op, "s")][i] for r in per_rank) for i in range(args.repeat)
            )
            for n in names
        }
        m_rank = {
            n: [statistics.median(r[(n, op, "peak")]) / 2**20 for r in per_rank] for n in names
        }
        above = {
            n: max(statistics.median(r[(n, op, "above")]) for r in per_rank) / 2**20 for n in names
        }
        m = {n: max(v) for n, v in m_rank.items()}
        speed = t["torch"] / t["shardstate"]
        mem = m["shardstate"] / m["torch"] if m["torch"] else float("nan")
        ok &= speed >= 2 and mem <= 0.6
        marks = ("time ok" if speed >= 2 else "TIME MISS") + ", " + (
            "mem ok" if mem <= 0.6 else "MEM MISS"
        )
        print(
            f"{op:14s} {t['torch']:8.3f} {t['shardstate']:8.3f} {speed:7.2f}x  "
            f"{m['torch']:9.1f} {m['shardstate']:8.1f} {mem:5.2f}x  "
            f"{above['torch']:23.1f} {above['shardstate']:5.1f}  {marks:9s} "
            f"{' '.join(f'{x:.0f}' for x in m_rank['torch'])} | "
            f"{' '.join(f'{x:.0f}' for x in m_rank['shardstate'])}"
        )
    print(
        "speedup = torch s / ours s; ratio = our peak / torch peak; above result = peak RSS "
        "minus the bytes of the returned tensors (what the call needs beyond its result)"
    )
    print(
        "targets: speedup >= 2x and peak ratio <= 0.6x on each:",
        "met" if ok else "NOT met",
        "(peak includes the result, which both must hold)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
