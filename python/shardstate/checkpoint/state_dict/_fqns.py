"""Canonical FQNs: the names ``named_parameters()`` gives on the undistributed
model, behind the keys DDP (``module.``), torch.compile (``_orig_mod.``),
FSDP1 (``_fsdp_wrapped_module.``, FlatParameters) and checkpoint wrappers
add, and every entry ``model.state_dict()`` holds."""

from __future__ import annotations

from collections.abc import Generator
from itertools import chain
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX
from torch.nn.parallel import DistributedDataParallel as DDP

_STATE = "state"
_PG = "param_groups"
_PARAMS = "params"
_FLAT_PARAM = "_flat_param"
_FSDP_WRAPPED = "_fsdp_wrapped_module"
_COMPILED = "_orig_mod"


class _ExtraState:
    """Stands for a module's ``_extra_state`` entry while loading."""


def _get_fqns(
    model: nn.Module,
    name: str,
    dsd_fqn_modifiers: str = "_fqn_modifiers",
    skip_ddp_prefix: bool = True,
    skip_compiler_prefix: bool = True,
) -> list[str]:
    """The canonical FQNs behind ``name`` (a key of ``model``'s state dict or
    ``named_parameters``): several for an FSDP1 FlatParameter, else one."""
    name = name.replace(_CHECKPOINT_PREFIX, "")
    if "." not in name:
        return [name]
    parts = name.split(".")
    kept: list[str] = []
    obj: Any = model
    for i, part in enumerate(parts):
        if isinstance(obj, DDP):
            if part != "module":
                raise AssertionError(f"Expected 'module', got '{part}'")
            obj = obj.module
            if not skip_ddp_prefix:
                kept.append(part)
        elif isinstance(obj, FSDP):
            if i + 1 < len(parts) and parts[i + 1] == _FLAT_PARAM:
                prefix = "".join(f"{p}." for p in kept)
                return [prefix + fqn for fqn in getattr(obj, _FLAT_PARAM)._fqns]
            obj = getattr(obj, _FSDP_WRAPPED)
            if part != _FSDP_WRAPPED:
                kept.append(part)
                obj = getattr(obj, part)
        elif isinstance(obj, torch._dynamo.eval_frame.OptimizedModule):
            if part != _COMPILED:
                raise AssertionError(f"Expected '{_COMPILED}', got '{part}'")
            obj = obj._orig_mod
            if not skip_compiler_prefix:
                kept.append(part)
        else:
            modifiers = getattr(obj, dsd_fqn_modifiers, None)
            if modifiers is not None:
                hidden = modifiers().get(part)
                if hidden and hasattr(obj, hidden):
                    obj = getattr(obj, hidden)
            kept.append(part)
            if part == _EXTRA_STATE_KEY_SUFFIX:
                if i != len(parts) - 1:
                    raise RuntimeError("Expect `_extra_state` to be the last obj name")
            else:
                obj = getattr(obj, part)
    return [".".join(kept).replace(_CHECKPOINT_PREFIX, "")]


def _one_fqn(model: nn.Module, name: str, **kwargs: Any) -> str:
    fqns = _get_fqns(model, name, **kwargs)
    if len(fqns) != 1:
        raise AssertionError(f"Expected 1 FQN for key '{name}', got {len(fqns)}: {fqns}")
    return fqns[0]


def _model_entries(
    model: nn.Module, dsd_fqn_modifiers: str = "_fqn_modifiers"
) -> Generator[tuple[str, Any], None, None]:
    """(name, value) of everything ``model.state_dict()`` holds: persistent
    buffers, parameters (tied ones under each name) and extra states."""
    seen: set[nn.Module] = set()

    def walk(module: nn.Module, prefix: str) -> Generator[tuple[str, Any], None, None]:
        seen.add(module)
        dot = f"{prefix}." if prefix else ""
        modifiers = getattr(module, dsd_fqn_modifiers, None)
        hidden = set(modifiers().values()) if modifiers is not None else set()
        for child_name, child in module.named_children():
            if child in seen:
                continue
            # A hidden child's entries appear directly under this module.
            yield from walk(child, prefix if child_name in hidden else dot + child_name)
        for entry_name, value in chain(
            module.named_buffers(recurse=False), module.named_parameters(recurse=False)
        ):
            if entry_name not in module._non_persistent_buffers_set:
                yield dot + entry_name, value
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            yield dot + _EXTRA_STATE_KEY_SUFFIX, _ExtraState()

    yield from walk(model, "")


def _only_wrapper_names_dropped(key: str, fqn: str) -> bool:
    """``fqn`` is ``key`` without some ``module`` / ``_orig_mod`` parts (the
    names DDP and torch.compile add), nothing else."""
    if len(fqn) >= len(key):
        return False
    want = fqn.split(".")
    i = 0
    for j, part in enumerate(key.split(".")):
        if i < len(want) and part == want[i]:
            i += 1
            if i == len(want):
                return j == len(key.split(".")) - 1
        elif part not in ("module", _COMPILED):
            return False
    return True
