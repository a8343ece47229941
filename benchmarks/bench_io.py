"""Throughput of the C I/O engine against the raw limit and plain Python.

    python benchmarks/bench_io.py [--gib 1] [--dirs /dev/shm build/bench] [--repeat 5]

For each directory, on the same buffers in one run:
  engine write   shardstate.io.write, --threads threads (the caller counted),
                 CRC-32 of every job computed in the same pass
  raw pwrite     one thread, a plain pwrite loop in C (one call per job), no
                 checksum: the raw limit
  python write   open().write() of each buffer
  engine read    shardstate.io.read into preallocated arrays, CRC verified
  raw pread      one thread, a plain pread loop in C, no checksum
and CRC-32 against zlib.crc32 on one buffer. Medians of --repeat runs; the
ratios are what the targets are about (write and read >= 0.90 of raw, CRC-32
>= 3x zlib). Files are deleted before every write, so every write allocates
its pages afresh; reads come from the page cache for both contenders.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib

import numpy as np
import shardstate
from shardstate import _core
from shardstate import io as ssio

HERE = os.path.dirname(os.path.abspath(__file__))


def median_time(fn, repeat: int, before=None) -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rm(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def bench_dir(d: str, data: np.ndarray, job_bytes: int, threads: int, repeat: int) -> dict:
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "shardstate-bench.bin")
    total = data.nbytes
    views = [data[o:o + job_bytes] for o in range(0, total, job_bytes)]
    jobs = [ssio.WriteJob(path, i * job_bytes, v) for i, v in enumerate(views)]
    res = {}

    def clear():
        rm(path)

    res["engine write"] = median_time(lambda: ssio.write(jobs, threads=threads), repeat, clear)
    res["raw pwrite"] = median_time(lambda: _core._raw_pwrite(path, data, job_bytes), repeat, clear)

    def py_write():
        with open(path, "wb") as f:
            for v in views:
                f.write(v)

    res["python write"] = median_time(py_write, repeat, clear)

    crcs = ssio.write(jobs, threads=threads)
    out = np.empty_like(data)
    outs = [out[o:o + job_bytes] for o in range(0, total, job_bytes)]
    rjobs = [ssio.ReadJob(path, i * job_bytes, v, crc)
             for i, (v, crc) in enumerate(zip(outs, crcs))]
    res["engine read"] = median_time(lambda: ssio.read(rjobs, threads=threads, verify=True), repeat)
    if not np.array_equal(out, data):
        raise SystemExit("engine read returned different bytes")
    res["raw pread"] = median_time(lambda: _core._raw_pread(path, out, job_bytes), repeat)
    rm(path)
    return {k: total / v / 2**30 for k, v in res.items()}  # GiB/s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="bytes per run, GiB")
    ap.add_argument("--job-mib", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--crc-mib", type=int, default=256)
    ap.add_argument("--dirs", nargs="+",
                    default=["/dev/shm", os.path.join(HERE, "..", "build", "bench")])
    args = ap.parse_args()

    total = int(args.gib * (1 << 30)) // (args.job_mib << 20) * (args.job_mib << 20)
    rng = np.random.default_rng(0)
    data = np.frombuffer(rng.bytes(total), dtype=np.uint8).copy()
    print(f"shardstate {shardstate.__version__}, "
          f"CRC implementations {shardstate.crc_implementation()}")
    print(f"{total / 2**30:.2f} GiB per run in {args.job_mib} MiB jobs, "
          f"engine threads={args.threads}, "
          f"median of {args.repeat}; cpu_count={os.cpu_count()}")

    ok = True
    for d in args.dirs:
        r = bench_dir(os.path.abspath(d), data, args.job_mib << 20, args.threads, args.repeat)
        print(f"\n{os.path.abspath(d)}  (GiB/s)")
        for k, v in r.items():
            print(f"  {k:<13} {v:7.2f}")
        w = r["engine write"] / r["raw pwrite"]
        rd = r["engine read"] / r["raw pread"]
        for what, x in (("write / raw pwrite ", w), ("read  / raw pread  ", rd)):
            print(f"  ratio engine {what} {x:5.2f}  (target >= 0.90) "
                  f"{'ok' if x >= 0.9 else 'MISS'}")
        print(f"  ratio engine write / python write {r['engine write'] / r['python write']:5.2f}")
        ok &= w >= 0.9 and rd >= 0.9

    buf = data[: args.crc_mib << 20]
    t_ss = median_time(lambda: shardstate.crc32(buf), args.repeat)
    t_z = median_time(lambda: zlib.crc32(buf), args.repeat)
    t_c = median_time(lambda: shardstate.crc32c(buf), args.repeat)
    if shardstate.crc32(buf) != zlib.crc32(buf):
        raise SystemExit("crc32 differs from zlib.crc32")
    gb = buf.nbytes / 2**30
    print(f"\nCRC on {args.crc_mib} MiB (GiB/s): shardstate.crc32 {gb / t_ss:.2f}, "
          f"zlib.crc32 {gb / t_z:.2f}, shardstate.crc32c {gb / t_c:.2f}")
    ratio = t_z / t_ss
    print(f"  ratio crc32 / zlib.crc32 {ratio:5.2f}  (target >= 3) "
          f"{'ok' if ratio >= 3 else 'MISS'}")
    ok &= ratio >= 3
    print("\nall targets met" if ok else "\nsome targets missed (see MISS above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
