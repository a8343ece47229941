"""The staging pipeline for device buffers (ss_stage), from Python, on the
"host" backend: its "device" memory is host memory and its copy stream is a
thread, so the pipeline's logic (pieces cut to the buffer size, copies
ahead of the writes, verified reads, failures, batches taking turns) runs
on machines without a GPU. The CUDA backend plugs into the same code."""

from __future__ import annotations

import os
import threading
import zlib

import numpy as np
import pytest
import shardstate
from shardstate import _core
from shardstate import io as sio
from shardstate.io import ReadJob, Stage, WriteJob


def _payloads(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 4095, 4096, 4097, 3 * 4096 + 5, 200_000, 1 << 20]
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


@pytest.mark.parametrize("buffers", [1, 3])
@pytest.mark.parametrize("threads", [1, 4])
def test_device_jobs_write_and_read_like_plain_ones(tmp_path, buffers, threads):
    data = _payloads()
    stage = Stage("host", buffers, 8192)
    plain_dir, dev_dir = tmp_path / "plain", tmp_path / "dev"
    plain_dir.mkdir()
    dev_dir.mkdir()

    def jobs(d, device_mask):
        out, off = [], {0: 0, 1: 0}
        for i, a in enumerate(data):
            f = i % 2
            out.append(WriteJob(d / f"f{f}", off[f], a, device=bool(device_mask >> i & 1)))
            off[f] += a.nbytes + 17
        return out

    plain = sio.write(jobs(plain_dir, 0), threads=threads)
    assert plain == [zlib.crc32(a.tobytes()) for a in data]
    for mask in (0xFF, 0x55):
        before = stage.copies
        got = sio.write(jobs(dev_dir, mask), threads=threads, stage=stage)
        assert got == plain
        for f in (0, 1):
            assert (dev_dir / f"f{f}").read_bytes() == (plain_dir / f"f{f}").read_bytes()
        staged = [a for i, a in enumerate(data) if mask >> i & 1]
        # every device job's bytes were copied through the stage, piece by piece
        assert stage.copies - before == sum(-(-a.nbytes // 8192) for a in staged)

        outs = [np.zeros_like(a) for a in data]
        rjobs = [ReadJob(j.path, j.offset, o, crc=c, device=j.device)
                 for j, o, c in zip(jobs(dev_dir, mask), outs, plain)]
        assert sio.read(rjobs, threads=threads, stage=stage) == plain
        for a, o in zip(data, outs):
            np.testing.assert_array_equal(a, o)


def test_corrupt_device_job_is_reported(tmp_path):
    a = np.arange(50_000, dtype=np.uint8)
    stage = Stage("host", 2, 4096)
    p = tmp_path / "f"
    (crc,) = sio.write([WriteJob(p, 0, a, device=True)], stage=stage)
    raw = bytearray(p.read_bytes())
    raw[12_345] ^= 0x40
    p.write_bytes(raw)
    out = np.zeros_like(a)
    with pytest.raises(shardstate.ChecksumError) as ei:
        sio.read([ReadJob(p, 0, out, crc=crc, device=True)], stage=stage)
    assert ei.value.path == str(p) and ei.value.job == 0
    # the stage is fine afterwards
    p.write_bytes(a.tobytes())
    sio.read([ReadJob(p, 0, out, crc=crc, device=True)], stage=stage)
    np.testing.assert_array_equal(out, a)


def test_io_failures_end_the_batch_and_leave_the_stage_usable(tmp_path):
    a = np.arange(100_000, dtype=np.uint8)
    stage = Stage("host", 2, 4096)
    p = tmp_path / "f"
    faults = _core.FaultInjector()
    faults.fail("pwrite", 5, 28)  # ENOSPC on the 5th pwrite
    with pytest.raises(shardstate.ShardstateIOError) as ei:
        sio.write([WriteJob(p, 0, a, device=True)], stage=stage, threads=3, _faults=faults)
    assert ei.value.errno == 28
    (crc,) = sio.write([WriteJob(p, 0, a, device=True)], stage=stage, threads=3)
    faults = _core.FaultInjector()
    faults.fail("pread", 3, 5)  # EIO
    out = np.zeros_like(a)
    with pytest.raises(shardstate.ShardstateIOError) as ei:
        sio.read([ReadJob(p, 0, out, crc=crc, device=True)], stage=stage, threads=3,
                 _faults=faults)
    assert ei.value.errno == 5
    sio.read([ReadJob(p, 0, out, crc=crc, device=True)], stage=stage, threads=3)
    np.testing.assert_array_equal(out, a)


def test_batches_from_several_threads_take_turns(tmp_path):
    stage = Stage("host", 2, 4096)
    data = _payloads(1)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for _ in range(3):
                jobs = [WriteJob(tmp_path / f"t{k}_{i}", 0, a, device=True)
                        for i, a in enumerate(data)]
                crcs = sio.write(jobs, stage=stage, threads=2)
                outs = [np.empty_like(a) for a in data]
                sio.read([ReadJob(j.path, 0, o, crc=c, device=True)
                          for j, o, c in zip(jobs, outs, crcs)], stage=stage, threads=2)
                for a, o in zip(data, outs):
                    np.testing.assert_array_equal(a, o)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="backend"):
        Stage("cuda-nope", 2, 4096)
    with pytest.raises(ValueError, match="device"):
        Stage("host", 2, 4096, device=-1)
    with pytest.raises(ValueError, match="buffers"):
        Stage("host", 0, 4096)
    with pytest.raises(ValueError, match="buffers"):
        Stage("host", 2, 100)
    s = Stage("host", 3, 65536)
    assert (s.backend, s.buffers, s.buffer_size) == ("host", 3, 65536)
    assert "host" in repr(s)
    p = str(tmp_path / "x")
    with pytest.raises(ValueError, match="no stage"):
        sio.write([WriteJob(p, 0, b"abc", device=True)])
    with pytest.raises(ValueError, match="entries"):
        _core.write_batch([p], [0], [0], [b"x"], None, False, True, 0, None, False, s,
                          [True, False], None, False)
    with pytest.raises(TypeError, match="Stage"):
        _core.write_batch([p], [0], [0], [b"x"], None, False, True, 0, None, False, 5, [True], None,
                          False)
    with pytest.raises(TypeError, match="Stage"):
        sio.read([ReadJob(p, 0, bytearray(1), device=True)], stage=os)


# ---- the CUDA backend, on the stand-in libcudart (tests/c/fake_cudart.c) ----
# Its "device" memory is host memory and cudaMemcpyAsync is memmove, so the
# CUDA backend's calls, the __cuda_array_interface__ intake and the errors
# are exercised without a GPU. The real runtime runs in benchmarks/gpu_check.sh.


class _FakeCudaArray:
    """A host array presented as device memory, the way torch presents a CUDA tensor."""

    def __init__(self, a: np.ndarray, readonly: bool = False, strides=None) -> None:
        self.a = a
        self.__cuda_array_interface__ = {
            "shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, readonly),
            "strides": strides, "version": 3,
        }


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory) -> str:
    import shutil
    import subprocess

    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc is not None
    so = tmp_path_factory.mktemp("fakecuda") / "libfake_cudart_stage.so"
    src = os.path.join(os.path.dirname(__file__), "c", "fake_cudart.c")
    subprocess.run([cc, "-std=c11", "-shared", "-fPIC", "-O1", "-o", str(so), src], check=True)
    return str(so)


def test_cuda_stage_moves_cuda_array_interface_buffers(tmp_path, fake_cudart):
    stage = Stage("cuda", 2, 8192, device=1, candidates=[fake_cudart])
    assert (stage.backend, stage.device, stage.copies) == ("cuda", 1, -1)
    data = _payloads(2)
    data.append(np.arange(3000, dtype=np.float32).reshape(30, 100))
    plain = sio.write([WriteJob(tmp_path / "plain", 0, a) for a in data[:1]] +
                      [WriteJob(tmp_path / f"p{i}", 0, a) for i, a in enumerate(data)])[1:]
    got = sio.write([WriteJob(tmp_path / f"d{i}", 0, _FakeCudaArray(a, readonly=True), device=True)
                     for i, a in enumerate(data)], stage=stage, stream=7, threads=3)
    assert got == plain
    for i in range(len(data)):
        assert (tmp_path / f"d{i}").read_bytes() == (tmp_path / f"p{i}").read_bytes()
    outs = [np.zeros_like(a) for a in data]
    back = sio.read([ReadJob(tmp_path / f"d{i}", 0, _FakeCudaArray(o), crc=c, device=True)
                     for i, (o, c) in enumerate(zip(outs, plain))], stage=stage, threads=3)
    assert back == plain
    for a, o in zip(data, outs):
        np.testing.assert_array_equal(a, o)


def test_cuda_stage_refuses_bad_device_buffers(tmp_path, fake_cudart):
    stage = Stage("cuda", 2, 8192, candidates=[fake_cudart])
    a = np.arange(64, dtype=np.int64).reshape(8, 8)
    p = tmp_path / "f"
    (crc,) = sio.write([WriteJob(p, 0, _FakeCudaArray(a), device=True)], stage=stage)
    with pytest.raises(BufferError, match="writable"):
        sio.read([ReadJob(p, 0, _FakeCudaArray(np.empty_like(a), readonly=True), device=True)],
                 stage=stage)
    with pytest.raises(BufferError, match="C-contiguous"):
        sio.write([WriteJob(p, 0, _FakeCudaArray(a, strides=(8, 64)), device=True)], stage=stage)
    # explicit C-contiguous strides are fine
    sio.write([WriteJob(p, 0, _FakeCudaArray(a, strides=(64, 8)), device=True)], stage=stage)
    with pytest.raises(TypeError, match="__cuda_array_interface__"):
        sio.write([WriteJob(p, 0, a, device=True)], stage=stage)
    bad = _FakeCudaArray(a)
    bad.__cuda_array_interface__ = dict(bad.__cuda_array_interface__, typestr="f8")
    with pytest.raises(ValueError, match="malformed"):
        sio.write([WriteJob(p, 0, bad, device=True)], stage=stage)
    null = _FakeCudaArray(a)
    null.__cuda_array_interface__ = dict(null.__cuda_array_interface__, data=(0, False))
    with pytest.raises(ValueError, match="NULL"):
        sio.write([WriteJob(p, 0, null, device=True)], stage=stage)
    # host buffers beside device ones in one batch still go the plain way
    out_dev, out_host = np.zeros_like(a), np.zeros_like(a)
    sio.read([ReadJob(p, 0, _FakeCudaArray(out_dev), crc=crc, device=True),
              ReadJob(p, 0, out_host, crc=crc)], stage=stage)
    np.testing.assert_array_equal(out_dev, a)
    np.testing.assert_array_equal(out_host, a)


def test_cuda_stage_unavailable_is_a_clear_error(tmp_path, fake_cudart):
    with pytest.raises(shardstate.ShardstateError, match="libcudart not found"):
        Stage("cuda", 2, 8192, candidates=[str(tmp_path / "libcudart.so.99")])
    with pytest.raises(shardstate.ShardstateError, match="cudaSetDevice: invalid device ordinal"):
        Stage("cuda", 2, 8192, device=5, candidates=[fake_cudart])
