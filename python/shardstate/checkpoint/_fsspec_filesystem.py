"""``FsspecWriter`` / ``FsspecReader``: DCP checkpoints on any fsspec
filesystem (``s3://``, ``gs://``, ``memory://``, ...), torch 2.13's
``torch.distributed.checkpoint._fsspec_filesystem`` on shardstate's engine.

The objects are those torch's FsspecWriter writes for the same plan (the
local writer's names, records and ``.metadata``), so either reader reads
either writer's checkpoints. The bytes go through the local engine
unchanged, with in-memory files in place of the directory
(``_fs_upload.MemFiles``: ``memfd`` files reached through
``/proc/self/fd``):

* save: ``_fs_write.write_files`` lays a rank's records out and
  ``_fs_upload.write_objects`` has the engine frame them (CRC-32s in C)
  window by window into memory, each window uploaded as it is filled (no
  copy: ``_fs_upload.Body``, a read-only view of the window's mapping): a
  part of an S3 multipart upload, several in flight, or the next write to
  the object's file elsewhere; the memory held is bounded by the windows
  in flight, not by the files' size (with stream transforms, whole files
  are still framed in memory first, then uploaded). ``.metadata`` is put
  last, after every data object is complete, and an earlier save's
  metadata objects are removed first (``prepare_local_plan``), as on a
  local directory;
* load: the byte ranges of the records this rank reads (whole records,
  so every CRC-32 is checked) are fetched in parallel (``cat_ranges``) into
  sparse in-memory files the size of the objects, and the local reader's
  record code (``_records``, ``_fs_read``: C parsing, CRC checks, copies
  into place, the restricted unpickler for bytes items) reads them there.
  Storage paths are confined to the checkpoint prefix as on disk, and
  ``.metadata``'s size is checked before it is fetched.

Thread safety: one writer or reader serves one save or load at a time, as
in torch.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import uuid
import warnings
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fsspec.core import url_to_fs

from . import _fs_remote, _fs_upload
from ._fs_write import _uses_overlapping_loader, write_files
from ._records import _File, _Records
from .filesystem import (
    _MAX_METADATA_BYTES,
    _METADATA_FN,
    _RANK_METADATA,
    CURRENT_DCP_VERSION,
    FileSystemBase,
    FileSystemReader,
    FileSystemWriter,
    SerializationFormat,
    _dump_metadata,
    _load_metadata,
    _StoragePrefix,
)
from .metadata import StorageMeta
from .storage import WriteResult, completed_future

__all__ = ["FsspecWriter", "FsspecReader"]


class FileSystem(FileSystemBase):
    """torch's ``_fsspec_filesystem.FileSystem``: the fsspec filesystem of a
    checkpoint (``fs``, set by ``init_path``) behind torch's interface."""

    def __init__(self) -> None:
        self.fs: Any = None

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        path = os.fspath(path)
        with self.fs.open(path, mode) as stream:
            try:
                yield stream
            except BaseException:
                if any(ch in mode for ch in "w+a"):
                    try:
                        self.rm_file(path)
                    except Exception:  # noqa: BLE001 - the first error is the one to raise
                        pass
                raise

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike:
        return posixpath.join(os.fspath(path), suffix)

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        self.fs, _ = url_to_fs(os.fspath(path), **kwargs)
        return path

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.fs.rename(os.fspath(path), os.fspath(new_path))

    def mkdir(self, path: str | os.PathLike) -> None:
        self.fs.makedirs(os.fspath(path), exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        if isinstance(checkpoint_id, Path):
            return False
        try:
            url_to_fs(checkpoint_id)
        except ValueError:
            return False
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return bool(self.fs.exists(os.fspath(path)))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.fs.rm(os.fspath(path))

    def ls(self, path: str | os.PathLike) -> list[str]:
        return list(self.fs.ls(os.fspath(path), detail=False))


def _join(root: str | os.PathLike, name: str) -> str:
    return posixpath.join(os.fspath(root), name)


class FsspecWriter(FileSystemWriter):
    """Writes a DCP checkpoint to an fsspec URL, as torch 2.13's
    ``FsspecWriter`` does (same signature; ``kwargs`` go to
    ``fsspec.core.url_to_fs``), through shardstate's engine. ``sync_files``
    has no meaning for an object store (an object exists once complete);
    ``thread_count`` splits a rank's data into that many objects, as in
    torch, all uploaded at once."""

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, single_file_per_rank, sync_files, thread_count,
                         per_thread_copy_ahead, overwrite=overwrite, _extensions=_extensions,
                         serialization_format=serialization_format)
        self._fs_kwargs = kwargs
        self.fs = FileSystem()
        self.path = self.fs.init_path(path, **kwargs)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = self.fs.init_path(checkpoint_id, **self._fs_kwargs)
        self.save_id = str(uuid.uuid4())

    def _metadata_url(self, rank: int | None = None) -> str:
        return _join(self.path, _METADATA_FN if rank is None else f"__{rank}{_METADATA_FN}")

    def _own_metadata_url(self) -> str:
        if not self.use_collectives and self.rank is not None:
            return self._metadata_url(self.rank)
        return self._metadata_url()

    def prepare_local_plan(self, plan: Any) -> Any:
        """As the local writer's: an earlier save's metadata objects (those
        ``FileSystemWriter._stale_metadata`` names) are removed before any
        data object of this save is written, or, without ``overwrite``,
        refused."""
        fs = self.fs.fs
        root = os.fspath(self.path)
        fs.makedirs(root, exist_ok=True)
        names = _fs_remote.listing(fs, root)
        if not self.use_collectives and self.rank is not None:
            stale = [_METADATA_FN, f"__{self.rank}{_METADATA_FN}"]
            probe = f"__0{_METADATA_FN}"
        else:
            stale = ([_METADATA_FN] + sorted(n for n in names if _RANK_METADATA.fullmatch(n))
                     if self.is_coordinator else [])
            probe = _METADATA_FN
        found = probe if probe in names else next((n for n in stale if n in names), None)
        if found is not None:
            if not self.overwrite:
                raise RuntimeError(
                    f"Checkpoint already exists in {root} ({found}) and overwrite=False.")
            warnings.warn(f"Detected an existing checkpoint in {root}, overwriting since "
                          "overwrite=True.", stacklevel=2)
        for n in stale:
            if n in names:
                fs.rm_file(_join(root, n))
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def write_data(self, plan: Any, planner: Any) -> Any:
        files = self._files(plan)
        reorder = _uses_overlapping_loader(self.thread_count, self.per_thread_copy_ahead)
        if self._transforms is None:
            urls = [_join(self.path, name) for name, _items in files]

            def engine(table: Any, buffers: Any, plans: Any, stage: Any,
                       stream: Any) -> list[int]:
                return _fs_upload.write_objects(self.fs.fs, urls, table, buffers, plans,
                                                stage, stream)

            return completed_future(write_files(Path(), files, planner, reorder, False,
                                                engine=engine))
        # (stream transforms: whole files in memory, then uploaded)
        with _fs_upload.MemFiles() as mem:
            locate = {name: mem.create(name) for name, _items in files}
            results = write_files(Path(), files, planner, reorder, False, self._transforms,
                                  locate)
            _fs_upload.upload(self.fs.fs, {_join(self.path, name): mem.body(name)
                                           for name, _items in files})
        return completed_future(results)

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        _fs_remote.publish(self.fs.fs, self._own_metadata_url(), _dump_metadata(metadata))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)


class _RemoteRecords(_Records):
    """``_Records`` whose files are the in-memory copies of the objects'
    fetched ranges (``_fs_remote.Mirror``); paths are confined to the
    checkpoint prefix exactly as on disk."""

    def __init__(self, path: Any, storage_data: Any, metadata: Any,
                 mirror: _fs_remote.Mirror) -> None:
        super().__init__(path, storage_data, metadata)
        self.mirror = mirror

    def _open_file(self, rel: object, files: dict[str, _File]) -> _File:
        f = files.get(rel) if type(rel) is str else None
        if f is not None:
            return f
        _fs_remote.check_relative(self.path, rel)
        f = files[rel] = self.mirror.file(rel)  # type: ignore[index]
        return f

    def display(self, text: str) -> str:
        return self.mirror.rename(text)


class FsspecReader(FileSystemReader):
    """Reads a DCP checkpoint at an fsspec URL written by torch 2.13 or by
    us (same signature as torch's: ``kwargs`` go to
    ``fsspec.core.url_to_fs``). Reads only the records this rank needs,
    whole (every CRC-32 checked), fetched in parallel; everything else is
    the local ``FileSystemReader``'s."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path)
        self._fs_kwargs = kwargs
        self.fs = FileSystem()
        self.path = self.fs.init_path(path, **kwargs)
        self._records = self._remote_records(None)

    def _remote_records(self, metadata: Any) -> _RemoteRecords:
        return _RemoteRecords(self.path, self.storage_data, metadata,
                              _fs_remote.Mirror(self.fs.fs, os.fspath(self.path)))

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = self.fs.init_path(checkpoint_id, **self._fs_kwargs)
        super().reset(None)
        self._records = self._remote_records(None)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        url = _join(self.path, _METADATA_FN if rank is None else f"__{rank}{_METADATA_FN}")
        data = _fs_remote.fetch_bounded(self.fs.fs, url, _MAX_METADATA_BYTES,
                                        "checkpoint metadata")
        md = _load_metadata(data, url, self.unsafe_unpickle)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._records = _RemoteRecords(self.path, self.storage_data, metadata,
                                       _fs_remote.Mirror(self.fs.fs, os.fspath(self.path)))

    def read_data(self, plan: Any, planner: Any) -> Any:
        mirror = self._records.mirror  # type: ignore[attr-defined]
        try:
            mirror.fetch(self._records.requests(plan.items))
            return super().read_data(plan, planner)
        except Exception as e:
            mirror.rename_in(e)  # the objects' URLs in the message, not the local copies'
            raise
        finally:
            mirror.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)
