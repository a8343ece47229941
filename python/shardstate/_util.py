"""Small helpers shared across the package: one of each.

Nothing here imports torch at module import; ``loaded_torch`` never
imports it at all.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["contiguous_strides", "gc_paused", "import_torch", "is_contiguous", "loaded_torch",
           "torch_dcp"]


def loaded_torch() -> Any:
    """torch if something already imported it, else None (never imports it)."""
    return sys.modules.get("torch")


def import_torch() -> Any:
    """torch, imported on first use (for paths that only torch users reach)."""
    import torch

    return torch


@functools.cache
def torch_dcp() -> Any:
    """``torch.distributed.checkpoint`` when torch is installed with
    distributed support, else None. The first call imports it (and torch);
    the answer is kept for the process. shardstate.checkpoint's data types
    are torch's own whenever this is not None."""
    try:
        torch = importlib.import_module("torch")
        if not torch.distributed.is_available():
            return None
        return importlib.import_module("torch.distributed.checkpoint")
    except ImportError:
        return None


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_resume = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was after).

    Reading or writing a large ``.metadata``, or walking a large state dict,
    makes hundreds of thousands of short-lived containers; every 700 of them
    the collector runs, and its full passes walk everything alive, so with it
    on the time grows faster than the size (192,000 chunks: 30% of the time).
    These graphs hold no cycles, so nothing waits for it. A synchronous save
    or load runs whole in one pause (20,000 small tensors: a quarter of its
    time went to the collector); async_save's background work does not, as
    the caller's thread runs on meanwhile.

    Nested and concurrent pauses (threads) are counted: the collector comes
    back when the last one ends, and only if it was on when the first began."""
    global _gc_depth, _gc_resume
    with _gc_lock:
        if _gc_depth == 0:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_resume:
                gc.enable()


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides, in elements, of a C-contiguous tensor of ``shape``, as
    torch gives them: a zero-size dimension counts as 1, so
    ``(2, 0, 3) -> (3, 3, 1)``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def is_contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` lays ``shape`` out C-contiguously, by torch's rule
    (``Tensor.is_contiguous``): an empty tensor always is, and a dimension of
    size 1 may have any stride."""
    if any(int(n) == 0 for n in shape):
        return True
    acc = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1 and s != acc:
            return False
        acc *= n
    return True


# Linux moves at most this many bytes in one read/write call (2 GiB - 4 KiB)
_MAX_RW = 0x7FFFF000


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """All of ``data`` (any buffer) written at ``offset``: ``os.pwrite``
    may write less than asked (always, past ``_MAX_RW`` bytes on Linux)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + _MAX_RW], offset + done)
