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
:func:`_fsdp1_optim_state_dict` / :func:`_fsdp1_optim_state_dict_to_load`
for the optimizer. Everything else (FQN mapping, tied and frozen
parameters, gathering, offload, broadcast and resharding of full state
dicts) is done here.

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

Importing this module imports torch.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import chain
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp import (
    FullyShardedDataParallel as FSDP,
)
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX, _IncompatibleKeys
from torch.nn.parallel import DistributedDataParallel as DDP

from .._util import gc_paused

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

FQNS_T = set[str]
PrimitiveType = DTensor | ShardedTensor | torch.Tensor | int | float | str
ValueType = (
    PrimitiveType | list[PrimitiveType] | tuple[PrimitiveType] | dict[str, "ValueType"]
)
DictValueType = dict[str, ValueType]
ListDictValueType = list[DictValueType]
OptimizerStateType = dict[str, DictValueType | ListDictValueType]

_STATE = "state"
_PG = "param_groups"
_PARAMS = "params"
_FLAT_PARAM = "_flat_param"
_FSDP_WRAPPED = "_fsdp_wrapped_module"
_COMPILED = "_orig_mod"
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


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


class _ExtraState:
    """Stands for a module's ``_extra_state`` entry while loading."""


class _TensorInfo(NamedTuple):
    """What rank 0 tells the others about a tensor it is about to broadcast."""

    size: torch.Size
    dtype: torch.dtype


# --------------------------------------------------------------------------- FQNs


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


# ------------------------------------------------------ gathering and offloading


def _gather_sharded_tensor(value: ShardedTensor) -> torch.Tensor:
    """All-gather a ShardedTensor chunked along dim 0 over the default group
    (FSDP1's layout): every rank contributes its shard padded to one chunk."""
    world = dist.get_world_size()
    size = value.size()
    numel = size.numel()
    chunk = -(-size[0] // world) * (numel // size[0]) if size[0] else 0
    shards = value.local_shards()
    device = shards[0].tensor.device if shards else torch.device("cpu")
    mine = torch.zeros(chunk, dtype=value.dtype, device=device)
    if shards:
        local = shards[0].tensor.reshape(-1)
        if local.numel() > chunk:
            raise ValueError(
                f"ShardedTensor shard of {local.numel()} elements exceeds the "
                f"{chunk}-element chunk of a dim-0 split over {world} ranks"
            )
        mine[: local.numel()] = local
    out = torch.empty(chunk * world, dtype=value.dtype, device=device)
    from .. import comm

    comm.all_gather_into(out, mine)  # NCCL for CUDA shards; older torch's name too
    return out[:numel].reshape(size)


def _gather(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        full = value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)
        local = full.to_local()
        wait = getattr(local, "wait", None)  # an AsyncCollectiveTensor
        return wait() if callable(wait) else local
    if isinstance(value, ShardedTensor):
        return _gather_sharded_tensor(value)
    return value


_PLAIN_LEAVES = (int, float, str, bytes, type(None))


def _map_state(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Copy of nested dicts/lists/tuples with ``fn`` applied to each tensor
    (depth first, in order, so collectives line up across ranks)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, _PLAIN_LEAVES) or type(obj).__name__ == "BytesIO":
        return obj
    if isinstance(obj, dict):
        return {k: _map_state(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_state(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_state(v, fn) for v in obj)
    raise ValueError(f"Unexpected value type {type(obj)}")


def _full_or_offloaded(state: dict[str, Any], info: _Info) -> dict[str, Any]:
    """Apply ``full_state_dict`` / ``cpu_offload`` to a state dict being saved."""
    cpu = torch.device("cpu")
    if info.full_state_dict:
        rank0_only = info.cpu_offload and dist.is_initialized()
        keep = not rank0_only or dist.get_rank() == 0

        def full(t: torch.Tensor) -> torch.Tensor | None:
            t = _gather(t)  # every rank takes part
            if not keep:
                return None  # dropped at once: other ranks never hold the whole
            return t.to(cpu) if info.cpu_offload else t

        result = _map_state(state, full)
        return result if keep else {}
    if info.cpu_offload:
        return _map_state(state, lambda t: t.to(cpu))
    return state


# ------------------------------------------------------------------ model get


def _get_model_state_dict(model: nn.Module, info: _Info) -> dict[str, ValueType]:
    if not info.handle_model:
        return {}
    with info.fsdp_context():
        state = model.state_dict()
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


# ----------------------------------------------------------------- model set


def _shard_like(local: DTensor, full: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``local``'s shard of the full tensor: copied into ``local`` itself
    (``in_place``, unless it lives on the meta device) or a new DTensor.
    A tensor of another shape, or a DTensor, is returned as it is, for
    ``load_state_dict`` to copy or to report (``size mismatch for ...``)."""
    if isinstance(full, DTensor) or tuple(full.shape) != tuple(local.shape):
        return full
    shape, offset = compute_local_shape_and_global_offset(
        full.shape, local.device_mesh, local.placements
    )
    piece = full[tuple(slice(o, o + n) for n, o in zip(shape, offset))]
    if in_place and not local.is_meta:
        local.to_local().copy_(piece)
        return local
    device = full.device if local.is_meta else local.to_local().device
    return DTensor.from_local(
        piece.detach().to(device).clone(),
        local.device_mesh,
        local.placements,
        shape=local.shape,
        stride=local.stride(),
    )


def _broadcast_from_rank0(
    full: dict[str, Any],
    local: dict[str, Any],
    device: torch.device,
    *,
    strict: bool,
    cpu_offload: bool,
) -> None:
    """Rank 0's ``full`` into every rank's ``local`` (in place): one object
    broadcast with the keys, small values and tensor sizes, then the tensors
    in buckets (:func:`_broadcast_tensors`), each cut to the local shard as
    it arrives."""
    rank = dist.get_rank()

    def describe() -> dict[str, Any]:
        header: dict[str, Any] = {}
        for key, value in full.items():
            if not torch.is_tensor(value):
                header[key] = value
            elif value.dim() == 0:
                header[key] = value.cpu()
            else:
                _full_for_broadcast(value, key)
                header[key] = _TensorInfo(value.size(), value.dtype)
        return header

    header = _header_from_rank0(describe)

    keys = []
    for key, info in header.items():
        if isinstance(info, _TensorInfo):
            keys.append(key)
        elif key in local:
            local[key] = info

    def deliver(i: int, buf: torch.Tensor) -> None:
        mine = local.get(keys[i])
        if mine is None:
            return
        mine = _shard_like(mine, buf, in_place=True) if isinstance(mine, DTensor) else buf
        local[keys[i]] = mine.cpu() if cpu_offload else mine

    sources = (full[k] for k in keys) if rank == 0 else None
    _broadcast_tensors([header[k] for k in keys], sources, device, deliver)
    if strict:
        for key in [k for k in local if k not in header]:
            del local[key]


# Small tensors of one dtype travel together, up to this many bytes a broadcast.
_BUCKET_BYTES = 16 << 20


def _broadcast_tensors(
    infos: list[_TensorInfo],
    sources: Iterator[torch.Tensor] | None,
    device: torch.device,
    deliver: Callable[[int, torch.Tensor], None],
) -> None:
    """Broadcast rank 0's tensors (``sources``, described by ``infos``; None
    on the other ranks). Runs of one dtype go as one flat buffer of at most
    _BUCKET_BYTES (a bigger tensor alone, without a copy on rank 0): one
    collective per bucket. ``deliver(i, tensor)`` gets each tensor as soon
    as its bucket arrived, so at most one bucket (or one big tensor) of full
    tensors exists at a time beyond what ``deliver`` keeps."""
    rank = dist.get_rank()
    i = 0
    while i < len(infos):
        dtype = infos[i].dtype
        item = torch.empty((), dtype=dtype).element_size()
        j, nbytes = i, 0
        while j < len(infos) and infos[j].dtype == dtype:
            size = infos[j].size.numel() * item
            if j > i and nbytes + size > _BUCKET_BYTES:
                break
            nbytes += size
            j += 1
        group = infos[i:j]
        if rank == 0:
            assert sources is not None
            tensors = [_full_for_broadcast(next(sources), f"#{k}").to(device)
                       for k in range(i, j)]
        if j - i == 1:
            buf = (tensors[0].contiguous() if rank == 0
                   else torch.empty(group[0].size, dtype=dtype, device=device))
            dist.broadcast(buf, src=0)
            deliver(i, buf)
        else:
            flat = (torch.cat([t.reshape(-1) for t in tensors]) if rank == 0
                    else torch.empty(nbytes // item, dtype=dtype, device=device))
            dist.broadcast(flat, src=0)
            at = 0
            for k, info in enumerate(group):
                n = info.size.numel()
                # A copy: nothing keeps the bucket alive or shares its storage.
                deliver(i + k, flat[at:at + n].view(info.size).clone())
                at += n
        i = j


def _header_from_rank0(describe: Callable[[], Any]) -> Any:
    """``describe()`` run on rank 0 and sent to every rank; if it raises,
    every rank raises (none is left waiting in a broadcast)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [(True, describe())]
        except (ValueError, TypeError, KeyError, RuntimeError) as e:
            box = [(False, e)]
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _full_for_broadcast(value: torch.Tensor, key: str) -> torch.Tensor:
    if isinstance(value, (DTensor, ShardedTensor)):
        raise ValueError(
            f"broadcast_from_rank0 needs full tensors on rank 0, but '{key}' is a "
            f"{type(value).__name__} (get it with full_state_dict=True)"
        )
    return value.detach()


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
            _IncompatibleKeys, model.load_state_dict(state, strict=info.strict, assign=assign)
        )


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
        osd = optim.state_dict()
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
    local = _rekey_by_fqn(model, optim, optim.state_dict())
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
        optim.load_state_dict(osd)


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


# ------------------------------------------------------------------ public API


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
