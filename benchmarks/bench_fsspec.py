"""shardstate's FsspecWriter/FsspecReader against torch's, side by side.

    python benchmarks/bench_fsspec.py [--mib 512] [--repeat 3] [--targets s3 memory]
        [--ceiling] [--part-mib N] [--concurrency N]

The benchmark state of bench_checkpoint.py (a transformer's weights and
Adam moments, float32, a few large and many small tensors; plain tensors,
one process) of about --mib MiB, saved and loaded through each library's
fsspec storage with its defaults: on a local S3 API (moto's standalone
server, tests/_s3server.py, through s3fs) and on memory://. torch and
shardstate take turns in one run; each line gives the median of --repeat
runs (and the range), then the ratios torch / shardstate (above 1:
shardstate is faster).

Each save line also gives the peak growth of the process's resident
memory during the save (sampled every few ms; the moto server is another
process): what the save holds beyond the state itself.

moto's server is one Python process: it bounds what either library can
reach on s3. ``--ceiling`` measures that bound for the same bytes: one put,
then multipart uploads of part sizes 8-128 MiB with 1-8 parts in flight,
each timed once; the best is compared to torch's save. ``--part-mib`` /
``--concurrency`` set shardstate's upload part size and parts in flight
(``_fs_upload.UPLOAD_PART`` / ``UPLOAD_CONCURRENCY``) for tuning.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
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


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssPeak:
    """The most the resident set grew over its start while in the block,
    sampled every 2 ms by a thread."""

    def __enter__(self) -> _RssPeak:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def grew(self) -> int:
        return self.peak - self.start


def _run(impl: str, root: str, opts: dict, sd: dict,
         blank: dict) -> tuple[float, float, int]:
    dcp, writer, reader = _impl(impl)
    url = f"{root}/{impl}-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    with _RssPeak() as rss:
        dcp.save(sd, storage_writer=writer(url, **opts))
    t1 = time.perf_counter()
    dcp.load(blank, storage_reader=reader(url, **opts))
    t2 = time.perf_counter()
    if not _equal(blank, sd):
        raise SystemExit(f"{impl}: loaded state differs from the saved one ({url})")
    return t1 - t0, t2 - t1, rss.grew


def _multipart(fs, key: str, data: bytes, part: int, inflight: int) -> float:
    """Seconds for one multipart upload of data in parts of ``part`` bytes,
    ``inflight`` at once (s3fs's client, no checkpoint work)."""
    bucket, k, _ = fs.split_path(key)
    view = memoryview(data)

    async def go() -> None:
        mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=k)
        sem = asyncio.Semaphore(inflight)

        async def one(n: int, a: int) -> dict:
            async with sem:
                out = await fs._call_s3("upload_part", Bucket=bucket, Key=k,
                                        UploadId=mpu["UploadId"], PartNumber=n,
                                        Body=_fs_upload.Body(view[a:a + part]))
                return {"PartNumber": n, "ETag": out["ETag"]}

        parts = await asyncio.gather(*[one(i + 1, a)
                                       for i, a in enumerate(range(0, len(data), part))])
        await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=k,
                          UploadId=mpu["UploadId"], MultipartUpload={"Parts": parts})

    import fsspec.asyn
    from shardstate.checkpoint import _fs_upload

    t0 = time.perf_counter()
    fsspec.asyn.sync(fs.loop, go)
    dt = time.perf_counter() - t0
    fs.rm_file(key)
    return dt


def _ceiling(server: S3Server, nbytes: int, torch_save: float) -> None:
    """moto's ingest of the same bytes: one put, then each multipart
    layout, each once (a table: part MiB x parts in flight)."""
    fs = server.fs()
    data = os.urandom(1 << 20) * (nbytes >> 20)
    key = f"{BUCKET}/raw-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    fs.pipe_file(key, data, chunksize=1 << 40)
    put = time.perf_counter() - t0
    fs.rm_file(key)
    inflights = (1, 2, 4, 8)
    print(f"s3 ceiling: one put of {nbytes / 2**20:.0f} MiB {put:.2f} s; multipart (s):")
    print("  part MiB " + "".join(f"{f'{n} in flight':>13s}" for n in inflights))
    best = (put, "one put")
    for part_mib in (8, 16, 32, 64, 128):
        row = []
        for n in inflights:
            dt = _multipart(fs, f"{BUCKET}/raw-{uuid.uuid4().hex[:8]}", data, part_mib << 20, n)
            row.append(dt)
            best = min(best, (dt, f"{part_mib} MiB parts, {n} in flight"))
        print(f"  {part_mib:8d} " + "".join(f"{x:13.2f}" for x in row))
    print(f"s3 ceiling: best {best[0]:.2f} s ({best[1]}); torch's save {torch_save:.2f} s: "
          f"ceiling ratio torch / best raw ingest {torch_save / best[0]:.2f}x")


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
    ap.add_argument("--ceiling", action="store_true",
                    help="measure moto's multipart ingest for the same bytes (slow)")
    ap.add_argument("--part-mib", type=int, default=0, help="shardstate's upload part size")
    ap.add_argument("--concurrency", type=int, default=0, help="shardstate's parts in flight")
    args = ap.parse_args()
    from shardstate.checkpoint import _fs_upload

    if args.part_mib:
        _fs_upload.UPLOAD_PART = args.part_mib << 20
    if args.concurrency:
        _fs_upload.UPLOAD_CONCURRENCY = args.concurrency
    warnings.filterwarnings("ignore")  # torch's "single process" notes, botocore's
    import fsspec

    sd = _state(args.mib << 20, empty=False)
    blank = _state(args.mib << 20, empty=True)
    nbytes = sum(t.numel() * 4 for m in (sd["model"],) for t in m.values()) * 3
    load = os.getloadavg()
    print(f"state: {len(sd['model'])} parameters with Adam moments, "
          f"{nbytes / 2**20:.0f} MiB; median of {args.repeat}; shardstate parts "
          f"{_fs_upload.UPLOAD_PART >> 20} MiB x {_fs_upload.UPLOAD_CONCURRENCY} in flight; "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    server = None
    try:
        for target in args.targets:
            if target == "s3":
                server = S3Server().start()
                server.make_bucket(BUCKET)
                root, opts = f"s3://{BUCKET}", server.storage_options
            else:
                root, opts = "memory://bench", {}
            times: dict[str, list[tuple[float, float, int]]] = {"torch": [], "shardstate": []}
            for _ in range(args.repeat):
                for impl in ("torch", "shardstate"):
                    times[impl].append(_run(impl, root, opts, sd, blank))
                    if target == "memory":
                        fsspec.filesystem("memory").store.clear()
            if target == "s3" and not args.ceiling:
                print(_floor(server, nbytes, args.repeat))
            med = {}
            for impl, ts in times.items():
                for k, what in enumerate(("save", "load")):
                    xs = [t[k] for t in ts]
                    med[impl, what] = statistics.median(xs)
                    rss = (f"  peak RSS +{max(t[2] for t in ts) / 2**20:.0f} MiB"
                           if what == "save" else "")
                    print(f"{target:7s} {what:5s} {impl:10s} {med[impl, what]:7.2f} s "
                          f"({min(xs):.2f}-{max(xs):.2f})  "
                          f"{nbytes / 2**20 / med[impl, what]:7.0f} MiB/s{rss}")
            for what in ("save", "load"):
                print(f"{target:7s} {what:5s} ratio torch/shardstate: "
                      f"{med['torch', what] / med['shardstate', what]:.2f}x")
            if target == "s3" and args.ceiling:
                _ceiling(server, nbytes, med["torch", "save"])
            if server is not None:
                server.stop()
                server = None
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
