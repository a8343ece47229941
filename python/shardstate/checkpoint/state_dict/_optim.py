"""The optimizers' state dict: get (keyed by FQN, FSDP1 through
shardstate.fsdp, optionally flattened) and set (split among several
optimizers, unflattened, a full state dict cut to this rank's part or
broadcast from rank 0)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.tensor import DTensor

from ._broadcast import _broadcast_tensors, _full_for_broadcast, _header_from_rank0, _TensorInfo
from ._fqns import _COMPILED, _PARAMS, _PG, _STATE, _get_fqns, _one_fqn
from ._info import (
    DictValueType,
    ListDictValueType,
    OptimizerStateType,
    ValueType,
    _Info,
    _state_dict_fn,
)
from ._shards import _full_or_offloaded, _map_state, _shard_like

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


# -------------------------------------------------------------- optimizer get


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Give every trainable parameter its optimizer state (a step with zero
    gradients and a zero learning rate), unless there is state or a gradient."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g[_PARAMS]]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = []
    for group in optim.param_groups:
        if "lr" in group:
            lrs.append(group["lr"])
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    optim.step(closure=None)
    for group in optim.param_groups:
        if "lr" in group:
            group["lr"] = lrs.pop(0)
    optim.zero_grad(set_to_none=True)


def _fsdp1_group(model: nn.Module, info: _Info) -> dist.ProcessGroup | None:
    unit = model if isinstance(model, FSDP) else info.fsdp_modules[0]
    unit = cast(FSDP, unit)
    if unit.sharding_strategy in _HYBRID or isinstance(unit.process_group, tuple):
        return None
    return unit.process_group


def _fsdp1_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """FSDP1: the optimizer's own state dict -> FQN-keyed (sharded or full,
    as the state-dict type set on ``model`` says).

    The one place the FSDP1 optimizer-state conversion comes from:
    ``shardstate.fsdp.optim_state_dict`` (torch's FSDP.optim_state_dict's
    signature and results, one collective per unit and state name).
    """
    from shardstate import fsdp

    return fsdp.optim_state_dict(model, optim, optim_state_dict, group=group)


def _fsdp1_optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """FSDP1: an FQN-keyed optimizer state dict -> what ``optim.load_state_dict``
    takes on this rank.

    ``shardstate.fsdp.optim_state_dict_to_load`` (torch's signature and results).
    """
    from shardstate import fsdp

    return fsdp.optim_state_dict_to_load(model, optim, optim_state_dict, group=group)


def _rekey_by_fqn(
    model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any]
) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter index -> keyed by FQN
    (each parameter by its first name in ``model.named_parameters()``)."""
    params = chain.from_iterable(g[_PARAMS] for g in optim.param_groups)
    index = {p: i for i, p in enumerate(params)}
    fqn_of: dict[int, str] = {}
    for name, param in model.named_parameters():
        if param in index:
            fqn_of[index[param]] = _one_fqn(model, name)

    def fqn(pid: int) -> str:
        if pid not in fqn_of:
            raise KeyError(
                f"optimizer parameter {pid} is not a parameter of the model "
                f"(model.named_parameters() does not yield it)"
            )
        return fqn_of[pid]

    osd[_STATE] = {fqn(pid): value for pid, value in osd[_STATE].items()}
    for group in osd[_PG]:
        group[_PARAMS] = [fqn(pid) for pid in group[_PARAMS]]
    return osd


def _flatten_optim_state_dict(osd: OptimizerStateType) -> dict[str, ValueType]:
    """``{"state": {fqn: {name: v}}, "param_groups": [...]}`` ->
    ``{"state.<fqn>.<name>": v, "param_groups.<fqn>.<hyper>": v}`` (nested
    state dicts flattened further with dots)."""
    flat: dict[str, ValueType] = {}

    def put(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{prefix}.{k}", v)
            return
        if not isinstance(value, (torch.Tensor, int, float)):
            raise NotImplementedError(
                "Flattening optimizer state_dict only supports "
                "tensor, int, float, dict states now. "
                f"Type is {type(value)}."
            )
        flat[prefix] = value

    for fqn, state in cast(DictValueType, osd[_STATE]).items():
        for name, value in cast(dict[str, Any], state).items():
            put(f"{_STATE}.{fqn}.{name}", value)
    for group in cast(ListDictValueType, osd[_PG]):
        for fqn in cast(list[str], group[_PARAMS]):
            for k, v in group.items():
                if k != _PARAMS:
                    flat[f"{_PG}.{fqn}.{k}"] = v
    return flat


def _get_optim_state_dict(
    model: nn.Module, optims: tuple[torch.optim.Optimizer, ...], info: _Info
) -> OptimizerStateType:
    if not info.handle_optim:
        return {}
    merged: OptimizerStateType = {_STATE: {}, _PG: []}
    for optim in optims:
        _init_optim_state(optim)
        osd = _state_dict_fn(optim, "state_dict")()
        if info.fsdp_modules:
            with info.fsdp_context():
                osd = _fsdp1_optim_state_dict(model, optim, osd, group=_fsdp1_group(model, info))
            if not osd:  # rank0_only, on another rank
                continue
            # FSDP1 keeps torch.compile's name in its FQNs.
            osd[_STATE] = {k.replace(f"{_COMPILED}.", ""): v for k, v in osd[_STATE].items()}
            for group in osd[_PG]:
                group[_PARAMS] = [k.replace(f"{_COMPILED}.", "") for k in group[_PARAMS]]
        else:
            osd = _rekey_by_fqn(model, optim, osd)
        cast(DictValueType, merged[_STATE]).update(osd[_STATE])
        cast(ListDictValueType, merged[_PG]).extend(osd[_PG])
    if info.flatten_optimizer_state_dict:
        merged = cast(OptimizerStateType, _flatten_optim_state_dict(merged))
    return _full_or_offloaded(merged, info)


# -------------------------------------------------------------- optimizer set


def _names_in_checkpoint(fqns: list[str], info: _Info, present: Callable[[str], bool]) -> list[str]:
    # A tied parameter is saved under one of its names only: keep that one.
    return [f for f in fqns if f not in info.shared_fqns or present(f)]


def _split_optim_state_dict(
    optim: torch.optim.Optimizer, osd: OptimizerStateType, info: _Info
) -> OptimizerStateType:
    """The part of a (possibly several-optimizer) FQN-keyed state dict that
    belongs to ``optim``, with its param groups in ``optim``'s order."""
    saved_state = cast(DictValueType, osd[_STATE])
    if all(isinstance(k, int) for k in saved_state):
        return osd
    saved_groups = cast(ListDictValueType, osd[_PG])
    state: DictValueType = {}
    groups: ListDictValueType = []
    group_of: dict[int, int] = {}  # id(saved group) -> index in groups

    def saved_group_of(fqn: str) -> list[DictValueType]:
        return [g for g in saved_groups if fqn in cast(list[str], g[_PARAMS])]

    for group in optim.param_groups:
        groups.append({_PARAMS: []})
        for param in group[_PARAMS]:
            for fqn in _names_in_checkpoint(
                info.param_fqns[param], info, lambda f: bool(saved_group_of(f))
            ):
                cast(list[str], groups[-1][_PARAMS]).append(fqn)
                if param.requires_grad:
                    if fqn in saved_state:
                        state[fqn] = saved_state[fqn]
                    elif info.strict:
                        raise RuntimeError(
                            f"Missing optimizer state for parameter '{fqn}' in checkpoint. "
                            "The parameter requires gradients but has no saved optimizer "
                            "state. To load anyway, use StateDictOptions(strict=False)."
                        )
                for saved in saved_group_of(fqn):
                    group_of[id(saved)] = len(groups) - 1
        if not group[_PARAMS]:
            empty = [g for g in saved_groups if not g[_PARAMS]]
            if len(empty) != 1:
                raise ValueError(
                    "There are param groups that have zero parameters. "
                    "In such a case, DSD only support exactly one param group "
                    "with zero parameters."
                    "But the loaded state_dict has zero or more than one param groups "
                    "that have zero parameters."
                )
            if len(saved_groups) != len(optim.param_groups):
                raise ValueError(
                    "When there is a parameter group that has zero parameters, "
                    "multiple optimizers are not supported."
                )
            group_of[id(empty[0])] = len(groups) - 1
    for saved in saved_groups:
        at = group_of.get(id(saved))
        if at is not None:
            groups[at].update((k, v) for k, v in saved.items() if k != _PARAMS)
    return {_STATE: state, _PG: groups}


def _unflatten_optim_state_dict(
    optim: torch.optim.Optimizer, flat: dict[str, ValueType], info: _Info
) -> OptimizerStateType:
    """Inverse of :func:`_flatten_optim_state_dict` for ``optim``."""

    def nested(prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in flat.items():
            if not key.startswith(prefix + "."):
                continue
            *path, last = key[len(prefix) + 1:].split(".")
            node = out
            for part in path:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise AssertionError(f"{key}: '{part}' is both a value and a prefix")
            node[last] = value
        return out

    state: DictValueType = {}
    groups: ListDictValueType = []
    for group in optim.param_groups:
        hyper = [k for k in group if k != _PARAMS]
        groups.append({_PARAMS: []})
        params = cast(list[str], groups[-1][_PARAMS])
        for param in group[_PARAMS]:
            present = (lambda f: f"{_PG}.{f}.{hyper[0]}" in flat) if hyper else (lambda f: False)
            for fqn in _names_in_checkpoint(info.param_fqns[param], info, present):
                params.append(fqn)
                if not param.requires_grad:
                    continue
                entry: dict[str, Any] = {}
                for name in optim.state[param]:
                    key = f"{_STATE}.{fqn}.{name}"
                    entry[name] = flat[key] if key in flat else nested(key)
                state[fqn] = entry
        if not params:
            raise ValueError(
                "A param group without parameters cannot be loaded from a flattened "
                "optimizer state_dict (its hyperparameters are keyed by parameter FQN)."
            )
        for k in hyper:
            key = f"{_PG}.{params[0]}.{k}"
            if key not in flat:
                raise KeyError(f"flattened optimizer state_dict has no '{key}'")
            value = flat[key]
            if k in groups[-1] and groups[-1][k] != value:
                raise RuntimeError(
                    "All the parameters in the same parameter group should have "
                    f"the same saved param_group value. But {params[0]}.{k} "
                    f"is {value} while other(s) is {groups[-1][k]}."
                )
            groups[-1][k] = value
    return {_STATE: state, _PG: groups}


def _full_optim_to_local(
    model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any], info: _Info
) -> dict[str, Any]:
    """A full FQN-keyed optimizer state dict (on every rank, or on rank 0
    only with ``broadcast_from_rank0``) -> this rank's part, shaped like
    ``optim``'s current state: DTensor state gets its shard, the rest the
    full value; entries the full state lacks keep their current value."""
    local = _rekey_by_fqn(model, optim, _state_dict_fn(optim, "state_dict")())
    if info.cpu_offload:
        local = _map_state(local, lambda t: t.to(torch.device("cpu")))
    devices = {t.device for t in _tensors(local) if t.dim() > 0}
    if len(devices) > 1:
        raise ValueError("Device mismatch")
    if not devices:
        raise AssertionError("Expected device to be set")
    device = devices.pop()

    if info.broadcast_from_rank0:
        rank = dist.get_rank()

        def header_of(path: tuple[Any, ...], t: torch.Tensor) -> Any:
            if t.dim() == 0:
                return t.cpu()
            _full_for_broadcast(t, ".".join(map(str, path)))
            return _TensorInfo(t.size(), t.dtype)

        header = _header_from_rank0(lambda: _map_with_path(osd, (), header_of))
        paths: list[tuple[Any, ...]] = []
        infos: list[_TensorInfo] = []

        def collect(path: tuple[Any, ...], leaf: Any) -> Any:
            if isinstance(leaf, _TensorInfo):
                paths.append(path)
                infos.append(leaf)
            return leaf

        _map_with_path(header, (), collect)
        arrived: dict[tuple[Any, ...], torch.Tensor] = {}

        def deliver(i: int, buf: torch.Tensor) -> None:
            arrived[paths[i]] = _to_local_part(_at(local, paths[i]), buf)

        sources = _tensors(osd, dims=True) if rank == 0 else None
        _broadcast_tensors(infos, sources, device, deliver)

        def receive(path: tuple[Any, ...], leaf: Any) -> torch.Tensor:
            # scalars came in the header; the rest in the buckets
            return arrived[path] if isinstance(leaf, _TensorInfo) else leaf

        full_here = _map_with_path(header, (), receive)
    else:

        def take(path: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 0:
                return t.cpu()
            return _to_local_part(_at(local, path), t.detach().to(device))

        full_here = _map_with_path(osd, (), take)
    merged = _merge(local, full_here)
    for group in merged[_PG]:
        group.setdefault(_PARAMS, [])
    return merged


def _tensors(obj: Any, dims: bool = False) -> Iterator[torch.Tensor]:
    """Tensors in ``obj`` in traversal order (``dims``: only non-scalar ones)."""
    if isinstance(obj, torch.Tensor):
        if not dims or obj.dim() > 0:
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, dims)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, dims)


def _map_with_path(obj: Any, path: tuple[Any, ...], fn: Callable[..., Any]) -> Any:
    """Like :func:`_map_state`, over tensors and _TensorInfo headers, passing
    each leaf's path."""
    if isinstance(obj, (torch.Tensor, _TensorInfo)):
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: _map_with_path(v, path + (k,), fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_with_path(v, path + (i,), fn) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_map_with_path(v, path + (i,), fn) for i, v in enumerate(obj))
    return obj


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, (list, tuple)) and isinstance(part, int) and part < len(obj):
            obj = obj[part]
        else:
            return None
    return obj


def _to_local_part(mine: Any, full: torch.Tensor) -> torch.Tensor:
    if isinstance(mine, DTensor):
        return _shard_like(mine, full, in_place=False)
    return full


def _merge(local: Any, loaded: Any) -> Any:
    """``loaded`` over ``local``: dicts by key, lists by index, else ``loaded``."""
    if isinstance(local, dict) and isinstance(loaded, dict):
        out = dict(local)
        for k, v in loaded.items():
            out[k] = _merge(local[k], v) if k in local else v
        return out
    if isinstance(local, list) and isinstance(loaded, list):
        return [
            _merge(local[i], v) if i < len(local) else v for i, v in enumerate(loaded)
        ] + local[len(loaded):]
    return loaded


def _load_optim_state_dict(
    model: nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    state_dict: OptimizerStateType,
    info: _Info,
) -> None:
    if not info.handle_optim:
        return
    for optim in optims:
        _init_optim_state(optim)
        osd: dict[str, Any]
        if not state_dict:
            osd = {}
        elif _STATE in state_dict:
            osd = _split_optim_state_dict(optim, state_dict, info)
        else:
            osd = _unflatten_optim_state_dict(optim, cast(dict[str, ValueType], state_dict), info)
        if info.fsdp_modules:
            osd = _with_compiler_names(model, osd)
            with info.fsdp_context():
                osd = _fsdp1_optim_state_dict_to_load(
                    model, optim, osd, group=_fsdp1_group(model, info)
                )
        elif info.full_state_dict:
            osd = _full_optim_to_local(model, optim, osd, info)
        # FQN keys work: load_state_dict pairs saved and current params by order.
        _state_dict_fn(optim, "load_state_dict")(state_dict=osd)


def _with_compiler_names(model: nn.Module, osd: dict[str, Any]) -> dict[str, Any]:
    """FSDP1 expects torch.compile's ``_orig_mod.`` in its FQNs."""
    if not osd:
        return osd
    for name, _ in model.named_parameters():
        plain = _get_fqns(model, name)
        compiled = _get_fqns(model, name, skip_compiler_prefix=False)
        if plain == compiled:
            continue
        if len(plain) != 1:
            raise AssertionError(f"Expected 1 FQN for '{name}', got {len(plain)}")
        old, new = plain[0], compiled[0]
        for group in osd[_PG]:
            group[_PARAMS] = [k.replace(old, new) for k in group[_PARAMS]]
        osd[_STATE] = {
            (k.replace(old, new) if old in k else k): v for k, v in osd[_STATE].items()
        }
    return osd
