"""Checkpoint metadata: the object graph pickled into ``.metadata``.

With torch installed these are torch's own classes
(``torch.distributed.checkpoint.metadata``, and ``filesystem._StorageInfo``):
torch's planners, storage layers and user subclasses of them then work under
shardstate and back with nothing converted. Without torch (NumPy-only state
dicts) the torch-free classes of ``_torchfree`` stand in, with the same names,
fields and on-disk form (see docs/FORMAT.md and ``_pickle``); their offsets
and sizes are tuples of ints and their dtype, layout and memory format
:class:`TorchName` strings such as ``"torch.float32"``.
"""

from __future__ import annotations

from .._util import torch_dcp
from ._names import TorchName
from ._names import _name as _name
from ._names import _size as _size

__all__ = [
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "TorchName",
]

# Whether the classes below are torch's.
TORCH_TYPES = torch_dcp() is not None

if TORCH_TYPES:
    from torch.distributed.checkpoint.filesystem import _StorageInfo as _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        _MEM_FORMAT_ENCODING as _MEM_FORMAT_ENCODING,
    )
    from torch.distributed.checkpoint.metadata import (
        STATE_DICT_TYPE as STATE_DICT_TYPE,
    )
    from torch.distributed.checkpoint.metadata import (
        STORAGE_TYPES as STORAGE_TYPES,
    )
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
else:
    from ._torchfree import _MEM_FORMAT_ENCODING as _MEM_FORMAT_ENCODING
    from ._torchfree import STATE_DICT_TYPE as STATE_DICT_TYPE
    from ._torchfree import STORAGE_TYPES as STORAGE_TYPES
    from ._torchfree import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
    from ._torchfree import _StorageInfo as _StorageInfo
