"""Save and load plans: the items each rank writes and reads.

Same names and fields as ``torch.distributed.checkpoint.planner`` in torch
2.13, defined without importing torch. The planner protocols
(``SavePlanner``, ``LoadPlanner``) live here too.
"""

from __future__ import annotations

import abc
import io
import math
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

from .metadata import (
    STATE_DICT_TYPE,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)

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


class SavePlanner(abc.ABC):
    """The protocol ``save`` drives to plan a checkpoint (torch's SavePlanner).

    Calls, in order: ``set_up_planner`` (all ranks), ``create_local_plan``
    (all ranks), ``create_global_plan`` (coordinator only, with every rank's
    plan), ``finish_plan`` (all ranks, with this rank's part of the global
    plan), then ``resolve_data`` for each item of the final plan, possibly
    several times and from several threads.

    The class-level dicts hold cached plans, keyed by planner class name,
    for planners created with ``enable_plan_caching=True``.
    """

    # This rank's plan from create_local_plan (local ranks).
    _cached_save_plan: dict[str, SavePlan] = {}
    # This rank's plan after finish_plan, as given to write_data (local ranks).
    _cached_final_save_plan: dict[str, SavePlan] = {}
    # Every rank's local plan, the input of create_global_plan (coordinator).
    _cached_all_plans: dict[str, list[SavePlan]] = {}
    # The global plan create_global_plan returned (coordinator).
    _cached_global_plan: dict[str, list[SavePlan]] = {}
    # The metadata create_global_plan returned (coordinator).
    _cached_metadata: dict[str, Metadata] = {}

    @abc.abstractmethod
    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Start planning the save of ``state_dict`` (all ranks)."""

    @abc.abstractmethod
    def create_local_plan(self) -> SavePlan:
        """This rank's plan; planner-specific data may go in ``planner_data``."""

    @abc.abstractmethod
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Every rank's final plan and the checkpoint metadata (coordinator only)."""

    @abc.abstractmethod
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """Adopt this rank's part of the global plan (all ranks)."""

    @abc.abstractmethod
    def resolve_data(self, write_item: WriteItem) -> Any:
        """The data to write for ``write_item``: a tensor (any device, may be a
        view) or an ``io.BytesIO``. Idempotent and thread-safe."""


class LoadPlanner:
    """The protocol ``load`` drives to plan a load (torch's LoadPlanner).

    Calls, in order: ``set_up_planner`` and ``create_local_plan`` (all
    ranks), ``create_global_plan`` (coordinator only), ``finish_plan`` (all
    ranks), then ``load_bytes`` once per bytes item and ``resolve_tensor`` /
    ``commit_tensor`` in pairs for each tensor item.

    Like torch's, this class is not an ``abc.ABC``: subclasses that leave a
    method out can still be created, and fail only when it is called.
    """

    @abc.abstractmethod
    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Start planning the load into ``state_dict`` (all ranks)."""

    @abc.abstractmethod
    def create_local_plan(self) -> LoadPlan:
        """This rank's reads, from ``state_dict`` and ``metadata``."""

    @abc.abstractmethod
    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """Every rank's final load plan (coordinator only)."""

    @abc.abstractmethod
    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        """Accept this rank's plan from the coordinator."""

    @abc.abstractmethod
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Put the bytes item ``value`` into the state dict, in place."""

    def resolve_bytes(self, read_item: ReadItem) -> io.BytesIO:
        """The BytesIO a reader fills for ``read_item`` (optional)."""
        raise NotImplementedError("LoadPlanner.resolve_bytes is not implemented")

    @abc.abstractmethod
    def resolve_tensor(self, read_item: ReadItem) -> Any:
        """The tensor the reader fills for ``read_item``: a view of the
        destination when possible, else a temporary that ``commit_tensor``
        copies into place."""

    @abc.abstractmethod
    def commit_tensor(self, read_item: ReadItem, tensor: Any) -> None:
        """Called once the reader has filled ``tensor`` (from resolve_tensor)."""
