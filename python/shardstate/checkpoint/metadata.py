"""Checkpoint metadata: the object graph pickled into ``.metadata``.

Same class names and fields as ``torch.distributed.checkpoint.metadata`` in
torch 2.13 (and ``filesystem._StorageInfo``), defined here without importing
torch, so NumPy-only state dicts can be saved and loaded where torch is
absent. On disk they are written under torch's class paths, so torch reads
them as its own classes (see docs/FORMAT.md and ``_pickle``).

Where torch uses ``torch.Size``, ``torch.dtype``, ``torch.layout`` and
``torch.memory_format``, these classes hold the torch objects when torch is
loaded and plain stand-ins otherwise: offsets and sizes are tuples of ints
(``torch.Size`` is a tuple subclass, so the two compare and hash equal), and
dtype, layout and memory format are :class:`TorchName` strings such as
``"torch.float32"``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .._util import loaded_torch

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


class TorchName(str):
    """A torch object (dtype, layout, memory format) named without torch.

    ``TorchName("torch.float32")``; ``resolve()`` gives the torch object.
    """

    __slots__ = ()

    def resolve(self) -> Any:
        import torch

        obj: Any = torch
        for part in self.split(".")[1:]:
            obj = getattr(obj, part)
        return obj


def _size(values: Sequence[int]) -> tuple[int, ...]:
    """torch.Size when torch is loaded, else a tuple of ints."""
    torch = loaded_torch()
    if torch is not None and type(values) is torch.Size:
        return values
    values = tuple(int(v) for v in values)
    return torch.Size(values) if torch is not None else values


def _name(obj: Any) -> str:
    """'torch.float32' for a torch dtype/layout/memory format or a TorchName."""
    if isinstance(obj, str):
        return str(obj)
    return str(obj) if str(obj).startswith("torch.") else f"torch.{obj}"


@dataclass
class ChunkStorageMetadata:
    """One saved chunk of a tensor: a box in global coordinates."""

    offsets: Sequence[int]
    sizes: Sequence[int]


class _MEM_FORMAT_ENCODING(Enum):
    """How TensorProperties encodes its memory format when pickled."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_MEM_FORMAT_BY_NAME = {
    "torch.contiguous_format": _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
    "torch.channels_last": _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST,
    "torch.preserve_format": _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT,
}
_MEM_FORMAT_NAME = {v: k for k, v in _MEM_FORMAT_BY_NAME.items()}


def _default_dtype() -> Any:
    torch = loaded_torch()
    return torch.get_default_dtype() if torch is not None else TorchName("torch.float32")


def _default_layout() -> Any:
    torch = loaded_torch()
    return torch.strided if torch is not None else TorchName("torch.strided")


def _default_memory_format() -> Any:
    torch = loaded_torch()
    return torch.contiguous_format if torch is not None else TorchName("torch.contiguous_format")


def _torch_or_name(name: str) -> Any:
    torch = loaded_torch()
    return TorchName(name).resolve() if torch is not None else TorchName(name)


@dataclass
class TensorProperties:
    """Properties used to create a tensor (dtype, layout, ...)."""

    dtype: Any = field(default_factory=_default_dtype)
    layout: Any = field(default_factory=_default_layout)
    requires_grad: bool = False
    memory_format: Any = field(default_factory=_default_memory_format)
    pin_memory: bool = False

    def __getstate__(self) -> tuple:
        try:
            encoding = _MEM_FORMAT_BY_NAME[_name(self.memory_format)]
        except KeyError:
            raise RuntimeError(f"Invalid torch.memory_format: {self.memory_format}") from None
        return (self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory)

    def __setstate__(self, state: tuple) -> None:
        (self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory) = state
        try:
            self.memory_format = _torch_or_name(_MEM_FORMAT_NAME[_MEM_FORMAT_ENCODING(encoding)])
        except (KeyError, ValueError):
            raise RuntimeError(f"Invalid torch.memory_format encoding: {encoding}") from None

    @staticmethod
    def create_from_tensor(tensor: Any) -> TensorProperties:
        torch = loaded_torch()
        return TensorProperties(
            dtype=tensor.dtype,
            layout=tensor.layout,
            requires_grad=tensor.requires_grad,
            memory_format=torch.contiguous_format,
            pin_memory=tensor.is_pinned(),
        )


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: Sequence[int]
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


STORAGE_TYPES = TensorStorageMetadata | BytesStorageMetadata
STATE_DICT_TYPE = dict[str, Any]


@dataclass
class StorageMeta:
    checkpoint_id: str | os.PathLike | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    """The metadata of a checkpoint."""

    state_dict_metadata: dict[str, STORAGE_TYPES]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True)
class MetadataIndex:
    """Lookup key for items in a state dict or Metadata."""

    fqn: str
    offset: Sequence[int] | None = None
    # A hint where to find the chunk in a chunk list; not part of equality.
    index: int | None = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset: Sequence[int] | None = None,
                 index: int | None = None) -> None:
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "index", index)
        if offset is not None:
            object.__setattr__(self, "offset", _size(offset))


@dataclass
class _StorageInfo:
    """Where one item's bytes are: file (relative to the checkpoint), offset, length.

    Pickled under torch's ``torch.distributed.checkpoint.filesystem._StorageInfo``.
    """

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None = None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def to_torch_metadata(md: Metadata) -> Any:
    """The same metadata built from torch's own classes (torch must be
    importable). Readers hand this to planners when torch is loaded, because
    torch's planners check the metadata classes with isinstance; ours accept
    either."""
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
