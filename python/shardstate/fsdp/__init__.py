"""FSDP optimizer state: torch 2.13's FSDP1 optimizer-state API as module functions.

    import shardstate.fsdp as ssfsdp
    FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT,
                             FullStateDictConfig(), FullOptimStateDictConfig(rank0_only=True))
    osd = ssfsdp.optim_state_dict(model, optim)            # FSDP.optim_state_dict
    flat = ssfsdp.optim_state_dict_to_load(model, optim, osd)
    optim.load_state_dict(flat)

Each function takes the arguments of the ``FullyShardedDataParallel`` static
method of the same name and returns what it returns; the enums and configs
are torch's own (see ``api``). The flat-parameter layout and bulk copies go
through ``_flatops``.
"""

from ._optim import (
    flatten_sharded_optim_state_dict,
    full_optim_state_dict,
    optim_state_dict,
    optim_state_dict_to_load,
    rekey_optim_state_dict,
    scatter_full_optim_state_dict,
    shard_full_optim_state_dict,
    sharded_optim_state_dict,
)
from .api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

__all__ = [
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "flatten_sharded_optim_state_dict",
    "full_optim_state_dict",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "rekey_optim_state_dict",
    "scatter_full_optim_state_dict",
    "shard_full_optim_state_dict",
    "sharded_optim_state_dict",
]
