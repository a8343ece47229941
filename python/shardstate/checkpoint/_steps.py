"""A root of step checkpoints: ``ROOT/<step>/`` (Orbax's layout: the step
number as the directory's name; ``step_<n>`` and ``step-<n>``, as
torchtitan and others name them, are read too).

A step is *committed* when its ``.metadata`` is published and the commit
marker ``.shardstate-commit`` is written after it (what shardstate's
checkpoint manager does), *complete* when it has a ``.metadata`` but no
marker (a plain DCP save, torch's or ours), and *incomplete* otherwise (a
save that is running or that crashed).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path

__all__ = ["COMMIT_MARKER", "Step", "list_steps", "remove_step"]

COMMIT_MARKER = ".shardstate-commit"
_METADATA = ".metadata"
_STEP_NAME = re.compile(r"(?:step[_-]?)?([0-9]+)")


@dataclasses.dataclass(frozen=True)
class Step:
    step: int
    path: Path
    state: str  # "committed", "complete" or "incomplete"
    size: int  # bytes of the files in the step's directory

    @property
    def loadable(self) -> bool:
        return self.state != "incomplete"


def _size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def step_state(path: Path) -> str:
    if not (path / _METADATA).is_file():
        return "incomplete"
    return "committed" if (path / COMMIT_MARKER).is_file() else "complete"


def list_steps(root: str | os.PathLike) -> list[Step]:
    """The steps under ``root``, ascending. Raises FileNotFoundError when
    ``root`` is not a directory."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory")
    out = []
    for entry in os.scandir(root):
        m = _STEP_NAME.fullmatch(entry.name)
        if m is None or not entry.is_dir(follow_symlinks=False):
            continue
        p = Path(entry.path)
        out.append(Step(int(m.group(1)), p, step_state(p), _size(p)))
    out.sort(key=lambda s: (s.step, s.path.name))
    return out


def remove_step(step: Step) -> None:
    """Removes a step's directory; its ``.metadata`` (and marker) first, so
    a step half removed reads as incomplete, never as a loadable
    checkpoint with missing files."""
    for name in (COMMIT_MARKER, _METADATA):
        try:
            os.unlink(step.path / name)
        except FileNotFoundError:
            pass
    shutil.rmtree(step.path)
