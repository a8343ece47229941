"""save, async_save and the deprecated save_state_dict."""

from __future__ import annotations

import inspect
import os
import threading
import warnings
from concurrent.futures import Future, wait
from datetime import timedelta
from enum import Enum
from typing import Any

from .._util import gc_paused
from . import _staging
from ._dist import _Coordinator
from ._liveness import group_timeout
from ._setup import _coordinator, _storage_setup
from .api import _wrap_exception
from .default_planner import DefaultSavePlanner as DefaultSavePlanner
from .logger import _dcp_method_logger
from .metadata import STATE_DICT_TYPE, TORCH_TYPES, Metadata
from .planner import SavePlan as SavePlan
from .planner import SavePlanner as SavePlanner
from .staging import AsyncStager, BlockingAsyncStager
from .staging import DefaultStager as DefaultStager
from .staging import StagingOptions as StagingOptions
from .stateful import Stateful as Stateful
from .stateful import is_stateful
from .storage import StorageWriter as StorageWriter
from .storage import WriteResult as WriteResult
from .utils import _api_bc_check

__all__ = ["AsyncCheckpointerType", "AsyncSaveResponse", "async_save", "save",
           "save_state_dict"]

if TORCH_TYPES:
    # torch's own: a torch.distributed.checkpoint AsyncCheckpointerType
    # member picks the same checkpointer here
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.checkpoint.state_dict_saver import (
        AsyncSaveResponse as _TorchAsyncSaveResponse,
    )
else:

    class AsyncCheckpointerType(Enum):  # type: ignore[no-redef]
        """Where async_save writes: a thread of this process, or a
        checkpoint process."""

        THREAD = "thread"
        PROCESS = "process"

    class _TorchAsyncSaveResponse:  # type: ignore[no-redef]
        pass


def _stateful_to_state_dict(state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
    """Top-level Stateful values are saved through their state_dict()."""
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in state_dict.items()}


def _default_save_planner(coord: _Coordinator, use_collectives: bool) -> Any:
    """torch's default planner, with plan caching on: a training loop saves
    the same structure again and again, and then no rank sends its plan and
    the coordinator plans nothing (torch leaves caching off by default).

    The cache is per process group and mode (its own key): every member of
    a group makes that group's saves in the same order, which keeps the
    ranks' cached plans and the coordinator's in step; saves on other
    groups, async_save's private group in its thread, and saves without
    collectives (where each rank plans alone) never touch it."""
    from .default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner(enable_plan_caching=True)
    if coord.use_dist and use_collectives:
        group = "default" if coord.group is None else f"group{id(coord.group)}"
        planner._cached_plans_key = (f"shardstate.DefaultSavePlanner@{group}/"
                                     f"{coord.world_size}/{coord.coordinator_rank}")
    else:  # this rank plans alone
        planner._cached_plans_key = "shardstate.DefaultSavePlanner@local"
    return planner


@_dcp_method_logger(log_exceptions=True)
@_api_bc_check
def save(
    state_dict: STATE_DICT_TYPE,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Metadata:
    """Save a state dict in SPMD style: every rank calls it with its own shards.

    Same signature and behaviour as ``torch.distributed.checkpoint.save``;
    ``no_dist`` is implied when torch.distributed is not initialised (no
    warning). Any rank's failure raises :class:`CheckpointException` on every
    rank, and leaves no ``.metadata`` behind.
    """
    writer = _storage_setup(storage_writer, checkpoint_id, reader=False)
    coord = _coordinator(process_group, no_dist)
    with gc_paused(), coord.session():
        try:
            flat, error = _stateful_to_state_dict(state_dict), None
        except Exception as e:
            if not coord.use_dist:
                raise
            flat, error = {}, e  # a Stateful's state_dict() failed: tell every rank
        return _save_state_dict(flat, writer, coord, planner, use_collectives, error)


def _save_state_dict(state_dict: STATE_DICT_TYPE, writer: Any, coord: _Coordinator,
                     planner: Any, use_collectives: bool = True,
                     local_error: BaseException | None = None) -> Metadata:
    """``local_error``: this rank already failed (a Stateful's state_dict(),
    async_save's staging); it is raised in the planning step, so every rank
    hears of it."""
    with coord.session():
        return _save_steps(state_dict, writer, coord, planner, use_collectives, local_error)


def _save_steps(state_dict: STATE_DICT_TYPE, writer: Any, coord: _Coordinator,
                planner: Any, use_collectives: bool,
                local_error: BaseException | None) -> Metadata:
    if planner is None:
        planner = _default_save_planner(coord, use_collectives)
    global_metadata: Metadata | None = None

    def local_step() -> Any:
        if local_error is not None:
            raise local_error
        params = inspect.signature(planner.set_up_planner).parameters
        if "storage_meta" in params:
            planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(),
                                   is_coordinator=coord.is_coordinator)
        else:
            planner.set_up_planner(state_dict, coord.is_coordinator)
        if "kwargs" in inspect.signature(writer.set_up_storage_writer).parameters:
            writer.set_up_storage_writer(coord.is_coordinator, rank=coord.rank,
                                         use_collectives=use_collectives)
        else:
            writer.set_up_storage_writer(coord.is_coordinator)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_step(all_plans: list) -> list:
        nonlocal global_metadata
        all_plans, global_metadata = planner.create_global_plan(all_plans)
        return writer.prepare_global_plan(all_plans)

    if use_collectives:
        central_plan = coord.reduce_scatter("plan", local_step, global_step)
    else:
        try:
            central_plan = global_step([local_step()])[0]
        except BaseException:
            coord.barrier()  # the others wait for this rank at the end of theirs
            raise

    def write_data() -> Any:
        futures = writer.write_data(planner.finish_plan(central_plan), planner)
        futures.wait()
        return futures.value()

    def finish(all_results: list) -> Metadata:
        assert global_metadata is not None
        writer.finish(metadata=global_metadata, results=all_results)
        return global_metadata

    if use_collectives:
        return coord.all_reduce("write", write_data, finish)
    try:
        return finish([write_data()])
    finally:
        coord.barrier()  # failed or not: no rank is left waiting here


def save_state_dict(
    state_dict: STATE_DICT_TYPE,
    storage_writer: Any,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: Any = None,
) -> Metadata:
    """Deprecated: use :func:`save`."""
    warnings.warn(
        "'save_state_dict' is deprecated and will be removed in future versions. "
        "Please use 'save' instead.", FutureWarning, stacklevel=2)
    storage_writer.reset()
    coord = _coordinator(process_group, no_dist, coordinator_rank)
    return _save_state_dict(state_dict, storage_writer, coord, planner)


# ---------------------------------------------------------------- async_save

class AsyncSaveResponse(_TorchAsyncSaveResponse, Future):
    """What async_save returns, torch's ``AsyncSaveResponse`` (a subclass of
    it with torch installed): ``staging_completion``, done when the state is
    staged (the caller may then modify its tensors), and
    ``upload_completion``, done with the save's Metadata when the checkpoint
    is committed, or failed with the exception.

    It is also a Future of the Metadata (``upload_completion`` itself, when
    given None): code written for torch's plain-Future return value keeps
    working.
    """

    def __init__(self, staging_completion: Future, upload_completion: Future | None) -> None:
        Future.__init__(self)
        self.staging_completion = staging_completion
        self.upload_completion = self if upload_completion is None else upload_completion
        if upload_completion is not None:
            upload_completion.add_done_callback(lambda f: _copy_outcome(f, self))

    # a Future: compared and hashed by identity (concurrent.futures.wait
    # keeps futures in sets), shown by its state
    __eq__ = object.__eq__
    __hash__ = object.__hash__
    __repr__ = Future.__repr__


def _copy_outcome(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


def _signal_outcome(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(None)


# One extra gloo group per process group spanning every rank, used only by
# background saves so their collectives never interleave with the training
# loop's.
_async_groups: dict[Any, Any] = {}
_async_groups_lock = threading.Lock()
# The last background save started on each private group, while it runs
# (a finished one removes itself). A new one waits for it: two saves running
# at once would issue their collectives on the shared group in an order that
# can differ between ranks, and hang.
_async_last: dict[Any, Future] = {}


def _async_group(process_group: Any) -> Any:
    """The group a background save runs its collectives on.

    A private copy for a group of every rank (dist.new_group must be entered
    by all ranks, and all of them are calling async_save). A smaller group
    is used as it is, as torch does: the ranks outside it are not calling
    async_save, so a new group can't be made without desynchronising their
    group numbering from the members' (their next new_group would hang)."""
    import torch.distributed as dist

    if process_group is not None and \
            dist.get_world_size(process_group) != dist.get_world_size():
        return process_group
    key = process_group if process_group is not None else "default"
    with _async_groups_lock:
        if key not in _async_groups:
            # with the caller's group's timeout: new_group's default is
            # gloo's 30 minutes, whatever init_process_group was given, and
            # it bounds how long a rank stuck alive holds the others
            # (_liveness)
            seconds = group_timeout(dist, process_group)
            _async_groups[key] = dist.new_group(
                ranks=list(range(dist.get_world_size())), backend="gloo",
                timeout=None if seconds is None else timedelta(seconds=seconds))
        return _async_groups[key]


def _in_process(async_checkpointer_type: Any) -> bool:
    """True for PROCESS, False for THREAD; anything else is refused (never
    a silent thread in place of a process)."""
    kind = getattr(async_checkpointer_type, "value", async_checkpointer_type)
    if kind == "process":
        return True
    if kind == "thread":
        return False
    raise ValueError(f"async_checkpointer_type must be AsyncCheckpointerType.THREAD or "
                     f"AsyncCheckpointerType.PROCESS, got {async_checkpointer_type!r}")


def _for_process(writer: Any, planner: Any, coord: _Coordinator) -> None:
    """Refuses at the call what the checkpoint process can't be given."""
    from . import _async_process

    for what, obj in (("storage writer", writer), ("planner", planner)):
        try:
            _async_process.dumps(obj, arenas=False)
        except Exception as e:
            raise TypeError(
                f"async_save(async_checkpointer_type=PROCESS): the {what} "
                f"{type(obj).__qualname__} cannot be pickled to the checkpoint process "
                f"({type(e).__name__}: {e}); use AsyncCheckpointerType.THREAD") from e
    _async_process.check_alive(_async_process.group_key(coord))


def _save_in_process(staged: Any, error: BaseException | None, writer: Any, planner: Any,
                     coord: _Coordinator, use_collectives: bool) -> Metadata:
    """The save, written and committed by the checkpoint process (started
    on first use: every rank of the group is here together)."""
    from . import _async_process

    proc = _async_process.checkpoint_process(coord)
    restaged: _staging.StagedState | None = None
    payload, arenas = None, []
    try:
        if error is None:
            try:
                if _async_process.needs_restaging(staged):
                    # not all in shared memory (another stager's output):
                    # copied there once, here, rather than through the pipe
                    restaged = _staging.stage(staged, shared=True)
                    staged = restaged.state_dict
                payload, arenas = _async_process.dumps((staged, writer, planner))
            except Exception as e:  # noqa: BLE001 - the process takes part failing
                error = e
        return proc.save(payload, arenas, use_collectives,
                         None if error is None else _wrap_exception(error))
    finally:
        if restaged is not None:
            restaged.release()


@_dcp_method_logger(log_exceptions=True)
def async_save(
    state_dict: STATE_DICT_TYPE,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: Any = None,
    async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
    async_stager: AsyncStager | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> AsyncSaveResponse:
    """Stage the state on the host, then save it in the background.

    Same signature and staging protocol as torch's: ``async_stager`` stages
    the state (else ``storage_writer`` when it is an ``AsyncStager``, as
    FileSystemWriter is, else shardstate's staging pool); a stager whose
    ``stage`` returns a Future stages in the background, and
    ``staging_completion`` completes with it; otherwise async_save returns
    once staging is done (the caller may then modify its tensors), after
    ``synchronize_staging`` when the stager's
    ``should_synchronize_after_execute``.

    ``async_checkpointer_type``: THREAD writes in a thread of this process;
    PROCESS in this rank's checkpoint process (see ``_async_process``),
    staged in shared memory it maps, so this process's GIL never touches the
    write. What PROCESS can't be given (a storage writer or planner that
    can't be pickled) raises TypeError here.

    The returned AsyncSaveResponse completes with the Metadata when the
    checkpoint is committed, or with the exception (a CheckpointException
    when any rank failed; a rank whose staging fails also fails
    ``staging_completion`` and still takes part, so the others are told).
    Background saves on a group of every rank use a private gloo group, so
    they never interleave with the caller's own collectives (a smaller
    ``process_group`` is used as it is, as in torch); they run one after
    another in call order (a save started before the previous one finished
    waits for it).

    The staging pool copies CPU and CUDA tensors, DTensor local shards and
    ndarrays into a reusable buffer from a bounded per-process pool (two in
    use at a time: a third save in flight waits in staging for the oldest
    to finish), so a training loop's repeated saves copy into memory
    already mapped.
    """
    in_process = _in_process(async_checkpointer_type)
    stager = async_stager
    if stager is None and storage_writer is not None and isinstance(storage_writer, AsyncStager):
        stager = storage_writer  # as torch: a writer that stages
    cached = isinstance(stager, BlockingAsyncStager) and stager.cache_staged_state_dict
    if cached and stager._inflight is not None:
        # its cache (and, a writer, its path) still serve the last save
        wait([stager._inflight])
    writer = _storage_setup(storage_writer, checkpoint_id, reader=False)
    coord = _coordinator(process_group, no_dist)
    if coord.use_dist:
        coord = _Coordinator(_async_group(process_group), True, 0)
        # its heartbeat starts now: a rank that dies before its background
        # save begins is known to be gone
        coord._liveness()
    if in_process:
        _for_process(writer, planner, coord)
    response = AsyncSaveResponse(Future(), None)
    staged: Any = None
    staging: _staging.StagedState | None = None
    staging_future: Future | None = None
    staging_error: BaseException | None = None
    try:
        flat = _stateful_to_state_dict(state_dict)
        if stager is None:
            staging = _staging.stage(flat, shared=in_process)
            staged = staging.state_dict
        else:
            with _staging.sharing(in_process):
                out = stager.stage(flat)
            if isinstance(out, Future):
                staging_future = out
            else:
                staged = out
    except Exception as e:
        if not coord.use_dist:
            raise
        # The other ranks are about to plan this save with this one: take
        # part, failing, so they get the error instead of waiting forever.
        staging_error = e
        response.staging_completion.set_exception(e)
    else:
        if staging_future is None:
            response.staging_completion.set_result(None)
        else:
            staging_future.add_done_callback(
                lambda f: _signal_outcome(f, response.staging_completion))
    if cached:
        stager._inflight = response  # the next staging into its cache waits for this save
    previous: Future | None = None
    if coord.use_dist:
        # Every rank calls async_save in the same order, so running each
        # group's saves one after another keeps their collectives matched.
        with _async_groups_lock:
            previous = _async_last.get(coord.group)
            _async_last[coord.group] = response

    def run() -> None:
        nonlocal staged, staging_error
        if previous is not None:
            wait([previous])  # its outcome is its own caller's business
        if staging_future is not None:
            try:
                staged = staging_future.result()
            except BaseException as e:  # noqa: BLE001 - carried to every rank
                staging_error = e
        result: Any = None
        failure: BaseException | None = None
        try:
            if in_process:
                result = _save_in_process(staged, staging_error, writer, planner, coord,
                                          use_collectives)
            else:
                result = _save_state_dict(staged, writer, coord, planner, use_collectives,
                                          staging_error)
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            failure = e
        finally:
            # the arena goes back to the pool for the next save (before the
            # caller hears that this one is done)
            if staging is not None:
                staging.release()
            elif staged is not None and not cached:
                _staging.release_staged(staged)
        if coord.use_dist:
            # done: the next save need not wait for it, and nothing here
            # keeps it (a failure's traceback holds the staged state, and a
            # PROCESS save's shared arenas, for as long as it is kept)
            with _async_groups_lock:
                if _async_last.get(coord.group) is response:
                    del _async_last[coord.group]
        if failure is not None:
            response.set_exception(failure)
        else:
            response.set_result(result)

    threading.Thread(target=run, name="shardstate-async-save", daemon=True).start()
    if staging_future is None and stager is not None and staging_error is None \
            and stager.should_synchronize_after_execute:
        stager.synchronize_staging()
    return response
