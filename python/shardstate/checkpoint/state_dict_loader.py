"""load and the deprecated load_state_dict."""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any

from ._dist import _Coordinator
from ._setup import _coordinator, _storage_setup
from .logger import _dcp_method_logger
from .stateful import Stateful
from .utils import _api_bc_check

__all__ = ["load", "load_state_dict"]


def _default_load_planner() -> Any:
    from .default_planner import DefaultLoadPlanner

    return DefaultLoadPlanner()


@_dcp_method_logger(log_exceptions=True)
@_api_bc_check
def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_reader: Any = None,
    planner: Any = None,
    process_group: Any = None,
    no_dist: bool = False,
) -> None:
    """Load a checkpoint into ``state_dict`` in place, in SPMD style.

    Same signature and behaviour as ``torch.distributed.checkpoint.load``:
    tensors are filled in place, other values replaced, and top-level
    Stateful values get ``load_state_dict`` called with what was loaded.
    """
    reader = _storage_setup(storage_reader, checkpoint_id, reader=True)
    coord = _coordinator(process_group, no_dist)
    keys = sorted(state_dict.keys())  # every rank walks the keys in one order
    error: BaseException | None = None
    try:
        flat = {k: (state_dict[k].state_dict() if isinstance(state_dict[k], Stateful)
                    else state_dict[k]) for k in keys}
    except Exception as e:
        if not coord.use_dist:
            raise
        flat, error = {}, e  # a Stateful's state_dict() failed: tell every rank
    _load_state_dict(flat, reader, coord, planner, error)
    for k in keys:
        if isinstance(state_dict[k], Stateful):
            state_dict[k].load_state_dict(flat[k])
        else:
            state_dict[k] = flat[k]


def _read_metadata(reader: Any, rank: int) -> tuple[Any, bool]:
    """The global ``.metadata``, or else (as torch 2.13 does) this rank's own
    ``__{rank}.metadata``, which a save with ``use_collectives=False``
    writes; the flag says whether the global one was found.

    Unlike torch, only a *missing* global metadata falls back: one that is
    refused or malformed is reported as it is."""
    try:
        return reader.read_metadata(), True
    except FileNotFoundError as global_exc:
        if "kwargs" not in inspect.signature(reader.read_metadata).parameters:
            raise
        try:
            return reader.read_metadata(rank=rank), False
        except FileNotFoundError as rank_exc:
            raise FileNotFoundError(
                f"{global_exc}; nor is there rank {rank}'s own metadata of a save "
                f"without collectives: {rank_exc}") from None


def _load_state_dict(state_dict: dict[str, Any], reader: Any, coord: _Coordinator,
                     planner: Any, local_error: BaseException | None = None) -> None:
    """``local_error``: this rank already failed; it is raised in the
    planning step, so every rank hears of it."""
    if planner is None:
        planner = _default_load_planner()
    # Our file-system reader can let the ranks verify a record's checksum
    # together when their reads cover it (each byte read once): it needs the
    # pieces gathered after the reads, which this loader does.
    shared_verify = coord.use_dist and coord.world_size > 1 and \
        hasattr(reader, "_enable_shared_verify")
    if shared_verify:
        reader._enable_shared_verify()
    # It can also read a chunk several ranks need once and broadcast it
    # over the group (if its broadcast_shared_reads option says so); then
    # every rank must run the broadcast rounds, even one that fails first.
    exchange = coord.use_dist and coord.world_size > 1 and hasattr(reader, "_enable_broadcast")
    if exchange:
        reader._enable_broadcast(coord)
        try:
            _plan_and_read(state_dict, reader, coord, planner, local_error, shared_verify, True)
        finally:
            reader._enable_broadcast(None)  # not for a later load by someone else
        return
    _plan_and_read(state_dict, reader, coord, planner, local_error, shared_verify, False)


def _plan_and_read(state_dict: dict[str, Any], reader: Any, coord: _Coordinator, planner: Any,
                   local_error: BaseException | None, shared_verify: bool,
                   exchange: bool) -> None:
    def local_step() -> Any:
        if local_error is not None:
            raise local_error
        metadata, use_collectives = _read_metadata(reader, coord.rank)
        planner.set_up_planner(state_dict, metadata, coord.is_coordinator)
        if "kwargs" in inspect.signature(reader.set_up_storage_reader).parameters:
            reader.set_up_storage_reader(metadata, coord.is_coordinator, rank=coord.rank,
                                         use_collectives=use_collectives)
        else:
            reader.set_up_storage_reader(metadata, coord.is_coordinator)
        return reader.prepare_local_plan(planner.create_local_plan())

    def global_step(all_plans: list) -> list:
        return reader.prepare_global_plan(planner.create_global_plan(all_plans))

    central_plan = coord.reduce_scatter("plan", local_step, global_step)

    def read_data() -> Any:
        if exchange:
            reader._arm(getattr(central_plan, "storage_data", None))
            try:
                plan = planner.finish_plan(central_plan)
            except BaseException:
                reader._abort_exchange()
                raise
        else:
            plan = planner.finish_plan(central_plan)
        futures = reader.read_data(plan, planner)
        futures.wait()
        return reader._take_pieces() if shared_verify else None

    pieces = coord.all_gather("read", read_data)
    if shared_verify:
        from .filesystem import verify_pieces

        verify_pieces(pieces)


def load_state_dict(
    state_dict: dict[str, Any],
    storage_reader: Any,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: Any = None,
) -> None:
    """Deprecated: use :func:`load`."""
    warnings.warn(
        "'load_state_dict' is deprecated and will be removed in future versions. "
        "Please use 'load' instead.", FutureWarning, stacklevel=2)
    storage_reader.reset()
    coord = _coordinator(process_group, no_dist, coordinator_rank)
    _load_state_dict(state_dict, storage_reader, coord, planner)


def _load_state_dict_from_keys(
    keys: set[str] | str | None = None,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_reader: Any = None,
    process_group: Any = None,
) -> dict[str, Any]:
    """A new state dict of the checkpoint's ``keys`` (all of it if None),
    built from its metadata and read whole into this process (torch 2.13's
    private function, which real code imports).

    ``keys``: flat keys of the checkpoint or dotted prefixes of their
    nested paths (see ``_EmptyStateDictLoadPlanner``). Tensors come back on
    CPU, bytes items as their values (through the planner's restricted
    ``loads``). Without an initialised process group it loads in this
    process alone (torch warns that it assumes so; this does not).
    """
    from .default_planner import _EmptyStateDictLoadPlanner

    reader = _storage_setup(storage_reader, checkpoint_id, reader=True)
    if isinstance(keys, str):
        keys = {keys}
    state_dict: dict[str, Any] = {}
    _load_state_dict(state_dict, reader, _coordinator(process_group, False),
                     _EmptyStateDictLoadPlanner(keys=keys))
    return state_dict
