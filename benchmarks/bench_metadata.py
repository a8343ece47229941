""".metadata at scale: shardstate's writer and restricted reader against torch's pickle.

    python benchmarks/bench_metadata.py [--chunks 19200 192000] [--repeat 3]

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[19_200, 192_000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--torch-free-child", metavar="OUT", help=argparse.SUPPRESS)
    args = ap.parse_args()
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
