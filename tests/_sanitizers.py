"""Whether the suite runs on the ASan+UBSan build (``make asan-test``
preloads libasan): the sweeps and the soak then run fewer cases and do not
judge memory, which ASan holds on to."""

from __future__ import annotations

import os

UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")
