"""Storage layer interfaces: ``StorageWriter``, ``StorageReader``, ``WriteResult``.

torch's own classes (``torch.distributed.checkpoint.storage``) whenever torch
is installed, so a storage plugged into torch's DCP plugs into ours and back
(and a subclass of torch's StorageWriter is one of ours); the torch-free
stand-ins of ``_torchfree`` otherwise. The futures returned by ``write_data`` and
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

import sys
from typing import Any, Generic, TypeVar

from .metadata import TORCH_TYPES
from .metadata import Metadata as Metadata
from .metadata import MetadataIndex as MetadataIndex
from .metadata import StorageMeta as StorageMeta
from .planner import LoadPlan as LoadPlan
from .planner import LoadPlanner as LoadPlanner
from .planner import SavePlan as SavePlan
from .planner import SavePlanner as SavePlanner

__all__ = ["StorageReader", "StorageWriter", "WriteResult", "completed_future"]

T = TypeVar("T")

if TORCH_TYPES:
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
else:
    from ._torchfree import StorageReader, StorageWriter, WriteResult


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
