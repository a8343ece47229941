""".metadata at scale: shardstate's writer and restricted reader against torch's pickle.

    python benchmarks/bench_metadata.py [--chunks 19200 192000] [--repeat 3]

A checkpoint's ``.metadata`` grows with tensors x ranks (one chunk per
shard). For each size, one Metadata of 2-D tensors split in 64 row chunks
(its storage_data included) is written and read, side by side in one run:

  write   torch DCP: pickle.dumps of torch's classes; shardstate:
          _pickle.dumps_metadata (the same bytes; with torch loaded, as
          here, the C pickler on stand-in classes)
  write, torch-free
          the same against _pickle._dumps_reference, the opcode writer that
          serves when torch is not loaded
  read    torch DCP: pickle.loads (unrestricted: it runs any code the file
          names); shardstate: _pickle.loads_metadata (allowlist, checked)

and prints medians and the ratio torch / shardstate (> 1: shardstate is
faster). Runs in one process on the CPU; torch must be installed.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402
from shardstate.checkpoint import _pickle  # noqa: E402
from shardstate.checkpoint import metadata as smd  # noqa: E402
from shardstate.checkpoint._pickle import writer as _writer  # noqa: E402


def _metadata(chunks: int) -> smd.Metadata:
    per = 64
    sdm, storage = {}, {}
    for i in range(max(1, chunks // per)):
        fqn = f"layers.{i}.weight"
        cs = [smd.ChunkStorageMetadata(offsets=torch.Size([c * 64, 0]),
                                       sizes=torch.Size([64, 4096])) for c in range(per)]
        sdm[fqn] = smd.TensorStorageMetadata(
            properties=smd.TensorProperties(dtype=torch.float32),
            size=torch.Size([64 * per, 4096]), chunks=cs)
        for c in range(per):
            storage[smd.MetadataIndex(fqn, torch.Size([c * 64, 0]))] = smd._StorageInfo(
                f"__{c}_0.distcp", i * 33_554_688, 33_554_688)
    return smd.Metadata(state_dict_metadata=sdm, storage_data=storage, version="1.0.0")


def _median(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[19_200, 192_000])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"{'chunks':>8} {'MB':>6} {'op':<18}{'torch s':>10}{'shardstate s':>14}{'ratio':>8}")
    for n in args.chunks:
        ours = _metadata(n)
        theirs = smd.to_torch_metadata(ours)
        data = _pickle.dumps_metadata(ours)
        if _writer._dumps_fast(ours) != data or _writer._dumps_reference(ours) != data:
            raise AssertionError("the two writers disagree")
        if pickle.loads(data) != theirs:
            raise AssertionError("torch does not read back what shardstate wrote")
        back = _pickle.loads_metadata(data)
        if len(back.storage_data) != len(theirs.storage_data):
            raise AssertionError("shardstate's reader lost entries")
        rows = [
            ("write", _median(lambda: pickle.dumps(theirs), args.repeat),
             _median(lambda: _pickle.dumps_metadata(ours), args.repeat)),
            ("write, torch-free", _median(lambda: pickle.dumps(theirs), args.repeat),
             _median(lambda: _writer._dumps_reference(ours), args.repeat)),
            ("read", _median(lambda: pickle.loads(data), args.repeat),
             _median(lambda: _pickle.loads_metadata(data), args.repeat)),
        ]
        for op, t, s in rows:
            print(f"{n:>8} {len(data) / 1e6:>6.1f} {op:<18}{t:>10.3f}{s:>14.3f}{t / s:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
