"""torch 2.13's ``utils``: finding the value behind a ``MetadataIndex``, the
failure-safe cross-rank wrapper, a bounded view of a file, and the
positional-argument shim of ``save`` and ``load``."""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from ._dist import _Coordinator
from ._tensors import find_state_dict_object, find_tensor_shard
from .api import CheckpointException as CheckpointException
from .api import _get_failure_dict as _get_failure_dict
from .metadata import MetadataIndex as MetadataIndex  # as torch's module has it

__all__ = ["find_state_dict_object", "find_tensor_shard"]

T = TypeVar("T")
R = TypeVar("R")

# torch's name for the object-collective wrapper: failure-safe steps
# (reduce_scatter, all_reduce, all_gather, broadcast) and no-ops without a group.
_DistWrapper = _Coordinator


def _all_gather_keys(local_dict: dict[str, Any], group: Any = None) -> set[str]:
    """Every rank's keys, united."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(local_dict.keys()), group=group)
    return {k for keys in gathered for k in keys}


def _assert_same_keys(state_dict: dict[str, Any], process_group: Any = None) -> None:
    """Raise AssertionError if another rank has a key this one lacks (collective)."""
    import torch.distributed as dist

    if dist.get_world_size(process_group) == 1:
        return
    diff = _all_gather_keys(state_dict, process_group) - set(state_dict)
    if diff:
        raise AssertionError(f"Key(s) present in other ranks but not this one, difference: {diff}")


def _element_wise_add(a: Sequence[int], b: Sequence[int]) -> list[int]:
    return [x + y for x, y in zip(a, b)]


def _element_wise_sub(a: Sequence[int], b: Sequence[int]) -> list[int]:
    return [x - y for x, y in zip(a, b)]


class _ReaderView(io.IOBase):
    """``length`` bytes of ``base_stream`` from ``offset``, as a readable stream."""

    def __init__(self, base_stream: Any, offset: int, len: int) -> None:  # noqa: A002
        super().__init__()
        self.offset = offset
        self.len = len
        self.base_stream = base_stream
        self.seek(0)

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        if whence == os.SEEK_SET:
            offset = self.offset + offset
        elif whence == os.SEEK_END:
            whence = os.SEEK_SET
            offset = (self.offset + self.len) - offset
        return self.base_stream.seek(offset, whence)

    def tell(self) -> int:
        return self.base_stream.tell() - self.offset

    def readable(self) -> bool:
        return self.base_stream.readable()

    def seekable(self) -> bool:
        return self.base_stream.seekable()

    def readinto(self, b: Any) -> int:
        left = self.len - self.tell()
        if left <= 0:
            return 0
        if len(b) > left:
            b = memoryview(b)[:left]
        return self.base_stream.readinto(b)

    def read(self, size: int = -1) -> bytes:
        left = max(self.len - self.tell(), 0)
        if size == -1 or size > left:
            size = left
        return self.base_stream.read(size)


def _create_file_view(file: Any, offset: int, length: int) -> Any:
    return _ReaderView(file, offset, length)


def _normalize_device_info(device_type: str, device_id: int) -> str:
    return "cpu" if device_type == "cpu" else f"{device_type}:{device_id}"


ENABLE_PROFILE = False


@contextlib.contextmanager
def _profile() -> Iterator[None]:
    """cProfile around the block when ``ENABLE_PROFILE`` (rank 0 only)."""
    if not ENABLE_PROFILE:
        yield
        return
    import cProfile
    from pstats import Stats

    from ._dist import dist_ready

    if dist_ready():
        import torch.distributed as dist

        if dist.get_rank() != 0:
            yield
            return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        Stats(profiler).sort_stats("time").print_stats(10)


def _api_bc_check(func: Any) -> Any:
    """Accept the old positional form ``save(state_dict, storage_writer)`` /
    ``load(state_dict, storage_reader)`` with a warning, as torch does. A
    path given there (torch would fail on it later) is taken as the
    ``checkpoint_id``."""
    kwonly = [p.name for p in inspect.signature(func).parameters.values()
              if p.kind == p.KEYWORD_ONLY]
    storage_kw = ("storage_writer" if "storage_writer" in kwonly
                  else "storage_reader" if "storage_reader" in kwonly else None)
    if storage_kw is None:
        raise RuntimeError(f"Unexpected kwonlyargs = {kwonly}")

    @functools.wraps(func)
    def inner_func(*args: Any, **kwargs: Any) -> Any:
        if len(args) != 2:
            return func(*args, **kwargs)
        warnings.warn(
            f"The argument order of {func.__name__} has been changed. "
            "Please check the document to avoid future breakages.", stacklevel=2)
        second = args[1]
        key = "checkpoint_id" if isinstance(second, (str, os.PathLike)) else storage_kw
        if key in kwargs:
            raise TypeError(f"{func.__name__}() got {key} both positionally and by keyword")
        kwargs[key] = second
        return func(args[0], **kwargs)

    return inner_func
