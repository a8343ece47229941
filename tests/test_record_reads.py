"""The engine's record reads (``shardstate.io.read_records``) as loads use
them: range reads verified whole, scatter reads into strided destinations,
and the refusal of bad table entries."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from shardstate import ChecksumError, ShardstateError
from shardstate import io as ssio
from shardstate.checkpoint.filesystem import FileSystemReader, FileSystemWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Planner:
    """resolve_tensor/commit_tensor for a fixed destination per fqn."""

    def __init__(self, dests: dict) -> None:
        self.dests, self.committed = dests, []

    def resolve_tensor(self, item):
        return self.dests[item.dest_index.fqn]

    def commit_tensor(self, item, tensor):
        self.committed.append(item.dest_index.fqn)


def _read(path: Path, regions: dict, dests: dict, **kw) -> _Planner:
    """Reads region (offsets, lengths) of each saved 2-d tensor's one chunk
    into dests[fqn], through FileSystemReader.read_data."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    reader = FileSystemReader(path, **kw)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    items = [ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(k, (0, 0)),
                      dest_offsets=torch.Size([0, 0]),
                      storage_index=MetadataIndex(k, (0, 0), 0),
                      storage_offsets=torch.Size(o), lengths=torch.Size(n))
             for k, (o, n) in regions.items()]
    planner = _Planner(dests)
    reader.read_data(LoadPlan(items), planner).wait()
    return planner


def _data_offset(path: Path, fqn: str) -> tuple[Path, int]:
    from shardstate.checkpoint._zipfmt import parse_record

    md = FileSystemReader(path).read_metadata()
    for idx, info in md.storage_data.items():
        if idx.fqn == fqn:
            f = path / info.relative_path
            rec = parse_record(f.read_bytes()[info.offset:info.offset + info.length],
                               base_offset=info.offset)
            return f, rec.data_offset
    raise KeyError(fqn)


def _flip(file: Path, at: int) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def test_partial_reads_of_many_records_name_the_corrupted_one(tmp_path):
    sd = {f"t{i}": torch.randn(16, 8) for i in range(30)}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path))
    # rows 2..5 of every tensor: one range of each record, the rest verified
    regions = {k: ((2, 0), (4, 8)) for k in sd}
    dests = {k: torch.zeros(4, 8) for k in sd}
    p = _read(tmp_path, regions, dests)
    assert sorted(p.committed) == sorted(sd)
    for k in sd:
        assert torch.equal(dests[k], sd[k][2:6])
    file, data = _data_offset(tmp_path, "t17")
    _flip(file, data + 12 * 8 * 4 + 5)  # row 12: outside every region read
    with pytest.raises(ChecksumError, match=r"CRC-32 mismatch in item 't17'"):
        _read(tmp_path, regions, {k: torch.zeros(4, 8) for k in sd})
    out = {k: torch.zeros(4, 8) for k in sd}
    _read(tmp_path, regions, out, verify_checksums=False)
    assert torch.equal(out["t17"], sd["t17"][2:6])


def test_scatter_into_strided_destinations_equals_torch_load(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(3)
    src = {
        "f32": torch.randn(12, 7, generator=g),
        "bf16": torch.randn(5, 9, generator=g).to(torch.bfloat16),
        "i64_t": torch.randint(-99, 99, (6, 10), generator=g).t(),  # a strided record
        "u8": torch.randint(0, 255, (4, 3, 5), generator=g, dtype=torch.uint8),
        "c64": torch.randn(3, 4, dtype=torch.complex64, generator=g),
    }
    dcp.save(src, storage_writer=FileSystemWriter(tmp_path))

    def dests() -> dict:
        # transposed / sliced views: no region is one range of a dense destination
        return {
            "f32": torch.zeros(7, 12).t(),
            "bf16": torch.zeros(5, 18, dtype=torch.bfloat16)[:, ::2],
            "i64_t": torch.zeros(10, 6, dtype=torch.int64),
            "u8": torch.zeros(5, 3, 4, dtype=torch.uint8).permute(2, 1, 0),
            "c64": torch.zeros(4, 3, dtype=torch.complex64).t(),
        }

    kinds: list[int] = []
    real = ssio.read_records

    def spy(paths, table, geom, **kw):
        kinds.extend(int(k) for k in np.asarray(table)[:, 1])
        return real(paths, table, geom, **kw)

    monkeypatch.setattr(ssio, "read_records", spy)
    ours, theirs = dests(), dests()
    dcp.load(ours, storage_reader=FileSystemReader(tmp_path))
    # every one scattered by the engine (i64_t: a strided record into a
    # contiguous destination)
    assert kinds == [ssio.REC_SCATTER] * 5
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(tmp_path))
    for k in src:
        assert torch.equal(ours[k], theirs[k]), k
        assert torch.equal(ours[k], src[k]), k
    # a sub-box of a record into a NumPy destination with negative strides is
    # copied by NumPy; one with positive strides by the engine: both exact
    for dest in (np.zeros((3, 6), np.float32)[:, ::-1], np.zeros((6, 3), np.float32).T):
        _read(tmp_path, {"f32": ((4, 1), (3, 6))}, {"f32": dest})
        assert np.array_equal(dest, src["f32"][4:7, 1:7].numpy())
    # a corrupted record read through scratch names its item
    file, data = _data_offset(tmp_path, "bf16")
    _flip(file, data + 7)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match=r"ChecksumError: CRC-32 mismatch in item 'bf16'"):
        dcp.load(dests(), storage_reader=FileSystemReader(tmp_path))


def test_records_torch_wrote_without_crcs_load_as_torch_loads_them(tmp_path):
    """torch.serialization.set_crc32_options(False): every CRC-32 in the
    records is 0, so their data has nothing to be checked against; a load
    reads them (range, scatter and whole reads) instead of calling them
    corrupt, and still checks the records that have CRCs."""
    from shardstate import _core
    from shardstate.checkpoint._zipfmt import parse_record

    g = torch.Generator().manual_seed(5)
    src = {"a": torch.randn(16, 8, generator=g), "b": torch.randn(6, 10, generator=g).t()}
    torch.serialization.set_crc32_options(False)
    try:
        dcp.save(src, storage_writer=dcp.FileSystemWriter(tmp_path / "off"))
    finally:
        torch.serialization.set_crc32_options(True)
    dcp.save({"c": torch.randn(4, 4, generator=g)},
             storage_writer=dcp.FileSystemWriter(tmp_path / "on"))
    file, _ = _data_offset(tmp_path / "off", "a")
    md = FileSystemReader(tmp_path / "off").read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "a")
    rec = file.read_bytes()[info.offset:info.offset + info.length]
    assert parse_record(rec).data_crc32 is None
    assert _core.parse_tensor_record(rec)[8] is None
    whole = {"a": torch.zeros(16, 8), "b": torch.zeros(10, 6)}
    dcp.load(whole, storage_reader=FileSystemReader(tmp_path / "off"))
    assert torch.equal(whole["a"], src["a"]) and torch.equal(whole["b"], src["b"])
    part = {"a": torch.zeros(4, 8)}
    _read(tmp_path / "off", {"a": ((2, 0), (4, 8))}, part)  # a range of the record
    assert torch.equal(part["a"], src["a"][2:6])
    strided = {"a": torch.zeros(8, 16).t()}  # scattered through scratch
    dcp.load(strided, storage_reader=FileSystemReader(tmp_path / "off"))
    assert torch.equal(strided["a"], src["a"])
    # a record with CRCs is still checked
    file, data = _data_offset(tmp_path / "on", "c")
    _flip(file, data + 3)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match=r"CRC-32 mismatch in item 'c'"):
        dcp.load({"c": torch.zeros(4, 4)}, storage_reader=FileSystemReader(tmp_path / "on"))


def _row(**kw) -> list[int]:
    row = dict.fromkeys(ssio.REC_COLUMNS, 0)
    row.update(kw)
    return [row[c] for c in ssio.REC_COLUMNS]


def test_bad_table_entries_are_refused(tmp_path):
    import zlib

    f = tmp_path / "f"
    payload = bytes(range(256)) * 4
    f.write_bytes(payload)
    crc = zlib.crc32(payload[:120])
    out = np.zeros(16, np.int32)
    ok = _row(kind=ssio.REC_SCATTER, len=120, crc=crc, addr=out.ctypes.data,
              dst_len=out.nbytes, ndim=2, elsize=4, src_off=28)
    geom = [3, 2, 20, 4, 4, 12]  # sizes, source strides, destination strides
    crcs = ssio.read_records([f], [ok], geom)
    assert crcs[0] == crc
    assert np.array_equal(out[[0, 3, 1, 4, 2, 5]],
                          np.frombuffer(payload[:120], np.int32).reshape(6, 5)[1:4, 2:4].ravel())
    rng = _row(kind=ssio.REC_RANGE, len=120, crc=crc, addr=out.ctypes.data, dst_len=out.nbytes,
               start=8, count=64, whole=1)
    ssio.read_records([f], [rng], [])
    assert out.tobytes() == payload[8:72]

    def refused(exc, pattern, rows, g=geom, paths=(f,)):
        with pytest.raises(exc, match=pattern):
            ssio.read_records(list(paths), rows, g)

    refused(ValueError, "n x 14", np.zeros((1, 13), np.int64))
    refused(ValueError, "row 1: file index", [ok, _row(file=-1)])
    refused(ValueError, "row 0: kind", [_row(kind=5)])
    refused(ValueError, "row 0: a length", [_row(len=-4)])
    refused(ValueError, "row 0: crc", [_row(crc=1 << 32)])
    refused(ValueError, "row 0: ndim", [ok[:10] + [65] + ok[11:]])
    refused(ValueError, "row 0: ndim", [ok], g=geom[:5])
    bad = list(ok)
    bad[ssio.REC_COLUMNS.index("src_off")] = 100  # past the record's 120 bytes
    refused(ValueError, "item 0: source region", [bad])
    bad = list(ok)
    bad[ssio.REC_COLUMNS.index("dst_len")] = 20  # the region reaches 24 bytes
    refused(ValueError, "item 0: destination region", [bad])
    bad = list(rng)
    bad[ssio.REC_COLUMNS.index("count")] = 200
    refused(ValueError, "item 0: range runs past", [bad])
    bad = list(rng)
    bad[ssio.REC_COLUMNS.index("file")] = 1
    refused(ValueError, "item 0: file index", [bad])
    bad = list(rng)
    bad[ssio.REC_COLUMNS.index("offset")] = 2000  # past the end of the 1024-byte file
    refused(ShardstateError, "outside the file", [bad])
    bad = list(rng)
    bad[ssio.REC_COLUMNS.index("crc")] = crc ^ 1
    with pytest.raises(ChecksumError) as ei:
        ssio.read_records([f], [ok, bad], geom)
    assert ei.value.job == 1
