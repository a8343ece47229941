"""What a get/set call is asked (StateDictOptions) and what it learns about
the model (_Info: FQNs, tied parameters, FSDP1 units), the type aliases of
torch 2.13's module, torch's sanity checks on the state dicts, and the way
past a ``state_dict`` / ``load_state_dict`` that ``_patch_*`` replaced."""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from torch.distributed.fsdp import (
    FullyShardedDataParallel as FSDP,
)
from torch.distributed.tensor import DTensor

from ._fqns import _FLAT_PARAM, _ExtraState, _get_fqns, _model_entries, _one_fqn

FQNS_T = set[str]
PrimitiveType = DTensor | ShardedTensor | torch.Tensor | int | float | str
ValueType = (
    PrimitiveType | list[PrimitiveType] | tuple[PrimitiveType] | dict[str, "ValueType"]
)
DictValueType = dict[str, ValueType]
ListDictValueType = list[DictValueType]
OptimizerStateType = dict[str, DictValueType | ListDictValueType]

# The callables _patch_model_state_dict / _patch_optimizer_state_dict put in
# place of a model's or an optimizer's state_dict and load_state_dict (as
# torch 2.13 keeps them): the get/set functions call past them.
_patched_state_dict: set[Callable[..., Any]] = set()

_TORCH_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def _state_dict_fn(obj: nn.Module | torch.optim.Optimizer, api: str) -> Callable[..., Any]:
    """``obj``'s own ``state_dict`` / ``load_state_dict`` (``api``): the
    class's method where a patch replaced it (call it with keywords, as
    torch does: ``self`` is bound by keyword). torch's own patches count
    too (if torch's module is loaded, it may have made some): a get here
    is then what it was asked, not what torch's patch was set up to give."""
    call = getattr(obj, api)
    torch_sd = sys.modules.get(_TORCH_STATE_DICT)
    if call in _patched_state_dict or call in getattr(torch_sd, "_patched_state_dict", ()):
        call = functools.partial(getattr(obj.__class__, api), self=obj)
    return call


@dataclass
class StateDictOptions:
    """How the get_* / set_* functions work (torch 2.13's fields and defaults).

    - ``full_state_dict``: gather every DTensor / ShardedTensor into a full
      tensor (on save), or take full tensors and shard them (on load).
    - ``cpu_offload``: move tensors to the CPU; with ``full_state_dict``,
      only rank 0 gets the state dict and the other ranks get ``{}``.
    - ``ignore_frozen_params``: leave out parameters with ``requires_grad=False``.
    - ``keep_submodule_prefixes`` (deprecated with ``submodules``): keep the
      submodule's prefix in the keys.
    - ``strict``: the ``strict`` of ``model.load_state_dict``; also makes
      missing optimizer state for a trainable parameter an error.
    - ``broadcast_from_rank0``: on load, only rank 0 holds the (full) state
      dict; its tensors are broadcast and every rank keeps its shard.
      Needs ``full_state_dict``.
    - ``flatten_optimizer_state_dict``: one-level optimizer state dict.
    - ``dsd_fqn_modifiers``: name of the module method that returns
      ``{attribute: child}`` renamings hidden from the state-dict keys.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"


@dataclass
class _Info(StateDictOptions):
    """The options plus what one call learnt about the model."""

    # parameter -> its FQNs (several when tied), in model order
    param_fqns: dict[torch.Tensor, list[str]] = field(default_factory=dict)
    # FQNs of parameters reachable under more than one name
    shared_fqns: set[str] = field(default_factory=set)
    submodule_prefixes: set[str] = field(default_factory=set)
    handle_model: bool = True
    handle_optim: bool = True
    fsdp_modules: list[nn.Module] = field(default_factory=list)
    fsdp_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


def _fsdp1_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, FSDP)]


def _fsdp1_context(model: nn.Module, options: StateDictOptions) -> Callable[[], Any]:
    """A context that sets the FSDP1 state-dict type the options ask for."""
    if options.full_state_dict:
        sd_type = StateDictType.FULL_STATE_DICT
        sd_config: Any = FullStateDictConfig(
            offload_to_cpu=options.cpu_offload, rank0_only=options.cpu_offload
        )
        osd_config: Any = FullOptimStateDictConfig(
            offload_to_cpu=options.cpu_offload,
            rank0_only=options.cpu_offload or options.broadcast_from_rank0,
        )
    else:
        sd_type = StateDictType.SHARDED_STATE_DICT
        sd_config = ShardedStateDictConfig(offload_to_cpu=options.cpu_offload)
        osd_config = ShardedOptimStateDictConfig(offload_to_cpu=options.cpu_offload)

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="FSDP.state_dict_type", category=FutureWarning
            )
            with FSDP.state_dict_type(model, sd_type, sd_config, osd_config):
                yield

    return context


def _make_info(
    model: nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    optim_only: bool,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> _Info:
    if submodules:
        warnings.warn(
            "Getting submodules only model/optim state_dict is deprecated and "
            "will be removed in 2.5. This feature can be achieved by manually "
            "filtering out the state_dict returned from get_state_dict.",
            FutureWarning,
            stacklevel=3,
        )
    if optim_only and not optims:
        raise RuntimeError("Optimizers are not passed in but optim_only is set to True.")
    options = options or StateDictOptions()
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("full_state_dict must be True when broadcast_from_rank0 is True.")

    param_fqns: dict[torch.Tensor, list[str]] = {}
    shared: set[str] = set()
    for name, value in _model_entries(model):
        if isinstance(value, _ExtraState):
            continue
        known = param_fqns.setdefault(value, [])
        for fqn in _get_fqns(model, name):
            if fqn not in known:
                known.append(fqn)
        if len(known) > 1:
            shared.update(known)

    prefixes: set[str] = set()
    if submodules:
        wanted = set(submodules)
        for name, module in model.named_modules():
            if module in wanted:
                prefixes.add(_one_fqn(model, name) + ".")

    fsdp_modules = _fsdp1_modules(model)
    return _Info(
        **asdict(options),
        param_fqns=param_fqns,
        shared_fqns=shared,
        submodule_prefixes=prefixes,
        handle_model=not optim_only,
        handle_optim=len(optims) > 0,
        fsdp_modules=fsdp_modules,
        fsdp_context=_fsdp1_context(model, options) if fsdp_modules else contextlib.nullcontext,
    )


def _check_state_dicts(model_sd: dict[str, Any], optim_sd: Any, info: _Info) -> None:
    """torch's sanity checks on what is saved or loaded."""
    full_on_rank0 = info.cpu_offload and info.full_state_dict
    if (
        info.handle_model
        and not model_sd
        and not info.submodule_prefixes
        and not info.ignore_frozen_params
        and not full_on_rank0
        and info.strict
        and not info.broadcast_from_rank0
    ):
        raise RuntimeError(
            "The option indicates that model state_dict is required to save "
            "or load, but model state_dict is empty."
            f"rank = {dist.get_rank() if dist.is_initialized() else 0}."
        )
    if info.handle_optim and not optim_sd and not full_on_rank0 and not info.broadcast_from_rank0:
        raise RuntimeError(
            "The option indicates that model state_dict is required to save, "
            f"or load but optim state_dict is empty. {optim_sd}"
        )
    for key in model_sd:
        if _FLAT_PARAM in key:
            raise RuntimeError(
                f"{key} contains {_FLAT_PARAM}. This can happen if the model "
                "is not the root module."
            )
