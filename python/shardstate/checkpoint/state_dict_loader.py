"""load and the deprecated load_state_dict, and the protocol through which a
storage reader takes part in a load's collective steps (LoadCollectives)."""

from __future__ import annotations

import inspect
import logging
import os
import warnings
from typing import Any, Protocol

from .._util import gc_paused
from ._dist import _Coordinator
from ._setup import _coordinator, _storage_setup
from .default_planner import DefaultLoadPlanner as DefaultLoadPlanner
from .logger import _dcp_method_logger
from .planner import LoadPlan as LoadPlan
from .planner import LoadPlanner as LoadPlanner
from .stateful import Stateful as Stateful
from .stateful import is_stateful
from .storage import StorageReader as StorageReader
from .utils import _api_bc_check

__all__ = ["load", "load_state_dict"]

logger = logging.getLogger()  # as torch's module has it


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
    Any rank's failure, that call included (where torch lets the other
    ranks return), raises :class:`CheckpointException` on every rank.
    """
    reader = _storage_setup(storage_reader, checkpoint_id, reader=True)
    coord = _coordinator(process_group, no_dist)
    keys = sorted(state_dict.keys())  # every rank walks the keys in one order
    error: BaseException | None = None
    with gc_paused(), coord.session():
        try:
            flat = {k: (state_dict[k].state_dict() if is_stateful(state_dict[k])
                        else state_dict[k]) for k in keys}
        except Exception as e:
            if not coord.use_dist:
                raise
            flat, error = {}, e  # a Stateful's state_dict() failed: tell every rank
        _load_state_dict(flat, reader, coord, planner, error)

        def apply() -> None:
            for k in keys:
                if is_stateful(state_dict[k]):
                    state_dict[k].load_state_dict(flat[k])
                else:
                    state_dict[k] = flat[k]

        # a Stateful's load_state_dict failing on one rank fails the load on
        # every rank (torch 2.13 lets the others return)
        coord.agree("load_state_dict", apply)


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


class LoadCollectives(Protocol):
    """A storage reader's part in the collective steps of one load over a
    process group of 2+ ranks. The loader asks for it with the reader's
    ``load_collectives(coord)`` (``coord``: the load's ``_Coordinator``),
    if the reader has that method, on every rank before planning; a reader
    without it, or one that returns None, is driven as torch drives it.

    ``FileSystemReader`` uses it to verify records split between ranks
    together and to read shared chunks once and broadcast them; its
    ``prepare_global_plan`` leaves what it planned in ``storage_data``."""

    def arm(self, storage_data: Any) -> None:
        """The central plan's ``storage_data``, before ``planner.finish_plan``
        (which may drop it)."""

    def abort(self) -> None:
        """``finish_plan`` or ``read_data`` raised on this rank: take part,
        as failed, in whatever the other ranks may still wait for in this
        read; nothing where the reader's own ``read_data`` took part already
        (a subclass's or a wrapper's ``read_data`` may raise before it)."""

    def pieces(self) -> Any:
        """After ``read_data``: what this rank contributes to ``verify``."""

    def verify(self, gathered: list[Any]) -> None:
        """On every rank, every rank's ``pieces()`` in rank order; raises
        (the same on every rank) when the load's data is bad."""

    def done(self) -> None:
        """The load is over, whether it succeeded or not."""


def _load_state_dict(state_dict: dict[str, Any], reader: Any, coord: _Coordinator,
                     planner: Any, local_error: BaseException | None = None) -> None:
    """``local_error``: this rank already failed; it is raised in the
    planning step, so every rank hears of it."""
    if planner is None:
        planner = _default_load_planner()
    with coord.session():
        hook = getattr(reader, "load_collectives", None)
        collectives = hook(coord) if hook is not None and coord.use_dist and \
            coord.world_size > 1 else None
        if collectives is None:
            _plan_and_read(state_dict, reader, coord, planner, local_error, None)
            return
        try:
            _plan_and_read(state_dict, reader, coord, planner, local_error, collectives)
        finally:
            collectives.done()


def _plan_and_read(state_dict: dict[str, Any], reader: Any, coord: _Coordinator, planner: Any,
                   local_error: BaseException | None,
                   collectives: LoadCollectives | None) -> None:
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
        if collectives is None:
            futures = reader.read_data(planner.finish_plan(central_plan), planner)
        else:
            collectives.arm(getattr(central_plan, "storage_data", None))
            try:
                futures = reader.read_data(planner.finish_plan(central_plan), planner)
            except BaseException:
                collectives.abort()  # the other ranks may wait for this one
                raise
        futures.wait()
        return None if collectives is None else collectives.pieces()

    pieces = coord.all_gather("read", read_data)
    if collectives is not None:
        collectives.verify(pieces)


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
