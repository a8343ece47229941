"""A one-line progress bar on stderr for the ``shardstate`` command: bytes
done, rate and time left, redrawn at most ten times a second; silent when
stderr is not a terminal or when turned off (``--quiet``)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class Progress:
    def __init__(self, label: str, total: int, *, enabled: bool | None = None,
                 stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self.label, self.total, self.done = label, max(total, 0), 0
        self.start = self._last = time.monotonic()

    def __call__(self, n: int, total: int | None = None) -> None:
        if total is not None:
            self.total = max(total, 0)
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or self.done >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        secs = max(now - self.start, 1e-9)
        rate = self.done / secs
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * int(frac * 24)
        self.stream.write(f"\r{self.label} [{bar:<24}] {_human(self.done)}/{_human(self.total)} "
                          f"{_human(rate)}/s {int(left) // 60}:{int(left) % 60:02d} left ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
