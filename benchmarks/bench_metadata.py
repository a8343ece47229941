""".metadata at scale: shardstate's writer and restricted reader against torch's pickle.

    python benchmarks/bench_metadata.py [--chunks 19200 192000] [--repeat 3]
    python benchmarks/bench_metadata.py --peak [--chunks 2000000]

A checkpoint's ``.metadata`` grows with tensors x ranks (one chunk per
shard). For each size, one Metadata of 2-D tensors split in 64 row chunks
(its storage_data included, and a StorageMeta with a Path checkpoint_id as
every save writes) is written and read, side by side in one run:

  write   torch DCP: pickle.dumps of torch's classes; shardstate:
          _pickle.dumps_metadata (the same bytes: the C walk _core.md_dumps
          over the Metadata, here with torch loaded)
  write, stand-ins
          the same through the writer's Python fast conversion and CPython's
          C pickler on stand-in classes (what serves graphs the C walk hands
          over)
  write, generic
          the same through the writer's generic conversion (what serves
          graphs the fast conversion hands over)
  write, torch-free
          dumps_metadata in a child process where torch cannot be imported
          (sizes as tuples, dtypes as TorchName: a NumPy-only save); its
          bytes are checked equal to torch's
  read    torch DCP: pickle.loads (unrestricted: it runs any code the file
          names); shardstate: _pickle.loads_metadata (allowlist, checked)

and prints medians and the ratio torch / shardstate (> 1: shardstate is
faster). Runs on the CPU; torch must be installed.

``--peak``: the memory a read takes instead. The file is written once; then
for each reader a fresh process reads it (the file's bytes, then the read)
and reports its peak resident memory above what it held before (Linux:
VmHWM after resetting it through /proc/self/clear_refs), the file's bytes
included, as a multiple of the file size.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = os.path.join(HERE, "..", "python")
sys.path.insert(0, PYTHON)


def _metadata(chunks: int, torch: Any = None) -> Any:
    """The benchmark's Metadata: torch's sizes and dtypes when ``torch`` is
    given, else tuples and TorchName (as a torch-free save holds them)."""
    from shardstate.checkpoint import metadata as smd

    size = torch.Size if torch is not None else tuple
    dtype = torch.float32 if torch is not None else smd.TorchName("torch.float32")
    per = 64
    sdm, storage = {}, {}
    for i in range(max(1, chunks // per)):
        fqn = f"layers.{i}.weight"
        cs = [smd.ChunkStorageMetadata(offsets=size([c * 64, 0]), sizes=size([64, 4096]))
              for c in range(per)]
        sdm[fqn] = smd.TensorStorageMetadata(properties=smd.TensorProperties(dtype=dtype),
                                             size=size([64 * per, 4096]), chunks=cs)
        for c in range(per):
            storage[smd.MetadataIndex(fqn, size([c * 64, 0]))] = smd._StorageInfo(
                f"__{c}_0.distcp", i * 33_554_688, 33_554_688)
    # as every save writes it: checkpoint_id is the Path the save was given
    meta = smd.StorageMeta(checkpoint_id=pathlib.Path("/checkpoints/run/step_1000"),
                           save_id="0b4d3a4e-6f8e-4a57-9d1c-2f1e5f0a7c11", load_id=None,
                           modules=[])
    return smd.Metadata(state_dict_metadata=sdm, storage_data=storage, storage_meta=meta,
                        version="1.0.0")


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _torch_free_child(chunks: int, repeat: int, out: str) -> int:
    """Runs in the child: torch blocked, times dumps_metadata, writes its bytes."""
    sys.modules["torch"] = None  # type: ignore[assignment]  # any import of torch now fails
    from shardstate.checkpoint import _pickle

    md = _metadata(chunks)
    t = _median(lambda: _pickle.dumps_metadata(md), repeat)
    with open(out, "wb") as f:
        f.write(_pickle.dumps_metadata(md))
    print(t)
    return 0


def _torch_free(chunks: int, repeat: int) -> tuple[float, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "metadata")
        r = subprocess.run([sys.executable, __file__, "--torch-free-child", out,
                            "--chunks", str(chunks), "--repeat", str(repeat)],
                           capture_output=True, text=True, check=True)
        with open(out, "rb") as f:
            return float(r.stdout.split()[-1]), f.read()


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_child(path: str, who: str) -> int:
    """Runs in the child: the peak memory (bytes) of reading ``path`` with
    ``who``'s reader, above the memory held before, printed."""
    import torch  # noqa: F401 - both readers make torch's classes
    from shardstate.checkpoint import _pickle

    load = pickle.loads if who == "torch" else _pickle.loads_metadata
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_kb("VmRSS")
    with open(path, "rb") as f:
        data = f.read()
    md = load(data)
    peak = _status_kb("VmHWM")
    assert md.state_dict_metadata
    print((peak - before) * 1024)
    return 0


def _peak(chunks: list[int]) -> int:
    import torch
    from shardstate.checkpoint import _pickle

    print(f"{'chunks':>9} {'file MB':>8} {'torch MB':>9} {'x file':>7} {'ss MB':>8} {'x file':>7}")
    for n in chunks:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "metadata")
            with open(path, "wb") as f:
                f.write(_pickle.dumps_metadata(_metadata(n, torch)))
            size = os.path.getsize(path)
            peaks = {}
            for who in ("torch", "shardstate"):
                r = subprocess.run([sys.executable, __file__, "--peak-child", path, who],
                                   capture_output=True, text=True, check=True)
                peaks[who] = int(r.stdout.split()[-1])
        t, s = peaks["torch"], peaks["shardstate"]
        print(f"{n:>9} {size / 1e6:>8.1f} {t / 1e6:>9.1f} {t / size:>6.2f}x "
              f"{s / 1e6:>8.1f} {s / size:>6.2f}x", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--peak", action="store_true",
                    help="peak memory of a read in a fresh process (default --chunks 2000000)")
    ap.add_argument("--torch-free-child", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("--peak-child", nargs=2, metavar=("PATH", "WHO"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peak_child:
        return _peak_child(*args.peak_child)
    if args.peak:
        return _peak(args.chunks or [2_000_000])
    args.chunks = args.chunks or [19_200, 192_000]
    if args.torch_free_child:
        return _torch_free_child(args.chunks[0], args.repeat, args.torch_free_child)

    import torch
    from shardstate.checkpoint import _pickle
    from shardstate.checkpoint._pickle import writer as _writer

    print(f"{'chunks':>8} {'MB':>6} {'op':<18}{'torch s':>10}{'shardstate s':>14}{'ratio':>8}")
    for n in args.chunks:
        ours = _metadata(n, torch)
        theirs = ours  # with torch installed, the metadata classes are torch's own
        data = _pickle.dumps_metadata(ours)
        if (pickle.dumps(theirs) != data or _writer._dumps(ours, True) != data
                or _writer._dumps(ours, c=False) != data):
            raise AssertionError("the writer's conversions disagree with torch's pickle")
        if pickle.loads(data) != theirs:
            raise AssertionError("torch does not read back what shardstate wrote")
        back = _pickle.loads_metadata(data)
        if len(back.storage_data) != len(theirs.storage_data):
            raise AssertionError("shardstate's reader lost entries")
        if _pickle.fastread._fast(data) is None:
            raise AssertionError("the read row would time the reference, not the fast path")
        free_s, free_data = _torch_free(n, args.repeat)
        if free_data != data:
            raise AssertionError("the torch-free write differs from torch's pickle")
        torch_write = _median(lambda: pickle.dumps(theirs), args.repeat)
        rows = [
            ("write", torch_write, _median(lambda: _pickle.dumps_metadata(ours), args.repeat)),
            ("write, stand-ins", torch_write,
             _median(lambda: _writer._dumps(ours, c=False), args.repeat)),
            ("write, generic", torch_write,
             _median(lambda: _writer._dumps(ours, True), args.repeat)),
            ("write, torch-free", torch_write, free_s),
            ("read", _median(lambda: pickle.loads(data), args.repeat),
             _median(lambda: _pickle.loads_metadata(data), args.repeat)),
        ]
        for op, t, s in rows:
            print(f"{n:>8} {len(data) / 1e6:>6.1f} {op:<18}{t:>10.3f}{s:>14.3f}{t / s:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
