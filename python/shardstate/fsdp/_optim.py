"""FSDP1 optimizer state: flat shards <-> per-parameter state keyed by name.

Mirrors ``torch.distributed.fsdp._optim_utils`` (torch 2.13): the same keys,
``param_groups``, values and errors, but with a different data path.

Save (flat shards -> per-parameter state), per FSDP unit:
  * one collective per tensor state name: the local flat shard (or, with
    ``use_orig_params=True``, the shard packed from the per-parameter local
    pieces) is gathered once and every parameter's state is a view into it;
  * with ``rank0_only`` the collective is a ``gather`` to rank 0, so other
    ranks never hold an unsharded copy, and rank 0 holds the result plus the
    send buffer of one unit;
  * every state name gets its own gather buffer, so no result aliases another
    (torch 2.13 reuses one buffer per unit with ``use_orig_params=True``: on
    CPU with ``offload_to_cpu=True`` its ``exp_avg`` and ``exp_avg_sq`` come
    back as the same numbers; ours are the right ones).
Load (per-parameter state -> this rank's flat shard):
  * a full state dict is cut straight into this rank's shard: only the part of
    each parameter inside the shard is copied, nothing full is built;
  * with ``rank0_only`` rank 0 builds one unit's padded flat state for one
    state name at a time and ``scatter``s it, instead of broadcasting every
    full tensor to every rank;
  * a SHARDED state (ShardedTensor / DTensor values in torch's dim-0 chunk
    layout) is loaded with one ``all_to_all_single`` per unit and state name,
    the save's plan run backwards, so each rank receives only its shard
    (NO_SHARD: one all-gather); values in any other layout are gathered, as
    torch does. One small all-reduce first makes every rank agree on the
    input's structure, so a bad input raises everywhere instead of hanging.

Key discovery, re-keying and ``param_groups`` use torch's own helpers, so they
equal torch's by construction. Layout and bulk copies go through ``_flatops``.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import itertools
import math
import warnings
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.fsdp._traversal_utils as traversal_utils
import torch.nn as nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed._state_dict_utils import _gather_state_dict
from torch.distributed.distributed_c10d import _get_pg_default_device
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._common_utils import _get_param_to_fqns
from torch.distributed.fsdp._fsdp_extensions import _ext_chunk_dtensor, _ext_chunk_tensor
from torch.distributed.fsdp._optim_utils import (
    FSDPParamInfo,
    StateInfo,
    _broadcast_processed_state,
    _broadcast_state,
    _convert_all_state_info,
    _flatten_non_tensor_optim_state,
    _flatten_zero_dim_tensor_optim_state,
    _get_flat_param_to_fqn,
    _get_fqn_to_fsdp_param_info,
    _get_param_id_to_param_from_optim_input,
    _get_param_key_to_param,
    _get_param_to_param_id_from_optim_input,
    _get_param_to_param_key,
    _is_named_optimizer,
    _map_param_key_to_optim_keys,
    _OptimStateKey,
    _PosDimTensorInfo,
    _rekey_sharded_optim_state_dict,
    _unflatten_param_groups,
    sorted_items,
)
from torch.distributed.fsdp._runtime_utils import _reset_flat_param_grad_info_if_needed
from torch.distributed.fsdp._shard_utils import _get_remote_device_str
from torch.distributed.fsdp.api import ShardingStrategy
from torch.distributed.fsdp.fully_sharded_data_parallel import (
    _get_fqn_to_param,
    _get_param_to_fqn,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard

from .. import comm
from . import _flatops
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

OptimInput = list[dict[str, Any]] | Iterable[nn.Parameter] | None


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


def _is_sharded(fsdp_state: Any) -> bool:
    return fsdp_state.world_size != 1 and fsdp_state.sharding_strategy != ShardingStrategy.NO_SHARD


def _layout(info: FSDPParamInfo) -> _flatops.UnitLayout:
    st = info.state
    return _flatops.unit_layout(info.handle, st.world_size, st.rank, _is_sharded(st))


def _is_pos_dim(v: Any) -> bool:
    return isinstance(v, _PosDimTensorInfo) or (torch.is_tensor(v) and v.dim() > 0)


def _describe(v: Any) -> str:
    """A state value for an error message: tensors by shape and dtype, not by contents."""
    if isinstance(v, _PosDimTensorInfo) or torch.is_tensor(v):
        return f"Tensor(shape={tuple(v.shape)}, dtype={v.dtype})"
    return repr(v)


def _chunk(fsdp_state: Any, value: torch.Tensor) -> torch.Tensor:
    """``value`` as the sharded (dim-0 chunked) tensor torch's SHARDED state dict holds."""
    if getattr(fsdp_state._optim_state_dict_config, "_use_dtensor", False):
        if fsdp_state._device_mesh is None:
            raise AssertionError("_use_dtensor is set but the FSDP state has no device mesh")
        return _ext_chunk_dtensor(
            value, fsdp_state.rank, fsdp_state._device_mesh, fsdp_state._fsdp_extension
        )
    if fsdp_state.process_group is None:
        raise AssertionError("the FSDP state has no process group")
    return _ext_chunk_tensor(
        value,
        fsdp_state.rank,
        fsdp_state.world_size,
        fsdp_state._device_handle.device_count(),
        fsdp_state.process_group,
        fsdp_state._fsdp_extension,
    )


def _fast_sharded(fsdp_state: Any) -> bool:
    """Whether SHARDED results can be built by an all-to-all (plain ShardedTensors)."""
    return not getattr(fsdp_state._optim_state_dict_config, "_use_dtensor", False) and (
        fsdp_state._fsdp_extension is None
    )


def _dim0_chunks(
    local: torch.Tensor | list[torch.Tensor | None],
    layout: _flatops.UnitLayout,
    pg: dist.ProcessGroup | None,
    what: str,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor] | None:
    """One all-to-all: every rank's flat shard -> this rank's dim-0 chunk of every parameter.

    ``local`` is this rank's flat shard, or (``use_orig_params=True``) the
    per-parameter local pieces, packed straight into the send buffer.
    Each rank receives about one shard's worth instead of the whole unit.
    None when a parameter cannot be chunked on dim 0 (the caller gathers instead).
    """
    plan = _flatops.dim0_plan(layout)
    if plan is None:
        return None
    if isinstance(local, torch.Tensor) and (
        local.dim() != 1 or local.numel() != layout.shard_numel
    ):
        raise ValueError(
            f"optimizer state {what} should be this rank's flat shard of "
            f"{layout.shard_numel} elements but has shape {tuple(local.shape)}"
        )
    if device.type == "cpu" and comm.point_to_point([], pg):
        return _dim0_chunks_p2p(local, layout, plan, pg, dtype)
    send = torch.empty(sum(plan.send_sizes), dtype=dtype, device=device)
    if isinstance(local, list):
        _flatops.pack_local_segments_into(layout, local, plan.send_segments, send)
    else:
        _flatops.pack_segments(local, plan.send_segments, send)
    recv = torch.empty(sum(plan.recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, list(plan.recv_sizes), list(plan.send_sizes), group=pg)
    del send
    out = []
    jobs = []
    for i, n in enumerate(plan.chunk_numels):
        segs = plan.recv_segments[i]
        if len(segs) == 1:
            # The chunk came whole from one rank: a view, no copy (all of
            # recv belongs to some chunk, so the views waste nothing).
            off, k = segs[0]
            out.append(recv[off : off + k])
            continue
        chunk = torch.empty(n, dtype=dtype, device=device)
        jobs.append((recv, segs, chunk))
        out.append(chunk)
    _flatops.pack_segments_many(jobs)  # the chunks cut by a shard boundary, one C batch
    return out


def _zeros(cache: list[torch.Tensor], n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` zeros, a view of one zero buffer kept in ``cache`` (grown as
    needed) for the messages of a parameter without state."""
    if not cache or cache[0].numel() < n:
        cache[:] = [torch.zeros(n, dtype=dtype)]
    return cache[0][:n]


def _dim0_chunks_p2p(
    local: torch.Tensor | list[torch.Tensor | None],
    layout: _flatops.UnitLayout,
    plan: _flatops.Dim0Plan,
    pg: dist.ProcessGroup | None,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """``_dim0_chunks`` as point-to-point messages (gloo): each segment of
    the local state goes from where it lies, each received piece lands in
    its chunk; nothing is packed or unpacked."""
    msgs = _flatops.dim0_messages(plan)
    me = layout.rank
    out = [torch.empty(n, dtype=dtype) for n in plan.chunk_numels]
    zeros: list[torch.Tensor] = []

    def segments(segs: tuple[tuple[int, int], ...]) -> list[torch.Tensor]:
        if isinstance(local, list):
            views = _flatops.local_segment_views(layout, local, segs)
        else:
            views = [local[off : off + n] for off, n in segs]
        res = []
        for v, (_, n) in zip(views, segs):
            if v is None:  # a parameter without this state: zeros, as the packed buffer held
                v = _zeros(zeros, n, dtype)
            elif v.dtype != dtype:
                raise ValueError(f"local optimizer state is {v.dtype}, expected {dtype}")
            res.append(v.contiguous())
        return res

    def pieces(r: int) -> list[torch.Tensor]:
        return [out[i][at : at + k] for i, at, k in msgs.chunk_side[r]]

    for src, dst in zip(segments(msgs.shard_side[me]), pieces(me)):
        dst.copy_(src)
    sends = [(t, r) for r in range(layout.world_size) if r != me
             for t in segments(msgs.shard_side[r])]
    recvs = [(t, r) for r in range(layout.world_size) if r != me for t in pieces(r)]
    comm.exchange(sends, recvs, pg)
    return out


def _sharded_tensor(fsdp_state: Any, chunk: torch.Tensor, size: torch.Size) -> ShardedTensor:
    """torch's ``_create_chunk_sharded_tensor`` for a ``size`` tensor of which we hold our chunk."""
    ws, rank, pg = fsdp_state.world_size, fsdp_state.rank, fsdp_state.process_group
    chunks = torch.empty(size, device="meta").chunk(ws, dim=0)
    local_shards = []
    if len(chunks) > rank:
        offsets = [0] * len(size)
        offsets[0] = math.ceil(size[0] / ws) * rank
        local = chunk.view(chunks[rank].shape)
        local_shards = [Shard.from_tensor_and_offsets(local, offsets, rank)]
    chunk_sizes = [list(c.size()) for c in chunks]
    dim0_offsets = [0] + list(itertools.accumulate(cs[0] for cs in chunk_sizes))[:-1]
    chunk_offsets = [[d0] + [0] * (len(size) - 1) for d0 in dim0_offsets]
    device_type = _get_pg_default_device(pg).type
    ndev = fsdp_state._device_handle.device_count()
    placements = [
        _get_remote_device_str(dist.get_global_rank(pg, r), device_type, ndev)
        for r in range(len(chunk_sizes))
    ]
    metadata = ShardedTensorMetadata(
        shards_metadata=[
            ShardMetadata(off, sz, pl)
            for off, sz, pl in zip(chunk_offsets, chunk_sizes, placements)
        ],
        size=size,
        tensor_properties=TensorProperties(
            dtype=chunk.dtype,
            layout=chunk.layout,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        ),
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=metadata, process_group=pg
    )


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


# ---------------------------------------------------------------------------
# Save: flat shards -> per-parameter state
# ---------------------------------------------------------------------------


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
    layout = _layout(info)
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
            if shard_state and _fast_sharded(fsdp_state):
                chunks = _dim0_chunks(
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
                state[name] = _sharded_tensor(fsdp_state, chunked[name][i], layout.shapes[i])
                continue
            v = views[name][i]
            state[name] = _chunk(fsdp_state, v) if shard_state else v
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
        if not _is_sharded(info.state):
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
    if not _is_sharded(fsdp_state):
        return input_states if to_save else {}
    assert gathered_info is not None
    output_states: dict[str, dict[str, Any]] = {fqn: {} for fqn in input_states}
    dtype, state_buffers = _convert_all_state_info(info, gathered_info, input_states, output_states)
    if state_buffers:
        layout = _layout(info)
        device = fsdp_state.compute_device
        for name, pieces in state_buffers.items():
            chunks = None
            if shard_state and _fast_sharded(fsdp_state):
                chunks = _dim0_chunks(
                    list(pieces), layout, fsdp_state.process_group, repr(name), dtype, device
                )
            if chunks is not None:
                for fqn, idx in info.param_indices.items():
                    if fqn in output_states:
                        value = _sharded_tensor(fsdp_state, chunks[idx], layout.shapes[idx])
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
                    value = _chunk(fsdp_state, value)
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
def _optim_state_dict(
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


# ---------------------------------------------------------------------------
# Load: per-parameter state -> this rank's flat shard
# ---------------------------------------------------------------------------


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
# Load from a sharded state: every rank's dim-0 chunks -> this rank's flat shard
# ---------------------------------------------------------------------------


def _is_dist_tensor(v: Any) -> bool:
    return isinstance(v, (ShardedTensor, DTensor))


def _dist_shape(v: ShardedTensor | DTensor) -> torch.Size:
    return torch.Size(v.metadata().size if isinstance(v, ShardedTensor) else v.shape)


def _dist_dtype(v: ShardedTensor | DTensor) -> torch.dtype:
    return v.metadata().tensor_properties.dtype if isinstance(v, ShardedTensor) else v.dtype


def _dim0_check(fsdp_state: Any, value: Any, shape: torch.Size) -> tuple[bool, str | None]:
    """Is ``value`` (a ShardedTensor or DTensor) torch's dim-0 chunks of a
    ``shape`` tensor over the unit's process group (``torch.chunk(t, W, 0)[r]``
    on group rank ``r``, as the SHARDED state dict holds it)?

    The answer comes from the value's global metadata only, which every rank
    holds alike, so every rank takes the same path. The second element says
    what is wrong with this rank's local shard when the metadata says yes
    (None: nothing).
    """
    if not _is_dist_tensor(value) or len(shape) == 0 or shape[0] == 0:
        return False, None
    if _dist_shape(value) != shape:
        return False, None  # the gather path reports torch's shape error
    ws, rank, pg = fsdp_state.world_size, fsdp_state.rank, fsdp_state.process_group
    chunks = torch.empty(shape, device="meta").chunk(ws, dim=0)
    step = -(-shape[0] // ws)
    ranks = [dist.get_global_rank(pg, r) for r in range(ws)]
    want = tuple(chunks[rank].shape) if rank < len(chunks) else (0, *shape[1:])
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        if (
            mesh.ndim != 1
            or tuple(value.placements) != (DShard(0),)
            or mesh.mesh.flatten().tolist() != ranks
        ):
            return False, None
        local = value.to_local()
        if tuple(local.shape) != want or local.dtype != value.dtype:
            return True, (
                f"its DTensor's local tensor is {tuple(local.shape)} {local.dtype}, "
                f"rank {rank}'s chunk is {want} {value.dtype}"
            )
        return True, None
    md = value.metadata()
    if len(md.shards_metadata) != len(chunks):
        return False, None
    seen = set()
    for m in md.shards_metadata:
        off = list(m.shard_offsets)
        k = off[0] // step
        if (
            any(off[1:])
            or off[0] % step
            or k >= len(chunks)
            or k in seen
            or list(m.shard_sizes) != list(chunks[k].shape)
            or m.placement is None
            or m.placement.rank() != ranks[k]
        ):
            return False, None
        seen.add(k)
    shards = value.local_shards()
    if rank >= len(chunks):
        if shards:
            return True, f"rank {rank} holds {len(shards)} local shards, its chunk is empty"
        return True, None
    if (
        len(shards) != 1
        or list(shards[0].metadata.shard_offsets) != [rank * step] + [0] * (len(shape) - 1)
        or tuple(shards[0].tensor.shape) != want
        or shards[0].tensor.dtype != md.tensor_properties.dtype
    ):
        got = [(list(sh.metadata.shard_offsets), tuple(sh.tensor.shape)) for sh in shards]
        return True, (
            f"its ShardedTensor's local shards are {got}, rank {rank}'s chunk is "
            f"{want} at row {rank * step} ({md.tensor_properties.dtype})"
        )
    return True, None


def _local_chunk(value: ShardedTensor | DTensor) -> torch.Tensor | None:
    if isinstance(value, DTensor):
        return value.to_local()
    shards = value.local_shards()
    return shards[0].tensor if shards else None


def _agree_sharded(
    fqn_to_info: dict[str, FSDPParamInfo],
    unflat_state: dict[Any, Any],
    group: dist.ProcessGroup | None,
) -> None:
    """One small all-reduce before a sharded load: every rank must see the
    same parameters, state names, types, shapes and shard layouts (so every
    rank runs the same collectives), and no rank's local shard may disagree
    with its metadata. Otherwise every rank raises, instead of one rank
    raising while the others wait in a collective."""
    if dist.get_world_size(group) == 1:
        return
    desc: list[str] = []
    errors: list[str] = []
    for fqn in sorted(k for k in unflat_state if isinstance(k, str) and k in fqn_to_info):
        state = unflat_state[fqn]
        if not isinstance(state, dict):
            continue
        info = fqn_to_info[fqn]
        shape = torch.Size(info.handle.flat_param._shapes[info.param_indices[fqn]])
        for name in sorted(state, key=str):
            v = state[name]
            if _is_dist_tensor(v):
                ok, err = _dim0_check(info.state, v, shape)
                kind = f"{type(v).__name__}:{ok}:{_dist_dtype(v)}:{tuple(_dist_shape(v))}"
                if err is not None:
                    errors.append(f"state {name!r} of {fqn!r}: {err}")
            elif torch.is_tensor(v) and v.dim() > 0:
                kind = f"Tensor:{v.dtype}:{tuple(v.shape)}"
            else:
                continue
            desc.append(f"{fqn}\0{name}\0{kind}")
    digest = hashlib.blake2b("\n".join(desc).encode(), digest_size=7).digest()
    h = int.from_bytes(digest, "little")
    flags = torch.tensor([h, -h, -len(errors)], dtype=torch.int64)
    flags = flags.to(_get_pg_default_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
    lo, hi, bad = (int(x) for x in flags.cpu())
    if errors:
        raise ValueError(
            "sharded optimizer state whose local shard does not match its metadata: "
            + "; ".join(errors[:4])
            + (f" (and {len(errors) - 4} more)" if len(errors) > 4 else "")
        )
    if bad:
        raise ValueError(
            "another rank holds sharded optimizer state whose local shard does not match "
            "its metadata (that rank's error names it)"
        )
    if lo != -hi:
        raise ValueError(
            "the sharded optimizer state differs between ranks (parameters, state names, "
            "types, shapes or shard layouts): every rank must pass the same structure"
        )


def _exchange_chunks(
    fsdp_state: Any,
    layout: _flatops.UnitLayout,
    chunks: list[torch.Tensor | None],
    dtype: torch.dtype,
    into: Any = None,
) -> list[tuple[int, torch.Tensor]] | None:
    """The inverse of ``_dim0_chunks``, one exchange: every rank's dim-0
    chunks of the unit's parameters (``chunks[i]``, None for zeros) -> the
    pieces of this rank's local flat state, as ``(offset, piece)`` pairs in
    the flat shard (or, not sharded, the whole unpadded flat buffer).

    Sharded: one ``all_to_all_single`` on ``dim0_plan`` with the roles
    swapped (what the save receives is sent, what it sends is received), so
    every rank receives only its shard. On a gloo group, given ``into``
    (``into(offset, numel)``: the 1-D view of the final destination of that
    part of the flat shard, or None to drop it), the pieces travel as
    point-to-point messages straight from the chunks into their
    destinations instead, and the result is None: every non-padding element
    of the shard has been written, the padding is left alone. NO_SHARD: one
    all-gather of every rank's packed chunks (every rank needs the whole unit).
    """
    pg, device = fsdp_state.process_group, fsdp_state.compute_device
    ws, rank = fsdp_state.world_size, fsdp_state.rank
    numels = _flatops.dim0_chunk_numels(layout.shapes, ws)
    if numels is None or len(chunks) != layout.num_params:
        raise AssertionError("a unit without dim-0 chunks has no chunk exchange")
    for i, c in enumerate(chunks):
        if c is not None and c.numel() != numels[rank][i]:
            raise ValueError(
                f"parameter {i}'s dim-0 chunk has {c.numel()} elements, rank {rank}'s "
                f"chunk of a {tuple(layout.shapes[i])} tensor has {numels[rank][i]}"
            )
    if layout.sharded:
        plan = _flatops.dim0_plan(layout)
        assert plan is not None
        if into is not None and device.type == "cpu" and comm.point_to_point([], pg):
            _exchange_chunks_p2p(layout, plan, chunks, dtype, into, pg)
            return None
        send = torch.empty(sum(plan.recv_sizes), dtype=dtype, device=device)
        _flatops.pack_chunks_into(plan, chunks, send)
        recv = torch.empty(sum(plan.send_sizes), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, list(plan.send_sizes), list(plan.recv_sizes), group=pg)
        return _flatops.shard_pieces(plan, recv)
    per_rank = sum(numels[0])  # rank 0 holds the largest chunks
    send = torch.empty(per_rank, dtype=dtype, device=device)
    items, pos = [], 0
    for i, c in enumerate(chunks):
        if c is not None:
            items.append((pos, c))
        pos += numels[rank][i]
    _flatops.place_many([(send, items)])
    if ws > 1:
        every = torch.empty(ws * per_rank, dtype=dtype, device=device)
        comm.all_gather_into(every, send, pg)
    else:
        every = send
    out = []
    for r in range(ws):
        pos = r * per_rank
        for i, n in enumerate(numels[r]):
            if n:
                out.append((layout.offsets[i] + r * numels[0][i], every[pos : pos + n]))
            pos += n
    return out


def _exchange_chunks_p2p(
    layout: _flatops.UnitLayout,
    plan: _flatops.Dim0Plan,
    chunks: list[torch.Tensor | None],
    dtype: torch.dtype,
    into: Any,
    pg: dist.ProcessGroup | None,
) -> None:
    """``_exchange_chunks``'s sharded exchange as point-to-point messages
    (gloo): ``_dim0_chunks_p2p`` backwards."""
    msgs = _flatops.dim0_messages(plan)
    me = layout.rank
    zeros: list[torch.Tensor] = []

    def pieces(r: int) -> list[torch.Tensor]:
        res = []
        for i, at, k in msgs.chunk_side[r]:
            c = chunks[i]
            if c is None:  # no state for this parameter: zeros, as the packed buffer held
                res.append(_zeros(zeros, k, dtype))
                continue
            if c.dtype != dtype:
                raise ValueError(f"parameter {i}'s dim-0 chunk is {c.dtype}, expected {dtype}")
            res.append(c.reshape(-1)[at : at + k].contiguous())
        return res

    def dests(r: int) -> list[torch.Tensor]:
        res = []
        for off, n in msgs.shard_side[r]:
            v = into(off, n)
            if v is None:
                v = torch.empty(n, dtype=dtype)  # received and dropped
            elif v.dtype != dtype or v.numel() != n or not v.is_contiguous():
                raise AssertionError(f"the destination of ({off}, {n}) is not {n} {dtype}")
            res.append(v)
        return res

    for src, dst in zip(pieces(me), dests(me)):
        dst.copy_(src)
    sends = [(t, r) for r in range(layout.world_size) if r != me for t in pieces(r)]
    recvs = [(t, r) for r in range(layout.world_size) if r != me for t in dests(r)]
    comm.exchange(sends, recvs, pg)


def _sharded_unit_states(
    info: FSDPParamInfo,
    layout: _flatops.UnitLayout,
    states: list[dict[str, Any] | None],
) -> tuple[list[dict[str, Any] | None], set[str]]:
    """A FlatParameter's per-parameter sharded states -> the states torch's
    checks see, and the state names loaded by ``_exchange_chunks``.

    A state name whose every value is dim-0 chunked (``_dim0_check``) keeps
    only its shape and dtype here; other ShardedTensor / DTensor values are
    gathered whole, as torch does, in the same order on every rank.
    """
    fsdp_state = info.state
    chunkable = _flatops.dim0_chunk_numels(layout.shapes, 1) is not None
    names = sorted({n for s in states if s for n in s}, key=str)
    fast: set[str] = set()
    for name in names:
        present = [
            (s[name], layout.shapes[i]) for i, s in enumerate(states) if s and name in s
        ]
        if chunkable and all(_dim0_check(fsdp_state, v, shape)[0] for v, shape in present):
            fast.add(name)
    out: list[dict[str, Any] | None] = []
    for s in states:
        if s is None:
            out.append(None)
            continue
        slow = {n: s[n] for n in sorted(s, key=str) if n not in fast and _is_dist_tensor(s[n])}
        gathered = (
            _gather_state_dict(slow, pg=fsdp_state.process_group, device=fsdp_state.compute_device)
            if slow
            else {}
        )
        out.append(
            {
                n: _PosDimTensorInfo(_dist_shape(v), _dist_dtype(v))
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
    layout = _layout(info)
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
                    _local_chunk(s[state_name]) if s is not None else None for s in raw
                ]
                shard = torch.empty(layout.shard_numel, dtype=dtype, device=cpu)
                items = _exchange_chunks(
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
    layout = _layout(info)
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
    chunkable = _flatops.dim0_chunk_numels(layout.shapes, 1) is not None
    groups: dict[tuple[str, torch.dtype], dict[int, Any]] = {}
    for fqn in fqns:
        idx = info.param_indices[fqn]
        for name, v in unflat_state[fqn].items():
            if chunkable and _dim0_check(fsdp_state, v, layout.shapes[idx])[0]:
                groups.setdefault((name, _dist_dtype(v)), {})[idx] = v
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
            _local_chunk(by_idx[i]) if i in by_idx else None for i in range(layout.num_params)
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

        items = _exchange_chunks(fsdp_state, layout, chunks, dtype, into=into)
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
            if (idx, n) not in fast and _is_dist_tensor(state[n])
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


def _flatten_optim_state_dict(
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
        _agree_sharded(
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


# ---------------------------------------------------------------------------
# The public functions (torch 2.13's FSDP static methods)
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
    return _optim_state_dict(
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
        sharded = _flatten_optim_state_dict(
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
