"""save, async_save and the deprecated save_state_dict."""

from __future__ import annotations

import inspect
import os
import threading
import warnings
from concurrent.futures import Future, wait
from typing import Any

from . import _staging
from ._dist import _Coordinator
from ._setup import _coordinator, _storage_setup
from .logger import _dcp_method_logger
from .metadata import STATE_DICT_TYPE, Metadata
from .stateful import Stateful
from .utils import _api_bc_check

__all__ = ["AsyncSaveResponse", "async_save", "save", "save_state_dict"]


def _stateful_to_state_dict(state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
    """Top-level Stateful values are saved through their state_dict()."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}


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
        central_plan = global_step([local_step()])[0]

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
    metadata = finish([write_data()])
    coord.barrier()
    return metadata


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

class AsyncSaveResponse(Future):
    """What async_save returns: a Future of the save's Metadata (so code
    written for torch's return value keeps working) that also shows the two
    phases separately: ``staging_completion`` (done when async_save returns:
    the state is copied, the caller may modify its tensors) and
    ``upload_completion`` (this future: done when the checkpoint is
    committed, or failed with the exception)."""

    def __init__(self) -> None:
        super().__init__()
        self.staging_completion: Future = Future()
        self.upload_completion: Future = self


# One extra gloo group per process group spanning every rank, used only by
# background saves so their collectives never interleave with the training
# loop's.
_async_groups: dict[Any, Any] = {}
_async_groups_lock = threading.Lock()
# The last background save started on each private group. A new one waits
# for it: two saves running at once would issue their collectives on the
# shared group in an order that can differ between ranks, and hang.
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
            _async_groups[key] = dist.new_group(
                ranks=list(range(dist.get_world_size())), backend="gloo")
        return _async_groups[key]


def async_save(
    state_dict: STATE_DICT_TYPE,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: Any = None,
    async_checkpointer_type: Any = None,
    async_stager: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> AsyncSaveResponse:
    """Copy the state to host memory, then save it in the background.

    Returns once staging is done (the caller may then modify its tensors);
    the returned future completes with the Metadata when the checkpoint is
    committed, or with the exception (a CheckpointException when any rank
    failed; a rank whose staging fails also fails ``staging_completion``
    and still takes part, so the others are told). Background saves on a
    group of every rank use a private gloo group, so they never interleave
    with the caller's own collectives (a smaller ``process_group`` is used
    as it is, as in torch); they run one after another in call order (a
    save started before the previous one finished waits for it).

    Staging copies CPU tensors, DTensor local shards and ndarrays into a
    reusable buffer from a bounded per-process pool (two in use at a time:
    a third save in flight waits in staging for the oldest to finish), so a
    training loop's repeated saves copy into memory already mapped.
    """
    writer = _storage_setup(storage_writer, checkpoint_id, reader=False)
    coord = _coordinator(process_group, no_dist)
    if coord.use_dist:
        coord = _Coordinator(_async_group(process_group), True, 0)
    response = AsyncSaveResponse()
    staged: Any = None
    staging: _staging.StagedState | None = None
    staging_error: BaseException | None = None
    try:
        if async_stager is not None:
            staged = async_stager.stage(_stateful_to_state_dict(state_dict))
            if isinstance(staged, Future):
                staged = staged.result()
        else:
            staging = _staging.stage(_stateful_to_state_dict(state_dict))
            staged = staging.state_dict
    except Exception as e:
        if not coord.use_dist:
            raise
        # The other ranks are about to plan this save with this one: take
        # part, failing, so they get the error instead of waiting forever.
        staging_error = e
        response.staging_completion.set_exception(e)
    else:
        response.staging_completion.set_result(None)
    previous: Future | None = None
    if coord.use_dist:
        # Every rank calls async_save in the same order, so running each
        # group's saves one after another keeps their collectives matched.
        with _async_groups_lock:
            previous = _async_last.get(coord.group)
            _async_last[coord.group] = response

    def run() -> None:
        if previous is not None:
            wait([previous])  # its outcome is its own caller's business
        try:
            response.set_result(_save_state_dict(staged, writer, coord, planner, use_collectives,
                                                 staging_error))
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            response.set_exception(e)
        finally:
            if staging is not None:
                staging.release()  # the arena goes back to the pool for the next save

    threading.Thread(target=run, name="shardstate-async-save", daemon=True).start()
    return response
