"""Load: per-parameter optimizer state keyed by name -> this rank's FSDP1 flat shard.

Mirrors torch 2.13's ``_optim_utils._flatten_optim_state_dict`` (the same
keys, values and errors, with a different data path), per FSDP unit:

  * a full state dict is cut straight into this rank's shard: only the part of
    each parameter inside the shard is copied, nothing full is built;
  * with ``rank0_only`` rank 0 builds one unit's padded flat state for one
    state name at a time and ``scatter``s it, instead of broadcasting every
    full tensor to every rank;
  * a SHARDED state (ShardedTensor / DTensor values in torch's dim-0 chunk
    layout, ``_sharded.dim0_check``) is loaded with one ``all_to_all_single``
    per unit and state name, the save's plan run backwards
    (``_dim0.chunks_to_shard``), so each rank receives only its shard
    (NO_SHARD: one all-gather); values in any other layout are gathered, as
    torch does. One small all-reduce first makes every rank agree on the
    input's structure, so a bad input raises everywhere instead of hanging.
"""

from __future__ import annotations

import bisect
import copy
import warnings
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._state_dict_utils import _gather_state_dict
from torch.distributed.fsdp._common_utils import _get_param_to_fqns
from torch.distributed.fsdp._optim_utils import (
    FSDPParamInfo,
    _broadcast_processed_state,
    _broadcast_state,
    _flatten_non_tensor_optim_state,
    _flatten_zero_dim_tensor_optim_state,
    _get_fqn_to_fsdp_param_info,
    _OptimStateKey,
    _PosDimTensorInfo,
)

from .. import comm
from . import _dim0, _flatops, _sharded

__all__ = ["flatten_optim_state_dict"]


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


def _is_pos_dim(v: Any) -> bool:
    return isinstance(v, _PosDimTensorInfo) or (torch.is_tensor(v) and v.dim() > 0)


def _describe(v: Any) -> str:
    """A state value for an error message: tensors by shape and dtype, not by contents."""
    if isinstance(v, _PosDimTensorInfo) or torch.is_tensor(v):
        return f"Tensor(shape={tuple(v.shape)}, dtype={v.dtype})"
    return repr(v)


def _check_tensor_states(
    state_name: str,
    values: list[Any],
    names: list[str],
    shapes: tuple[torch.Size, ...],
) -> torch.dtype:
    """torch's checks of a FlatParameter's positive-dim state, on tensors or their metadata."""
    dtypes = {v.dtype for v in values if v is not None}
    if len(dtypes) != 1:
        raise ValueError(
            "All unflattened parameters comprising a single flat parameter must have "
            "positive-dimension tensor state with the same dtype but got dtypes "
            f"{dtypes} for state {state_name} and unflattened parameter names {names}"
        )
    for v, shape, name in zip(values, shapes, names):
        if v is None and len(shape) == 0:
            raise ValueError("Flattening a zero-dimension parameter is not supported")
        if v is not None and tuple(v.shape) != tuple(shape):
            raise ValueError(
                "Tensor optimizer state does not have same shape as its parameter: "
                f"{v.shape} {shape} (state {state_name!r} of {name!r})"
            )
    return next(iter(dtypes))


def _scatter_shard(
    layout: _flatops.UnitLayout,
    pieces: list[torch.Tensor | None] | None,
    dtype: torch.dtype,
    device: torch.device,
    pg: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Rank 0 holds the full pieces (others pass None); every rank gets its flat shard.

    Rank 0 builds one padded flat buffer (one unit, one state name) and
    scatters it; the other ranks only ever allocate their shard.
    """
    shard = torch.empty(layout.shard_numel, dtype=dtype, device=device)
    if not layout.sharded:
        # NO_SHARD over several ranks: everyone needs the whole (unpadded) flat state.
        if pieces is not None:
            _flatops.flatten_shard_into(layout, pieces, 0, shard)
        if dist.get_world_size(pg) > 1:
            comm.broadcast(shard, 0, pg)
        return shard
    if layout.rank == 0:
        assert pieces is not None
        full = torch.empty(layout.padded_numel, dtype=dtype, device=device)
        _flatops.flatten_full_into(layout, pieces, full)
        comm.scatter(shard, full, 0, pg)
        del full
    else:
        comm.scatter(shard, None, 0, pg)
    return shard


# ---------------------------------------------------------------------------
# use_orig_params=False: a FlatParameter's per-parameter state -> its local shard
# ---------------------------------------------------------------------------


def _sharded_unit_states(
    info: FSDPParamInfo,
    layout: _flatops.UnitLayout,
    states: list[dict[str, Any] | None],
) -> tuple[list[dict[str, Any] | None], set[str]]:
    """A FlatParameter's per-parameter sharded states -> the states torch's
    checks see, and the state names loaded by ``_dim0.chunks_to_shard``.

    A state name whose every value is dim-0 chunked (``_sharded.dim0_check``) keeps
    only its shape and dtype here; other ShardedTensor / DTensor values are
    gathered whole, as torch does, in the same order on every rank.
    """
    fsdp_state = info.state
    chunkable = _dim0.dim0_chunk_numels(layout.shapes, 1) is not None
    names = sorted({n for s in states if s for n in s}, key=str)
    fast: set[str] = set()
    for name in names:
        present = [
            (s[name], layout.shapes[i]) for i, s in enumerate(states) if s and name in s
        ]
        if chunkable and all(_sharded.dim0_check(fsdp_state, v, shape)[0] for v, shape in present):
            fast.add(name)
    out: list[dict[str, Any] | None] = []
    for s in states:
        if s is None:
            out.append(None)
            continue
        slow = {
            n: s[n] for n in sorted(s, key=str) if n not in fast and _sharded.is_dist_tensor(s[n])
        }
        gathered = (
            _gather_state_dict(slow, pg=fsdp_state.process_group, device=fsdp_state.compute_device)
            if slow
            else {}
        )
        out.append(
            {
                n: _PosDimTensorInfo(_sharded.dist_shape(v), _sharded.dist_dtype(v))
                if n in fast
                else gathered.get(n, v)
                for n, v in s.items()
            }
        )
    return out, fast


def _flatten_flat_unit(
    info: FSDPParamInfo,
    unflat_state: dict[str, dict[str, Any]],
    names: list[str],
    rank0_only: bool,
    sharded_input: bool = False,
) -> dict[str, Any]:
    """One FlatParameter's per-parameter state (``use_orig_params=False``) -> its local shard.

    ``sharded_input`` (SHARDED_STATE_DICT): a state name held as dim-0
    chunks is loaded with one chunk exchange; anything else is gathered.
    """
    fsdp_state = info.state
    layout = _flatops.layout_of(info)
    if len(names) != layout.num_params:
        raise AssertionError(f"Expects {len(names)} shapes but got {layout.num_params}")
    if not any(n in unflat_state for n in names):
        return {}
    raw = [unflat_state.get(n) for n in names]
    fast: set[str] = set()
    if sharded_input:
        states, fast = _sharded_unit_states(info, layout, raw)
    else:
        states = [
            _gather_state_dict(s, pg=fsdp_state.process_group, device=fsdp_state.compute_device)
            if s is not None and not rank0_only
            else s
            for s in raw
        ]
    state_names: set[str] | None = None
    for s in states:
        if s is None:
            continue
        if state_names is None:
            state_names = set(s)
        elif state_names != set(s):
            raise ValueError(
                f"Differing optimizer state names for the unflattened parameters: {names}"
            )
    assert state_names is not None
    receiving = rank0_only and fsdp_state.rank != 0
    cpu = torch.device("cpu")
    flat: dict[str, Any] = {}
    # Sorted: with rank0_only every rank must run the same scatters in the same order.
    for state_name in sorted(state_names):
        values = [s[state_name] if s is not None else None for s in states]
        present = [v for v in values if v is not None]
        if not present:
            flat[state_name] = None
            continue
        pos = all(_is_pos_dim(v) for v in present)
        zero = all(torch.is_tensor(v) and v.dim() == 0 for v in present)
        non = all(not torch.is_tensor(v) and not isinstance(v, _PosDimTensorInfo) for v in present)
        types = {torch.Tensor if isinstance(v, _PosDimTensorInfo) else type(v) for v in present}
        if len(types) != 1 or not (pos or zero or non):
            raise ValueError(
                f"Differing optimizer state types for state {state_name}, values "
                f"[{', '.join(_describe(v) for v in values)}], and unflattened parameter "
                f"names {names}"
            )
        if pos:
            dtype = _check_tensor_states(state_name, values, names, layout.shapes)
            if state_name in fast:
                chunks = [
                    _sharded.local_chunk(s[state_name]) if s is not None else None for s in raw
                ]
                shard = torch.empty(layout.shard_numel, dtype=dtype, device=cpu)
                items = _dim0.chunks_to_shard(
                    fsdp_state, layout, chunks, dtype, into=lambda off, n: shard[off : off + n]
                )
                if items is None:  # received in place: the padding is still to be zeroed
                    _flatops.zero_padding(layout, shard)
                else:
                    _flatops.place_many([(shard, items)])
                flat[state_name] = shard
            elif rank0_only:
                pieces = None if receiving else values
                shard = _scatter_shard(
                    layout, pieces, dtype, fsdp_state.compute_device, fsdp_state.process_group
                )
                flat[state_name] = shard.to(cpu)
            else:
                shard = torch.empty(layout.shard_numel, dtype=dtype, device=cpu)
                _flatops.flatten_shard_into(layout, values, layout.rank, shard)
                flat[state_name] = shard
        elif zero:
            flat[state_name] = _flatten_zero_dim_tensor_optim_state(state_name, values, names)
        else:
            flat[state_name] = _flatten_non_tensor_optim_state(state_name, values, names)
    # Collectives ran in sorted order; the result keeps torch's (set) order.
    return {name: flat[name] for name in state_names}


# ---------------------------------------------------------------------------
# use_orig_params=True: a unit's per-parameter state -> our local pieces
# ---------------------------------------------------------------------------


def _shard_orig_unit(
    info: FSDPParamInfo,
    fqns: list[str],
    unflat_state: dict[str, dict[str, Any]],
    rank0_only: bool,
    sharded_input: bool = False,
) -> dict[str, dict[str, Any]]:
    """Full state of some of one unit's parameters (``use_orig_params=True``) -> our pieces.

    Without ``rank0_only`` every rank holds the full state and slices its own
    part out, no communication. With it, rank 0 scatters one padded flat
    buffer per (state name, dtype) of the unit.
    """
    fsdp_state = info.state
    layout = _flatops.layout_of(info)
    out: dict[str, dict[str, Any]] = {}
    if sharded_input:
        return _shard_orig_unit_from_chunks(info, layout, fqns, unflat_state)
    if not rank0_only:
        for fqn in fqns:
            state = unflat_state[fqn]
            if not state:
                out[fqn] = {}
                continue
            state = _gather_state_dict(
                state, pg=fsdp_state.process_group, device=fsdp_state.compute_device
            )
            idx = info.param_indices[fqn]
            if layout.sharded and not layout.shard_infos[idx].in_shard:
                out[fqn] = {}
                continue
            new: dict[str, Any] = {}
            for name, value in state.items():
                if layout.sharded and torch.is_tensor(value) and value.dim() > 0:
                    value = _flatops.slice_local(layout, idx, value, full=True)
                new[name] = value
            out[fqn] = new
        return out
    if not layout.sharded:
        for fqn in fqns:
            out[fqn] = (
                {
                    n: _broadcast_state(fsdp_state, v, group=fsdp_state.process_group)
                    for n, v in unflat_state[fqn].items()
                }
                if unflat_state[fqn]
                else {}
            )
        return out
    # Group the unit's positive-dim states by (name, dtype): one scatter each.
    groups: dict[tuple[str, torch.dtype], dict[int, Any]] = {}
    for fqn in fqns:
        for name, value in unflat_state[fqn].items():
            if _is_pos_dim(value):
                idx = info.param_indices[fqn]
                if (
                    value.shape != layout.shapes[idx]
                    and torch.Size(value.shape).numel() != layout.numels[idx]
                ):
                    raise ValueError(
                        f"optimizer state {name!r} of {fqn!r} has shape {tuple(value.shape)}, "
                        f"the parameter {tuple(layout.shapes[idx])}"
                    )
                groups.setdefault((name, value.dtype), {})[idx] = value
    shards: dict[tuple[str, torch.dtype], torch.Tensor] = {}
    for (name, dtype), by_idx in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        pieces = None
        if fsdp_state.rank == 0:
            pieces = [by_idx.get(i) for i in range(layout.num_params)]
        shards[(name, dtype)] = _scatter_shard(
            layout, pieces, dtype, fsdp_state.compute_device, fsdp_state.process_group
        )
    for fqn in fqns:
        state = unflat_state[fqn]
        idx = info.param_indices[fqn]
        if not state or not layout.shard_infos[idx].in_shard:
            out[fqn] = {}
            continue
        new = {}
        for name, value in state.items():
            if _is_pos_dim(value):
                value = _flatops.slice_local(layout, idx, shards[(name, value.dtype)], full=False)
            new[name] = value
        out[fqn] = new
    return out


def _shard_orig_unit_from_chunks(
    info: FSDPParamInfo,
    layout: _flatops.UnitLayout,
    fqns: list[str],
    unflat_state: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Sharded state of some of one unit's parameters (``use_orig_params=True``) -> our pieces.

    The dim-0 chunked values of one (state name, dtype) are loaded with one
    chunk exchange for the whole unit, straight into each parameter's local
    piece; other ShardedTensor / DTensor values are gathered and sliced, as
    torch does.
    """
    fsdp_state = info.state
    chunkable = _dim0.dim0_chunk_numels(layout.shapes, 1) is not None
    groups: dict[tuple[str, torch.dtype], dict[int, Any]] = {}
    for fqn in fqns:
        idx = info.param_indices[fqn]
        for name, v in unflat_state[fqn].items():
            if chunkable and _sharded.dim0_check(fsdp_state, v, layout.shapes[idx])[0]:
                groups.setdefault((name, _sharded.dist_dtype(v)), {})[idx] = v
    # Where each parameter lies in the local flat state the exchange fills.
    if layout.sharded:
        spans = _flatops.shard_spans(layout)
    else:
        spans = sorted(
            (off, off + n, i) for i, (off, n) in enumerate(zip(layout.offsets, layout.numels)) if n
        )
    starts = [a for a, _, _ in spans]
    loaded: dict[tuple[int, str], torch.Tensor] = {}
    # Sorted: every rank runs the same exchanges in the same order.
    for (name, dtype), by_idx in sorted(groups.items(), key=lambda kv: str(kv[0])):
        chunks = [
            _sharded.local_chunk(by_idx[i]) if i in by_idx else None
            for i in range(layout.num_params)
        ]
        outs: dict[int, tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]] = {}
        for i in by_idx:
            si = layout.shard_infos[i]
            if not layout.sharded:
                outs[i] = (torch.empty(layout.shapes[i], dtype=dtype), [])
            elif si.in_shard:
                outs[i] = (torch.empty(cast(int, si.numel_in_shard), dtype=dtype), [])

        def into(off: int, n: int, outs: Any = outs) -> torch.Tensor | None:
            a, b, i = spans[bisect.bisect_right(starts, off) - 1]
            if off + n > b:
                raise AssertionError(f"a received piece at {off} crosses parameter {i}'s end")
            return outs[i][0].view(-1)[off - a : off - a + n] if i in outs else None

        items = _dim0.chunks_to_shard(fsdp_state, layout, chunks, dtype, into=into)
        for i, (t, _) in outs.items():
            loaded[(i, name)] = t
        if items is None:  # received in place: each parameter's part is covered whole
            continue
        for off, piece in items:
            a, b, i = spans[bisect.bisect_right(starts, off) - 1]
            if off + piece.numel() > b:
                raise AssertionError(f"a received piece at {off} crosses parameter {i}'s end")
            if i in outs:
                outs[i][1].append((off - a, piece))
        _flatops.place_many([(t.view(-1), parts) for t, parts in outs.values()])
    fast = {(i, name) for (name, _), by_idx in groups.items() for i in by_idx}
    out: dict[str, dict[str, Any]] = {}
    for fqn in fqns:
        state = unflat_state[fqn]
        if not state:
            out[fqn] = {}
            continue
        idx = info.param_indices[fqn]
        slow = {
            n: state[n]
            for n in sorted(state, key=str)
            if (idx, n) not in fast and _sharded.is_dist_tensor(state[n])
        }
        gathered = (
            _gather_state_dict(slow, pg=fsdp_state.process_group, device=fsdp_state.compute_device)
            if slow
            else {}
        )
        if layout.sharded and not layout.shard_infos[idx].in_shard:
            out[fqn] = {}
            continue
        new: dict[str, Any] = {}
        for name, value in state.items():
            if (idx, name) in loaded:
                new[name] = loaded[(idx, name)]
                continue
            value = gathered.get(name, value)
            if layout.sharded and torch.is_tensor(value) and value.dim() > 0:
                value = _flatops.slice_local(layout, idx, value, full=True)
            new[name] = value
        out[fqn] = new
    return out


# ---------------------------------------------------------------------------
# The whole state dict
# ---------------------------------------------------------------------------


def flatten_optim_state_dict(
    osd: dict[str, Any],
    model: nn.Module,
    use_orig_params: bool,
    optim: torch.optim.Optimizer | None,
    rank0_only: bool,
    group: dist.ProcessGroup | None,
    sharded_input: bool = False,
) -> dict[str, Any]:
    if "state" not in osd and not rank0_only:
        raise ValueError(
            '`optim_state_dict` must have the keys "state" to be a valid optimizer state dict'
        )
    param_to_fqns = _get_param_to_fqns(model)
    fqn_to_info = _get_fqn_to_fsdp_param_info(model)
    if not fqn_to_info:
        raise ValueError("the model has no FSDP-managed parameters")
    fsdp_state = next(iter(fqn_to_info.values())).state
    if rank0_only:
        # Rank 0 keeps its dict; the others get it with every positive-dim
        # tensor replaced by its shape and dtype (torch's own skeleton).
        osd = _broadcast_processed_state(fsdp_state, osd, group=group)
    unflat_state = osd["state"]
    all_state_keys = set(unflat_state)
    if sharded_input:
        _sharded.agree_sharded(
            fqn_to_info, unflat_state, group if group is not None else fsdp_state.process_group
        )

    # use_orig_params: one unit at a time (its parameters are separate keys).
    orig_done: dict[str, dict[str, Any]] = {}
    if use_orig_params:
        unit_fqns: dict[int, list[str]] = {}
        unit_info: dict[int, FSDPParamInfo] = {}
        for fqns in param_to_fqns.values():
            fqn = fqns[0]
            if fqn in unflat_state and fqn in fqn_to_info:
                info = fqn_to_info[fqn]
                unit_fqns.setdefault(id(info), []).append(fqn)
                unit_info[id(info)] = info
        for uid, fqns in unit_fqns.items():
            orig_done.update(
                _shard_orig_unit(unit_info[uid], fqns, unflat_state, rank0_only, sharded_input)
            )

    flat_osd_state: dict[Any, Any] = {}
    for param, fqns in param_to_fqns.items():
        fqn = fqns[0]
        if fqn not in unflat_state:
            continue
        all_state_keys.difference_update(fqns)
        if fqn in fqn_to_info:
            key = _OptimStateKey(tuple(fqns), True)
            if use_orig_params:
                flat_state = orig_done[fqn]
            else:
                flat_state = _flatten_flat_unit(
                    fqn_to_info[fqn], unflat_state, list(fqns), rank0_only, sharded_input
                )
            if flat_state:
                flat_osd_state[key] = flat_state
            elif use_orig_params:
                if len(fqns) != 1:
                    raise AssertionError(
                        f"use_orig_params is True but there are multiple FQNs, {fqns}."
                    )
                if optim is not None:  # NamedOptimizer / KeyedOptimizer
                    state = optim.state.get(param, None)  # type: ignore[call-overload]
                    if state is not None:
                        flat_osd_state[key] = copy.deepcopy(state)
                    else:
                        warnings.warn(
                            f"optim_state[{key}] is not on rank{fsdp_state.rank}.", stacklevel=4
                        )
            else:
                raise RuntimeError(
                    f"The state of {key} is empty. This should happen when use_orig_params=True."
                )
        else:
            if len(fqns) != 1:
                raise AssertionError(f"Expected len(fqns) == 1, got {len(fqns)}")
            state = unflat_state[fqn]
            if rank0_only and state:
                state = {n: _broadcast_state(fsdp_state, v, group=group) for n, v in state.items()}
            flat_osd_state[_OptimStateKey(tuple(fqns), False)] = copy.copy(state)

    for key in all_state_keys:
        user_state = unflat_state[key]
        if isinstance(user_state, torch.Tensor) and rank0_only and use_orig_params:
            user_state = _broadcast_state(fsdp_state, user_state, group=group)
        flat_osd_state[key] = copy.copy(user_state)
    if "param_groups" in osd:
        return {"state": flat_osd_state, "param_groups": copy.deepcopy(osd["param_groups"])}
    return {"state": flat_osd_state}
