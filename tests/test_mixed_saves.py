"""Saves of both modes into one directory, and files a load must not trust.

Issue 15, case 5: a save with ``use_collectives=True`` writes ``.metadata``,
one without writes ``__{rank}.metadata``, and both write the same
``__{rank}_{n}.distcp`` data files. A save removes every metadata file of an
earlier save (either mode) before it writes data, so a load finds the newest
complete save's metadata or none at all (a clear error), never an older
save's metadata over newer data.

Case 6: the metadata and data files a load opens must be regular files; a
FIFO, a device or a directory is refused at once (a FIFO used to block the
load forever).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from shardstate import io as ssio
from shardstate.checkpoint import load, save
from shardstate.checkpoint.api import CheckpointException
from shardstate.checkpoint.filesystem import FileSystemReader, FileSystemWriter, StorageFormatError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _metadata_names(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if re.fullmatch(r"(__[0-9]+)?\.metadata", n))


def _sd(base: int, order: tuple[str, ...] = ("a", "b")) -> dict[str, torch.Tensor]:
    # The second save lists its keys the other way round and has other
    # values, so an older save's metadata over its data would be caught.
    return {k: torch.arange(8, dtype=torch.float32) + base + 10 * i
            for i, k in enumerate(order)}


def _zeros() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(8), "b": torch.zeros(8)}


def _equal(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


class _DiesBeforeMetadata(FileSystemWriter):
    """A save that dies between its data files and its metadata."""

    def finish(self, metadata: Any, results: Any) -> None:
        raise RuntimeError("killed before the metadata was published")


def _save(path: Path, sd: dict, collectives: bool, writer: type = FileSystemWriter) -> None:
    save(sd, storage_writer=writer(path), use_collectives=collectives)


def _mixed(rank: int, world_size: int, root: str) -> None:
    import torch.distributed as dist

    old, new = _sd(100), _sd(1000, ("b", "a"))
    for first in (True, False):
        # A complete save of one mode, then of the other: the load gets the
        # second, and only the second's metadata is left.
        d = Path(root, f"complete_{first}")
        _save(d, old, first)
        dist.barrier()
        _save(d, new, not first)
        dist.barrier()
        out = _zeros()
        load(out, storage_reader=FileSystemReader(d))
        assert _equal(out, new), (first, out)
        want = [".metadata"] if first is False else [f"__{r}.metadata" for r in range(world_size)]
        assert _metadata_names(d) == sorted(want), (first, _metadata_names(d))
        dist.barrier()

        # The second save dies after its data: the load refuses (no
        # metadata) or gives exactly the old state, never a mix.
        d = Path(root, f"killed_{first}")
        _save(d, old, first)
        dist.barrier()
        with pytest.raises((Exception, CheckpointException), match="killed before the metadata"):
            _save(d, new, not first, _DiesBeforeMetadata)
        dist.barrier()
        out = _zeros()
        try:
            load(out, storage_reader=FileSystemReader(d))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a clear error is right
            assert "no checkpoint metadata" in str(e), e
        else:
            assert _equal(out, old), (first, out)
        dist.barrier()

        # overwrite=False sees the other mode's checkpoint too.
        d = Path(root, f"keep_{first}")
        _save(d, old, first)
        dist.barrier()
        with pytest.raises((Exception, CheckpointException), match="overwrite=False"):
            save(new, storage_writer=FileSystemWriter(d, overwrite=False),
                 use_collectives=not first)
        dist.barrier()
        out = _zeros()
        load(out, storage_reader=FileSystemReader(d))
        assert _equal(out, old), (first, out)
        dist.barrier()


@pytest.mark.distributed_timeout(240)
@pytest.mark.parametrize("world_size", [1, 2])
def test_mixed_mode_saves_never_load_the_other_save(tmp_path, run_distributed, world_size):
    run_distributed(_mixed, world_size, str(tmp_path))


def test_metadata_over_another_saves_data_is_refused(tmp_path):
    # Each tensor's storage entry carries its data's CRC-32; a data file of
    # another save of the same layout (copied in, or left by a mixed save)
    # no longer matches the metadata and the load is refused, not wrong.
    a, b = tmp_path / "a", tmp_path / "b"
    save(_sd(100), storage_writer=FileSystemWriter(a))
    save(_sd(1000), storage_writer=FileSystemWriter(b))
    (a / "__0_0.distcp").write_bytes((b / "__0_0.distcp").read_bytes())
    out = _zeros()
    with pytest.raises(CheckpointException, match="not written with this data file"):
        load(out, storage_reader=FileSystemReader(a))
    # torch's own reader ignores the entry, and torch's metadata (without
    # one) loads in shardstate: the files are torch's, both ways.
    import torch.distributed.checkpoint as tdcp

    out = _zeros()
    tdcp.load(out, storage_reader=tdcp.FileSystemReader(b))
    assert _equal(out, _sd(1000))
    c = tmp_path / "c"
    tdcp.save(_sd(7), storage_writer=tdcp.FileSystemWriter(c))
    out = _zeros()
    load(out, storage_reader=FileSystemReader(c))
    assert _equal(out, _sd(7))


# --------------------------------------------------------------------------
# Case 6: non-regular files
# --------------------------------------------------------------------------


def _within(seconds: float, fn: Callable[[], Any], unblock: Callable[[], None]) -> BaseException:
    """Runs ``fn`` in a thread; returns what it raised. Fails (rather than
    hanging the suite) if it has not finished after ``seconds``; ``unblock``
    then frees it."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        unblock()
        t.join(seconds)
        pytest.fail(f"still blocked after {seconds} s")
    assert box[0] is not None, "expected the load to be refused"
    return box[0]


def _free_fifo(path: Path) -> Callable[[], None]:
    def unblock() -> None:
        try:  # a writer that opens and closes at once: the reader sees EOF
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    return unblock


def _checkpoint(path: Path) -> None:
    save(_sd(100), storage_writer=FileSystemWriter(path))


def test_fifo_metadata_is_refused_without_blocking(tmp_path):
    _checkpoint(tmp_path)
    md = tmp_path / ".metadata"
    md.unlink()
    os.mkfifo(md)
    err = _within(10, lambda: load(_zeros(), storage_reader=FileSystemReader(tmp_path)),
                  _free_fifo(md))
    assert "FIFO" in str(err) and "not a regular file" in str(err), err
    err = _within(10, lambda: FileSystemReader(tmp_path).read_metadata(), _free_fifo(md))
    assert isinstance(err, StorageFormatError), err


@pytest.mark.parametrize("kind", ["directory", "device"])
def test_non_regular_metadata_is_refused(tmp_path, kind):
    _checkpoint(tmp_path)
    md = tmp_path / ".metadata"
    md.unlink()
    if kind == "directory":
        md.mkdir()
    else:
        md.symlink_to("/dev/zero")
    err = _within(10, lambda: FileSystemReader(tmp_path).read_metadata(), lambda: None)
    assert isinstance(err, StorageFormatError) and kind in str(err), err
    err = _within(10, lambda: load(_zeros(), storage_reader=FileSystemReader(tmp_path)),
                  lambda: None)
    assert "not a regular file" in str(err), err


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev_zero_link", "outside_link"])
def test_non_regular_data_file_is_refused(tmp_path, kind):
    ck = tmp_path / "ck"
    _checkpoint(ck)
    data = ck / "__0_0.distcp"
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(data.read_bytes())
    data.unlink()
    if kind == "fifo":
        os.mkfifo(data)
    elif kind == "directory":
        data.mkdir()
    elif kind == "dev_zero_link":
        data.symlink_to("/dev/zero")
    else:  # a regular file, but outside the checkpoint directory
        data.symlink_to(outside)
    err = _within(10, lambda: load(_zeros(), storage_reader=FileSystemReader(ck)),
                  _free_fifo(data))
    assert re.search("not a regular file|outside the checkpoint", str(err)), err


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev_zero"])
def test_engine_refuses_non_regular_files(tmp_path, kind):
    # The C engine opens data files itself: it must not block on a FIFO or
    # read a device or a directory either.
    path = tmp_path / "x"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path = Path("/dev/zero")
    buf = bytearray(16)
    err = _within(10, lambda: ssio.read([ssio.ReadJob(path, 0, buf)]), _free_fifo(path))
    assert "not a regular file" in str(err), err
    assert buf == bytearray(16)
