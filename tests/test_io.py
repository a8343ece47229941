"""shardstate.io: round trips, CRCs, verification, errors, publish, GIL."""

import errno
import os
import pathlib
import threading
import zlib

import numpy as np
import pytest
import shardstate
from shardstate import _core
from shardstate import io as sio


def _layout(rng, nfiles, njobs, max_len):
    """Random jobs over nfiles: sizes (some 0) and offsets with gaps, in a
    shuffled order so one file's jobs land on several threads."""
    jobs = []
    ends = [0] * nfiles
    for j in range(njobs):
        f = int(rng.integers(nfiles))
        n = 0 if j % 9 == 4 else int(rng.integers(1, max_len))
        off = ends[f] + int(rng.integers(0, 3000))  # a gap, maybe empty
        ends[f] = off + n
        jobs.append((f, off, rng.integers(0, 256, n, dtype=np.uint8).tobytes()))
    order = rng.permutation(njobs)
    return [jobs[i] for i in order], ends


def test_roundtrip_many_jobs(tmp_path):
    rng = np.random.default_rng(1)
    paths = [tmp_path / f"f{i}" for i in range(3)]
    spec, ends = _layout(rng, 3, 60, 150_000)
    wjobs = [sio.WriteJob(paths[f], off, data) for f, off, data in spec]
    pool = shardstate.ThreadPool(3)
    crcs = sio.write(wjobs, pool=pool, _piece=16384)
    assert crcs == [zlib.crc32(d) for _, _, d in spec]
    for p, end in zip(paths, ends):
        assert p.stat().st_size == end

    # the gaps read back as zeros, the jobs as written
    for i, p in enumerate(paths):
        content = p.read_bytes()
        expect = bytearray(ends[i])
        for f, off, data in spec:
            if f == i:
                expect[off : off + len(data)] = data
        assert content == bytes(expect)

    # read into numpy arrays, bytearrays and slices of one big buffer
    big = bytearray(sum(len(d) for _, _, d in spec) + 100)
    outs, pos = [], 7
    for k, (_, _, data) in enumerate(spec):
        if k % 3 == 0:
            outs.append(np.empty(len(data), dtype=np.uint8))
        elif k % 3 == 1:
            outs.append(bytearray(len(data)))
        else:
            outs.append(memoryview(big)[pos : pos + len(data)])
            pos += len(data)
    rjobs = [
        sio.ReadJob(paths[f], off, out, crc) for (f, off, _), out, crc in zip(spec, outs, crcs)
    ]
    assert sio.read(rjobs, pool=pool, _piece=16384) == crcs
    for (_, _, data), out in zip(spec, outs):
        assert bytes(out) == data


def test_write_any_buffer_and_path_type(tmp_path):
    arr = np.arange(1000, dtype=np.float32)
    mv = memoryview(bytearray(b"abcdefgh"))[2:6]
    jobs = [
        sio.WriteJob(str(tmp_path / "a"), 0, arr),
        sio.WriteJob(os.fsencode(tmp_path / "a"), 4000, mv),
        sio.WriteJob(pathlib.Path(tmp_path / "b"), 3, b"xyz"),
    ]
    crcs = sio.write(jobs, threads=2)
    assert crcs == [zlib.crc32(arr.tobytes()), zlib.crc32(b"cdef"), zlib.crc32(b"xyz")]
    back = np.empty(1000, dtype=np.float32)
    sio.read([sio.ReadJob(tmp_path / "a", 0, back, crcs[0])], threads=1)
    np.testing.assert_array_equal(back, arr)
    assert (tmp_path / "b").read_bytes() == b"\0\0\0xyz"


def test_checksum_off_reports_zeros(tmp_path):
    crcs = sio.write([sio.WriteJob(tmp_path / "a", 0, b"hello")], checksum=False)
    assert crcs == [0]
    assert (tmp_path / "a").read_bytes() == b"hello"


def test_existing_file_is_truncated(tmp_path):
    p = tmp_path / "a"
    p.write_bytes(b"x" * 100)
    sio.write([sio.WriteJob(p, 0, b"short")])
    assert p.read_bytes() == b"short"


def test_verify_catches_flipped_byte(tmp_path):
    p = tmp_path / "a"
    data = os.urandom(50_000)
    (crc0, crc1) = sio.write([sio.WriteJob(p, 0, b"head"), sio.WriteJob(p, 100, data)])
    raw = bytearray(p.read_bytes())
    raw[100 + 12345] ^= 0x01
    p.write_bytes(raw)
    out = bytearray(len(data))
    jobs = [sio.ReadJob(p, 0, bytearray(4), crc0), sio.ReadJob(p, 100, out, crc1)]
    with pytest.raises(shardstate.ChecksumError) as ei:
        sio.read(jobs, _piece=4096)
    e = ei.value
    assert e.path == str(p)
    assert e.offset == 100
    assert e.job == 1
    assert str(p) in str(e) and "offset 100" in str(e)
    # without verify the bytes come back, with their (different) CRC
    crcs = sio.read(jobs, verify=False)
    assert crcs[1] == zlib.crc32(bytes(raw[100:])) != crc1
    assert out == raw[100:]
    # checksum=False still verifies the jobs that carry a CRC
    with pytest.raises(shardstate.ChecksumError):
        sio.read(jobs, checksum=False)
    assert sio.read([jobs[0], sio.ReadJob(p, 100, out)], checksum=False) == [crc0, 0]
    assert sio.read(jobs, checksum=False, verify=False) == [0, 0]


def test_out_of_range_read_is_an_error_not_a_short_read(tmp_path):
    p = tmp_path / "a"
    p.write_bytes(b"0123456789")
    out = bytearray(b"\xaa" * 4)
    with pytest.raises(shardstate.ShardstateError, match="outside the file") as ei:
        sio.read([sio.ReadJob(p, 8, out)])
    assert ei.value.path == str(p)
    assert ei.value.offset == 8
    assert "10 bytes" in str(ei.value)
    assert out == b"\xaa" * 4  # nothing read
    # exactly up to the end is fine, and so is an empty job at the end
    assert sio.read([sio.ReadJob(p, 6, out), sio.ReadJob(p, 10, bytearray())]) == [
        zlib.crc32(b"6789"),
        0,
    ]


def test_missing_file_is_enoent(tmp_path):
    p = tmp_path / "nope"
    with pytest.raises(shardstate.ShardstateIOError) as ei:
        sio.read([sio.ReadJob(p, 0, bytearray(1))])
    assert isinstance(ei.value, OSError)
    assert ei.value.errno == errno.ENOENT
    assert ei.value.filename == str(p)
    with pytest.raises(shardstate.ShardstateIOError) as ei:
        sio.write([sio.WriteJob(tmp_path / "no" / "dir", 0, b"x")])
    assert ei.value.errno == errno.ENOENT


def test_fsync(tmp_path):
    jobs = [sio.WriteJob(tmp_path / f"f{i}", 0, bytes([i]) * 1000) for i in range(4)]
    assert sio.write(jobs, fsync=True) == [zlib.crc32(bytes([i]) * 1000) for i in range(4)]
    assert (tmp_path / "f3").read_bytes() == b"\3" * 1000


def test_large_job_split_over_threads(tmp_path):
    data = np.frombuffer(os.urandom(64 << 20), dtype=np.uint8)
    pool = shardstate.ThreadPool(4)
    fi = sio.FaultInjector()  # only counts here
    (crc,) = sio.write([sio.WriteJob(tmp_path / "big", 0, data)], pool=pool, _faults=fi)
    assert crc == zlib.crc32(data)
    assert fi.calls("pwrite") == 8  # 8 MiB pieces
    out = np.empty_like(data)
    assert sio.read([sio.ReadJob(tmp_path / "big", 0, out, crc)], pool=pool) == [crc]
    assert np.array_equal(out, data)


def test_gil_released_during_batch(tmp_path):
    # A Python thread watches the pwrite counter while one big batch runs.
    # If the GIL were held for the batch it could only ever see 0 or the
    # final count; seeing a count in between proves it ran meanwhile. (A
    # few tries, in case the watcher is not scheduled on a busy machine.)
    data = np.frombuffer(os.urandom(32 << 20), dtype=np.uint8)
    npieces = (32 << 20) // (64 << 10)
    seen_between = 0
    for _ in range(5):
        fi = sio.FaultInjector()
        stop = threading.Event()

        def watch(fi=fi, stop=stop):
            nonlocal seen_between
            while not stop.is_set():
                if 0 < fi.calls("pwrite") < npieces:
                    seen_between += 1

        t = threading.Thread(target=watch)
        t.start()
        try:
            sio.write(
                [sio.WriteJob(tmp_path / "big", 0, data)], threads=1, _piece=64 << 10, _faults=fi
            )
        finally:
            stop.set()
            t.join()
        assert fi.calls("pwrite") == npieces
        if seen_between:
            break
    assert seen_between > 0


def test_atomic_publish(tmp_path):
    p = tmp_path / "meta"
    sio.atomic_publish(p, b"old contents")
    assert p.read_bytes() == b"old contents"
    sio.atomic_publish(str(p), memoryview(b"new"), fsync=False)
    assert p.read_bytes() == b"new"
    sio.atomic_publish(p, np.arange(4, dtype=np.uint8))
    assert p.read_bytes() == b"\0\1\2\3"
    assert os.listdir(tmp_path) == ["meta"]


def test_atomic_publish_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sio.atomic_publish("rel", b"x")
    assert (tmp_path / "rel").read_bytes() == b"x"
    assert os.listdir(tmp_path) == ["rel"]


def test_bad_buffers(tmp_path):
    p = tmp_path / "a"
    p.write_bytes(b"0123456789")
    with pytest.raises(BufferError, match="writable"):
        sio.read([sio.ReadJob(p, 0, b"xx")])
    with pytest.raises(BufferError, match="C-contiguous"):
        sio.read([sio.ReadJob(p, 0, np.zeros(4, dtype=np.uint8)[::2])])
    with pytest.raises(BufferError, match="C-contiguous"):
        sio.write([sio.WriteJob(p, 0, np.zeros((4, 4))[:, 1])])
    with pytest.raises(TypeError, match="buffer protocol"):
        sio.write([sio.WriteJob(p, 0, 12)])
    with pytest.raises(ValueError, match="offset"):
        sio.write([sio.WriteJob(p, -1, b"x")])
    assert p.read_bytes() == b"0123456789"  # nothing was opened


def test_threads_and_pool_arguments(tmp_path):
    job = sio.WriteJob(tmp_path / "a", 0, b"abc")
    for n in (1, 2, 5):
        assert sio.write([job], threads=n) == [zlib.crc32(b"abc")]
    with pytest.raises(ValueError, match="threads"):
        sio.write([job], threads=0)
    with pytest.raises(ValueError, match="not both"):
        sio.write([job], pool=shardstate.ThreadPool(1), threads=2)
    with pytest.raises(TypeError, match="ThreadPool"):
        sio.write([job], pool=object())
    assert sio.write([]) == []
    assert sio.read([]) == []


def test_core_entry_points_validate(tmp_path):
    p = str(tmp_path / "a")
    with pytest.raises(IndexError, match="file_idx"):
        _core.write_batch([p], [1], [0], [b"x"], None, False, True, 0, None, False,
                          None, None, None, False)
    with pytest.raises(ValueError, match="entries"):
        _core.write_batch([p], [0, 0], [0], [b"x"], None, False, True, 0, None, False,
                          None, None, None, False)
    with pytest.raises(TypeError, match="offsets must be a sequence of ints"):
        _core.write_batch([p], [0], 5, [b"x"], None, False, True, 0, None, False,
                          None, None, None, False)
    with pytest.raises(TypeError, match="FaultInjector"):
        _core.write_batch([p], [0], [0], [b"x"], None, False, True, 0, 3, False, None, None, None,
                          False)
    # NumPy int64 arrays are taken as they are
    crcs = _core.write_batch(
        [p], np.array([0, 0]), np.array([0, 5], dtype=np.int64), [b"ab", b"cd"],
        None, False, True, 0, None, True, None, None, None, False,
    )
    assert crcs == [zlib.crc32(b"ab"), zlib.crc32(b"cd")]
    with pytest.raises(ValueError, match="crcs"):
        _core.read_batch([p], [0], [0], [bytearray(2)], [2**40], None, True, True, 0, None,
                         None, None)


def test_raw_baselines(tmp_path):
    p = str(tmp_path / "raw")
    data = os.urandom(100_000)
    _core._raw_pwrite(p, data, 4096)
    out = bytearray(len(data))
    _core._raw_pread(p, out, 0)
    assert out == data
    with pytest.raises(shardstate.ShardstateError):
        _core._raw_pread(p, bytearray(len(data) + 1), 0)
    with pytest.raises(shardstate.ShardstateIOError) as ei:
        _core._raw_pread(str(tmp_path / "nope"), out, 0)
    assert ei.value.errno == errno.ENOENT


def test_small_adjacent_reads_are_coalesced(tmp_path):
    """Records of a checkpoint lie one after another with a header between
    them: small ones are read with one preadv per run, gaps skipped, each
    still checksummed on its own; a fault there reaches the caller."""
    rng = np.random.default_rng(7)
    p = str(tmp_path / "runs")
    blobs = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes()
             for n in rng.integers(1, 5000, 200)]
    offs, pos = [], 0
    for b in blobs:
        pos += int(rng.integers(0, 600))
        offs.append(pos)
        pos += len(b)
    crcs = shardstate.io.write([shardstate.io.WriteJob(p, o, b) for o, b in zip(offs, blobs)])
    outs = [bytearray(len(b)) for b in blobs]
    fi = shardstate.io.FaultInjector()
    got = shardstate.io.read([shardstate.io.ReadJob(p, o, out, c)
                              for o, out, c in zip(offs, outs, crcs)], _faults=fi)
    assert got == crcs == [zlib.crc32(b) for b in blobs]
    assert [bytes(o) for o in outs] == blobs
    assert fi.calls("pread") == 0 and 4 <= fi.calls("preadv") <= 10  # 200 jobs, <= 64 a run
    # a flipped byte in one record is still caught, naming that job
    bad = bytearray(pathlib.Path(p).read_bytes())
    bad[offs[77] + 3] ^= 1
    pathlib.Path(p).write_bytes(bytes(bad))
    with pytest.raises(shardstate.ChecksumError) as ei:
        shardstate.io.read([shardstate.io.ReadJob(p, o, out, c)
                            for o, out, c in zip(offs, outs, crcs)])
    assert ei.value.job == 77
    fi = shardstate.io.FaultInjector()
    fi.fail("preadv", 2, errno.EIO)
    with pytest.raises(shardstate.ShardstateIOError) as ei:
        shardstate.io.read([shardstate.io.ReadJob(p, o, out) for o, out in zip(offs, outs)],
                           _faults=fi)
    assert ei.value.op == "preadv" and ei.value.errno == errno.EIO and ei.value.filename == p
