"""shardstate.fsdp's FSDP1 optimizer-state functions against torch 2.13's own.

Every check runs on real processes (gloo, CPU FSDP1 with
``device_id=torch.device("cpu")``) and compares our result with what the
``FullyShardedDataParallel`` static method of the same name returns for the
same model and optimizer, right after it: keys (in order), ``param_groups``,
every tensor bitwise (``torch.equal`` and dtype; ShardedTensors shard by
shard with their offsets), scalar and non-tensor state. Loading goes both
ways (our save into torch's load and torch's save into ours) and through
``optim.load_state_dict`` to the optimizer's own state dict.

Models: nested FSDP units, a tied embedding/head, a frozen layer, a
parameter that never gets a gradient (no state), several param groups,
``use_orig_params`` False and True, odd sizes over 1-4 ranks. Optimizers:
Adam, AdamW, SGD with momentum, SGD without (no state at all).

One case differs from torch on purpose: with ``use_orig_params=True``,
``offload_to_cpu=True`` and CPU state, torch 2.13 gathers every state name
of a unit into one reused buffer and returns views of it, so its
``exp_avg`` comes back holding ``exp_avg_sq``. There we compare with
torch's ``offload_to_cpu=False`` result (the right numbers) and check that
torch's own is the aliased one.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import shardstate.fsdp as ssf
import torch
import torch.distributed as dist
import torch.nn as nn
from shardstate.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.tensor import DTensor

CPU = torch.device("cpu")
OPTIMS = ("adam", "adamw", "sgd_momentum", "sgd")


# ---------------------------------------------------------------------------
# Models and training
# ---------------------------------------------------------------------------


class Nested(nn.Module):
    """Odd sizes; a tied embedding/head; a frozen layer; ``unused`` never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.block1 = nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5))
        self.block2 = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 6))
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(3))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        h = self.block2(self.block1(h))
        return self.head(self.frozen(h))


def _wrap(use_orig_params: bool, strategy: ShardingStrategy | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = Nested()
    kw: dict[str, Any] = dict(device_id=CPU, use_orig_params=use_orig_params)
    if strategy is not None:
        kw["sharding_strategy"] = strategy
    model.block1 = FSDP(model.block1, **kw)
    model.block2 = FSDP(model.block2, **kw)
    if not use_orig_params:
        # A FlatParameter needs uniform requires_grad; with use_orig_params the
        # frozen layer shares the root unit with trainable parameters.
        model.frozen = FSDP(model.frozen, **kw)
    return FSDP(model, **kw)


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    params = list(model.parameters())
    k = max(1, len(params) // 2)
    groups: list[dict[str, Any]] = [{"params": params[:k]}, {"params": params[k:], "lr": 0.03}]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)
    if kind == "sgd_momentum":
        return torch.optim.SGD(groups, lr=0.01, momentum=0.9)
    return torch.optim.SGD(groups, lr=0.01)


def _train(model: nn.Module, optim: torch.optim.Optimizer, rank: int, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        idx = torch.randint(0, 11, (4, 3), generator=gen)
        model(idx).square().mean().backward()
        optim.step()
        optim.zero_grad()


def _setup(
    rank: int, use_orig_params: bool, kind: str, strategy: ShardingStrategy | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _wrap(use_orig_params, strategy)
    optim = _optimizer(model, kind)
    _train(model, optim, rank)
    return model, optim


def _set_type(
    model: nn.Module, sharded: bool, rank0_only: bool = False, offload: bool = True
) -> None:
    if sharded:
        FSDP.set_state_dict_type(
            model,
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(),
            ShardedOptimStateDictConfig(offload_to_cpu=offload),
        )
    else:
        FSDP.set_state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(),
            FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
        )


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------


def assert_same(ours: Any, theirs: Any, path: str = "osd") -> None:
    """Equal structure, key order, types, dtypes and bits."""
    assert type(ours) is type(theirs), (
        f"{path}: type {type(ours).__name__} != {type(theirs).__name__}"
    )
    if isinstance(theirs, ShardedTensor):
        assert ours.metadata().size == theirs.metadata().size, f"{path}: global size"
        assert [(m.shard_offsets, m.shard_sizes) for m in ours.metadata().shards_metadata] == [
            (m.shard_offsets, m.shard_sizes) for m in theirs.metadata().shards_metadata
        ], f"{path}: shard layout"
        a, b = ours.local_shards(), theirs.local_shards()
        assert len(a) == len(b), f"{path}: {len(a)} local shards != {len(b)}"
        for i, (sa, sb) in enumerate(zip(a, b)):
            assert sa.metadata.shard_offsets == sb.metadata.shard_offsets, f"{path}[{i}]: offsets"
            assert_same(sa.tensor, sb.tensor, f"{path}.shard{i}")
    elif isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype, f"{path}: dtype {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, (
            f"{path}: shape {tuple(ours.shape)} != {tuple(theirs.shape)}"
        )
        assert ours.device == theirs.device, f"{path}: device {ours.device} != {theirs.device}"
        assert torch.equal(ours, theirs), f"{path}: values differ\n{ours}\n{theirs}"
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), f"{path}: keys {list(ours)} != {list(theirs)}"
        for k in theirs:
            assert_same(ours[k], theirs[k], f"{path}[{k!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), f"{path}: length {len(ours)} != {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"


def _same_set(ours: dict[Any, Any], theirs: dict[Any, Any], path: str) -> None:
    """As assert_same for a state dict whose key order torch leaves to a set's hash order."""
    assert set(ours) == set(theirs), (
        f"{path}: keys {sorted(map(str, ours))} != {sorted(map(str, theirs))}"
    )
    for k in theirs:
        a, b = ours[k], theirs[k]
        if isinstance(b, dict):
            _same_set(a, b, f"{path}[{k!r}]")
        else:
            assert_same(a, b, f"{path}[{k!r}]")


def _same_loadable(ours: dict[str, Any], theirs: dict[str, Any], path: str) -> None:
    assert set(ours) == set(theirs), f"{path}: top-level keys"
    _same_set(ours["state"], theirs["state"], f"{path}.state")
    if "param_groups" in theirs:
        assert_same(ours["param_groups"], theirs["param_groups"], f"{path}.param_groups")


def _aliased(osd: dict[str, Any]) -> bool:
    """torch's use_orig_params + offload_to_cpu CPU result: exp_avg holds exp_avg_sq's numbers."""
    return all(
        torch.equal(s["exp_avg"], s["exp_avg_sq"]) for s in osd["state"].values() if "exp_avg" in s
    )


def _torch_aliases(
    use_orig_params: bool, kind: str, world_size: int, strategy: ShardingStrategy | None = None
) -> bool:
    """Whether torch's full save with offload_to_cpu=True returns aliased state here
    (NO_SHARD gathers nothing, so nothing is aliased)."""
    sharded = world_size > 1 and strategy != ShardingStrategy.NO_SHARD
    return use_orig_params and sharded and kind in ("adam", "adamw")


def _quiet() -> warnings.catch_warnings:
    cm = warnings.catch_warnings()
    cm.__enter__()
    # torch's legacy functions and its FSDP1 deprecation notices.
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", UserWarning)
    return cm


# ---------------------------------------------------------------------------
# The matrix: one process group per world size runs every case
# ---------------------------------------------------------------------------


def _check_case(
    rank: int,
    world_size: int,
    use_orig_params: bool,
    kind: str,
    strategy: ShardingStrategy | None = None,
) -> int:
    model, optim = _setup(rank, use_orig_params, kind, strategy)
    local = copy.deepcopy(optim.state_dict())
    checks = 0

    def restore() -> None:
        optim.load_state_dict(copy.deepcopy(local))

    # --- optim_state_dict, every type and config -------------------------
    settings = [
        (False, False, False),  # full, all ranks, no offload
        (False, False, True),  # full, all ranks, offload (torch's default)
        (False, True, True),  # full, rank 0 only
        (False, True, False),
        (True, False, True),  # sharded
        (True, False, False),
    ]
    saved: dict[tuple[bool, bool, bool], tuple[dict, dict]] = {}
    for sharded, rank0_only, offload in settings:
        _set_type(model, sharded, rank0_only, offload)
        theirs = FSDP.optim_state_dict(model, optim)
        ours = ssf.optim_state_dict(model, optim)
        where = f"optim_state_dict(sharded={sharded}, rank0_only={rank0_only}, offload={offload})"
        torch_aliased = (
            _torch_aliases(use_orig_params, kind, world_size, strategy) and offload and not sharded
        )
        if torch_aliased:
            # Collective: every rank asks torch for the right numbers.
            _set_type(model, False, rank0_only, False)
            right = FSDP.optim_state_dict(model, optim)
        if rank0_only and rank != 0:
            assert ours == {} and theirs == {}, where
        elif torch_aliased:
            assert _aliased(theirs), (
                f"{where}: torch's result is no longer aliased; compare directly"
            )
            assert_same(ours, right, where)
            assert not _aliased(ours), where
        else:
            assert_same(ours, theirs, where)
        saved[(sharded, rank0_only, offload)] = (ours, theirs)
        checks += 1
        # Our result must not alias the optimizer's live state in a way a step
        # could corrupt: equal to torch's after torch's own call too.
        assert_same(optim.state_dict()["param_groups"], local["param_groups"], where)

    # --- optim_state_dict_to_load: ours and torch's, from both saves --------
    for (sharded, rank0_only, offload), (ours_sd, theirs_sd) in saved.items():
        _set_type(model, sharded, rank0_only, offload)
        where = (
            f"optim_state_dict_to_load(sharded={sharded}, rank0_only={rank0_only}, "
            f"offload={offload})"
        )
        theirs = FSDP.optim_state_dict_to_load(model, optim, copy.copy(theirs_sd))
        for src_name, src in (("our save", ours_sd), ("torch's save", theirs_sd)):
            aliased = (
                _torch_aliases(use_orig_params, kind, world_size, strategy)
                and offload
                and not sharded
            )
            if aliased and src is theirs_sd:
                continue  # torch's aliased result is not a state to load
            ours = ssf.optim_state_dict_to_load(model, optim, copy.copy(src))
            if aliased:
                # torch loaded its own aliased save; load the right one into torch instead.
                theirs = FSDP.optim_state_dict_to_load(model, optim, copy.copy(ours_sd))
            _same_loadable(ours, theirs, f"{where} from {src_name}")
            # Through the optimizer: the same state as torch's load, and the
            # state the optimizer had before the round trip.
            optim.load_state_dict(theirs)
            after_theirs = copy.deepcopy(optim.state_dict())
            optim.load_state_dict(ours)
            after_ours = copy.deepcopy(optim.state_dict())
            assert_same(after_ours, after_theirs, f"{where} from {src_name}: loaded")
            _same_loadable(after_ours, local, f"{where} from {src_name}: round trip")
            restore()
            checks += 1
    _set_type(model, False, False, False)

    # --- the legacy names --------------------------------------------------
    for r0 in (True, False):
        ours = ssf.full_optim_state_dict(model, optim, rank0_only=r0)
        theirs = FSDP.full_optim_state_dict(model, optim, rank0_only=r0)
        if _torch_aliases(use_orig_params, kind, world_size, strategy) and theirs:
            assert _aliased(theirs)
            theirs = saved[(False, False, False)][1]
        assert_same(ours, theirs, f"full_optim_state_dict(rank0_only={r0})")
        checks += 1
    full = saved[(False, False, False)][0]
    _same_loadable(
        ssf.shard_full_optim_state_dict(copy.copy(full), model, optim=optim),
        FSDP.shard_full_optim_state_dict(copy.copy(full), model, optim=optim),
        "shard_full_optim_state_dict",
    )
    _same_loadable(
        ssf.scatter_full_optim_state_dict(
            copy.copy(full) if rank == 0 else None, model, optim=optim
        ),
        FSDP.scatter_full_optim_state_dict(
            copy.copy(full) if rank == 0 else None, model, optim=optim
        ),
        "scatter_full_optim_state_dict",
    )
    sharded_ours = ssf.sharded_optim_state_dict(model, optim)
    assert_same(
        sharded_ours, FSDP.sharded_optim_state_dict(model, optim), "sharded_optim_state_dict"
    )
    _same_loadable(
        ssf.flatten_sharded_optim_state_dict(sharded_ours, model, optim),
        FSDP.flatten_sharded_optim_state_dict(sharded_ours, model, optim),
        "flatten_sharded_optim_state_dict",
    )
    checks += 4

    # --- rekey: a full state <-> a plain (non-wrapped) model's ids ------------
    torch.manual_seed(0)
    plain = Nested()
    plain_optim = _optimizer(plain, kind)
    for key_type, src in ((OptimStateKeyType.PARAM_ID, full),):
        ours = ssf.rekey_optim_state_dict(copy.copy(src), key_type, plain, optim=plain_optim)
        theirs = FSDP.rekey_optim_state_dict(copy.copy(src), key_type, plain, optim=plain_optim)
        assert_same(ours, theirs, f"rekey_optim_state_dict({key_type})")
        back_ours = ssf.rekey_optim_state_dict(
            ours, OptimStateKeyType.PARAM_NAME, plain, optim=plain_optim
        )
        back_theirs = FSDP.rekey_optim_state_dict(
            theirs, OptimStateKeyType.PARAM_NAME, plain, optim=plain_optim
        )
        assert_same(back_ours, back_theirs, "rekey_optim_state_dict(PARAM_NAME)")
        checks += 2
    return checks


def _matrix(rank: int, world_size: int) -> int:
    cm = _quiet()
    try:
        checks = 0
        for use_orig_params in (False, True):
            for kind in OPTIMS:
                try:
                    checks += _check_case(rank, world_size, use_orig_params, kind)
                except AssertionError as e:
                    raise AssertionError(f"use_orig_params={use_orig_params}, {kind}: {e}") from e
        return checks
    finally:
        cm.__exit__(None, None, None)


@pytest.mark.distributed_timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_matches_torch(run_distributed, world_size: int) -> None:
    checks = run_distributed(_matrix, world_size)
    assert len(set(checks)) == 1 and checks[0] > 100, checks


def _no_shard_matrix(rank: int, world_size: int) -> int:
    cm = _quiet()
    try:
        checks = 0
        for use_orig_params in (False, True):
            for kind in ("adam", "sgd_momentum"):
                try:
                    checks += _check_case(
                        rank, world_size, use_orig_params, kind, ShardingStrategy.NO_SHARD
                    )
                except AssertionError as e:
                    raise AssertionError(f"use_orig_params={use_orig_params}, {kind}: {e}") from e
        return checks
    finally:
        cm.__exit__(None, None, None)


@pytest.mark.distributed_timeout(600)
@pytest.mark.parametrize("world_size", [2, 3])
def test_no_shard_matches_torch(run_distributed, world_size: int) -> None:
    # ShardingStrategy.NO_SHARD: every rank holds the whole flat state; the
    # SHARDED state dict still chunks it over the ranks.
    checks = run_distributed(_no_shard_matrix, world_size)
    assert len(set(checks)) == 1 and checks[0] > 50, checks


# ---------------------------------------------------------------------------
# Collectives: one per unit and tensor state name; rank0_only gathers/scatters
# ---------------------------------------------------------------------------

_COUNTED = (
    "gather",
    "all_gather_single",
    "all_gather",
    "all_gather_into_tensor",
    "scatter",
    "broadcast",
    "all_to_all_single",
    "all_reduce",
    "isend",
    "irecv",
)
# shardstate.comm's transfers, counted as one each whatever they run on
# (gloo's point-to-point messages, a collective, NCCL); what they call
# inside is not counted again. On these gloo groups the dim-0 chunk
# exchanges are one comm.exchange (point-to-point messages straight
# between the state's own buffers) where NCCL runs one all_to_all_single.
_COMM_COUNTED = ("gather", "all_gather_into", "scatter", "broadcast", "exchange")


def _count_collectives(fn: Any) -> dict[str, int]:
    from shardstate import comm

    counts = dict.fromkeys(_COUNTED + tuple(f"comm.{n}" for n in _COMM_COUNTED), 0)
    saved = {name: getattr(dist, name) for name in _COUNTED}
    saved_comm = {name: getattr(comm, name) for name in _COMM_COUNTED}
    depth = [0]

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not depth[0]:
                counts[name] += 1
            return saved[name](*args, **kwargs)

        return call

    def counting_comm(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not depth[0]:
                counts[f"comm.{name}"] += 1
            depth[0] += 1
            try:
                return saved_comm[name](*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    for name in _COUNTED:
        setattr(dist, name, counting(name))
    for name in _COMM_COUNTED:
        setattr(comm, name, counting_comm(name))
    try:
        fn()
    finally:
        for name, f in saved.items():
            setattr(dist, name, f)
        for name, f in saved_comm.items():
            setattr(comm, name, f)
    return {k: v for k, v in counts.items() if v}


def _collectives(rank: int, world_size: int) -> dict[bool, list[dict[str, int]]]:
    cm = _quiet()
    try:
        result = {}
        for use_orig_params in (False, True):
            model, optim = _setup(rank, use_orig_params, "adam")
            out = []
            _set_type(model, False, rank0_only=True)
            full: dict[str, Any] = {}

            def save() -> None:
                full.update(ssf.optim_state_dict(model, optim))

            out.append(_count_collectives(save))
            out.append(_count_collectives(lambda: ssf.optim_state_dict_to_load(model, optim, full)))
            _set_type(model, False, rank0_only=False)
            out.append(_count_collectives(lambda: ssf.optim_state_dict(model, optim)))
            _set_type(model, True)
            out.append(_count_collectives(lambda: ssf.optim_state_dict(model, optim)))
            result[use_orig_params] = out
        return result
    finally:
        cm.__exit__(None, None, None)


def test_one_collective_per_unit_and_state(run_distributed) -> None:
    # Units with state: block1, block2 and the root (the frozen layer has
    # none); Adam's tensor states: exp_avg and exp_avg_sq -> 3 * 2.
    per_rank = run_distributed(_collectives, 3)
    for rank, by_flag in enumerate(per_rank):
        for use_orig_params, (r0_save, r0_load, full_save, sharded_save) in by_flag.items():
            where = (rank, use_orig_params)
            # With FlatParameters every save also runs the one all_reduce of
            # torch's key mapping (_map_param_key_to_optim_keys: keys missing?).
            key_check = {} if use_orig_params else {"all_reduce": 1}
            assert r0_save == {"comm.gather": 6, **key_check}, (where, r0_save)  # none full off 0
            assert r0_load == {"comm.scatter": 6}, (where, r0_load)  # no full tensor broadcast
            assert full_save == {"comm.all_gather_into": 6, **key_check}, (where, full_save)
            # Each rank receives only its dim-0 chunks, never the whole unit.
            assert sharded_save == {"comm.exchange": 6, **key_check}, (where, sharded_save)


# ---------------------------------------------------------------------------
# Loading a sharded state: one chunk exchange per unit and state name
# ---------------------------------------------------------------------------


def _wrap_mesh(use_orig_params: bool, world_size: int) -> nn.Module:
    """``_wrap`` on a device mesh: FSDP1's SHARDED optimizer state is then DTensors."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = Nested()
    kw = dict(device_id=CPU, use_orig_params=use_orig_params, device_mesh=mesh)
    model.block1 = FSDP(model.block1, **kw)
    model.block2 = FSDP(model.block2, **kw)
    if not use_orig_params:
        model.frozen = FSDP(model.frozen, **kw)
    return FSDP(model, **kw)


def _sharded_load_case(
    rank: int, world_size: int, mesh: bool, strategy: ShardingStrategy | None = None
) -> list[Any]:
    """Load torch's SHARDED save with ours and torch's; count our collectives."""
    cm = _quiet()
    try:
        out = []
        for use_orig_params in (False, True):
            for kind in ("adam", "sgd_momentum"):
                if mesh:
                    model = _wrap_mesh(use_orig_params, world_size)
                    optim = _optimizer(model, kind)
                    _train(model, optim, rank)
                else:
                    model, optim = _setup(rank, use_orig_params, kind, strategy)
                _set_type(model, True)
                saved = FSDP.optim_state_dict(model, optim)
                where = f"mesh={mesh} use_orig_params={use_orig_params} {kind}"
                values = [v for s in saved["state"].values() for v in s.values()]
                want = DTensor if mesh else ShardedTensor
                # torch keeps plain tensors at world size 1 and (use_orig_params) NO_SHARD
                plain = world_size == 1 or (use_orig_params and strategy is not None)
                assert plain or any(isinstance(v, want) for v in values), where
                if world_size > 1 and plain:
                    # Chunk them anyway: a sharded state from elsewhere loads too.
                    from torch.distributed.fsdp._shard_utils import (
                        _create_chunk_sharded_tensor as chunked,
                    )

                    saved["state"] = {
                        fqn: {
                            n: chunked(v, rank, world_size, 1, dist.group.WORLD)
                            if v.dim() > 0
                            else v
                            for n, v in state.items()
                        }
                        for fqn, state in saved["state"].items()
                    }
                theirs = FSDP.optim_state_dict_to_load(model, optim, copy.copy(saved))
                ours: dict[str, Any] = {}

                def load(saved: dict[str, Any] = saved, ours: dict[str, Any] = ours) -> None:
                    ours.update(ssf.optim_state_dict_to_load(model, optim, copy.copy(saved)))

                counts = _count_collectives(load)
                _same_loadable(ours, theirs, where)
                flat_ours = ssf.flatten_sharded_optim_state_dict(saved, model, optim)
                flat_theirs = FSDP.flatten_sharded_optim_state_dict(saved, model, optim)
                _same_loadable(flat_ours, flat_theirs, where + " flatten_sharded")
                optim.load_state_dict(ours)
                after_ours = copy.deepcopy(optim.state_dict())
                optim.load_state_dict(theirs)
                assert_same(after_ours, optim.state_dict(), where + " loaded")
                out.append((use_orig_params, kind, counts))
        return out
    finally:
        cm.__exit__(None, None, None)


@pytest.mark.distributed_timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_load_one_exchange_per_unit_and_state(run_distributed, world_size: int) -> None:
    # Units with state: block1, block2 and the root -> 3; tensor states:
    # Adam 2, SGD with momentum 1. One exchange each, plus one small
    # all-reduce per call in which the ranks agree on the input's structure;
    # nothing is gathered.
    per_rank = run_distributed(_sharded_load_case, world_size, False)
    for rank, results in enumerate(per_rank):
        assert len(results) == 4
        for use_orig_params, kind, counts in results:
            states = 2 if kind == "adam" else 1
            want = {"comm.exchange": 3 * states, "all_reduce": 1} if world_size > 1 else {}
            assert counts == want, (rank, use_orig_params, kind, counts)


@pytest.mark.distributed_timeout(300)
def test_sharded_load_from_dtensors(run_distributed) -> None:
    # FSDP1 on a device mesh keeps SHARDED optimizer state as DTensors.
    per_rank = run_distributed(_sharded_load_case, 3, True)
    for rank, results in enumerate(per_rank):
        for use_orig_params, kind, counts in results:
            states = 2 if kind == "adam" else 1
            assert counts == {"comm.exchange": 3 * states, "all_reduce": 1}, (
                rank,
                use_orig_params,
                kind,
                counts,
            )


@pytest.mark.distributed_timeout(300)
def test_sharded_load_no_shard(run_distributed) -> None:
    # NO_SHARD: every rank needs the whole flat state, so the chunks of each
    # unit and state name travel in one all-gather instead.
    # (With use_orig_params torch's NO_SHARD sharded state is plain tensors;
    # the case chunks them itself.)
    per_rank = run_distributed(_sharded_load_case, 2, False, ShardingStrategy.NO_SHARD)
    for rank, results in enumerate(per_rank):
        for use_orig_params, kind, counts in results:
            states = 2 if kind == "adam" else 1
            want = {"comm.all_gather_into": 3 * states, "all_reduce": 1}
            assert counts == want, (rank, use_orig_params, kind, counts)


def _state_dict_route(rank: int, world_size: int) -> list[dict[str, int]]:
    """shardstate.checkpoint.state_dict's sharded get/set on FSDP1 (what a DCP
    resume runs) goes through the chunk exchange, and round-trips."""
    from shardstate.checkpoint import state_dict as ssd

    cm = _quiet()
    try:
        out = []
        for use_orig_params in (False, True):
            model, optim = _setup(rank, use_orig_params, "adam")
            before = copy.deepcopy(optim.state_dict())
            osd = ssd.get_optimizer_state_dict(model, optim)
            values = [v for s in osd["state"].values() for v in s.values()]
            assert any(isinstance(v, ShardedTensor) for v in values)
            optim.load_state_dict(
                {"state": {}, "param_groups": copy.deepcopy(before["param_groups"])}
            )
            out.append(
                _count_collectives(lambda: ssd.set_optimizer_state_dict(model, optim, osd))
            )
            _same_loadable(optim.state_dict(), before, f"use_orig_params={use_orig_params}")
        return out
    finally:
        cm.__exit__(None, None, None)


@pytest.mark.distributed_timeout(300)
def test_set_optimizer_state_dict_uses_the_exchange(run_distributed) -> None:
    for rank, per_flag in enumerate(run_distributed(_state_dict_route, 3)):
        for counts in per_flag:
            assert counts.get("comm.exchange") == 6, (rank, counts)
            assert not {"all_gather", "all_gather_single", "all_gather_into_tensor",
                        "comm.all_gather_into"} & set(
                counts
            ), (rank, counts)


def _relayout(saved: dict[str, Any], how: str, rank: int, world_size: int) -> dict[str, Any]:
    """torch's SHARDED save with every ShardedTensor re-laid out (same values)."""
    from torch.distributed._state_dict_utils import _gather_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    full = _gather_state_dict(saved)
    out: dict[str, Any] = {"state": {}, "param_groups": saved["param_groups"]}
    mesh = init_device_mesh("cpu", (world_size,)) if how == "replicate" else None
    for fqn, state in saved["state"].items():
        new = {}
        for name, v in state.items():
            if not isinstance(v, ShardedTensor):
                new[name] = v
            elif how == "replicate":
                new[name] = DTensor.from_local(full["state"][fqn][name], mesh, [Replicate()])
            elif how == "reversed":
                # dim-0 chunks, but rank k holds chunk W-1-k: not torch's layout
                from torch.distributed._shard.api import _shard_tensor
                from torch.distributed._shard.sharding_spec import ChunkShardingSpec

                spec = ChunkShardingSpec(
                    dim=0, placements=[f"rank:{world_size - 1 - k}/cpu" for k in range(world_size)]
                )
                new[name] = _shard_tensor(full["state"][fqn][name].contiguous(), spec)
            elif how == "bad_local" and rank == 1 and v.local_shards():
                # Shard checks sizes when built; a later change goes unchecked.
                v.local_shards()[0].tensor = v.local_shards()[0].tensor.double()
                new[name] = v
            else:
                new[name] = v
        out["state"][fqn] = new
    if how == "bad_structure" and rank == 1:
        out["state"].pop(next(iter(out["state"])))
    return out


def _relayout_case(rank: int, world_size: int) -> list[Any]:
    cm = _quiet()
    try:
        out = []
        for use_orig_params in (False, True):
            model, optim = _setup(rank, use_orig_params, "adam")
            _set_type(model, True)
            for how in ("replicate", "reversed"):
                saved = _relayout(FSDP.optim_state_dict(model, optim), how, rank, world_size)
                theirs = FSDP.optim_state_dict_to_load(model, optim, copy.copy(saved))
                ours: dict[str, Any] = {}

                def load(saved: dict[str, Any] = saved, ours: dict[str, Any] = ours) -> None:
                    ours.update(ssf.optim_state_dict_to_load(model, optim, copy.copy(saved)))

                counts = _count_collectives(load)
                _same_loadable(ours, theirs, f"{how} use_orig_params={use_orig_params}")
                out.append(counts.get("all_to_all_single", 0) + counts.get("comm.exchange", 0))
            for how in ("bad_local", "bad_structure"):
                saved = _relayout(FSDP.optim_state_dict(model, optim), how, rank, world_size)
                try:
                    ssf.optim_state_dict_to_load(model, optim, saved)
                except ValueError as e:
                    out.append(str(e))
                else:
                    out.append("loaded")
        return out
    finally:
        cm.__exit__(None, None, None)


@pytest.mark.distributed_timeout(300)
def test_sharded_load_other_layouts_gather_and_bad_input_raises(run_distributed) -> None:
    per_rank = run_distributed(_relayout_case, 3)
    for rank, results in enumerate(per_rank):
        for flag in range(2):
            replicate, reversed_, bad_local, bad_structure = results[4 * flag : 4 * flag + 4]
            # Not torch's dim-0 chunk layout: gathered (equal to torch), no exchange.
            assert replicate == 0 and reversed_ == 0, (rank, results)
            # A local shard that contradicts its metadata (on rank 1 only), or a
            # structure that differs between ranks: every rank raises, none hangs.
            if rank == 1:
                assert "does not match its metadata:" in bad_local, bad_local
            else:
                assert "another rank holds sharded optimizer state" in bad_local, bad_local
            assert "differs between ranks" in bad_structure, bad_structure


# ---------------------------------------------------------------------------
# Missing or inconsistent state: torch's errors
# ---------------------------------------------------------------------------


def _corrupt(osd: dict[str, Any], how: str) -> dict[str, Any]:
    osd = copy.deepcopy(osd)
    st = osd["state"]
    if how == "step_differs":
        st["block1.0.weight"]["step"] = torch.tensor(99.0)
    elif how == "step_dtype":
        st["block1.0.weight"]["step"] = st["block1.0.weight"]["step"].double()
    elif how == "shape":
        st["block1.0.bias"]["exp_avg"] = torch.zeros(2, 2)
    elif how == "dtype":
        st["block1.0.bias"]["exp_avg"] = st["block1.0.bias"]["exp_avg"].double()
    elif how == "names_differ":
        del st["block1.0.bias"]["exp_avg_sq"]
    elif how == "param_missing":
        del st["block1.0.bias"]
    elif how == "types_differ":
        st["block1.0.bias"]["exp_avg"] = 1.5
    elif how == "no_state_key":
        del osd["state"]
    return osd


_CORRUPTIONS = (
    "step_differs",
    "step_dtype",
    "shape",
    "dtype",
    "names_differ",
    "param_missing",
    "types_differ",
    "no_state_key",
)


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e)
    return "ok", ""


def _errors(rank: int, world_size: int) -> list[tuple[str, str, tuple[str, str], tuple[str, str]]]:
    cm = _quiet()
    try:
        model, optim = _setup(rank, False, "adam")
        _set_type(model, False)
        good = ssf.optim_state_dict(model, optim)
        out = []
        for how in _CORRUPTIONS:
            bad = _corrupt(good, how)
            for api in ("shard_full", "scatter"):
                if api == "scatter" and how == "no_state_key":
                    continue  # rank 0 would fail inside torch's own skeleton broadcast
                if api == "shard_full":
                    ours = _outcome(
                        lambda: ssf.shard_full_optim_state_dict(bad, model, optim=optim)
                    )
                    theirs = _outcome(
                        lambda: FSDP.shard_full_optim_state_dict(bad, model, optim=optim)
                    )
                else:
                    src = bad if rank == 0 else None
                    ours = _outcome(
                        lambda: ssf.scatter_full_optim_state_dict(src, model, optim=optim)
                    )
                    theirs = _outcome(
                        lambda: FSDP.scatter_full_optim_state_dict(src, model, optim=optim)
                    )
                out.append((how, api, ours, theirs))
        return out
    finally:
        cm.__exit__(None, None, None)


def test_errors_match_torch(run_distributed) -> None:
    per_rank = run_distributed(_errors, 2)
    for rank, results in enumerate(per_rank):
        assert len(results) == 2 * len(_CORRUPTIONS) - 1
        by_case = {(how, api): ours for how, api, ours, _ in results}
        for how, api, (our_type, our_msg), (their_type, their_msg) in results:
            where = f"rank {rank}, {how}, {api}"
            assert their_type != "ok", f"{where}: torch accepted it; the case tests nothing"
            if (how, api) == ("param_missing", "scatter"):
                # torch's broadcast loop indexes every FQN of the FlatParameter
                # and fails with a bare KeyError('block1.0.bias'); ours says
                # what shard_full_optim_state_dict says (the missing step).
                assert their_type == "KeyError", (their_type, their_msg)
                assert (our_type, our_msg) == by_case[("param_missing", "shard_full")], where
                continue
            assert our_type == their_type, (
                f"{where}: {our_type}({our_msg}) vs {their_type}({their_msg})"
            )
            # Ours may say more (which state of which parameter), never less;
            # spacing aside (torch's "state"to has lost a space).
            # Values are printed differently (torch prints whole tensors, we print shapes).
            head = their_msg.split(":")[0].split("[")[0].split("{")[0]
            ours_flat, theirs_head = "".join(our_msg.split()), "".join(head.split())
            assert ours_flat.startswith(theirs_head), f"{where}: {our_msg!r} vs {their_msg!r}"


def test_plain_model_is_refused() -> None:
    # Refused before any communication: no process group needed.
    model = nn.Linear(3, 3)
    optim = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match="Linear holds no FullyShardedDataParallel module"):
        ssf.full_optim_state_dict(model, optim)
    with pytest.raises(ValueError, match="Linear holds no FullyShardedDataParallel module"):
        ssf.shard_full_optim_state_dict({"state": {}, "param_groups": []}, model, optim=optim)


# ---------------------------------------------------------------------------
# _flatops, the seam to the C layout, against torch's FlatParamHandle
# ---------------------------------------------------------------------------


def _flatops_vs_torch(rank: int, world_size: int) -> int:
    from shardstate.fsdp import _flatops
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    from torch.distributed.fsdp._runtime_utils import _lazy_init
    from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

    cm = _quiet()
    checks = 0
    try:
        for use_orig_params in (False, True):
            model = _wrap(use_orig_params)
            _lazy_init(model, model)
            for handle in _get_fsdp_handles(model):
                fp = handle.flat_param
                layout = _flatops.unit_layout(handle, world_size, rank, world_size > 1)
                g = torch.Generator().manual_seed(7)
                pieces = [torch.randn(s, generator=g) for s in fp._shapes]
                # unflatten == torch's views of a full flat buffer
                full = torch.randn(layout.padded_numel, generator=g)
                ours = _flatops.unflatten(layout, full[: layout.unpadded_numel])
                theirs = (
                    handle._get_unflat_views_aligned(full[: layout.unpadded_numel])
                    if use_orig_params
                    else list(handle._get_unflat_views_unaligned(full[: layout.unpadded_numel]))
                )
                for a, b in zip(ours, theirs, strict=True):
                    assert_same(a, b, "unflatten")
                    assert a.data_ptr() == b.data_ptr(), "unflatten must not copy"
                # flatten_shard_into == torch's flatten_tensors + _get_shard (the
                # FlatParameter path; torch fills alignment padding with 42, we with 0)
                out = torch.empty(layout.shard_numel)
                _flatops.flatten_shard_into(layout, pieces, rank, out)
                flat = handle.flatten_tensors(pieces, handle._aligned_numel)
                if not use_orig_params:
                    ref = (
                        FlatParamHandle._get_shard(flat, rank, world_size)[0]
                        if world_size > 1
                        else flat
                    )
                    assert_same(out, ref, "flatten_shard_into")
                # slice_local and pack_local_into == torch's per-parameter shard slices
                local = []
                for i, info in enumerate(fp._shard_param_infos):
                    s = _flatops.slice_local(layout, i, pieces[i], full=True)
                    if not info.in_shard:
                        assert s is None
                        local.append(None)
                        continue
                    ref = pieces[i].flatten()[
                        info.intra_param_start_idx : info.intra_param_end_idx + 1
                    ]
                    assert_same(s, ref, "slice_local(full)")
                    assert_same(
                        _flatops.slice_local(layout, i, out, full=False), ref, "slice_local(shard)"
                    )
                    local.append(s)
                packed = torch.empty(layout.shard_numel)
                _flatops.pack_local_into(layout, local, packed)
                start = rank * layout.shard_numel
                for i, info in enumerate(fp._shard_param_infos):
                    if info.in_shard:
                        a = packed[
                            info.offset_in_shard : info.offset_in_shard + info.numel_in_shard
                        ]
                        assert_same(a, local[i], "pack_local_into")
                padding = torch.ones(layout.shard_numel, dtype=torch.bool)
                for info in fp._shard_param_infos:
                    if info.in_shard:
                        padding[
                            info.offset_in_shard : info.offset_in_shard + info.numel_in_shard
                        ] = False
                assert not packed[padding].any(), "pack_local_into leaves padding at zero"
                assert start + layout.shard_numel <= layout.padded_numel
                checks += 1
        return checks
    finally:
        cm.__exit__(None, None, None)


@pytest.mark.parametrize("world_size", [1, 3])
def test_flatops_match_torch_flat_param(run_distributed, world_size: int) -> None:
    checks = run_distributed(_flatops_vs_torch, world_size)
    # Units: block1, block2, frozen, root (use_orig_params=False); frozen joins the root with True.
    assert checks == [7] * world_size, checks


# ---------------------------------------------------------------------------
# bfloat16 state through the C copies (viewed as int16 there)
# ---------------------------------------------------------------------------


def _bf16_case(rank: int, world_size: int) -> int:
    cm = _quiet()
    checks = 0
    try:
        for use_orig_params in (False, True):
            torch.manual_seed(0)
            model = Nested().to(torch.bfloat16)
            kw = dict(device_id=CPU, use_orig_params=use_orig_params)
            model.block1 = FSDP(model.block1, **kw)
            model.block2 = FSDP(model.block2, **kw)
            if not use_orig_params:
                model.frozen = FSDP(model.frozen, **kw)
            model = FSDP(model, **kw)
            optim = _optimizer(model, "adam")
            gen = torch.Generator().manual_seed(100 + rank)
            for _ in range(2):
                idx = torch.randint(0, 11, (4, 3), generator=gen)
                model(idx).float().square().mean().backward()
                optim.step()
                optim.zero_grad()
            dtypes = {
                v.dtype for s in optim.state_dict()["state"].values() for k, v in s.items()
                if k != "step"
            }
            assert dtypes == {torch.bfloat16}, dtypes
            for sharded, rank0_only in ((False, True), (True, False), (False, False)):
                _set_type(model, sharded, rank0_only, offload=False)
                where = f"bf16 use_orig_params={use_orig_params} sharded={sharded} r0={rank0_only}"
                theirs = FSDP.optim_state_dict(model, optim)
                ours = ssf.optim_state_dict(model, optim)
                assert_same(ours, theirs, where)
                loaded_theirs = FSDP.optim_state_dict_to_load(model, optim, copy.copy(theirs))
                loaded_ours = ssf.optim_state_dict_to_load(model, optim, copy.copy(ours))
                _same_loadable(loaded_ours, loaded_theirs, where + " load")
                checks += 1
        return checks
    finally:
        cm.__exit__(None, None, None)


def test_bf16_state_matches_torch(run_distributed) -> None:
    checks = run_distributed(_bf16_case, 3)
    assert checks == [6] * 3, checks
