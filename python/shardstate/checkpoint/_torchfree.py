"""torch's DCP data types, for where torch is not installed.

``metadata``, ``planner``, ``storage`` and ``stateful`` hand out torch's own
classes whenever torch's DCP imports, so that torch's planners, storage
layers and user subclasses of them work under shardstate and back with no
conversion (``isinstance`` and ``==`` are torch's own). Where torch is
absent (NumPy-only state dicts), these stand in: the same names, fields,
methods and pickled form (on disk they are written under torch's class
paths, see ``_pickle``). Where torch uses ``torch.Size``, ``torch.dtype``,
``torch.layout`` and ``torch.memory_format``, these hold tuples of ints and
``TorchName`` strings such as ``"torch.float32"``.

Nothing here imports torch.
"""

from __future__ import annotations

import abc
import contextlib
import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from .._util import loaded_torch
from ._names import TorchName, _name, _size, element_size

# ---- metadata ----------------------------------------------------------------


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


# ---- planner -----------------------------------------------------------------


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


# ---- storage -----------------------------------------------------------------


@dataclass(frozen=True)
class WriteResult:
    """What writing one item produced: its index, its size on storage, and
    storage-specific data (``_StorageInfo`` for the file system)."""

    index: MetadataIndex
    size_in_bytes: int
    storage_data: Any


class StorageWriter(abc.ABC):
    """Where a checkpoint is written.

    One instance per rank acts as follower and, on the coordinator, also as
    the coordinator; ``set_up_storage_writer`` says which.
    """

    @abc.abstractmethod
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new checkpoint write begins. ``checkpoint_id`` (when given) names
        it in a storage-specific way: a directory, a file, a key."""

    @abc.abstractmethod
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Initialize this instance; ``is_coordinator`` tells its role. torch
        passes ``rank=`` and ``use_collectives=`` keywords when accepted."""

    @abc.abstractmethod
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Storage-specific local planning; storage data goes in
        ``SavePlan.storage_data``."""

    @abc.abstractmethod
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Storage-specific global planning, on the coordinator only."""

    @abc.abstractmethod
    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        """Write every item of ``plan``, getting each item's data from
        ``planner.resolve_data(item)`` (tensors may be views, non-contiguous,
        or on any device; only the item's own elements are saved). Returns a
        future that completes to ``list[WriteResult]``."""

    @abc.abstractmethod
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``metadata`` (with every rank's ``results``) and mark the
        checkpoint complete; on the coordinator only."""

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether this storage can handle ``checkpoint_id`` (used to pick a
        storage automatically)."""

    def storage_meta(self) -> StorageMeta | None:
        """Storage-specific metadata recorded in the checkpoint; None by
        default."""
        return None


class StorageReader(abc.ABC):
    """Where a checkpoint is read from; one instance per rank."""

    @abc.abstractmethod
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new checkpoint read begins; ``checkpoint_id`` as for
        ``StorageWriter.reset``."""

    @abc.abstractmethod
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata."""

    @abc.abstractmethod
    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Initialize this instance with the checkpoint's ``metadata``."""

    @abc.abstractmethod
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Storage-specific local planning; storage data goes in
        ``LoadPlan.storage_data``."""

    @abc.abstractmethod
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Storage-specific global planning, on the coordinator only."""

    @abc.abstractmethod
    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        """Read every item of ``plan``: tensors into
        ``planner.resolve_tensor(item)`` then ``planner.commit_tensor``, bytes
        items through ``planner.load_bytes(item, BytesIO)``. Returns a future
        that completes (to None) once everything is read."""

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether this storage can handle ``checkpoint_id``."""


# ---- stateful ----------------------------------------------------------------


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


StatefulT = TypeVar("StatefulT", bound=Stateful)


# ---- filesystem ---------------------------------------------------------------


class FileSystemBase(abc.ABC):
    """The file operations a file-system storage layer needs (torch's
    ``filesystem.FileSystemBase``)."""

    @abc.abstractmethod
    def create_stream(self, path: str | os.PathLike, mode: str) -> Any: ...

    @abc.abstractmethod
    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike: ...

    @abc.abstractmethod
    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None: ...

    @abc.abstractmethod
    def init_path(self, path: str | os.PathLike) -> str | os.PathLike: ...

    @abc.abstractmethod
    def mkdir(self, path: str | os.PathLike) -> None: ...

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool: ...

    @abc.abstractmethod
    def exists(self, path: str | os.PathLike) -> bool: ...

    @abc.abstractmethod
    def rm_file(self, path: str | os.PathLike) -> None: ...


class FileSystem(FileSystemBase):
    """FileSystemBase on the local file system (torch's ``filesystem.FileSystem``)."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Any:
        with Path(path).open(mode) as stream:
            yield stream

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike:
        return Path(path) / suffix

    def init_path(self, path: str | os.PathLike) -> str | os.PathLike:
        return Path(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        Path(path).rename(new_path)

    def mkdir(self, path: str | os.PathLike) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        if isinstance(checkpoint_id, Path):
            return True
        if "://" in str(checkpoint_id):
            return False
        return any(p.exists() and os.access(str(p), os.W_OK) for p in Path(checkpoint_id).parents)

    def exists(self, path: str | os.PathLike) -> bool:
        return Path(path).exists()

    def rm_file(self, path: str | os.PathLike) -> None:
        Path(path).unlink()

    def ls(self, path: str | os.PathLike) -> list[str]:
        return [str(p) for p in Path(path).iterdir()]
