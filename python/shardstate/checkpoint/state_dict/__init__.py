"""Model and optimizer state dicts keyed by canonical FQNs (torch 2.13's
``torch.distributed.checkpoint.state_dict``).

    from shardstate.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, optim)
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)

Works for plain modules, DDP, FSDP2 (``fully_shard``) and FSDP1-wrapped
models. Keys are the canonical FQNs (the names ``named_parameters()`` gives
on the undistributed model: no ``module.``, ``_orig_mod.``,
``_fsdp_wrapped_module.`` or checkpoint-wrapper prefixes); the optimizer
state is keyed by FQN and each ``param_groups`` entry lists FQNs.

What each option does, as in torch:

* ``full_state_dict``: DTensors (and ShardedTensors) are gathered into full
  tensors on every rank; with ``cpu_offload`` too, only rank 0 keeps the
  result and every other rank gets ``{}``.
* ``cpu_offload``: tensors are moved to the CPU.
* ``ignore_frozen_params``: parameters with ``requires_grad=False`` are left
  out of the model state dict.
* ``flatten_optimizer_state_dict``: the optimizer state dict is one level,
  ``state.<fqn>.<name>`` and ``param_groups.<fqn>.<hyperparameter>``.
* ``broadcast_from_rank0`` (needs ``full_state_dict``): on load only rank 0
  needs the full state dict; its tensors are broadcast (small ones of one
  dtype together, up to 16 MiB a collective; a bigger one alone) and each
  rank keeps its own shard.
* ``strict``: passed to ``load_state_dict``; a parameter that needs
  optimizer state and has none in the checkpoint is an error.

FSDP1 (``FullyShardedDataParallel``) models go through FSDP's own
state-dict hooks (under ``FSDP.state_dict_type``) for the model and through
:func:`_optim._fsdp1_optim_state_dict` / :func:`_optim._fsdp1_optim_state_dict_to_load`
for the optimizer. Everything else (FQN mapping, tied and frozen
parameters, gathering, offload, broadcast and resharding of full state
dicts) is done in this package.

Deliberate differences from torch 2.13, each where torch's result is an
accident of its implementation:

* the caller's ``model_state_dict`` is not modified by ``set_*`` (torch
  renames keys in it for DDP and adds entries to it for full state dicts);
* loading a full optimizer state dict into FSDP2/DDP/plain models keeps
  tuple hyperparameters (``betas``) as tuples (torch turns them into lists),
  works with ``flatten_optimizer_state_dict=True``, and every rank keeps
  every entry rank 0 broadcast;
* ``set_state_dict`` with ``broadcast_from_rank0`` loads the model on
  every rank when the other ranks pass ``{}`` (torch skips the model there
  and its broadcasts no longer pair up);
* a full model state dict is cut into each rank's shards locally, without
  a collective (torch scatters rank 0's copy; the inputs are the same full
  state dict on every rank by contract);
* a sharded value (DTensor, ShardedTensor) given for a
  ``broadcast_from_rank0`` load is a ValueError on every rank (torch fails
  on rank 0 and leaves the others waiting in a broadcast);
* the empty-model-state-dict error reads ``rank = 0.`` (torch's reads
  ``rank = dist.get_rank()=0.``).

This module holds the public API; the work is in its private modules,
each importing only those above it:

* ``_fqns``: canonical FQNs behind wrapper prefixes, the model's entries;
* ``_info``: StateDictOptions, the type aliases, what one call learns
  about the model (``_Info``), torch's checks on the state dicts, the
  registry of patched methods (``_patched_state_dict``);
* ``_shards``: gathering and offloading, a full tensor cut to a shard;
* ``_broadcast``: ``broadcast_from_rank0``'s header and tensor buckets;
* ``_model``: the model's state dict, get and set;
* ``_optim``: the optimizers' state dict, get and set.

Also torch's private ``_patch_model_state_dict`` and
``_patch_optimizer_state_dict``, which code written for torch imports from
this module: they make ``state_dict()`` / ``load_state_dict()`` of a model
and its optimizers call the functions here. Those functions reach the
model's and optimizers' own methods past such patches, torch's included.

Importing this module imports torch.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from ..._util import gc_paused
from ._fqns import _one_fqn
from ._info import (
    FQNS_T,
    DictValueType,
    ListDictValueType,
    OptimizerStateType,
    PrimitiveType,
    StateDictOptions,
    ValueType,
    _check_state_dicts,
    _make_info,
    _patched_state_dict,
)
from ._model import _get_model_state_dict, _load_model_state_dict
from ._optim import _get_optim_state_dict, _load_optim_state_dict

__all__ = [
    "FQNS_T",
    "DictValueType",
    "ListDictValueType",
    "OptimizerStateType",
    "PrimitiveType",
    "StateDictOptions",
    "ValueType",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]

# Defined in _info; shown (repr, pickle, docs) under the public path.
StateDictOptions.__module__ = __name__


def _as_tuple(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def get_model_state_dict(
    model: nn.Module,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, ValueType]:
    """The model's state dict keyed by canonical FQN (see :func:`get_state_dict`)."""
    with gc_paused(), torch.no_grad():
        info = _make_info(model, (), optim_only=False, submodules=submodules, options=options)
        model_sd = _get_model_state_dict(model, info)
        _check_state_dicts(model_sd, {}, info)
        return model_sd


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> OptimizerStateType:
    """The optimizers' combined state dict keyed by FQN (see :func:`get_state_dict`)."""
    with gc_paused(), torch.no_grad():
        optims = _as_tuple(optimizers)
        info = _make_info(model, optims, optim_only=True, submodules=submodules, options=options)
        optim_sd = _get_optim_state_dict(model, optims, info)
        _check_state_dicts({}, optim_sd, info)
        return optim_sd


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, ValueType], OptimizerStateType]:
    """The model's and the optimizers' state dicts, keyed by canonical FQN.

    ``model`` may be a plain module, DDP, FSDP2 (``fully_shard``) or FSDP1;
    sharded parameters and their optimizer state stay sharded (DTensor for
    FSDP2, ShardedTensor for FSDP1) unless ``options.full_state_dict``.
    The optimizers' state has not to exist yet: it is created first (one
    step with zero gradients and learning rate), as torch does.
    """
    with gc_paused(), torch.no_grad():
        optims = _as_tuple(optimizers)
        info = _make_info(model, optims, optim_only=False, submodules=submodules, options=options)
        model_sd = _get_model_state_dict(model, info)
        optim_sd = _get_optim_state_dict(model, optims, info)
        _check_state_dicts(model_sd, optim_sd, info)
        return model_sd, optim_sd


def _from_submodule_keys(
    model: nn.Module, state_dict: dict[Any, Any]
) -> dict[str, ValueType]:
    """The deprecated ``{submodule: its state dict}`` form -> FQN keys."""
    if not state_dict or not isinstance(next(iter(state_dict)), nn.Module):
        return cast(dict[str, ValueType], state_dict)
    warnings.warn(
        "Passing model_state_dict as a ``Dict[nn.Module, Dict[str, Any]]``"
        "is deprecated and will be removed in 2.5. If you need this "
        "feature, please preprocess the model_state_dict to achieve the "
        "same functionality.",
        FutureWarning,
        stacklevel=3,
    )
    out: dict[str, ValueType] = {}
    for submodule, sub_sd in state_dict.items():
        for name, module in model.named_modules():
            if module is submodule:
                prefix = _one_fqn(model, name) + "."
                out.update((prefix + k, v) for k, v in sub_sd.items())
    return out


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: dict[str, ValueType],
    *,
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """Load an FQN-keyed model state dict; returns ``missing_keys`` and
    ``unexpected_keys`` as ``load_state_dict`` does."""
    model_state_dict = _from_submodule_keys(model, model_state_dict)
    with gc_paused(), torch.no_grad():
        info = _make_info(model, (), optim_only=False, options=options)
        _check_state_dicts(model_state_dict, {}, info)
        return _load_model_state_dict(model, model_state_dict, info)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: OptimizerStateType,
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load an FQN-keyed optimizer state dict (nested or flattened) into
    ``optimizers``. Call it before ``backward()`` or after ``step()``."""
    with gc_paused(), torch.no_grad():
        optims = _as_tuple(optimizers)
        info = _make_info(model, optims, optim_only=True, options=options)
        _check_state_dicts({}, optim_state_dict, info)
        _load_optim_state_dict(model, optims, optim_state_dict, info)


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: dict[str, ValueType],
    optim_state_dict: OptimizerStateType,
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """Load what :func:`get_state_dict` returned (or any state dicts keyed
    by canonical FQN, sharded tensors as DTensor / ShardedTensor)."""
    model_state_dict = _from_submodule_keys(model, model_state_dict)
    with gc_paused(), torch.no_grad():
        optims = _as_tuple(optimizers)
        # With broadcast_from_rank0 the other ranks pass {} and still load the
        # model (torch 2.13 skips it there, and its broadcasts then mismatch).
        broadcast = options is not None and options.broadcast_from_rank0
        info = _make_info(
            model, optims, optim_only=not model_state_dict and not broadcast, options=options
        )
        _check_state_dicts(model_state_dict, optim_state_dict, info)
        _load_optim_state_dict(model, optims, optim_state_dict, info)
        return _load_model_state_dict(model, model_state_dict, info)


def _patch_model_state_dict(
    model: nn.Module,
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Make ``model.state_dict()`` return :func:`get_model_state_dict` and
    ``model.load_state_dict(sd)`` call :func:`set_model_state_dict` (both
    with ``options``; the latter returns None), as torch 2.13's private
    function of this name does. The replacements are registered in
    ``_patched_state_dict``, so the get/set functions still reach the
    model's own methods."""
    _state_dict_call = functools.partial(get_model_state_dict, model=model, options=options)

    def state_dict_call() -> dict[str, ValueType]:
        return _state_dict_call()

    model.state_dict = state_dict_call  # type: ignore[method-assign]

    _load_state_dict_call = functools.partial(set_model_state_dict, model=model, options=options)

    def load_state_dict_call(state_dict: dict[str, Any]) -> None:
        _load_state_dict_call(model_state_dict=state_dict)

    model.load_state_dict = load_state_dict_call  # type: ignore[method-assign]

    _patched_state_dict.add(state_dict_call)
    _patched_state_dict.add(load_state_dict_call)


def _patch_optimizer_state_dict(
    model: nn.Module,
    *,
    optimizers: tuple[torch.optim.Optimizer, ...],
    options: StateDictOptions | None = None,
) -> None:
    """Make every optimizer's ``state_dict()`` return
    :func:`get_optimizer_state_dict` of all of ``optimizers`` together and
    its ``load_state_dict(osd)`` call :func:`set_optimizer_state_dict` on
    all of them (with ``options``), as torch 2.13's private function of this
    name does; the replacements are registered in ``_patched_state_dict``."""
    _state_dict_call = functools.partial(
        get_optimizer_state_dict, model=model, optimizers=optimizers, options=options
    )

    def state_dict_call() -> OptimizerStateType:
        return _state_dict_call()

    _load_state_dict_call = functools.partial(
        set_optimizer_state_dict, model=model, optimizers=optimizers, options=options
    )

    def load_state_dict_call(state_dict: dict[str, Any]) -> None:
        _load_state_dict_call(optim_state_dict=state_dict)

    _patched_state_dict.add(state_dict_call)
    _patched_state_dict.add(load_state_dict_call)
    for optim in _as_tuple(optimizers):
        optim.state_dict = state_dict_call  # type: ignore[method-assign]
        optim.load_state_dict = load_state_dict_call  # type: ignore[method-assign]
