"""``FileSystemWriter`` / ``FileSystemReader``: DCP checkpoints in a directory,
with the bulk work done by the C I/O engine.

The files are exactly those torch 2.13's ``FileSystemWriter`` writes for the
same plan (docs/FORMAT.md): ``__{rank}_{n}.distcp`` data files split the same
way (``thread_count`` buckets per rank with ``single_file_per_rank``, one file
per item otherwise, empty files included), items in the same order, each a
``torch.save`` zip record, and ``.metadata`` a pickle of torch's metadata
classes, published last.

This module holds the two classes: options, paths, and ``.metadata`` read
and publish. The work is done by:

* ``_fs_write``: a rank's data files, one engine call per rank (records laid
  out up front, trailers patched with the CRCs, files fsynced);
* ``_records``: locating records through ``storage_data`` (paths confined to
  the checkpoint directory, offsets checked) and recognising them;
* ``_fs_read``: reading records into the destinations, CRC-32s checked;
* ``_fs_bcast``: load once, broadcast (``broadcast_shared_reads=True``);
* ``_fs_verify``: shared CRC verification of records split between ranks;
* ``_fs_transform``: items written through stream transforms
  (``_extensions`` / ``_extension_registry``, torch's ``_extension``).

``finish`` publishes ``.metadata`` (``__{rank}.metadata`` without
collectives) atomically, last; with ``overwrite`` every metadata file of an
earlier save, of either mode, is removed in ``prepare_local_plan``, before
any data file is touched (``_stale_metadata``), and each tensor's storage
entry carries its data's CRC-32 (``_records.DATA_CRC_ATTR``), so a load never
takes one save's metadata over another's data. A load opens only regular
files (``_records.file_errors`` names what the core refuses: a FIFO, a
device or a directory). Every file operation goes through ``shardstate.io``
(the core), so one FaultInjector reaches a whole save or load.
``.metadata`` is written by ``_pickle.dumps_metadata`` (torch's
bytes, no torch needed) and read by ``_pickle.loads_metadata``
(restricted); bytes items are checked with ``_pickle.loads_object`` before a
planner sees them.

Under shardstate's ``load`` over a group of 2+ ranks, the loader asks the
reader for ``load_collectives(coord)`` (the protocol is documented in
``state_dict_loader.LoadCollectives``): the reader's shared verification
and broadcast of shared reads run through the object it returns.

Known limit: a data file truncated by someone else while it is mapped can
raise SIGBUS.

Thread safety: one reader or writer instance serves one save or load at a
time, as in torch.
"""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from .. import io as ssio
from . import _fs_verify, _mdlazy, _safetensors
from ._extension import ExtensionRegistry as ExtensionRegistry
from ._extension import StreamTransformExtension as StreamTransformExtension
from ._fs_bcast import _Schedule, exchange, plan_broadcast, read_shared
from ._fs_read import _CudaDest, _new_stats, _Reads
from ._fs_transform import ReaderTransforms, WriterTransforms
from ._fs_write import _split_by_size_and_type, _uses_overlapping_loader, write_files
from ._pickle import (
    PickleFormatError,
    UnsafePickleError,
    dumps_metadata,
    loads_metadata,
)
from ._records import StorageFormatError, _index_key, _Records, file_errors
from .metadata import TORCH_TYPES, StorageMeta
from .metadata import Metadata as Metadata
from .planner import LoadItemType as LoadItemType
from .planner import LoadPlan as LoadPlan
from .planner import LoadPlanner as LoadPlanner
from .planner import ReadItem as ReadItem
from .planner import SavePlan as SavePlan
from .planner import SavePlanner as SavePlanner
from .planner import WriteItem as WriteItem
from .planner import WriteItemType as WriteItemType
from .staging import BlockingAsyncStager as BlockingAsyncStager
from .staging import _FileSystemWriterStager
from .storage import StorageReader, StorageWriter, WriteResult, completed_future

if TORCH_TYPES:  # torch's own, so a user's FileSystemBase subclass is one of ours
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase
else:
    from ._torchfree import FileSystem, FileSystemBase

# torch's private names for the same classes (its own tests import them)
_StorageWriterTransforms = WriterTransforms
_StorageReaderTransforms = ReaderTransforms

__all__ = [
    "FileSystem",
    "FileSystemBase",
    "FileSystemReader",
    "FileSystemWriter",
    "SerializationFormat",
    "StorageFormatError",
]

_METADATA_FN = ".metadata"
# A rank's own metadata, written by a save without collectives.
_RANK_METADATA = re.compile(r"__[0-9]+\.metadata")
DEFAULT_SUFFIX = ".distcp"
CURRENT_DCP_VERSION = "1.0.0"

# A .metadata larger than this is refused before it is read.
_MAX_METADATA_BYTES = 4 << 30


class SerializationFormat(Enum):
    TORCH_SAVE = "torch_save"
    SAFETENSORS = "safetensors"


@dataclass
class _StoragePrefix:
    prefix: str


def _dump_metadata(md: Any) -> bytes:
    """The ``.metadata`` bytes for ``md`` (ours or torch's Metadata), exactly
    as torch's pickle would write them, without needing torch."""
    return dumps_metadata(md)


def _load_metadata(data: bytes, path: str = _METADATA_FN, allow_unsafe: bool = False) -> Any:
    """``.metadata`` through the restricted unpickler: only the metadata
    classes, sizes, dtypes and plain containers are admitted."""
    try:
        return loads_metadata(data, allow_unsafe=allow_unsafe)
    except (UnsafePickleError, PickleFormatError) as e:
        raise StorageFormatError(f"{path}: refused or malformed checkpoint metadata: {e}") from e


def _validate_checkpoint_id(checkpoint_id: str | os.PathLike) -> bool:
    if isinstance(checkpoint_id, Path):
        return True
    if "://" in str(checkpoint_id):
        return False
    return any(p.exists() and os.access(p, os.W_OK) for p in Path(checkpoint_id).parents)


# --------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------


class FileSystemWriter(StorageWriter, _FileSystemWriterStager):
    """Writes a DCP checkpoint directory, byte-identical to torch 2.13's
    ``FileSystemWriter`` with the same options.

    ``thread_count`` sets how many files each rank writes (as in torch); the
    I/O itself always runs on the engine's thread pool. ``per_thread_copy_ahead``
    only matters for torch's item order when an accelerator is present, and
    is honoured for that. It is a ``BlockingAsyncStager``, as torch's is:
    ``async_save`` stages through it (``cache_staged_state_dict``: one arena
    kept for this writer, see ``staging``).
    With ``SerializationFormat.SAFETENSORS`` each data file is, as torch
    writes it, the file's bytes items followed by one safetensors blob of
    its tensors (``_safetensors.write_items``), written by the engine.

    ``_extensions`` (EXPERIMENTAL, as in torch): stream transforms, such as
    ``_extension.ZStandard()``, that every item's bytes go through, as
    torch's writer applies them (``_fs_transform``); the items' storage data
    records their descriptors. Without them the records are written as
    before, by the engine alone.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = SerializationFormat.TORCH_SAVE,
    ) -> None:
        _FileSystemWriterStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be an int >= 1, got {thread_count!r}")
        fmt = getattr(serialization_format, "value", serialization_format)
        if fmt not in ("torch_save", "safetensors"):
            raise ValueError(f"unknown serialization_format {serialization_format!r}")
        if fmt == "safetensors" and _extensions:
            raise NotImplementedError("_extensions with SerializationFormat.SAFETENSORS")
        self._safetensors = fmt == "safetensors"
        # None (torch: "the implementation's defaults") and () both mean none.
        self._transforms = (WriterTransforms(_extensions, thread_count) if _extensions
                            else None)
        self.fs = FileSystem()  # torch's attribute (shardstate's engine does the I/O)
        self.path = Path(path)
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.overwrite = overwrite
        self.serialization_format = serialization_format
        self.save_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.use_collectives = True
        self.is_coordinator = True

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def _metadata_path(self, rank: int | None = None) -> Path:
        return self.path / (_METADATA_FN if rank is None else f"__{rank}{_METADATA_FN}")

    def _own_metadata_path(self) -> Path:
        if not self.use_collectives and self.rank is not None:
            return self._metadata_path(self.rank)
        return self._metadata_path()

    def _stale_metadata(self) -> list[Path]:
        """The metadata files of an earlier save that this rank removes
        before any data file of this save is written, so none of them ever
        describes new, partial data: with collectives, the coordinator removes
        ``.metadata`` and every ``__{k}.metadata`` (the other ranks write only
        after the global plan, which needs the coordinator's local plan
        first); without, each rank removes ``.metadata`` (it names this rank's
        files too) and its own ``__{rank}.metadata`` (another rank's may
        already be this save's)."""
        if not self.use_collectives and self.rank is not None:
            return [self._metadata_path(), self._metadata_path(self.rank)]
        if not self.is_coordinator:
            return []
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            names = []
        return [self._metadata_path()] + [self.path / n for n in sorted(names)
                                          if _RANK_METADATA.fullmatch(n)]

    def prepare_local_plan(self, plan: Any) -> Any:
        ssio.makedirs(self.path)
        probe = self._metadata_path(None if self.use_collectives else 0)
        stale = self._stale_metadata()
        # Without overwrite, an earlier save of the other mode counts too.
        found = probe if probe.exists() else next((p for p in stale if p.exists()), None)
        if found is not None:
            if not self.overwrite:
                raise RuntimeError(
                    f"Checkpoint already exists in {self.path} ({found.name}) and overwrite=False."
                )
            warnings.warn(
                f"Detected an existing checkpoint in {self.path}, overwriting since "
                "overwrite=True.",
                stacklevel=2,
            )
        removed = [ssio.unlink(p, missing_ok=True) for p in stale]
        if any(removed):
            ssio.fsync_dir(self.path)
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return [
            dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_"))
            if p.storage_data is None
            else p
            for i, p in enumerate(plans)
        ]

    def _files(self, plan: Any) -> list[tuple[str, list[Any]]]:
        prefix = plan.storage_data.prefix
        if self.single_file_per_rank:
            buckets = _split_by_size_and_type(self.thread_count, list(plan.items))
        else:
            buckets = [[item] for item in plan.items]
        return [(f"{prefix}{n}{DEFAULT_SUFFIX}", b) for n, b in enumerate(buckets)]

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self._safetensors:  # torch's files: each a safetensors blob (bytes items first)
            return completed_future(_safetensors.write_items(
                self.path, self._files(plan), planner, self.sync_files))
        reorder = _uses_overlapping_loader(self.thread_count, self.per_thread_copy_ahead)
        return completed_future(
            write_files(self.path, self._files(plan), planner, reorder, self.sync_files,
                        self._transforms))

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        data = _dump_metadata(metadata)
        ssio.atomic_publish(self._own_metadata_path(), data, fsync=self.sync_files)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _validate_checkpoint_id(checkpoint_id)


# --------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _LoadPlanData:
    """A local load plan's ``storage_data`` from ``prepare_global_plan``:
    this rank's chunks verified together, and the broadcast schedule."""

    shared: frozenset
    bcast: _Schedule | None = None


class FileSystemReader(StorageReader):
    """Reads a DCP checkpoint directory written by torch 2.13 or by us.

    Every tensor record's CRC-32 is checked as it is read
    (``verify_checksums=False`` turns that off). Bytes items are handed to
    ``planner.load_bytes`` only after their entries' CRC-32s and their
    pickle's globals (an allowlist: builtin containers, tensors, storages,
    dtypes, sizes, NumPy arrays) have been checked, unless
    ``unsafe_unpickle=True`` (torch's own reader loads them with
    ``weights_only=False``, which runs any code they hold).

    ``_extension_registry`` (EXPERIMENTAL, as in torch): the
    ``_extension.ExtensionRegistry`` that makes the stream transforms items
    were written with (their ``transform_descriptors``) into extensions to
    undo them; by default one that knows ZStandard. What the transforms give
    back is bounded by the item's size and checked as any record
    (``_fs_transform``).

    ``broadcast_shared_reads``: under shardstate's ``load`` with a process
    group, a saved chunk that several ranks need (a Replicate() target, a
    plain tensor every rank loads, overlapping reshard regions) is read from
    storage by one rank and broadcast over the group, so storage reads do
    not grow with the replication factor (``_fs_bcast.plan_broadcast``).
    True turns it on; None (auto) and False leave it off: over gloo on one
    host each rank reading the page cache is as fast. The coordinator's
    option decides for the load. ``read_stats`` holds, after each
    ``read_data``, the bytes this rank read from storage and sent and
    received in broadcasts.

    Under shardstate's ``load`` the ranks also verify together the records
    their reads split between them (``_fs_verify``). Both run through
    ``load_collectives``, which only shardstate's loader calls; under
    torch's ``load`` the reader reads as torch's does.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        _extension_registry: Any | None = None,
        *,
        verify_checksums: bool = True,
        unsafe_unpickle: bool = False,
        broadcast_shared_reads: bool | None = None,
    ) -> None:
        super().__init__()
        if broadcast_shared_reads not in (None, True, False):
            raise TypeError("broadcast_shared_reads must be None, True or False, got "
                            f"{broadcast_shared_reads!r}")
        self.broadcast_shared_reads = broadcast_shared_reads
        self.fs = FileSystem()  # torch's attribute (shardstate's engine does the I/O)
        self.path = Path(path)
        self.storage_data: dict[Any, Any] = {}
        self._records = _Records(self.path, self.storage_data)
        self.load_id = str(uuid.uuid4())
        self.rank: int | None = None
        self.use_collectives = True
        self.verify_checksums = verify_checksums
        self.unsafe_unpickle = unsafe_unpickle
        self._transforms = ReaderTransforms(_extension_registry)
        # The load's collectives, while shardstate's load runs (None under
        # torch's load): see load_collectives.
        self._collectives: _Collectives | None = None
        self.read_stats: dict[str, int] = _new_stats()
        # CUDA destinations read through the staging pipeline, fixed by the
        # load's first CUDA destination
        self._cuda = _CudaDest()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        self._collectives = None  # set again by shardstate's load, after reset
        self._cuda = _CudaDest()  # each load picks its staging device afresh
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self._records = _Records(self.path, self.storage_data)
        self.load_id = str(uuid.uuid4())

    def _metadata_path(self, rank: int | None = None) -> Path:
        return self.path / (_METADATA_FN if rank is None else f"__{rank}{_METADATA_FN}")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._metadata_path(kwargs.get("rank"))
        try:
            with file_errors(path, "checkpoint metadata"):
                data = ssio.read_file(path, _MAX_METADATA_BYTES)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no checkpoint metadata at {path} (incomplete or missing checkpoint)"
            ) from None
        md = _load_metadata(data, os.fspath(path), self.unsafe_unpickle)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        # With torch installed the metadata classes are torch's own, so
        # torch's planners take md as it is.
        return md

    def set_up_storage_reader(
        self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise StorageFormatError(f"{self.path}: metadata has no storage_data")
        # Keyed by (fqn, offset) so plans made with torch's MetadataIndex and
        # with ours find the same entries (the two classes never compare equal).
        sd = metadata.storage_data
        if type(sd) is _mdlazy.StorageMap:  # a large file's compact form: looked up, not copied
            self.storage_data = _mdlazy.IndexKeyView(sd)
        else:
            self.storage_data = {_index_key(k): v for k, v in sd.items()}
        self._records = _Records(self.path, self.storage_data, metadata)
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan


    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """On the coordinator: puts in each plan's ``storage_data`` (a
        ``_LoadPlanData``) the saved chunks whose checksum the ranks verify
        together (``_fs_verify.shared_chunks``), under shardstate's load,
        and the broadcast schedule (``_fs_bcast.plan_broadcast``) when
        broadcasting shared reads is on. Every rank gets the same schedule."""
        sched = (plan_broadcast(plans, self._records)
                 if self._broadcast_on() and len(plans) > 1 else None)
        shared: set = set()
        if self._collectives is not None and self.verify_checksums and len(plans) > 1:
            shared = _fs_verify.shared_chunks(self._records.tensor_reads(plans))
            if sched is not None:
                shared -= sched.keys  # read whole, by one rank, which checks it
        if not shared and sched is None:
            return plans
        out = []
        for p in plans:
            mine = frozenset(k for k in (_index_key(it.storage_index) for it in p.items)
                             if k in shared)
            out.append(dataclasses.replace(p, storage_data=_LoadPlanData(mine, sched))
                       if mine or sched is not None else p)
        return out

    def _broadcast_on(self) -> bool:
        """Whether this (the coordinator's) load broadcasts shared reads:
        only under shardstate's load with a group of 2+ ranks. Auto (None)
        is off for now: over gloo on one host, reading from the page cache
        beats sending the bytes over loopback (measured); it is meant to
        turn on with the NCCL transport for CUDA targets (issue 5)."""
        coord = None if self._collectives is None else self._collectives.coord
        if coord is None or not coord.use_dist or coord.world_size < 2:
            return False
        return bool(self.broadcast_shared_reads)

    def load_collectives(self, coord: Any) -> _Collectives:
        """Called by shardstate's load, on every rank, before planning, with
        its coordinator (whose process group carries the broadcasts): the
        load's shared verification and broadcast of shared reads run
        through what it returns (``state_dict_loader.LoadCollectives``)
        until its ``done()``."""
        self._collectives = _Collectives(self, coord)
        return self._collectives

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _validate_checkpoint_id(checkpoint_id)

    def read_data(self, plan: Any, planner: Any) -> Any:
        col = self._collectives
        armed = None if col is None else col._take_armed()
        sd = armed if armed is not None else getattr(plan, "storage_data", None)
        lp = sd if isinstance(sd, _LoadPlanData) and col is not None else None
        reads = _Reads(self._records, self.verify_checksums, self.unsafe_unpickle, self._cuda,
                       lp.shared if lp is not None else frozenset(), self._transforms)
        self.read_stats = reads.stats
        if col is not None:
            col._reads = reads  # for its pieces()
        sched = lp.bcast if lp is not None else None
        if col is not None and sched is not None:
            read_shared(col.coord, sched, reads, plan, planner)
        else:
            reads.local(self._records.requests(plan.items), planner)
        return completed_future(None)


class _Collectives:
    """What ``FileSystemReader.load_collectives`` returns: the reader's side
    of one load's collective steps (``state_dict_loader.LoadCollectives``)."""

    def __init__(self, reader: FileSystemReader, coord: Any) -> None:
        self.coord = coord
        self._reader = reader
        self._armed: Any = None
        self._reads: _Reads | None = None

    def arm(self, storage_data: Any) -> None:
        """The central plan's ``storage_data``, before ``finish_plan``: the
        broadcast rounds are run from it even if a planner's
        ``finish_plan`` drops it."""
        self._armed = storage_data

    def _take_armed(self) -> Any:
        sd, self._armed = self._armed, None
        return sd

    def abort(self) -> None:
        """This rank failed before ``read_data`` began (in ``finish_plan``,
        or a subclass's ``read_data`` before this one's): it still takes
        part in the exchange (as failed) so no rank waits for its
        broadcasts. A no-op once ``read_data`` has begun: its exchange
        takes part itself, failing or not."""
        sd = self._take_armed()
        if isinstance(sd, _LoadPlanData) and sd.bcast is not None:
            exchange(self.coord, sd.bcast, {}, None, None, failed=True)

    def pieces(self) -> list[tuple]:
        """After ``read_data``: this rank's pieces of the shared records."""
        reads, self._reads = self._reads, None
        return [] if reads is None else reads.pieces

    def verify(self, gathered: list[list[tuple]]) -> None:
        """Every rank's ``pieces()``, in rank order (the same on every rank)."""
        _fs_verify.verify_pieces(gathered)

    def done(self) -> None:
        """The load is over: the reader reads as torch's again."""
        if self._reader._collectives is self:
            self._reader._collectives = None
