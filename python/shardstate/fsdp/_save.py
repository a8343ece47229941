"""Save: FSDP1 flat shards -> per-parameter optimizer state keyed by name.

Mirrors torch 2.13's ``_optim_utils._optim_state_dict`` (the same keys,
``param_groups``, values and errors, with a different data path), per
FSDP unit:

  * one collective per tensor state name: the local flat shard (or, with
    ``use_orig_params=True``, the shard packed from the per-parameter local
    pieces) is gathered once and every parameter's state is a view into it;
  * with ``rank0_only`` the collective is a ``gather`` to rank 0, so other
    ranks never hold an unsharded copy, and rank 0 holds the result plus the
    send buffer of one unit;
  * every state name gets its own gather buffer, so no result aliases another
    (torch 2.13 reuses one buffer per unit with ``use_orig_params=True``: on
    CPU with ``offload_to_cpu=True`` its ``exp_avg`` and ``exp_avg_sq`` come
    back as the same numbers; ours are the right ones);
  * SHARDED: one all-to-all per unit and state name (``_dim0``), so each rank
    receives only its dim-0 chunks, wrapped as torch's ShardedTensors
    (``_sharded``); with DTensors or an FSDP extension, torch's own chunking
    of the gathered state.

``use_orig_params=True`` first learns every rank's state names, shapes and
dtypes in one ``all_gather_object`` per process group (torch runs one per unit).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.fsdp._traversal_utils as traversal_utils
import torch.nn as nn
from torch.distributed.fsdp._common_utils import _get_param_to_fqns
from torch.distributed.fsdp._optim_utils import (
    FSDPParamInfo,
    StateInfo,
    _convert_all_state_info,
    _get_flat_param_to_fqn,
    _get_fqn_to_fsdp_param_info,
    _get_param_id_to_param_from_optim_input,
    _get_param_key_to_param,
    _is_named_optimizer,
    _map_param_key_to_optim_keys,
    _OptimStateKey,
    _PosDimTensorInfo,
    _unflatten_param_groups,
    sorted_items,
)
from torch.distributed.fsdp._runtime_utils import _reset_flat_param_grad_info_if_needed

from .. import comm
from . import _dim0, _flatops, _sharded

__all__ = ["OptimInput", "optim_state_dict"]

OptimInput = list[dict[str, Any]] | Iterable[nn.Parameter] | None


def _gather_flat(
    local: torch.Tensor,
    layout: _flatops.UnitLayout,
    pg: dist.ProcessGroup | None,
    to_rank0: bool,
    what: str,
) -> torch.Tensor | None:
    """One collective: every rank's flat shard -> the unpadded full flat state.

    ``to_rank0``: only rank 0 of ``pg`` receives (the others get None and
    never allocate the full buffer); otherwise every rank does.
    """
    if local.dim() != 1 or local.numel() != layout.shard_numel:
        raise ValueError(
            f"optimizer state {what} should be this rank's flat shard of "
            f"{layout.shard_numel} elements but has shape {tuple(local.shape)}"
        )
    local = local.contiguous()
    if to_rank0:
        if layout.rank == 0:
            full = local.new_empty(layout.padded_numel)
            comm.gather(full, local, 0, pg)
            return full[: layout.unpadded_numel]
        comm.gather(None, local, 0, pg)
        return None
    full = local.new_empty(layout.padded_numel)
    comm.all_gather_into(full, local, pg)
    return full[: layout.unpadded_numel]


def _offload(state: dict[str, Any]) -> None:
    for name in list(state):
        if torch.is_tensor(state[name]):
            state[name] = state[name].cpu()


def _unflatten_flat_state(
    info: FSDPParamInfo,
    flat_state: dict[str, Any],
    to_save: bool,
    shard_state: bool,
    cpu_offload: bool,
    to_rank0: bool,
) -> list[dict[str, Any]]:
    """One FlatParameter's state (``use_orig_params=False``) -> one dict per original parameter."""
    fsdp_state = info.state
    layout = _flatops.layout_of(info)
    tensor_state: dict[str, torch.Tensor | None] = {}
    chunked: dict[str, list[torch.Tensor]] = {}  # SHARDED via all-to-all: our dim-0 chunks
    zero_dim: dict[str, torch.Tensor] = {}
    non_tensor: dict[str, Any] = {}
    for name, value in sorted_items(flat_state):
        if torch.is_tensor(value) and value.dim() > 0:
            if not layout.sharded:
                tensor_state[name] = value
                continue
            if fsdp_state.compute_device is None:
                raise AssertionError("compute_device has not been initialized")
            if value.device.type != fsdp_state.compute_device.type:
                value = value.to(fsdp_state.compute_device)
            if shard_state and _sharded.fast_sharded(fsdp_state):
                chunks = _dim0.shards_to_chunks(
                    value, layout, fsdp_state.process_group, repr(name), value.dtype, value.device
                )
                if chunks is not None:
                    chunked[name] = chunks
                    tensor_state[name] = None
                    continue
            tensor_state[name] = _gather_flat(
                value, layout, fsdp_state.process_group, to_rank0, repr(name)
            )
        elif torch.is_tensor(value):
            zero_dim[name] = value.detach().clone()
        else:
            non_tensor[name] = value
    if not to_save:
        return []
    views = {
        name: _flatops.unflatten(layout, t) for name, t in tensor_state.items() if t is not None
    }
    out: list[dict[str, Any]] = []
    for i in range(layout.num_params):
        state: dict[str, Any] = {}
        for name in tensor_state:
            if name in chunked:
                state[name] = _sharded.sharded_tensor(
                    fsdp_state, chunked[name][i], layout.shapes[i]
                )
                continue
            v = views[name][i]
            state[name] = _sharded.chunk_tensor(fsdp_state, v) if shard_state else v
        state.update(zero_dim)
        state.update(non_tensor)
        if cpu_offload:
            _offload(state)
        out.append(state)
    return out


def _convert_state_with_flat_params(
    all_keys: list[_OptimStateKey],
    key_to_param_key: dict[_OptimStateKey, int | str],
    fqn_to_info: dict[str, FSDPParamInfo],
    osd_state: dict[Any, Any],
    to_save: bool,
    shard_state: bool,
    cpu_offload: bool,
    to_rank0: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Rank 0's key order, so every rank runs the same collectives in the same order.
    for key in all_keys:
        param_key = key_to_param_key.get(key)
        if param_key is None:
            raise AssertionError(
                "If use_orig_params is False, we must be able to find the "
                f"corresponding param id. {key} {param_key}"
            )
        if key.is_fsdp_managed:
            info = fqn_to_info[key.unflat_param_names[0]]
            unflat = _unflatten_flat_state(
                info, osd_state[param_key], to_save, shard_state, cpu_offload, to_rank0
            )
            if to_save:
                if len(unflat) != len(key.unflat_param_names):
                    raise AssertionError(
                        f"{len(unflat)} unflattened states for the "
                        f"{len(key.unflat_param_names)} parameters {key.unflat_param_names}"
                    )
                out.update(zip(key.unflat_param_names, unflat))
        elif to_save:
            (name,) = key.unflat_param_names
            out[name] = copy.copy(osd_state[param_key])
            if cpu_offload:
                _offload(out[name])
    return out


def _scratch(
    cache: dict[tuple[torch.dtype, torch.device], torch.Tensor],
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """``numel`` elements of a buffer kept in ``cache`` per (dtype, device), grown as needed:
    one allocation (and one round of page faults) for a whole call's send buffers."""
    buf = cache.get((dtype, device))
    if buf is None or buf.numel() < numel:
        cache.pop((dtype, device), None)
        del buf
        buf = cache[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def _pack_scalar(t: torch.Tensor) -> tuple[torch.dtype, bytes]:
    """A 0-dim tensor as (dtype, its bytes): pickles in microseconds, unlike a tensor."""
    return t.dtype, t.detach().cpu().reshape(1).view(torch.uint8).numpy().tobytes()


def _unpack_scalar(packed: tuple[torch.dtype, bytes]) -> torch.Tensor:
    dtype, raw = packed
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(()).clone()


def _allgather_units_state_info(
    units: list[tuple[FSDPParamInfo, dict[str, Any]]],
) -> list[list[dict[str, StateInfo]] | None]:
    """torch's ``_allgather_state_info`` for every sharded unit at once.

    torch runs one ``all_gather_object`` per unit (a synchronisation and a
    pickle of every ``step`` tensor each); here every unit of a process
    group travels in one, with 0-dim tensors as raw bytes. The result per
    unit is what torch's would be (None for units that are not sharded).
    """
    payload: list[Any] = []
    by_pg: dict[int, tuple[dist.ProcessGroup | None, list[int]]] = {}
    for j, (info, states) in enumerate(units):
        if not _flatops.is_sharded(info.state):
            payload.append(None)
            continue
        processed = {}
        for fqn, optim_state in states.items():
            tensors, scalars, others = {}, {}, {}
            for name, value in sorted_items(optim_state):
                if torch.is_tensor(value) and value.dim() == 0:
                    scalars[name] = _pack_scalar(value)
                elif torch.is_tensor(value):
                    tensors[name] = (tuple(value.shape), value.dtype)
                else:
                    others[name] = value
            processed[fqn] = (tensors, scalars, others)
        payload.append(processed)
        pg = info.state.process_group
        by_pg.setdefault(id(pg), (pg, []))[1].append(j)
    out: list[list[dict[str, StateInfo]] | None] = [None] * len(units)
    # Groups in the order of their first unit, the same on every rank.
    for pg, idxs in by_pg.values():
        every: list[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(every, [payload[j] for j in idxs], group=pg)
        for pos, j in enumerate(idxs):
            out[j] = [
                {
                    fqn: StateInfo(
                        {n: _PosDimTensorInfo(torch.Size(sh), dt) for n, (sh, dt) in t.items()},
                        {n: _unpack_scalar(v) for n, v in sc.items()},
                        others,
                    )
                    for fqn, (t, sc, others) in per_rank[pos].items()
                }
                for per_rank in every
            ]
    return out


def _gather_orig_unit(
    info: FSDPParamInfo,
    input_states: dict[str, Any],
    gathered_info: list[dict[str, StateInfo]] | None,
    shard_state: bool,
    to_save: bool,
    cpu_offload: bool,
    to_rank0: bool,
    scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor],
) -> dict[str, Any]:
    """One unit's local per-parameter pieces (``use_orig_params=True``) -> full state.

    The flat shard each gather sends is packed into ``scratch``, one buffer
    reused by every unit and state name (the results never alias it).
    """
    fsdp_state = info.state
    if not _flatops.is_sharded(fsdp_state):
        return input_states if to_save else {}
    assert gathered_info is not None
    output_states: dict[str, dict[str, Any]] = {fqn: {} for fqn in input_states}
    dtype, state_buffers = _convert_all_state_info(info, gathered_info, input_states, output_states)
    if state_buffers:
        layout = _flatops.layout_of(info)
        device = fsdp_state.compute_device
        for name, pieces in state_buffers.items():
            chunks = None
            if shard_state and _sharded.fast_sharded(fsdp_state):
                chunks = _dim0.shards_to_chunks(
                    list(pieces), layout, fsdp_state.process_group, repr(name), dtype, device
                )
            if chunks is not None:
                for fqn, idx in info.param_indices.items():
                    if fqn in output_states:
                        value = _sharded.sharded_tensor(fsdp_state, chunks[idx], layout.shapes[idx])
                        output_states[fqn][name] = value.cpu() if cpu_offload else value
                continue
            local = _scratch(scratch, layout.shard_numel, dtype, device)
            _flatops.pack_local_into(layout, pieces, local)
            full = _gather_flat(local, layout, fsdp_state.process_group, to_rank0, repr(name))
            del local
            if full is None or not to_save:
                continue
            if cpu_offload:
                full = full.cpu()
            views = _flatops.unflatten(layout, full)
            for fqn, idx in info.param_indices.items():
                if fqn not in output_states:
                    continue
                value = views[idx]
                if shard_state:
                    value = _sharded.chunk_tensor(fsdp_state, value)
                    if cpu_offload:
                        value = value.cpu()
                output_states[fqn][name] = value
    if not to_save:
        return {}
    for key, idx in info.param_indices.items():
        if key in output_states or not info.param_requires_grad[idx]:
            continue
        raise RuntimeError(
            f"{key} is not in the output state. The FSDPParamInfo has the param keys "
            f"{sorted(info.param_indices.keys())} while the output_states has the "
            f"param keys {sorted(output_states.keys())}."
        )
    return output_states


def _convert_state_with_orig_params(
    all_keys: list[_OptimStateKey],
    key_to_param_key: dict[_OptimStateKey, int | str],
    fqn_to_info: dict[str, FSDPParamInfo],
    osd_state: dict[Any, Any],
    to_save: bool,
    shard_state: bool,
    cpu_offload: bool,
    to_rank0: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Per unit (keyed by id(FSDPParamInfo)): fqn -> this rank's state ({} if none here).
    units: dict[int, dict[str, Any]] = {}
    for key in all_keys:
        param_key = key_to_param_key.get(key)
        if param_key is None and not key.is_fsdp_managed:
            continue
        if key.is_fsdp_managed:
            fqn = key.unflat_param_names[0]
            info = fqn_to_info.get(fqn)
            if info is None:
                continue  # an FSDP instance this rank does not have (MPMD-style models)
            units.setdefault(id(info), {})[fqn] = {} if param_key is None else osd_state[param_key]
        elif to_save:
            (name,) = key.unflat_param_names
            out[name] = copy.copy(osd_state[cast(int | str, param_key)])
            if cpu_offload:
                _offload(out[name])
    infos = [fqn_to_info[next(iter(states))] for states in units.values()]
    for info, states in zip(infos, units.values()):
        if len(info.param_requires_grad) <= 0:
            raise AssertionError(
                "With use_orig_params, FSDPParamInfo should have requires_grad "
                "information. However, the length is zero."
            )
        for key, idx in info.param_indices.items():
            if key in states or not info.param_requires_grad[idx]:
                continue
            raise RuntimeError(
                f"{key} is not in the optimizer state. The FSDPParamInfo has the param "
                f"keys {sorted(info.param_indices.keys())} while the optimizer has the "
                f"param keys {sorted(states.keys())}."
            )
    gathered = _allgather_units_state_info(list(zip(infos, units.values())))
    scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    for info, states, unit_info in zip(infos, units.values(), gathered):
        out.update(
            _gather_orig_unit(
                info, states, unit_info, shard_state, to_save, cpu_offload, to_rank0, scratch
            )
        )
    return out


@torch.no_grad()
def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    osd: dict[str, Any],
    optim_input: OptimInput,
    rank0_only: bool,
    shard_state: bool,
    group: dist.ProcessGroup | None,
    using_optim_input: bool,
    use_orig_params: bool,
    cpu_offload: bool,
) -> dict[str, Any]:
    _reset_flat_param_grad_info_if_needed(traversal_utils._get_fsdp_handles(model))
    rank = dist.get_rank(group)
    to_save = not rank0_only or rank == 0 or shard_state
    param_to_fqns = _get_param_to_fqns(model)
    flat_param_to_fqn = _get_flat_param_to_fqn(model)
    is_named = _is_named_optimizer(osd)
    param_key_to_param = cast(
        dict[int | str, nn.Parameter],
        _get_param_id_to_param_from_optim_input(model, optim_input)
        if using_optim_input
        else _get_param_key_to_param(optim, model, is_named, param_to_fqns, flat_param_to_fqn),
    )
    fqn_to_info = _get_fqn_to_fsdp_param_info(model)
    all_keys, key_to_param_key = _map_param_key_to_optim_keys(
        osd, group, param_key_to_param, param_to_fqns, fqn_to_info, merge_keys=use_orig_params
    )
    # Gather to rank 0 alone when only rank 0 keeps the result and it is rank 0
    # of the FSDP groups too (the usual case); otherwise gather everywhere.
    to_rank0 = (
        rank0_only
        and not shard_state
        and all((info.state.rank == 0) == (rank == 0) for info in fqn_to_info.values())
    )
    convert = (
        _convert_state_with_orig_params if use_orig_params else _convert_state_with_flat_params
    )
    fsdp_osd_state = convert(
        all_keys,
        key_to_param_key,
        fqn_to_info,
        osd["state"],
        to_save,
        shard_state,
        cpu_offload,
        to_rank0,
    )
    if not to_save:
        return {}
    fsdp_osd: dict[str, Any] = {"state": fsdp_osd_state}
    flat_param_fqns = set(flat_param_to_fqn.values())
    for key, value in osd["state"].items():
        if key in fsdp_osd_state or key in flat_param_fqns or key in param_key_to_param:
            continue
        warnings.warn(
            f"Found a optim state, {key}, that FSDP cannot process. FSDP "
            "will directly copy everything to the returned state_dict. In "
            "most cases, this is a user-defined state that is not "
            "associated with any particular parameter. Another possible "
            "case is this state is managed by TorchRec. Otherwise, there may "
            " be a mismatched assumption of optim_state_dict of this mode.",
            stacklevel=4,
        )
        fsdp_osd_state[key] = value
    if "param_groups" in osd:
        fsdp_osd["param_groups"] = _unflatten_param_groups(osd, param_key_to_param, param_to_fqns)
    return fsdp_osd
