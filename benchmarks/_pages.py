"""Page conditions for the benchmarks: every timed region starts from the same.

A virtual machine may hand free guest pages back to its host (virtio-balloon
free-page reporting; this project's machines do: see
/sys/module/page_reporting), and the first touch of such a page then faults on
the host too. A timed region that takes fresh memory (the tmpfs or page-cache
pages a save writes, the buffers a load or an optimizer-state conversion
allocates) runs 2-3x slower on pages that were freed long ago than on pages
just freed, and which one it gets depends on what ran before it.

So a benchmark calls warm() before each timed region, torch's and shardstate's
alike: each process writes to, then frees, a little more memory than the region
will take, and the region gets pages just freed, as in a training process
whose memory churns. Setting SHARDSTATE_BENCH_COLD=1 (the scripts' --cold)
turns it off; the variable reaches ranks started by spawn.
"""

from __future__ import annotations

import os

COLD_ENV = "SHARDSTATE_BENCH_COLD"


def set_cold(cold: bool) -> None:
    os.environ[COLD_ENV] = "1" if cold else "0"


def describe() -> str:
    return "cold" if os.environ.get(COLD_ENV) == "1" else "warmed before each timed region"


def warm(nbytes: int) -> None:
    """Write to, then free, 1.5 * nbytes of fresh memory (nothing if cold)."""
    if os.environ.get(COLD_ENV) == "1" or nbytes <= 0:
        return
    import numpy as np

    a = np.empty(int(nbytes * 1.5), dtype=np.uint8)
    a.fill(1)
    del a  # a mapping this large is unmapped: its pages go back to the free lists
