"""The ``shardstate`` command's progress bar: tqdm's, on stderr, in bytes
(done, rate, time left); silent when stderr is not a terminal or when
turned off (``--quiet``)."""

from __future__ import annotations

import sys
from typing import Any, TextIO


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class Progress:
    """``progress(n, total=None)``: ``n`` more bytes done (and the total,
    when it becomes known), as the library's work reports it."""

    def __init__(self, label: str, total: int | None, *, enabled: bool | None = None,
                 stream: TextIO | None = None) -> None:
        stream = sys.stderr if stream is None else stream
        if enabled is None:
            enabled = bool(getattr(stream, "isatty", lambda: False)())
        self.enabled = enabled
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total or None, desc=label, unit="B", unit_scale=True,
                             unit_divisor=1000, file=stream, dynamic_ncols=True, leave=True)

    def __call__(self, n: int, total: int | None = None) -> None:
        if self._bar is None:
            return
        if total is not None and total != self._bar.total:
            self._bar.total = max(total, 0)
            self._bar.refresh()
        self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
