"""Save and load plans: the items each rank writes and reads, and the
planner protocols (``SavePlanner``, ``LoadPlanner``).

torch's own classes (``torch.distributed.checkpoint.planner``) whenever torch
is installed, so plans, items and planners pass between torch's DCP and
shardstate's unchanged; the torch-free stand-ins of ``_torchfree`` otherwise
(same names, fields and methods).
"""

from __future__ import annotations

from ._names import element_size as element_size
from .metadata import TORCH_TYPES
from .metadata import ChunkStorageMetadata as ChunkStorageMetadata
from .metadata import Metadata as Metadata
from .metadata import MetadataIndex as MetadataIndex
from .metadata import StorageMeta as StorageMeta
from .metadata import TensorProperties as TensorProperties

__all__ = [
    "BytesIOWriteData",
    "LoadItemType",
    "LoadPlan",
    "LoadPlanner",
    "ReadItem",
    "SavePlan",
    "SavePlanner",
    "TensorWriteData",
    "WriteItem",
    "WriteItemType",
]

if TORCH_TYPES:
    from torch.distributed.checkpoint.planner import (
        BytesIOWriteData,
        LoadItemType,
        LoadPlan,
        LoadPlanner,
        ReadItem,
        SavePlan,
        SavePlanner,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )
else:
    from ._torchfree import (
        BytesIOWriteData,
        LoadItemType,
        LoadPlan,
        LoadPlanner,
        ReadItem,
        SavePlan,
        SavePlanner,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )
