"""The model's state dict: get (FQN keys, submodules, frozen parameters,
gathered or offloaded) and set (FQN keys back to the model's own, full
state dicts cut to each rank's shards or broadcast from rank 0)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from ._broadcast import _broadcast_from_rank0
from ._fqns import _ExtraState, _get_fqns, _model_entries, _one_fqn, _only_wrapper_names_dropped
from ._info import ValueType, _Info, _state_dict_fn
from ._shards import _full_or_offloaded, _shard_like

# ------------------------------------------------------------------ model get


def _get_model_state_dict(model: nn.Module, info: _Info) -> dict[str, ValueType]:
    if not info.handle_model:
        return {}
    with info.fsdp_context():
        state = _state_dict_fn(model, "state_dict")()
    renamed = []
    for key, value in state.items():
        fqn = _one_fqn(model, key)
        if fqn != key and not _only_wrapper_names_dropped(key, fqn):
            raise RuntimeError(f"An unexpected key, {key}, exists. FQN is {fqn}")
        renamed.append((fqn, value))
    if any(fqn != key for (fqn, _), key in zip(renamed, state)):
        # Renamed in place and in order: the dict keeps its type and _metadata.
        state.clear()
        state.update(renamed)

    if info.submodule_prefixes:
        picked: dict[str, Any] = {}
        for fqn, value in state.items():
            for prefix in info.submodule_prefixes:
                if fqn.startswith(prefix):
                    picked[fqn if info.keep_submodule_prefixes else fqn[len(prefix):]] = value
        state = picked

    if info.ignore_frozen_params:
        for name, param in model.named_parameters():
            if not param.requires_grad:
                for fqn in _get_fqns(model, name):
                    state.pop(fqn, None)
    return _full_or_offloaded(state, info)


# ----------------------------------------------------------------- model set


def _distribute_full(full: dict[str, Any], local: dict[str, Any], device: torch.device) -> None:
    """Every rank holds ``full``: put each rank's part of it in ``local``."""
    for key, value in full.items():
        if not torch.is_tensor(value):
            local[key] = value
        elif value.dim() == 0:
            local[key] = value.cpu()
        elif (mine := local.get(key)) is not None:
            if isinstance(mine, DTensor):
                local[key] = _shard_like(mine, value.detach().to(device), in_place=False)
            else:
                local[key] = value.detach().to(device)


def _one_device(tensors: Iterable[Any]) -> tuple[torch.device, bool]:
    """The device the model's (non-scalar) tensors live on, and whether some
    are on the meta device (then they are replaced, not copied into)."""
    devices = {t.device for t in tensors if torch.is_tensor(t) and t.dim() > 0}
    meta = torch.device("meta")
    has_meta = meta in devices
    devices.discard(meta)
    if len(devices) > 1:
        raise ValueError("Multiple devices found")
    if not devices:
        return _group_device(), has_meta
    return devices.pop(), has_meta


def _group_device() -> torch.device:
    """Where the default group's collectives run: the current CUDA device for
    NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _load_model_state_dict(
    model: nn.Module, state_dict: dict[str, ValueType], info: _Info
) -> _IncompatibleKeys:
    if not info.handle_model or (not state_dict and not info.broadcast_from_rank0):
        return _IncompatibleKeys([], [])
    state: dict[str, Any] = dict(state_dict)  # the caller's dict stays as it is
    renames_here = not info.broadcast_from_rank0 or dist.get_rank() == 0
    local: dict[str, Any] = {}
    for name, value in _model_entries(model, info.dsd_fqn_modifiers):
        fqns = _get_fqns(model, name, info.dsd_fqn_modifiers)
        with_prefix = _get_fqns(
            model, name, info.dsd_fqn_modifiers, skip_ddp_prefix=False,
            skip_compiler_prefix=False,
        )
        for fqn, key in zip(fqns, with_prefix):
            if renames_here and fqn != key:
                loaded = state.pop(fqn, None)
                if loaded is None:
                    if info.strict:
                        raise RuntimeError(f"Missing key: {fqn}.")
                else:
                    state[key] = loaded
            local[key] = value

    assign = False
    if info.broadcast_from_rank0 or info.full_state_dict:
        device, assign = _one_device(local.values())
        if info.broadcast_from_rank0:
            _broadcast_from_rank0(
                state, local, device, strict=info.strict, cpu_offload=info.cpu_offload
            )
        else:
            _distribute_full(state, local, device)
        state.update((k, v) for k, v in local.items() if not isinstance(v, _ExtraState))
    with info.fsdp_context():
        return cast(
            _IncompatibleKeys,
            _state_dict_fn(model, "load_state_dict")(
                state_dict=state, strict=info.strict, assign=assign
            ),
        )
