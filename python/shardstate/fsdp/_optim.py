"""FSDP1 optimizer state: torch 2.13's ``FullyShardedDataParallel`` static methods as functions.

Mirrors ``torch.distributed.fsdp._optim_utils`` (torch 2.13): the same keys,
``param_groups``, values and errors, but with a different data path. Here
are the public functions and their dispatch (argument checks, the state-dict
type set on the model, ``optim_input``, re-keying); the work is in

    _save      flat shards -> per-parameter state (gather, all_gather, dim-0 all-to-all)
    _load      per-parameter state -> this rank's flat shard (flatten, scatter, sharded load)
    _dim0      one unit's flat shards <-> every parameter's dim-0 chunks (plan, exchanges)
    _sharded   torch's SHARDED values (ShardedTensor / DTensor): make, recognise, agree
    _flatops   the flat layout (the C core's ``FlatLayout``) and the bulk copies

Key discovery, re-keying and ``param_groups`` use torch's own helpers, so they
equal torch's by construction.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._optim_utils import (
    _get_param_id_to_param_from_optim_input,
    _get_param_key_to_param,
    _get_param_to_param_id_from_optim_input,
    _get_param_to_param_key,
    _rekey_sharded_optim_state_dict,
)
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    _get_fqn_to_param,
    _get_param_to_fqn,
)

from . import _load, _save
from ._save import OptimInput
from .api import OptimStateKeyType, StateDictType

__all__ = [
    "optim_state_dict",
    "optim_state_dict_to_load",
    "full_optim_state_dict",
    "sharded_optim_state_dict",
    "shard_full_optim_state_dict",
    "flatten_sharded_optim_state_dict",
    "scatter_full_optim_state_dict",
    "rekey_optim_state_dict",
]


# ---------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------


def _warn_optim_input(optim_input: OptimInput, stacklevel: int) -> None:
    if optim_input is not None:
        warnings.warn(
            "The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. "
            "You may remove it from your code without changing its functionality.",
            FutureWarning,
            stacklevel=stacklevel + 1,
        )


def _use_orig_params(model: nn.Module) -> bool:
    modules = FSDP.fsdp_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} holds no FullyShardedDataParallel module: "
            "the FSDP optimizer-state functions need an FSDP1-wrapped model"
        )
    flag = modules[0]._use_orig_params
    if not all(m._use_orig_params == flag for m in modules):
        raise AssertionError("Not all FSDP modules have the same _use_orig_params value")
    return flag


def _optim_state_dict_impl(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    osd: dict[str, Any],
    optim_input: OptimInput = None,
    rank0_only: bool = True,
    full_state_dict: bool = True,
    group: dist.ProcessGroup | None = None,
    cpu_offload: bool = True,
) -> dict[str, Any]:
    if full_state_dict:
        _warn_optim_input(optim_input, stacklevel=3)
        using_optim_input = optim_input is not None or optim is None
    else:
        using_optim_input = False
        if optim_input is not None or rank0_only:
            raise AssertionError(
                "Expected optim_input to be None and rank0_only to be False, "
                f"got optim_input={optim_input}, rank0_only={rank0_only}"
            )
    return _save.optim_state_dict(
        model,
        optim,
        osd,
        optim_input,
        rank0_only,
        not full_state_dict,
        group,
        using_optim_input,
        _use_orig_params(model),
        cpu_offload,
    )


def _optim_state_dict_to_load_impl(
    osd: dict[str, Any],
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
    full_state_dict: bool = True,
    rank0_only: bool = False,
    is_named_optimizer: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    if full_state_dict:
        _warn_optim_input(optim_input, stacklevel=3)
        using_optim_input = optim_input is not None or optim is None
    else:
        using_optim_input = False
        if optim_input is not None or rank0_only:
            raise AssertionError(
                "Expected optim_input to be None and rank0_only to be False, "
                f"got optim_input={optim_input}, rank0_only={rank0_only}"
            )
    use_orig_params = _use_orig_params(model)
    if rank0_only and dist.get_rank(group) > 0:
        osd = {}
    with torch.no_grad():
        sharded = _load.flatten_optim_state_dict(
            osd,
            model,
            use_orig_params,
            optim if is_named_optimizer else None,
            rank0_only,
            group,
            sharded_input=not full_state_dict,
        )
    return _rekey_sharded_optim_state_dict(
        sharded,
        model,
        cast(torch.optim.Optimizer, optim),
        optim_input,
        using_optim_input,
        is_named_optimizer,
    )


# ---------------------------------------------------------------------------
# The public functions (torch 2.13's FSDP static methods)
# ---------------------------------------------------------------------------


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``FSDP.optim_state_dict``: the optimizer state keyed by parameter name.

    Full (gathered) or sharded per the state-dict type set on ``model`` with
    ``FSDP.set_state_dict_type`` (``rank0_only`` and ``offload_to_cpu`` from
    its optimizer config). Collective: call on every rank.
    """
    settings = FSDP.get_state_dict_type(model)
    if optim_state_dict is None:
        optim_state_dict = optim.state_dict()
    return _optim_state_dict_impl(
        model,
        optim,
        optim_state_dict,
        None,
        rank0_only=getattr(settings.optim_state_dict_config, "rank0_only", False),
        full_state_dict=settings.state_dict_type == StateDictType.FULL_STATE_DICT,
        group=group,
        cpu_offload=getattr(settings.optim_state_dict_config, "offload_to_cpu", True),
    )


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``FSDP.optim_state_dict_to_load``: a name-keyed state -> ``optim.load_state_dict``'s input.

    Reads full or sharded input per the state-dict type set on ``model``;
    with ``rank0_only`` only rank 0 needs the state (the others may pass
    anything). Collective: call on every rank.
    """
    settings = FSDP.get_state_dict_type(model)
    result = _optim_state_dict_to_load_impl(
        optim_state_dict,
        model,
        None,
        optim,
        full_state_dict=settings.state_dict_type == StateDictType.FULL_STATE_DICT,
        rank0_only=getattr(settings.optim_state_dict_config, "rank0_only", False),
        is_named_optimizer=is_named_optimizer,
        group=group,
    )
    if load_directly:
        optim.load_state_dict(result)
    return result


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: OptimInput = None,
    rank0_only: bool = True,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``FSDP.full_optim_state_dict``: the full state; by default on rank 0 only (others: {})."""
    return _optim_state_dict_impl(
        model,
        optim,
        optim.state_dict(),
        optim_input,
        rank0_only=rank0_only,
        full_state_dict=True,
        group=group,
    )


def sharded_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``FSDP.sharded_optim_state_dict``: per-parameter state as dim-0 ShardedTensors."""
    return _optim_state_dict_impl(
        model,
        optim,
        optim.state_dict(),
        None,
        rank0_only=False,
        full_state_dict=False,
        group=group,
    )


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """``FSDP.shard_full_optim_state_dict``: a full state on every rank -> our flat state."""
    return _optim_state_dict_to_load_impl(
        full_optim_state_dict,
        model,
        optim_input,
        optim,
        full_state_dict=True,
        is_named_optimizer=False,
    )


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim: torch.optim.Optimizer,
) -> dict[str, Any]:
    """``FSDP.flatten_sharded_optim_state_dict``: a sharded state -> this rank's flat state."""
    return _optim_state_dict_to_load_impl(
        sharded_optim_state_dict,
        model,
        None,
        optim,
        full_state_dict=False,
        is_named_optimizer=False,
    )


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
    group: Any | None = None,
) -> dict[str, Any]:
    """``FSDP.scatter_full_optim_state_dict``: rank 0's full state -> every rank's flat state."""
    return _optim_state_dict_to_load_impl(
        cast(dict[str, Any], full_optim_state_dict),
        model,
        optim_input,
        optim,
        full_state_dict=True,
        rank0_only=True,
        is_named_optimizer=False,
        group=group,
    )


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: OptimStateKeyType,
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """``FSDP.rekey_optim_state_dict``: parameter ids <-> parameter names (no communication)."""
    _warn_optim_input(optim_input, stacklevel=2)
    using_optim_input = optim_input is not None or optim is None
    if optim_state_key_type not in (OptimStateKeyType.PARAM_NAME, OptimStateKeyType.PARAM_ID):
        raise AssertionError(
            "Expected optim_state_key_type to be PARAM_NAME or PARAM_ID, got "
            f"{optim_state_key_type}"
        )
    osd = optim_state_dict
    by_name = [type(k) is str for k in osd["state"]]
    by_id = [type(k) is int for k in osd["state"]]
    if (any(by_name) and not all(by_name)) or (any(by_id) and not all(by_id)):
        raise ValueError(f"Invalid parameter keys: {osd['state'].keys()}")
    if (optim_state_key_type == OptimStateKeyType.PARAM_NAME and all(by_name)) or (
        optim_state_key_type == OptimStateKeyType.PARAM_ID and all(by_id)
    ):
        return osd
    new: dict[str, Any] = {}
    if optim_state_key_type == OptimStateKeyType.PARAM_NAME:
        id_to_param = (
            _get_param_id_to_param_from_optim_input(model, optim_input)
            if using_optim_input
            else _get_param_key_to_param(cast(torch.optim.Optimizer, optim))
        )
        param_to_name = _get_param_to_fqn(model)
        id_to_name = [param_to_name[p] for p in id_to_param.values()]
        new["state"] = {id_to_name[k]: v for k, v in osd["state"].items()}
        new["param_groups"] = copy.deepcopy(osd["param_groups"])
        for g in new["param_groups"]:
            g["params"] = sorted(id_to_name[k] for k in g["params"])
        return new
    name_to_param = _get_fqn_to_param(model)
    param_to_id = (
        _get_param_to_param_id_from_optim_input(model, optim_input)
        if using_optim_input
        else _get_param_to_param_key(cast(torch.optim.Optimizer, optim))
    )
    name_to_id = {n: param_to_id[p] for n, p in name_to_param.items() if p in param_to_id}
    new["state"] = {name_to_id[k]: v for k, v in osd["state"].items()}
    new["param_groups"] = copy.deepcopy(osd["param_groups"])
    for g in new["param_groups"]:
        g["params"] = sorted(name_to_id[k] for k in g["params"])
    return new
