"""FileSystemWriter / FileSystemReader driven by torch 2.13's own DCP save/load.

Byte identity with torch's FileSystemWriter, cross-loads both ways, CRC
checks, path and bounds checks, restricted unpickling, overwrite rules, and
multi-process saves and reshards over gloo.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dtypes import DTYPES, seeded
from shardstate import ChecksumError
from shardstate.checkpoint import _fs_read, _records
from shardstate.checkpoint import filesystem as fs
from shardstate.checkpoint.filesystem import FileSystemReader, FileSystemWriter, StorageFormatError
from shardstate.checkpoint.storage import StorageReader, StorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _raised(exc_type: type[BaseException], match: str, fn, *args, **kwargs) -> BaseException:
    """Runs fn; returns the exception it raised, unwrapped from torch's
    CheckpointException, after checking its type and message."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn(*args, **kwargs)
    except CheckpointException as e:
        err = next(iter(e.failures.values()))[0]
    except Exception as e:  # noqa: BLE001
        err = e
    else:
        raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}")
    assert isinstance(err, exc_type), repr(err)
    assert re.search(match, str(err)), f"{match!r} not in {err}"
    return err



def _state_dict() -> dict:
    sd: dict = {f"t_{str(dt)[6:]}": seeded(dt, (3, 5), i) for i, dt in enumerate(DTYPES)}
    big = torch.arange(100, dtype=torch.float32)
    sd.update({
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(5, 4).t(),  # dense, non-contiguous: stored as is
        "view": big[10:17],  # view into a bigger storage: cloned
        "strided": big[::3],  # non-dense: cloned contiguous
        "large": torch.randn(300, 200),
        "step": 7,
        "lr": {"value": 0.1, "name": "adam"},
        "nested": {"l": [torch.ones(2, 2), "s", torch.arange(4)], "d": {"x": torch.zeros(3)}},
    })
    return sd


def _empty_like(sd: dict) -> dict:
    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = (torch.zeros_like(v) if v.dtype != torch.bool
                      else torch.zeros(v.shape, dtype=torch.bool))
            if k == "transposed":
                out[k] = torch.zeros(4, 5)  # a contiguous destination for a strided record
        elif isinstance(v, dict):
            out[k] = _empty_like(v)
        elif isinstance(v, list):
            out[k] = [_empty_like({"x": x})["x"] for x in v]
        else:
            out[k] = None
    return out


def _assert_equal(a: object, b: object, key: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), key
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), key  # type: ignore[union-attr]
        for k in a:
            _assert_equal(a[k], b[k], f"{key}.{k}")  # type: ignore[index]
    elif isinstance(a, list):
        assert len(a) == len(b), key  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b)):  # type: ignore[arg-type]
            _assert_equal(x, y, f"{key}.{i}")
    else:
        assert a == b, key


def _load_md(path: Path) -> object:
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # trusted: written by this test


def _compare_dirs(a: Path, b: Path) -> None:
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for n in names:
        if n.endswith(".distcp"):
            assert (a / n).read_bytes() == (b / n).read_bytes(), n
    ma, mb = _load_md(a), _load_md(b)
    assert ma.state_dict_metadata == mb.state_dict_metadata
    assert ma.planner_data == mb.planner_data
    assert ma.version == mb.version
    assert ma.storage_data == mb.storage_data
    assert type(ma.storage_meta) is type(mb.storage_meta)
    assert ma.storage_meta.checkpoint_id == a and mb.storage_meta.checkpoint_id == b
    assert ma.storage_meta.save_id and ma.storage_meta.save_id != mb.storage_meta.save_id


def test_duck_typed_bases():
    # torch's save/load take our classes as they are (no isinstance check),
    # and ours are our own abstract bases.
    assert issubclass(FileSystemWriter, StorageWriter)
    assert issubclass(FileSystemReader, StorageReader)
    with pytest.raises(TypeError):
        StorageWriter()  # type: ignore[abstract]


@pytest.mark.parametrize("thread_count", [1, 3])
@pytest.mark.parametrize("single_file", [True, False])
def test_byte_identical_and_cross_load(tmp_path, thread_count, single_file):
    sd = _state_dict()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    dcp.save(sd, storage_writer=FileSystemWriter(
        ours, thread_count=thread_count, single_file_per_rank=single_file))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(
        theirs, thread_count=thread_count, single_file_per_rank=single_file))
    _compare_dirs(ours, theirs)
    if single_file:
        assert len([n for n in os.listdir(ours) if n.endswith(".distcp")]) == thread_count
    # Both readers load both checkpoints.
    for src in (ours, theirs):
        for reader in (FileSystemReader, dcp.FileSystemReader):
            out = _empty_like(sd)
            dcp.load(out, storage_reader=reader(src))
            expect = dict(sd, transposed=sd["transposed"].contiguous())
            _assert_equal(expect, out)


def test_non_contiguous_destination_and_dtype_cast(tmp_path):
    sd = {"a": torch.randn(6, 4), "b": torch.randn(4, 6).t()}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path))
    out = {"a": torch.zeros(4, 6).t(), "b": torch.zeros(6, 4, dtype=torch.float64)}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path))
    assert torch.equal(out["a"], sd["a"])
    assert torch.equal(out["b"], sd["b"].double())


def _record(path: Path, key: str) -> tuple[Path, int, int]:
    md = _load_md(path)
    for idx, info in md.storage_data.items():
        if idx.fqn == key:
            return path / info.relative_path, info.offset, info.length
    raise KeyError(key)


def _flip(file: Path, at: int) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("key", ["a", "t"])  # read in place / through scratch
def test_flipped_data_byte_is_detected(tmp_path, key):
    sd = {"a": torch.arange(64, dtype=torch.float32), "t": torch.randn(8, 4).t(), "s": 3}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path))
    file, off, length = _record(tmp_path, key)
    from shardstate.checkpoint._zipfmt import parse_record
    rec = parse_record(file.read_bytes()[off:off + length], base_offset=off)
    _flip(file, rec.data_offset + 5)
    out = {"a": torch.zeros(64), "t": torch.zeros(4, 8), "s": 0}
    msg = str(_raised(ChecksumError, "CRC-32 mismatch", dcp.load, out,
                      storage_reader=FileSystemReader(tmp_path)))
    assert repr(key) in msg and str(file) in msg and str(off) in msg
    # With verification off the corrupted value loads (as torch would).
    dcp.load(out, storage_reader=FileSystemReader(tmp_path, verify_checksums=False))
    assert not torch.equal(out[key], sd[key].contiguous())


def test_flipped_bytes_item_is_detected(tmp_path):
    dcp.save({"cfg": {"lr": 0.5}}, storage_writer=FileSystemWriter(tmp_path))
    file, off, _ = _record(tmp_path, "cfg.lr")
    _flip(file, off + 64 + 4)  # inside data.pkl (data starts 64-aligned)
    _raised(ChecksumError, "cfg.lr", dcp.load, {"cfg": {"lr": 0.0}},
            storage_reader=FileSystemReader(tmp_path))


def _rewrite_storage(path: Path, key: str, **changes: object) -> None:
    md = _load_md(path)
    for idx, info in md.storage_data.items():
        if idx.fqn == key:
            for k, v in changes.items():
                setattr(info, k, v)
    (path / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("bad", ["../x.distcp", "/etc/passwd", "sub/../../x", "", "a/./b"])
def test_storage_path_outside_checkpoint_is_refused(tmp_path, bad):
    ck = tmp_path / "ck"
    dcp.save({"a": torch.ones(3)}, storage_writer=FileSystemWriter(ck))
    (tmp_path / "x.distcp").write_bytes((ck / "__0_0.distcp").read_bytes())
    _rewrite_storage(ck, "a", relative_path=bad)
    _raised(StorageFormatError, "storage path", dcp.load, {"a": torch.zeros(3)},
            storage_reader=FileSystemReader(ck))


def test_symlink_escape_is_refused(tmp_path):
    ck = tmp_path / "ck"
    dcp.save({"a": torch.ones(3)}, storage_writer=FileSystemWriter(ck))
    outside = tmp_path / "outside.distcp"
    (ck / "__0_0.distcp").rename(outside)
    (ck / "__0_0.distcp").symlink_to(outside)
    _raised(StorageFormatError, "outside the checkpoint", dcp.load, {"a": torch.zeros(3)},
            storage_reader=FileSystemReader(ck))


def test_item_past_end_of_file(tmp_path):
    dcp.save({"a": torch.ones(3), "b": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path))
    file, off, length = _record(tmp_path, "b")
    _rewrite_storage(tmp_path, "b", length=length + 1)
    _raised(StorageFormatError, "runs past the end", dcp.load, {"b": torch.zeros(2)},
            storage_reader=FileSystemReader(tmp_path))
    _rewrite_storage(tmp_path, "b", length=length)
    os.truncate(file, off + length - 10)  # the file itself got shorter
    _raised(StorageFormatError, f"{file}", dcp.load, {"b": torch.zeros(2)},
            storage_reader=FileSystemReader(tmp_path))


def test_wrong_record_length_is_a_format_error(tmp_path):
    dcp.save({"a": torch.ones(3), "b": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path))
    _rewrite_storage(tmp_path, "a", length=_record(tmp_path, "a")[2] - 1)
    _raised(StorageFormatError, "'a'", dcp.load, {"a": torch.zeros(3)},
            storage_reader=FileSystemReader(tmp_path))


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_metadata_is_refused(tmp_path):
    dcp.save({"a": torch.ones(3)}, storage_writer=FileSystemWriter(tmp_path))
    marker = tmp_path / "pwned"
    md = _load_md(tmp_path)
    md.planner_data = _Evil(str(marker))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    _raised(StorageFormatError, r"system, which is not on the allowlist",
            FileSystemReader(tmp_path).read_metadata)
    # Through torch's load too (it reports the refusal inside its own error).
    _raised(Exception, "not on the allowlist", dcp.load, {"a": torch.zeros(3)},
            storage_reader=FileSystemReader(tmp_path))
    assert not marker.exists()


def test_malicious_bytes_item_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    ck = tmp_path / "ck"
    # Saving pickles the object; nothing runs.
    dcp.save({"obj": _Evil(str(marker)), "a": torch.ones(2)}, storage_writer=FileSystemWriter(ck))
    assert not marker.exists()
    _raised(StorageFormatError, "system", dcp.load, {"obj": None, "a": torch.zeros(2)},
            storage_reader=FileSystemReader(ck))
    assert not marker.exists()


def test_metadata_checks(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint metadata"):
        FileSystemReader(tmp_path).read_metadata()
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(StorageFormatError, match="0 bytes"):
        FileSystemReader(tmp_path).read_metadata()
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(StorageFormatError, match="not a Metadata"):
        FileSystemReader(tmp_path).read_metadata()
    (tmp_path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(StorageFormatError):
        FileSystemReader(tmp_path).read_metadata()


def test_overwrite(tmp_path):
    dcp.save({"a": torch.ones(3)}, storage_writer=FileSystemWriter(tmp_path))
    _raised(RuntimeError, "overwrite=False", dcp.save, {"a": torch.ones(3)},
            storage_writer=FileSystemWriter(tmp_path, overwrite=False))
    assert (tmp_path / ".metadata").exists()  # untouched

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    # A save that fails while writing leaves no .metadata: the old one was
    # removed before any data file was touched.
    with pytest.warns(UserWarning, match="overwriting"):
        _raised(RuntimeError, "cannot pickle", dcp.save, {"a": torch.ones(3), "z": Unpicklable()},
                storage_writer=FileSystemWriter(tmp_path))
    assert not (tmp_path / ".metadata").exists()
    dcp.save({"a": torch.full((3,), 2.0)}, storage_writer=FileSystemWriter(tmp_path))
    out = {"a": torch.zeros(3)}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path))
    assert torch.equal(out["a"], torch.full((3,), 2.0))


def test_unsupported_options():
    # SAFETENSORS is supported (tests/test_safetensors.py), not through stream transforms.
    with pytest.raises(NotImplementedError, match="SAFETENSORS"):
        FileSystemWriter("x", serialization_format=fs.SerializationFormat.SAFETENSORS,
                         _extensions=[object()])
    # Stream transforms are supported (tests/test_extension.py); what is not one is refused.
    with pytest.raises(TypeError, match="_extensions"):
        FileSystemWriter("x", _extensions=[object()])
    with pytest.raises(ValueError, match="thread_count"):
        FileSystemWriter("x", thread_count=0)


def test_validate_checkpoint_id(tmp_path):
    assert FileSystemWriter.validate_checkpoint_id(tmp_path / "new")
    assert FileSystemReader.validate_checkpoint_id(str(tmp_path / "new"))
    assert not FileSystemWriter.validate_checkpoint_id("s3://bucket/ck")
    # checkpoint_id= goes through reset().
    dcp.save({"a": torch.ones(1)}, checkpoint_id=str(tmp_path / "c"),
             storage_writer=FileSystemWriter(tmp_path / "ignored"))
    assert (tmp_path / "c" / ".metadata").exists() and not (tmp_path / "ignored").exists()


# ---------------------------------------------------------------------------
# Multi-process: DTensor shards over gloo, saved and resharded
# ---------------------------------------------------------------------------

_GLOBAL = {"w": (11, 6), "v": (7,)}


def _global(name: str) -> torch.Tensor:
    n = 1
    for s in _GLOBAL[name]:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(_GLOBAL[name]) * 0.5 + 1


def _dist_sd(world_size: int, placement_dim: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    return {
        "w": distribute_tensor(_global("w"), mesh, [Shard(placement_dim)]),  # uneven
        "v": distribute_tensor(_global("v"), mesh, [Replicate()]),
        "step": 5,
    }


def _zeroed(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            v = v.detach().clone()
            v.to_local().zero_()
        else:
            v = 0
        out[k] = v
    return out


def _check(sd: dict) -> None:
    assert sd["step"] == 5
    for k in ("w", "v"):
        assert torch.equal(sd[k].full_tensor(), _global(k)), k


def _save_both(rank: int, world_size: int, root: str) -> None:
    import torch.distributed as dist

    sd = _dist_sd(world_size, 0)
    dcp.save(sd, storage_writer=FileSystemWriter(f"{root}/ours", thread_count=2))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{root}/theirs", thread_count=2))
    dist.barrier()
    if rank == 0:
        _compare_dirs(Path(root, "ours"), Path(root, "theirs"))
    # Without collectives every rank writes its own __{rank}.metadata.
    dcp.save(sd, storage_writer=FileSystemWriter(f"{root}/ours_nc"), use_collectives=False)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{root}/theirs_nc"), use_collectives=False)
    dist.barrier()
    if rank == 0:
        a, b = Path(root, "ours_nc"), Path(root, "theirs_nc")
        assert sorted(os.listdir(a)) == sorted(os.listdir(b))
        assert f"__{world_size - 1}.metadata" in os.listdir(a) and ".metadata" not in os.listdir(a)
        for n in os.listdir(a):
            if n.endswith(".distcp"):
                assert (a / n).read_bytes() == (b / n).read_bytes(), n
            else:
                ma, mb = (pickle.loads((d / n).read_bytes()) for d in (a, b))
                assert ma.state_dict_metadata == mb.state_dict_metadata, n
                assert ma.storage_data == mb.storage_data, n
    dist.barrier()
    out = _zeroed(_dist_sd(world_size, 0))
    dcp.load(out, storage_reader=FileSystemReader(f"{root}/ours_nc"))
    _check(out)
    # Each reader loads each checkpoint into another placement.
    for src in ("ours", "theirs"):
        for reader in (FileSystemReader, dcp.FileSystemReader):
            out = _zeroed(_dist_sd(world_size, 1))
            dcp.load(out, storage_reader=reader(f"{root}/{src}"))
            _check(out)


def _load_resharded(rank: int, world_size: int, root: str) -> None:
    for src in ("ours", "theirs"):
        out = _zeroed(_dist_sd(world_size, 0))
        dcp.load(out, storage_reader=FileSystemReader(f"{root}/{src}"))
        _check(out)


def test_distributed_save_and_reshard(tmp_path, run_distributed):
    run_distributed(_save_both, 3, str(tmp_path))
    files = sorted(n for n in os.listdir(tmp_path / "ours") if n.endswith(".distcp"))
    assert files == [f"__{r}_{n}.distcp" for r in range(3) for n in range(2)]
    run_distributed(_load_resharded, 2, str(tmp_path))


def test_record_fast_path_agrees_with_parser(tmp_path):
    # Dense records are recognised by comparing them with the record we would
    # write; every other record is parsed. Both must give the same answer.
    import mmap

    sd = _state_dict()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=2))
    reader = FileSystemReader(tmp_path)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    hits = misses = 0
    for idx, info in md.storage_data.items():
        if not hasattr(md.state_dict_metadata[idx.fqn], "chunks"):
            continue
        f = _records._File(info.relative_path, str(tmp_path / info.relative_path),
                     (tmp_path / info.relative_path).stat().st_size)
        item = type("Item", (), {"storage_index": idx, "dest_index": idx})()
        req = _records._Req(item, info, f)
        with open(f.path, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), f.size, prot=mmap.PROT_READ)
        fast, parsed = reader._records.expected(mm, req), _records._parsed(mm, req)
        mm.close()
        if fast is None:
            misses += 1
            assert idx.fqn == "transposed"  # stored with its own strides
        else:
            hits += 1
            assert fast == parsed, idx.fqn
    assert hits >= 15 and misses == 1


class _Planner:
    """The two LoadPlanner calls read_data makes for tensors."""

    def __init__(self, dest: torch.Tensor) -> None:
        self.dest, self.committed = dest, 0

    def resolve_tensor(self, item):
        return self.dest

    def commit_tensor(self, item, tensor):
        assert tensor.data_ptr() == self.dest.data_ptr()
        self.committed += 1


def _read_region(path: Path, offsets, lengths, dest: torch.Tensor, **kw) -> _Planner:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    reader = FileSystemReader(path, **kw)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    item = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("w", (0, 0)),
                    dest_offsets=torch.Size([0, 0]),
                    storage_index=MetadataIndex("w", (0, 0), 0),
                    storage_offsets=torch.Size(offsets), lengths=torch.Size(lengths))
    planner = _Planner(dest)
    reader.read_data(LoadPlan([item]), planner).wait()
    return planner


def test_partial_reads_are_checked_whole(tmp_path, monkeypatch):
    w = torch.arange(40 * 64, dtype=torch.float32).reshape(40, 64)
    dcp.save({"w": w}, storage_writer=FileSystemWriter(tmp_path))
    monkeypatch.setattr(_fs_read, "_PIECE", 1000)  # the unread rest in several pieces
    # A slab along dim 0 lands straight in the destination; a box along
    # dim 1 goes through scratch.
    for offs, lens in (((3, 0), (4, 64)), ((39, 0), (1, 64)), ((0, 1), (40, 2)), ((5, 7), (1, 9))):
        dest = torch.zeros(lens)
        p = _read_region(tmp_path, offs, lens, dest)
        assert p.committed == 1
        assert torch.equal(dest, w[offs[0]:offs[0] + lens[0], offs[1]:offs[1] + lens[1]])
    # Corrupt a row no region above reads: every read still sees it.
    file, off, length = _record(tmp_path, "w")
    from shardstate.checkpoint._zipfmt import parse_record
    rec = parse_record(file.read_bytes()[off:off + length], base_offset=off)
    _flip(file, rec.data_offset + 20 * 64 * 4 + 3)
    for offs, lens in (((3, 0), (4, 64)), ((0, 1), (40, 2))):
        _raised(ChecksumError, r"'w'.*offset", _read_region, tmp_path, offs, lens,
                torch.zeros(lens))
        dest = torch.zeros(lens)
        _read_region(tmp_path, offs, lens, dest, verify_checksums=False)
        assert torch.equal(dest[:, :2], w[offs[0]:offs[0] + lens[0], offs[1]:offs[1] + 2])


def test_empty_files_match_torch(tmp_path):
    # One tensor over three buckets: torch writes two empty files too.
    sd = {"only": torch.ones(4)}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "ours", thread_count=3))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "theirs", thread_count=3))
    _compare_dirs(tmp_path / "ours", tmp_path / "theirs")
    assert [(tmp_path / "ours" / f"__0_{n}.distcp").stat().st_size for n in (1, 2)] == [0, 0]


def test_bytes_items_of_allowed_kinds(tmp_path):
    import collections

    import numpy as np

    sd = {"np": np.arange(5, dtype=np.float32), "tup": (torch.ones(2), 3),
          "misc": {"set": {1, 2}, "b": b"\x00\xff", "c": 1 + 2j,
                   "od": (collections.OrderedDict(a=1),), "none": None, "path": Path("/x")}}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path))
    out = {"np": None, "tup": None, "misc": {k: None for k in sd["misc"]}}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path))
    assert np.array_equal(out["np"], sd["np"]) and out["np"].dtype == np.float32
    assert torch.equal(out["tup"][0], torch.ones(2)) and out["tup"][1] == 3
    assert out["misc"] == sd["misc"]
