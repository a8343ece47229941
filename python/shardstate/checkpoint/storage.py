"""Storage layer interfaces: ``StorageWriter``, ``StorageReader``, ``WriteResult``.

Same names, methods and signatures as ``torch.distributed.checkpoint.storage``
in torch 2.13, so a storage plugged into torch's DCP plugs into ours and back.
Defined without importing torch: the futures returned by ``write_data`` and
``read_data`` are ``torch.futures.Future`` when torch is loaded, and a minimal
completed future with the same ``wait()`` / ``value()`` / ``done()`` otherwise
(see ``completed_future``).

Call order on every rank (the coordinator also runs the starred steps):

* save: ``reset(checkpoint_id)``, ``set_up_storage_writer``,
  ``prepare_local_plan``, *``prepare_global_plan``*, ``write_data``,
  *``finish``*.
* load: ``reset(checkpoint_id)``, ``read_metadata``, ``set_up_storage_reader``,
  ``prepare_local_plan``, *``prepare_global_plan``*, ``read_data``.
"""

from __future__ import annotations

import abc
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .metadata import Metadata, MetadataIndex, StorageMeta

if TYPE_CHECKING:
    from .planner import LoadPlan, SavePlan

__all__ = ["StorageReader", "StorageWriter", "WriteResult", "completed_future"]

T = TypeVar("T")


@dataclass(frozen=True)
class WriteResult:
    """What writing one item produced: its index, its size on storage, and
    storage-specific data (``_StorageInfo`` for the file system)."""

    index: MetadataIndex
    size_in_bytes: int
    storage_data: Any


class _DoneFuture(Generic[T]):
    """A completed future, for when torch is not loaded."""

    def __init__(self, value: T) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def wait(self) -> T:
        return self._value

    def value(self) -> T:
        return self._value

    def then(self, fn: Any) -> _DoneFuture[Any]:
        return _DoneFuture(fn(self))


def completed_future(value: T) -> Any:
    """A future already holding ``value``: ``torch.futures.Future`` when
    torch is imported (torch's ``save``/``load`` call ``wait()`` on it),
    else a minimal stand-in. Never imports torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        fut = torch.futures.Future()
        fut.set_result(value)
        return fut
    return _DoneFuture(value)


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
