"""The C record framing (``_core.RecordPlan``, csrc/core/ss_zipwrite.c) and
the one-call save engine (``io.write_records``, csrc/core/ss_recwrite.c).

* A plan's header and trailers are ``_zipfmt.plan_tensor_record``'s bytes
  for every dtype and many shapes, strides, storage sizes and CRCs, and a
  record made from one is what ``torch.save`` writes (torch.load reads it).
* A bad job table (an index, an offset, a length, a device row without a
  stage, a table of the wrong shape) raises before anything is written.
* Device rows go through a Stage (the host backend here).
* A real save's records with trailers written by the engine (big records)
  and packed ones load in torch's DCP and, one by one, in torch.load.
* A failure between the data and the trailers (the trailer write) fails
  the save: no metadata is published, and the record has no trailer.
"""

from __future__ import annotations

import errno
import io
import random
import zlib

import numpy as np
import pytest
import shardstate.checkpoint as dcp
import shardstate.io as sio
import torch
import torch.distributed.checkpoint as tdcp
from hypothesis import given, settings
from hypothesis import strategies as st
from shardstate._core import RecordPlan
from shardstate.checkpoint import _fs_write
from shardstate.checkpoint import _zipfmt as z

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled",
                                        "ignore:ComplexHalf support is experimental")

SHAPES = [(), (0,), (1,), (7,), (2, 3), (2, 0, 3), (300, 70000), (4, 1, 5, 2, 3)]


def _same(dtype, shape, stride=None, numel=None) -> None:
    ours = RecordPlan(dtype, shape, stride, numel)
    ref = z.plan_tensor_record(dtype, shape, stride, numel)
    assert ours.header == ref.header and ours.data_offset == ref.data_offset
    assert ours.data_length == ref.data_length
    assert ours.template == ref.trailer(0)
    assert ours.total_length == ref.total_length
    crcs = [0, 1, 0xFFFFFFFF, random.Random(len(ref.header)).getrandbits(32)]
    for crc in crcs if ref.data_length else [0]:  # empty data: no CRC anywhere
        assert ours.trailer(crc) == ref.trailer(crc), (dtype, shape, stride, numel, crc)


def test_plan_is_zipfmts_for_every_dtype_and_shape() -> None:
    for dtype in z.DTYPES:
        for shape in SHAPES:
            _same(dtype, shape)
    _same("torch.float32", (3, 4), (1, 3))  # transposed
    _same("float32", (3, 4), (8, 2), 100)  # strided over a bigger storage
    _same("bfloat16", (2, 3), (0, 1))  # broadcast
    _same("uint8", (1 << 32,))  # zip64 sizes
    _same("float64", (1 << 30,))  # data/0 within, version past 4 GiB
    _same("complex32", (2,), (1,), 1 << 40)  # pickled LONG1 storage size


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(z.DTYPES)),
       st.lists(st.integers(0, 1 << 11), max_size=5),
       st.booleans(), st.integers(0, 1000))
def test_plan_is_zipfmts_for_random_geometry(dtype, shape, strided, extra) -> None:
    stride = tuple(random.Random(sum(shape)).randrange(0, 1 << 16) for _ in shape) \
        if strided else None
    ref = z.plan_tensor_record(dtype, shape, stride)
    _same(dtype, shape, stride, None)
    _same(dtype, shape, stride, ref.data_length // z.DTYPES[dtype].itemsize + extra)


@pytest.mark.parametrize("dtype", sorted(z.DTYPES))
def test_plan_record_is_torch_save(dtype) -> None:
    td = getattr(torch, dtype)
    t = torch.arange(96, dtype=torch.uint8).view(td).reshape(2, -1)
    data = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy().tobytes()
    plan = RecordPlan(str(t.dtype), t.shape, t.stride(), t.numel())
    rec = plan.header + data + plan.trailer(zlib.crc32(data))
    buf = io.BytesIO()
    torch.save(t, buf)
    assert rec == buf.getvalue()
    back = torch.load(io.BytesIO(rec), weights_only=True)
    assert back.dtype == td and back.view(torch.uint8).tolist() == t.view(torch.uint8).tolist()


def test_plan_refuses_bad_geometry() -> None:
    with pytest.raises(ValueError, match="dtype float33"):
        RecordPlan("float33", (2,))
    with pytest.raises(ValueError):
        RecordPlan("float32", (-1, 2))
    with pytest.raises(ValueError, match="does not match"):
        RecordPlan("float32", (2, 2), (1,))
    with pytest.raises(ValueError):  # strides reach element 22
        RecordPlan("float32", (3, 4), (8, 2), 22)
    with pytest.raises(ValueError, match="more than 64"):
        RecordPlan("float32", (1,) * 65)
    with pytest.raises(ValueError, match="32-bit"):
        RecordPlan("float32", (2,)).trailer(1 << 32)


# ---- the job table ------------------------------------------------------


def _table(*rows) -> np.ndarray:
    return np.array(rows, np.int64).reshape(-1, 5)


def _records(tmp_path):
    small = np.arange(15, dtype=np.float32)
    big = np.arange(20000, dtype=np.float32)
    plans = [RecordPlan("float32", (3, 5)), RecordPlan("float32", (200, 100))]
    bufs = [b"\x80\x02K\x03.", small.view(np.uint8), big.view(np.uint8)]
    at = [0, 5, 5 + plans[0].total_length]
    rows = [(0, at[0], 0, -1, 0), (0, at[1], 1, 0, 0), (0, at[2], 2, 1, 0)]
    want = (bufs[0] + plans[0].header + small.tobytes() + plans[0].trailer(zlib.crc32(small))
            + plans[1].header + big.tobytes() + plans[1].trailer(zlib.crc32(big)))
    return [tmp_path / "a.distcp", tmp_path / "empty.distcp"], rows, bufs, plans, want


def test_write_records_writes_records_and_empty_files(tmp_path) -> None:
    paths, rows, bufs, plans, want = _records(tmp_path)
    crcs = sio.write_records(paths, _table(*rows), bufs, plans, fsync=True)
    assert paths[0].read_bytes() == want and paths[1].read_bytes() == b""
    assert crcs == [zlib.crc32(b) for b in bufs]


@pytest.mark.parametrize("row, match", [
    ((2, 0, 1, 0, 0), "file is not an index"),
    ((-1, 0, 1, 0, 0), "file is not an index"),
    ((0, -5, 1, 0, 0), "offset is negative"),
    ((0, 0, 3, 0, 0), "buffer is not an index"),
    ((0, 0, 1, 2, 0), "plan is neither -1"),
    ((0, 0, 1, -2, 0), "plan is neither -1"),
    ((0, 0, 1, 0, 2), "device is neither"),
    ((0, 0, 1, 0, 1), "no stage was given"),
    ((0, 0, 2, 0, 0), "has 80000 bytes but plans\\[0\\] stores 60"),
])
def test_bad_table_rows_are_refused_before_writing(tmp_path, row, match) -> None:
    paths, rows, bufs, plans, _want = _records(tmp_path)
    with pytest.raises(ValueError, match=match):
        sio.write_records(paths, _table(rows[0], row), bufs, plans)
    assert not paths[0].exists()


def test_bad_tables_are_refused(tmp_path) -> None:
    paths, rows, bufs, plans, _want = _records(tmp_path)
    with pytest.raises(ValueError, match="shape \\(n, 5\\)"):
        sio.write_records(paths, np.zeros((2, 4), np.int64), bufs, plans)
    with pytest.raises(TypeError, match="int64"):
        sio.write_records(paths, _table(*rows).astype(np.int32), bufs, plans)
    with pytest.raises(TypeError, match="RecordPlan"):
        sio.write_records(paths, _table(*rows), bufs, [plans[0], "plan"])
    with pytest.raises(ValueError, match="2\\^63"):  # the core's own check
        sio.write_records(paths, _table((0, (1 << 63) - 10, 1, 0, 0)), bufs, plans)
    assert not paths[0].exists()


def test_device_rows_go_through_the_stage(tmp_path) -> None:
    paths, rows, bufs, plans, want = _records(tmp_path)
    stage = sio.Stage("host", 2, 8192)  # the big record's data in 10 pieces
    dev_rows = [(f, o, b, p, int(p >= 0)) for f, o, b, p, _d in rows]
    crcs = sio.write_records(paths, _table(*dev_rows), bufs, plans, stage=stage)
    assert paths[0].read_bytes() == want
    assert crcs[2] == zlib.crc32(bufs[2]) and stage.copies >= 10


# ---- real saves ---------------------------------------------------------


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(300, 100, generator=g), "big16": torch.randn(70000).half(),
            "small": torch.randn(3, 4, generator=g), "empty": torch.empty(0, 2),
            "rows": torch.randn(400, 50, generator=g)[100:300], "step": 7}


def test_saved_records_load_in_torch(tmp_path) -> None:
    sd = _state()
    dcp.save(sd, checkpoint_id=tmp_path)
    dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    tdcp.load(dest, checkpoint_id=tmp_path)
    assert all(torch.equal(dest[k], sd[k]) for k in sd if isinstance(sd[k], torch.Tensor))
    assert dest["step"] == 7
    md = tdcp.FileSystemReader(tmp_path).read_metadata()
    for idx, info in md.storage_data.items():
        if idx.fqn == "step":
            continue
        raw = (tmp_path / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        t = torch.load(io.BytesIO(raw), weights_only=True)
        assert torch.equal(t, sd[idx.fqn])


def test_failure_between_data_and_trailers_fails_the_save(tmp_path, monkeypatch) -> None:
    sd = _state()
    seen: list[int] = []
    real = sio.write_records

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(f.calls("pwrite"))  # the last pwrite of the call: a trailer
        return out

    monkeypatch.setattr(sio, "write_records", counting)
    f = sio.FaultInjector()
    with sio.inject_faults(f):
        dcp.save(sd, checkpoint_id=tmp_path / "clean")
    assert len(seen) == 1
    f = sio.FaultInjector()
    f.fail("pwrite", seen[0], errno.EIO)
    with sio.inject_faults(f), pytest.raises(dcp.CheckpointException,
                                             match="Input/output error"):
        dcp.save(sd, checkpoint_id=tmp_path / "failed")
    assert not (tmp_path / "failed" / ".metadata").exists()
    # the data is there, the last trailer is not (zeros): no valid record
    clean = sorted((tmp_path / "clean").glob("*.distcp"))
    failed = sorted((tmp_path / "failed").glob("*.distcp"))
    assert [p.name for p in clean] == [p.name for p in failed]
    assert any(a.read_bytes() != b.read_bytes() for a, b in zip(clean, failed))
    assert all(len(a.read_bytes()) == len(b.read_bytes()) for a, b in zip(clean, failed))


def test_pack_segment_reaches_the_engine(tmp_path, monkeypatch) -> None:
    """Runs split at a tiny size give the same bytes as the default runs."""
    g = torch.Generator().manual_seed(4)
    sd = {f"t{i}": torch.randn(5, 7, generator=g) for i in range(40)}
    dcp.save(sd, checkpoint_id=tmp_path / "a")
    monkeypatch.setattr(_fs_write, "_PACK_SEGMENT", 1)
    dcp.save(sd, checkpoint_id=tmp_path / "b")
    for p in (tmp_path / "a").glob("*.distcp"):
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes()
