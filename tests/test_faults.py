"""Fault injection through the I/O vtable: every injected failure gives a
clean ShardstateIOError with the right errno, leaks no descriptor or
thread, and leaves the process usable; short transfers and EINTR are
absorbed; atomic_publish never damages the old file."""

import errno
import os
import zlib

import numpy as np
import pytest
import shardstate
from shardstate import io as sio

POOL = shardstate.ThreadPool(2)  # created once, so thread counts are stable
PIECE = 8192


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _tasks():
    return len(os.listdir("/proc/self/task"))


def _dataset(tmp_path):
    rng = np.random.default_rng(7)
    spec = []
    for j in range(12):
        n = 0 if j == 5 else int(rng.integers(1000, 40_000))
        spec.append((tmp_path / f"f{j % 3}", j * 50_000, rng.bytes(n)))
    return spec


def _roundtrip(spec, faults=None, fsync=True):
    """Write then read back through faults; check bytes and CRCs."""
    crcs = sio.write(
        [sio.WriteJob(p, off, d) for p, off, d in spec],
        pool=POOL,
        fsync=fsync,
        writeback=True,
        _piece=PIECE,
        _faults=faults,
    )
    assert crcs == [zlib.crc32(d) for _, _, d in spec]
    outs = [bytearray(len(d)) for _, _, d in spec]
    got = sio.read(
        [sio.ReadJob(p, off, o, c) for (p, off, _), o, c in zip(spec, outs, crcs)],
        pool=POOL,
        _piece=PIECE,
        _faults=faults,
    )
    assert got == crcs
    assert [bytes(o) for o in outs] == [d for _, _, d in spec]


@pytest.fixture(scope="module")
def clean_calls(tmp_path_factory):
    """Calls of each op in one clean write+read round trip."""
    spec = _dataset(tmp_path_factory.mktemp("count"))
    fi = sio.FaultInjector()
    _roundtrip(spec, fi)
    return {op: fi.calls(op) for op in OPS}


OPS = ["open", "ftruncate", "pwrite", "writeback", "fsync", "close", "fstat", "pread"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("which", ["1", "2", "last"])
def test_fault_matrix(tmp_path, clean_calls, op, err, which):
    spec = _dataset(tmp_path)
    last = clean_calls[op]
    assert last >= 2
    k = last if which == "last" else int(which)
    fi = sio.FaultInjector()
    fi.fail(op, k, err)
    fds, tasks = _fds(), _tasks()
    with pytest.raises(shardstate.ShardstateIOError) as ei:
        _roundtrip(spec, fi)
    e = ei.value
    assert isinstance(e, OSError)
    assert e.errno == err
    assert e.op == op
    assert e.filename in {str(p) for p, _, _ in spec}
    assert os.strerror(err) in str(e)
    assert fi.calls(op) >= k
    assert _fds() == fds
    assert _tasks() == tasks
    _roundtrip(spec)  # the process is still usable


@pytest.mark.parametrize("err", [errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINTR])
def test_writeback_unsupported_is_only_a_hint(tmp_path, clean_calls, err):
    """A file system without sync_file_range (or a signal) loses nothing:
    the batch completes and the data is right; only real write errors
    reported early (the matrix above: EIO, ENOSPC) fail it."""
    spec = _dataset(tmp_path)
    assert clean_calls["writeback"] >= 2  # one per written piece
    fi = sio.FaultInjector()
    fi.fail("writeback", 1, err)
    fi.fail("writeback", clean_calls["writeback"], err)
    _roundtrip(spec, fi)
    assert fi.calls("writeback") == clean_calls["writeback"]


@pytest.mark.parametrize("op", ["pwrite", "pread"])
@pytest.mark.parametrize("which", ["1", "2", "last"])
@pytest.mark.parametrize("nbytes", [0, 1, 3000])
def test_short_transfers_are_completed(tmp_path, clean_calls, op, which, nbytes):
    spec = _dataset(tmp_path)
    last = clean_calls[op]
    k = last if which == "last" else int(which)
    fi = sio.FaultInjector()
    if op == "pread" and nbytes == 0:
        # a read returning 0 bytes is end of file: an error, never a hang
        fi.short(op, k, 0)
        with pytest.raises(shardstate.ShardstateError, match="unexpected end of file") as ei:
            _roundtrip(spec, fi)
        assert ei.value.op == "pread"
        return
    if nbytes == 0:
        nbytes = 1
    fi.short(op, k, nbytes)
    _roundtrip(spec, fi)  # data and CRCs still right
    # one more call to finish the short piece (unless it was that small)
    assert fi.calls(op) in (last, last + 1)


@pytest.mark.parametrize("op", ["open", "ftruncate", "pwrite", "fsync", "fstat", "pread"])
def test_eintr_is_retried(tmp_path, clean_calls, op):
    spec = _dataset(tmp_path)
    fi = sio.FaultInjector()
    fi.eintr(op, 1)
    fi.eintr(op, 3)
    _roundtrip(spec, fi)
    assert fi.calls(op) == clean_calls[op] + 2


def test_eintr_on_close_is_not_retried(tmp_path, clean_calls):
    # On Linux the descriptor is gone after close() reports EINTR.
    spec = _dataset(tmp_path)
    fi = sio.FaultInjector()
    fi.eintr("close", 1)
    fds = _fds()
    _roundtrip(spec, fi)
    assert fi.calls("close") == clean_calls["close"]
    assert _fds() == fds


def test_several_arms_at_once(tmp_path, clean_calls):
    spec = _dataset(tmp_path)
    fi = sio.FaultInjector()
    fi.short("pwrite", 1, 10)
    fi.eintr("pwrite", 2)
    fi.short("pread", 2, 100)
    fi.fail("pread", clean_calls["pread"] + 5, errno.EIO)  # never reached
    _roundtrip(spec, fi)
    fi.reset()
    assert fi.calls("pwrite") == 0
    fi.fail("fsync", 1, errno.EIO)
    with pytest.raises(shardstate.ShardstateIOError) as ei:
        _roundtrip(spec, fi)
    assert (ei.value.errno, ei.value.op) == (errno.EIO, "fsync")


def test_fsync_failure_fails_the_batch(tmp_path):
    fi = sio.FaultInjector()
    fi.fail("fsync", 1, errno.EIO)
    job = sio.WriteJob(tmp_path / "a", 0, b"data")
    with pytest.raises(shardstate.ShardstateIOError, match="fsync"):
        sio.write([job], fsync=True, _faults=fi)
    assert sio.write([job], fsync=False, _faults=fi) == [zlib.crc32(b"data")]


def test_checksum_failure_leaks_nothing(tmp_path):
    spec = _dataset(tmp_path)
    _roundtrip(spec)
    p, off, d = spec[1]
    fds = _fds()
    with pytest.raises(shardstate.ChecksumError):
        sio.read([sio.ReadJob(p, off, bytearray(len(d)), zlib.crc32(d) ^ 1)], pool=POOL)
    assert _fds() == fds


PUBLISH_OPS = ["open", "pwrite", "fsync", "close", "rename"]


@pytest.mark.parametrize("op", PUBLISH_OPS)
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_publish_failure_keeps_old_file(tmp_path, op, err):
    p = tmp_path / "meta"
    sio.atomic_publish(p, b"old")
    fi = sio.FaultInjector()
    fi.fail(op, 1, err)
    fds = _fds()
    with pytest.raises(shardstate.ShardstateIOError) as ei:
        sio.atomic_publish(p, b"new contents", _faults=fi)
    assert ei.value.errno == err
    assert ei.value.op == op
    assert ei.value.filename == str(p)
    assert p.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["meta"]  # no temp file left
    assert _fds() == fds
    sio.atomic_publish(p, b"later")  # still usable
    assert p.read_bytes() == b"later"


def test_publish_directory_fsync_failure(tmp_path):
    # The rename has happened: the new file is in place but not durable,
    # and the caller is told.
    p = tmp_path / "meta"
    sio.atomic_publish(p, b"old")
    fi = sio.FaultInjector()
    fi.fail("fsync_dir", 1, errno.EIO)
    with pytest.raises(shardstate.ShardstateIOError) as ei:
        sio.atomic_publish(p, b"new", _faults=fi)
    assert (ei.value.errno, ei.value.op) == (errno.EIO, "fsync_dir")
    assert os.listdir(tmp_path) == ["meta"]
    assert p.read_bytes() == b"new"


def test_publish_absorbs_short_writes_and_eintr(tmp_path):
    p = tmp_path / "meta"
    fi = sio.FaultInjector()
    fi.short("pwrite", 1, 3)
    fi.eintr("pwrite", 2)
    fi.eintr("rename", 1)
    fi.eintr("fsync_dir", 1)
    sio.atomic_publish(p, b"0123456789", _faults=fi)
    assert p.read_bytes() == b"0123456789"
    assert fi.calls("pwrite") == 3
    assert os.listdir(tmp_path) == ["meta"]


def test_publish_without_fsync_makes_no_fsync_calls(tmp_path):
    fi = sio.FaultInjector()
    sio.atomic_publish(tmp_path / "m", b"x", fsync=False, _faults=fi)
    assert fi.calls("fsync") == 0 and fi.calls("fsync_dir") == 0
    sio.atomic_publish(tmp_path / "m", b"x", _faults=fi)
    assert fi.calls("fsync") == 1 and fi.calls("fsync_dir") == 1


def test_injector_api():
    fi = sio.FaultInjector()
    with pytest.raises(ValueError, match="unknown op 'bogus'"):
        fi.fail("bogus", 1, errno.EIO)
    with pytest.raises(ValueError, match="pwrite"):
        fi.short("fsync", 1, 10)
    with pytest.raises(ValueError):
        fi.fail("open", 0, errno.EIO)
    with pytest.raises(ValueError):
        fi.fail("open", 1, 0)
    with pytest.raises(TypeError):
        sio.FaultInjector(1)
    for _ in range(64):
        fi.eintr("open", 1000)
    with pytest.raises(ValueError, match="arms"):
        fi.eintr("open", 1000)
    fi.reset()
    fi.eintr("open", 1000)  # room again
    assert fi.calls("open") == 0


def test_failure_skips_remaining_pieces(tmp_path):
    fi = sio.FaultInjector()
    fi.fail("pwrite", 2, errno.ENOSPC)
    data = bytes(100_000)
    with pytest.raises(shardstate.ShardstateIOError) as ei:
        sio.write([sio.WriteJob(tmp_path / "a", 0, data)], threads=1, _piece=4096, _faults=fi)
    assert ei.value.offset == 4096 and ei.value.job == 0
    assert fi.calls("pwrite") == 2  # the other 23 pieces were not attempted
