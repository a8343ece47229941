"""The FSDP1 state-dict enums and configs: torch's own classes, re-exported.

They are torch's objects (not copies) so that ``FSDP.set_state_dict_type``
and ``FSDP.state_dict_type`` set what ``shardstate.fsdp.optim_state_dict``
and ``optim_state_dict_to_load`` read, and a config made from either module
is accepted by both.
"""

from torch.distributed.fsdp import (
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
]
