"""Save and load plans: the items each rank writes and reads.

Same names and fields as ``torch.distributed.checkpoint.planner`` in torch
2.13, defined without importing torch. The planner protocols
(``SavePlanner``, ``LoadPlanner``) live here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

from .metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties

__all__ = [
    "BytesIOWriteData",
    "LoadItemType",
    "LoadPlan",
    "ReadItem",
    "SavePlan",
    "TensorWriteData",
    "WriteItem",
    "WriteItemType",
]


class WriteItemType(Enum):
    TENSOR = auto()
    SHARD = auto()
    BYTE_IO = auto()


class LoadItemType(Enum):
    TENSOR = auto()
    BYTE_IO = auto()


@dataclass(frozen=True)
class BytesIOWriteData:
    nbytes: int


@dataclass(frozen=True)
class TensorWriteData:
    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: Any  # torch.Size or tuple of ints


_ELEMENT_SIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "complex32": 4,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
}


def element_size(dtype: Any) -> int:
    """Bytes per element of a torch dtype or a 'torch.<name>' stand-in."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    name = str(dtype).removeprefix("torch.")
    try:
        return _ELEMENT_SIZE[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


@dataclass(frozen=True)
class WriteItem:
    """What one rank writes for one state-dict entry (or one shard of it)."""

    index: MetadataIndex
    type: WriteItemType
    bytes_io_data: BytesIOWriteData | None = None
    tensor_data: TensorWriteData | None = None

    def tensor_storage_size(self) -> int | None:
        """Bytes of the tensor this item writes, or None for a bytes item."""
        if self.tensor_data is None:
            return None
        return math.prod(self.tensor_data.size) * element_size(self.tensor_data.properties.dtype)


@dataclass(frozen=True)
class ReadItem:
    """Copy ``lengths`` from ``storage_index`` at ``storage_offsets`` into
    ``dest_index`` at ``dest_offsets``."""

    type: LoadItemType
    dest_index: MetadataIndex
    dest_offsets: Any
    storage_index: MetadataIndex
    storage_offsets: Any
    lengths: Any


@dataclass(frozen=True)
class SavePlan:
    items: list[WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    # False tells the ranks to reuse their cached plans.
    usable: bool = True


@dataclass
class LoadPlan:
    items: list[ReadItem]
    storage_data: Any = None
    planner_data: Any = None
