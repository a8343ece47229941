"""shardstate.io's single-file operations (the core's ss_file) and the
process-wide fault injector that reaches them and the batches."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import shardstate.io as sio
from shardstate import ChecksumError, ShardstateError, ShardstateIOError


def test_read_file_whole_and_bounded(tmp_path):
    p = tmp_path / "m"
    p.write_bytes(b"x" * 100)
    assert sio.read_file(p, 100) == b"x" * 100
    with pytest.raises(ShardstateError, match="100 bytes, expected 1..99"):
        sio.read_file(p, 99)
    p.write_bytes(b"")
    with pytest.raises(ShardstateError, match="0 bytes"):
        sio.read_file(p, 10)
    with pytest.raises(ShardstateIOError) as e:
        sio.read_file(tmp_path / "missing", 10)
    assert e.value.errno == errno.ENOENT and e.value.op == "open"


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_non_regular_files_are_refused_at_once(tmp_path, kind):
    p = tmp_path / "x"
    if kind == "fifo":
        os.mkfifo(p)  # no writer: an open without O_NONBLOCK would wait forever
    else:
        p.mkdir()
    for fn in (lambda: sio.read_file(p, 10), lambda: sio.file_size(p), lambda: sio.map_file(p)):
        with pytest.raises(ShardstateError, match="not a regular file") as e:
            fn()
        assert e.value.code == sio._core.error_codes()["SS_ENOTREG"]


def test_map_file_is_a_buffer_until_closed(tmp_path):
    p = tmp_path / "d"
    p.write_bytes(bytes(range(256)) * 4)
    assert sio.file_size(p) == 1024
    with sio.map_file(p) as m:
        assert len(m) == 1024
        v = memoryview(m)
        assert v[3] == 3 and bytes(v[250:260]) == bytes(range(250, 256)) + bytes(range(4))
        with pytest.raises(BufferError):
            m.close()  # a view still points into the mapping
        v.release()
    assert m.closed
    with pytest.raises(ValueError, match="closed"):
        memoryview(m)
    p.write_bytes(b"")
    with sio.map_file(p) as m:
        assert len(m) == 0 and bytes(memoryview(m)) == b""


def test_unlink_makedirs_fsync_dir(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"1")
    assert sio.unlink(f) is True
    assert sio.unlink(f) is False
    with pytest.raises(ShardstateIOError) as e:
        sio.unlink(f, missing_ok=False)
    assert e.value.errno == errno.ENOENT
    d = tmp_path / "a" / "b" / "c"
    sio.makedirs(d)
    sio.makedirs(d)  # exists: fine
    assert d.is_dir()
    sio.fsync_dir(d)
    (tmp_path / "a" / "file").write_bytes(b"")
    with pytest.raises(ShardstateIOError) as e:
        sio.makedirs(tmp_path / "a" / "file")
    assert e.value.errno == errno.EEXIST


def test_write_files_and_patch(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    # a file with no job is created empty
    sio.write([sio.WriteJob(a, 0, b"header-DATA-trailer")], files=[b])
    assert b.read_bytes() == b"" and a.read_bytes() == b"header-DATA-trailer"
    # patch: in place, size kept, other files only fsynced; missing: ENOENT
    f = sio.FaultInjector()
    sio.write([sio.WriteJob(a, 12, b"TRAIL")], files=[b], patch=True, fsync=True, _faults=f)
    assert a.read_bytes() == b"header-DATA-TRAILer"
    assert f.calls("fsync") == 2 and f.calls("ftruncate") == 0
    with pytest.raises(ShardstateIOError) as e:
        sio.write([sio.WriteJob(c, 0, b"x")], patch=True)
    assert e.value.errno == errno.ENOENT and not c.exists()


def test_inject_faults_reaches_every_thread_and_call(tmp_path):
    p = tmp_path / "m"
    p.write_bytes(b"abc")
    f = sio.FaultInjector()
    f.fail("open", 2, errno.EIO)
    seen: list[BaseException | None] = []

    def other_thread() -> None:
        try:
            sio.read_file(p, 10)
            seen.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            seen.append(e)

    with sio.inject_faults(f):
        assert sio.read_file(p, 10) == b"abc"  # open call 1
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        with pytest.raises(RuntimeError, match="already installed"):
            with sio.inject_faults(sio.FaultInjector()):
                pass
        # an explicit injector wins over the installed one
        assert sio.read_file(p, 10, _faults=sio.FaultInjector()) == b"abc"
    assert isinstance(seen[0], ShardstateIOError) and seen[0].errno == errno.EIO
    assert f.calls("open") == 2
    assert sio.read_file(p, 10) == b"abc"  # uninstalled: plain calls
    assert f.calls("open") == 2


def test_kill_arm_is_accepted_and_checked():
    f = sio.FaultInjector()
    f.kill("rename", 1)
    with pytest.raises(ValueError):
        f.kill("nope", 1)
    with pytest.raises(ValueError):
        f.kill("rename", 0)


def test_checksum_error_type_is_still_distinct(tmp_path):
    p = tmp_path / "d"
    sio.write([sio.WriteJob(p, 0, b"hello")])
    with pytest.raises(ChecksumError):
        sio.read([sio.ReadJob(p, 0, bytearray(5), crc=1)])
