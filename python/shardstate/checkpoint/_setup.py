"""Choosing the storage and the process group for a save or load."""

from __future__ import annotations

import os
from typing import Any

from ._dist import _Coordinator, dist_ready


def _storage_setup(storage: Any, checkpoint_id: str | os.PathLike | None, reader: bool) -> Any:
    """The storage to use: the one given (reset to checkpoint_id if given),
    else a FileSystemReader/Writer on checkpoint_id, else (a URL, as in
    torch) an FsspecReader/Writer when fsspec is installed."""
    if storage is not None:
        if checkpoint_id is not None:
            storage.reset(checkpoint_id)
        return storage
    if checkpoint_id is None:
        kind = "storage_reader" if reader else "storage_writer"
        raise RuntimeError(f"`checkpoint_id` must be specified if {kind} is None.")
    from .filesystem import FileSystemReader, FileSystemWriter

    targets: list[Any] = [FileSystemReader if reader else FileSystemWriter]
    try:
        from ._fsspec_filesystem import FsspecReader, FsspecWriter
    except ImportError:  # fsspec is optional
        pass
    else:
        targets.append(FsspecReader if reader else FsspecWriter)
    for cls in targets:
        if cls.validate_checkpoint_id(checkpoint_id):
            return cls(checkpoint_id)
    raise RuntimeError(
        f"Cannot detect which StorageReader or StorageWriter to use for "
        f"checkpoint_id {os.fspath(checkpoint_id)!r}: it is not a local path"
        f"{'' if len(targets) > 1 else ' (and fsspec, for URLs, is not installed)'}.")


def _tool_reader(path: str | os.PathLike, unsafe_unpickle: bool = False) -> Any:
    """The reader a tool (the command, format_utils) opens a checkpoint
    with: an FsspecReader for a URL (fsspec's configured options), else a
    FileSystemReader, also on a read-only mount (which _storage_setup's
    writable-parent check would send to fsspec)."""
    from ._steps import is_url

    if is_url(path):
        from ._fsspec_filesystem import FsspecReader

        reader = FsspecReader(path)
        reader.unsafe_unpickle = unsafe_unpickle
        return reader
    from .filesystem import FileSystemReader

    return FileSystemReader(path, unsafe_unpickle=unsafe_unpickle)


def _tool_writer(path: str | os.PathLike) -> Any:
    """``_tool_reader``'s writer: an FsspecWriter for a URL, else a
    FileSystemWriter."""
    from ._steps import is_url

    if is_url(path):
        from ._fsspec_filesystem import FsspecWriter

        return FsspecWriter(path)
    from .filesystem import FileSystemWriter

    return FileSystemWriter(path)


def _coordinator(process_group: Any, no_dist: bool, coordinator_rank: int = 0) -> _Coordinator:
    """no_dist is implied when torch.distributed is not initialised."""
    use_dist = (not no_dist) and dist_ready()
    return _Coordinator(process_group, use_dist, coordinator_rank)
