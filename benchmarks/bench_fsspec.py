"""shardstate's FsspecWriter/FsspecReader against torch's, side by side.

    python benchmarks/bench_fsspec.py [--mib 512] [--repeat 3] [--targets s3 memory]

The benchmark state of bench_checkpoint.py (a transformer's weights and
Adam moments, float32, a few large and many small tensors; plain tensors,
one process) of about --mib MiB, saved and loaded through each library's
fsspec storage with its defaults: on a local S3 API (moto's standalone
server, tests/_s3server.py, through s3fs) and on memory://. torch and
shardstate take turns in one run; each line gives the median of --repeat
runs (and the range), then the ratios torch / shardstate (above 1:
shardstate is faster).

moto's server is one Python process: it bounds what either library can
reach on s3, so the ratio there is a floor of what a real store gives.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from _s3server import S3Server  # noqa: E402
from bench_checkpoint import _shapes  # noqa: E402

BUCKET = "bench-fsspec"


def _state(total_bytes: int, empty: bool) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    model, optim = {}, {}

    def make(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape) if empty else torch.randn(shape, generator=g)

    for name, shape in _shapes(total_bytes):
        model[name] = make(shape)
        optim[name] = {"exp_avg": make(shape), "exp_avg_sq": make(shape),
                       "step": torch.tensor(10.0)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-3}]}}


def _equal(a: dict, b: dict) -> bool:
    import torch

    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _impl(name: str):
    if name == "torch":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    else:
        import shardstate.checkpoint as dcp
        from shardstate.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    return dcp, FsspecWriter, FsspecReader


def _run(impl: str, root: str, opts: dict, sd: dict, blank: dict) -> tuple[float, float]:
    dcp, writer, reader = _impl(impl)
    url = f"{root}/{impl}-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=writer(url, **opts))
    t1 = time.perf_counter()
    dcp.load(blank, storage_reader=reader(url, **opts))
    t2 = time.perf_counter()
    if not _equal(blank, sd):
        raise SystemExit(f"{impl}: loaded state differs from the saved one ({url})")
    return t1 - t0, t2 - t1


def _floor(server: S3Server, nbytes: int, repeat: int) -> str:
    """The server's own speed for the same bytes as one object: s3fs's
    pipe_file and cat_file with their defaults (no checkpoint work)."""
    fs = server.fs()
    data = os.urandom(1 << 20) * (nbytes >> 20)
    puts, gets = [], []
    for _ in range(repeat):
        key = f"{BUCKET}/raw-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        fs.pipe_file(key, data)
        t1 = time.perf_counter()
        fs.cat_file(key)
        gets.append(time.perf_counter() - t1)
        puts.append(t1 - t0)
    return (f"s3      raw s3fs put {statistics.median(puts):.2f} s, "
            f"get {statistics.median(gets):.2f} s (one object of the same size: the "
            "server's floor)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--targets", nargs="+", default=["s3", "memory"], choices=["s3", "memory"])
    args = ap.parse_args()
    warnings.filterwarnings("ignore")  # torch's "single process" notes, botocore's
    import fsspec

    sd = _state(args.mib << 20, empty=False)
    blank = _state(args.mib << 20, empty=True)
    nbytes = sum(t.numel() * 4 for m in (sd["model"],) for t in m.values()) * 3
    print(f"state: {len(sd['model'])} parameters with Adam moments, "
          f"{nbytes / 2**20:.0f} MiB; median of {args.repeat}")
    server = None
    try:
        for target in args.targets:
            if target == "s3":
                server = S3Server().start()
                server.make_bucket(BUCKET)
                root, opts = f"s3://{BUCKET}", server.storage_options
            else:
                root, opts = "memory://bench", {}
            times: dict[str, list[tuple[float, float]]] = {"torch": [], "shardstate": []}
            for _ in range(args.repeat):
                for impl in ("torch", "shardstate"):
                    times[impl].append(_run(impl, root, opts, sd, blank))
                    if target == "memory":
                        fsspec.filesystem("memory").store.clear()
            if target == "s3":
                print(_floor(server, nbytes, args.repeat))
            med = {}
            for impl, ts in times.items():
                for k, what in enumerate(("save", "load")):
                    xs = [t[k] for t in ts]
                    med[impl, what] = statistics.median(xs)
                    print(f"{target:7s} {what:5s} {impl:10s} {med[impl, what]:7.2f} s "
                          f"({min(xs):.2f}-{max(xs):.2f})  "
                          f"{nbytes / 2**20 / med[impl, what]:7.0f} MiB/s")
            for what in ("save", "load"):
                print(f"{target:7s} {what:5s} ratio torch/shardstate: "
                      f"{med['torch', what] / med['shardstate', what]:.2f}x")
            if server is not None:
                server.stop()
                server = None
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
