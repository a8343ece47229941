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

from typing import Any

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

def to_torch_metadata(md: Metadata) -> Any:
    """The same metadata built from torch's own classes (torch must be
    importable): ``md`` itself when it is made of them already, as it is
    whenever torch is installed (``TORCH_TYPES``)."""
    if TORCH_TYPES and type(md) is Metadata:
        return md
    import torch
    import torch.distributed.checkpoint.metadata as tm
    from torch.distributed.checkpoint.filesystem import _StorageInfo as TorchStorageInfo

    def obj(v: Any) -> Any:
        return v.resolve() if isinstance(v, TorchName) else v

    def entry(e: Any) -> Any:
        if isinstance(e, TensorStorageMetadata):
            p = e.properties
            props = tm.TensorProperties(
                dtype=obj(p.dtype), layout=obj(p.layout), requires_grad=p.requires_grad,
                memory_format=obj(p.memory_format), pin_memory=p.pin_memory)
            return tm.TensorStorageMetadata(
                properties=props, size=torch.Size(e.size),
                chunks=[tm.ChunkStorageMetadata(offsets=torch.Size(c.offsets),
                                                sizes=torch.Size(c.sizes)) for c in e.chunks])
        if isinstance(e, BytesStorageMetadata):
            return tm.BytesStorageMetadata()
        return e

    def index(k: Any) -> Any:
        return tm.MetadataIndex(k.fqn, k.offset, k.index) if isinstance(k, MetadataIndex) else k

    def info(v: Any) -> Any:
        if isinstance(v, _StorageInfo):
            return TorchStorageInfo(v.relative_path, v.offset, v.length, v.transform_descriptors)
        return v

    storage_data = md.storage_data
    if isinstance(storage_data, dict):
        storage_data = {index(k): info(v) for k, v in storage_data.items()}
    sm = md.storage_meta
    if isinstance(sm, StorageMeta):
        sm = tm.StorageMeta(checkpoint_id=sm.checkpoint_id, save_id=sm.save_id,
                            load_id=sm.load_id, modules=list(sm.modules))
    return tm.Metadata(
        state_dict_metadata={k: entry(v) for k, v in md.state_dict_metadata.items()},
        planner_data=md.planner_data, storage_data=storage_data, storage_meta=sm,
        version=md.version)
