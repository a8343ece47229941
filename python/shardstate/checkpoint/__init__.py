"""A drop-in for ``torch.distributed.checkpoint`` (torch 2.13).

    import shardstate.checkpoint as dcp
    dcp.save(state_dict, checkpoint_id="/ckpt/step100")
    dcp.load(state_dict, checkpoint_id="/ckpt/step100")

Same names, signatures and on-disk format as torch's DCP; the bulk work runs
in shardstate's C engine (parallel writes with CRC-32 in the same pass,
verified reads straight into place), ``.metadata`` and bytes items are read
with a restricted unpickler, and a checkpoint becomes visible only when its
``.metadata`` is published atomically, last. With torch installed, the
data types (metadata, plans, storage and planner bases) are torch's own
classes, so importing this package imports torch's DCP; without torch,
NumPy-only state dicts save and load through torch-free stand-ins.
"""

from ._pickle import PickleFormatError, UnsafePickleError
from .api import CheckpointException
from .default_planner import DefaultLoadPlanner, DefaultSavePlanner
from .filesystem import FileSystemReader, FileSystemWriter, StorageFormatError
from .hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from .manager import CheckpointManager
from .metadata import TORCH_TYPES as _TORCH_TYPES
from .metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from .optimizer import load_sharded_optimizer_state_dict
from .planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem
from .state_dict_loader import load, load_state_dict
from .state_dict_saver import AsyncSaveResponse, async_save, save, save_state_dict
from .stateful import Stateful
from .storage import StorageReader, StorageWriter

__all__ = [
    "AsyncSaveResponse",
    "BytesStorageMetadata",
    "CheckpointException",
    "CheckpointManager",
    "ChunkStorageMetadata",
    "DefaultLoadPlanner",
    "DefaultSavePlanner",
    "FileSystemReader",
    "FileSystemWriter",
    "HuggingFaceStorageReader",
    "HuggingFaceStorageWriter",
    "LoadPlan",
    "LoadPlanner",
    "Metadata",
    "MetadataIndex",
    "PickleFormatError",
    "ReadItem",
    "SavePlan",
    "SavePlanner",
    "Stateful",
    "StorageFormatError",
    "StorageReader",
    "StorageWriter",
    "TensorStorageMetadata",
    "UnsafePickleError",
    "WriteItem",
    "async_save",
    "load",
    "load_sharded_optimizer_state_dict",
    "load_state_dict",
    "save",
    "save_state_dict",
]

if _TORCH_TYPES:  # it dequantizes with torch (its signature names a torch dtype)
    from .quantized_hf_storage import QuantizedHuggingFaceStorageReader

    __all__ += ["QuantizedHuggingFaceStorageReader"]
