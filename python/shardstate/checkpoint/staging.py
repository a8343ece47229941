"""Staging for ``async_save``, as torch 2.13's ``staging``: ``AsyncStager``,
``StagingOptions``, ``DefaultStager`` and ``BlockingAsyncStager``.

``AsyncStager`` and ``StagingOptions`` are torch's own whenever torch is
installed (a stager written for torch's DCP is one of ours, and back);
torch-free stand-ins otherwise. ``DefaultStager`` and ``BlockingAsyncStager``
are shardstate's: they stage through the bounded pool of reusable host
arenas of ``_staging`` (the C engine's copies, GIL released), so a training
loop's repeated saves copy into memory already mapped, and no more than two
staged copies are ever alive (a third staging waits for the oldest save).
Their output goes back to the pool when ``async_save`` has written it, or,
for a stager used on its own, when the staged values are garbage collected.

``FileSystemWriter`` is a ``BlockingAsyncStager``, as torch's is: given as
``storage_writer`` to ``async_save``, it stages the state.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from . import _staging
from .metadata import STATE_DICT_TYPE, TORCH_TYPES

__all__ = ["AsyncStager", "BlockingAsyncStager", "DefaultStager", "StagingOptions"]

if TORCH_TYPES:
    from torch.distributed.checkpoint.staging import AsyncStager, StagingOptions
else:

    @runtime_checkable
    class AsyncStager(Protocol):  # type: ignore[no-redef]
        """What ``async_save`` stages through: ``stage`` returns a
        training-safe copy of the state dict (or a Future of one);
        ``synchronize_staging`` waits for an asynchronous ``stage``, and is
        called by async_save when ``should_synchronize_after_execute``."""

        _synchronize_after_execute: bool = True

        @property
        def should_synchronize_after_execute(self) -> bool:
            return self._synchronize_after_execute

        def stage(self, state_dict: STATE_DICT_TYPE) -> Future | STATE_DICT_TYPE:
            raise NotImplementedError(f"{self.__class__.__name__} must implement stage method")

        def synchronize_staging(self) -> None:
            """Waits until an asynchronous ``stage`` has finished."""

        def close(self) -> None:
            """Frees what the stager holds."""

    @dataclass
    class StagingOptions:  # type: ignore[no-redef]
        """How ``DefaultStager`` stages (torch's fields and defaults)."""

        use_pinned_memory: bool = True
        use_shared_memory: bool = True
        use_async_staging: bool = True
        use_non_blocking_copy: bool = True


class DefaultStager(AsyncStager):
    """Stages into arenas of shardstate's bounded staging pool.

    ``StagingOptions``: ``use_pinned_memory`` page-locks the arena when CUDA
    tensors are staged (their copies then run at DMA speed);
    ``use_shared_memory`` puts the staged values in shared memory (what the
    PROCESS checkpointer maps without a copy); ``use_async_staging`` stages
    in a background thread: ``stage`` returns a Future of the staged state,
    ``synchronize_staging`` waits for it (CUDA copies run on a side stream
    after the work queued before ``stage``); ``use_non_blocking_copy`` lets
    the device-to-host copies run asynchronously, waited for once.

    Unlike torch's, it needs no accelerator: on a host without one the CUDA
    options have nothing to do. Not thread-safe, as torch's.
    """

    def __init__(self, config: StagingOptions = StagingOptions()) -> None:  # noqa: B008 - torch's
        self._config = config
        self._staging_executor: ThreadPoolExecutor | None = None
        if config.use_async_staging:
            self._staging_executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="shardstate-staging")
        self._staging_future: Future | None = None

    def stage(self, state_dict: STATE_DICT_TYPE, **kwargs: Any) -> STATE_DICT_TYPE | Future:
        """The staged state (``use_async_staging``: a Future of it)."""
        if self._staging_executor is None:
            return self._stage(state_dict, None)
        after = _cuda_ready_events(state_dict)
        fut = self._staging_executor.submit(self._stage, state_dict, after)
        # synchronize_staging waits on a signal that does not hold the staged
        # values, so they go back to the pool as soon as their user drops them
        done: Future = Future()
        fut.add_done_callback(lambda f: _copy_outcome(f, done))
        self._staging_future = done
        return fut

    def _stage(self, state_dict: STATE_DICT_TYPE, after: dict | None) -> STATE_DICT_TYPE:
        cfg = self._config
        return _staging.stage(state_dict, shared=cfg.use_shared_memory,
                              pin_memory=cfg.use_pinned_memory,
                              non_blocking=cfg.use_non_blocking_copy, after=after).state_dict

    def synchronize_staging(self) -> None:
        """Waits for the last asynchronous ``stage`` (a no-op otherwise)."""
        if self._staging_future is not None:
            self._staging_future.result()

    def close(self) -> None:
        """Stops the staging thread (after the staging in progress)."""
        if self._staging_executor is not None:
            self._staging_executor.shutdown(wait=True)


class BlockingAsyncStager(AsyncStager):
    """Stages on the host and returns once the copy is done (torch's).

    Each staging takes an arena of the bounded pool.
    ``cache_staged_state_dict=True`` keeps one arena for this stager instead
    and copies every staging into it (less latency, memory held for the
    stager's life; the same state structure is expected each time). Within
    async_save, a save through the cache first waits for the one that
    still reads it. ``type_check``: refuse values DCP can't save (torch's check:
    tensors, DTensor, ShardedTensor, int, float, str, bytes, BytesIO, None
    and containers of them); always on with the cache, as in torch.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, cache_staged_state_dict: bool = False, type_check: bool = False) -> None:
        self.cache_staged_state_dict = cache_staged_state_dict
        self.type_check = type_check
        self.state_dict_cache: STATE_DICT_TYPE | None = None
        self._cache: _staging.ArenaCache | None = None
        self._inflight: Future | None = None  # the async_save reading the cache

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """A copy of ``state_dict`` on the host."""
        if not self.cache_staged_state_dict:
            if self.type_check:
                _check_types(state_dict)
            return _staging.stage(state_dict, shared=_staging.shared_wanted()).state_dict
        _check_types(state_dict)
        if self._inflight is not None:
            wait([self._inflight])  # its outcome is its caller's business
            self._inflight = None
        if self._cache is None:
            self._cache = _staging.ArenaCache()
        self.state_dict_cache = _staging.stage(state_dict, shared=_staging.shared_wanted(),
                                               cache=self._cache).state_dict
        return self.state_dict_cache

    def synchronize_staging(self) -> None:
        """A no-op: staging is blocking."""

    def close(self) -> None:
        pass

    def __getstate__(self) -> dict[str, Any]:
        # the cache is host memory, not configuration (a stager or a writer
        # is pickled to the PROCESS checkpointer's process)
        state = self.__dict__.copy()
        state.update(state_dict_cache=None, _cache=None, _inflight=None)
        return state


class _FileSystemWriterStager(BlockingAsyncStager):
    """What makes FileSystemWriter an AsyncStager, as torch's is."""

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        # as torch's: the staged state is on the host, no copy-ahead needed
        self.per_thread_copy_ahead = 0
        return super().stage(state_dict)


def _copy_outcome(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(None)


def _cuda_ready_events(state_dict: Any) -> dict | None:
    """device -> an event recorded now on its current stream, for each CUDA
    device whose tensors state_dict holds (None when it holds none)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    sources: list[Any] = []
    _staging._collect(state_dict, torch, sources)
    devices = {s.device for s in sources if getattr(s, "is_cuda", False)}
    events = {}
    for dev in devices:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        events[dev] = ev
    return events or None


def _check_types(value: Any) -> None:
    """torch's type check for staging (``_copy_state_dict(type_check=True)``)."""
    import io
    import sys

    if isinstance(value, dict):
        for v in value.values():
            _check_types(v)
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_types(v)
        return
    torch = sys.modules.get("torch")
    if value is None or isinstance(value, (int, float, str, bytes, io.BytesIO)):
        return
    if torch is not None and isinstance(value, torch.Tensor):
        return  # DTensor and ShardedTensor are tensors too
    raise ValueError(f"Unexpected value type {type(value)}")
