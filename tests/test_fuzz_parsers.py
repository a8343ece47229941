"""Every Python parser of on-disk bytes, fed mutated real inputs (issue 15; the
C scan's libFuzzer harness is tests/fuzz/fuzz_pickle.c, run by ``make fuzz``).

The seeds are the committed corpora (tests/fuzz/corpus/: .metadata files
written by torch's DCP and by shardstate, torch.save records, bytes items,
zstd-transformed items as stored, pickles of plain objects and hand-made
edge cases; tests/fuzz/make_corpus.py wrote them). Hypothesis mutates them:
bit flips, byte writes, truncation, deletion, insertion, splicing in bytes
of another seed, repeats, and edits of length and offset fields (found from
the zip signatures and the pickle opcodes) and of a pickle's integers. Each
parser must either give a well-formed result or raise the errors it
documents, never anything else:

- ``_zipfmt.parse_record``: RecordFormatError;
- record recognition, ``_Records.parse_buffer`` (the byte comparison with
  the record we would write, else the strict parse): StorageFormatError,
  and both ways agree where the comparison accepts;
- ``loads_metadata`` / ``loads_object``: PickleFormatError /
  UnsafePickleError, and the C fast path and the pure-Python reference
  agree (value or error);
- ``_fs_read._check_bytes_record`` (a bytes item's zip and pickle):
  ChecksumError / StorageFormatError;
- ``ReaderTransforms.decode`` (zstd), then the record inside:
  StorageFormatError, never more than the limit.

Bomb-shaped inputs are checked for the memory they take (tracemalloc's
peak). Every input kept in tests/fuzz/crashes/ and every corpus file is
replayed through all the readers. Runs are reproducible: the hypothesis seed
is SHARDSTATE_FUZZ_SEED (default 0), noted in every failure report with the
falsifying example; another seed (and SHARDSTATE_FUZZ_EXAMPLES) explores further.
"""

from __future__ import annotations

import math
import os
import pickle
import pickletools
import re
import struct
import tracemalloc
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import shardstate
import torch
import zstandard
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st
from shardstate._core import ChecksumError
from shardstate.checkpoint import _zipfmt
from shardstate.checkpoint._fs_read import _check_bytes_record
from shardstate.checkpoint._fs_transform import ReaderTransforms
from shardstate.checkpoint._pickle import (
    PickleFormatError,
    UnsafePickleError,
    loads_metadata,
    loads_object,
)
from shardstate.checkpoint._pickle import allowlist as A
from shardstate.checkpoint._pickle import build as B
from shardstate.checkpoint._pickle import unpickler as U
from shardstate.checkpoint._records import StorageFormatError, _File, _Records, _Req
from shardstate.checkpoint._zipfmt import RecordFormatError
from shardstate.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from shardstate.checkpoint.metadata import _StorageInfo as StorageInfo

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "fuzz" / "corpus"
CRASHES = HERE / "fuzz" / "crashes"
SEED = int(os.environ.get("SHARDSTATE_FUZZ_SEED", "0"))
# Bounded: 200 examples a parser (SHARDSTATE_FUZZ_EXAMPLES=N for a longer hunt);
# the database off, so a run is its seed.
EXAMPLES = int(os.environ.get("SHARDSTATE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _files(folder: Path, pattern: str = "*") -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob(pattern)) if p.is_file()}


PICKLES = _files(CORPUS / "fuzz_pickle")
RECORDS = _files(CORPUS / "records", "*.rec")
BYTES_ITEMS = _files(CORPUS / "records", "*.bytes")
ZSTD_ITEMS = {n: (b, (CORPUS / "records" / f"{n}.desc").read_text().split())
              for n, b in _files(CORPUS / "records", "*.zst").items()}
METADATA = {n: b for n, b in PICKLES.items() if n.startswith("metadata_")}
KEPT = {n: b for n, b in _files(CRASHES).items() if n != "README.md"}  # every kept input
# whole safetensors files (st_*: the safetensors package's, ss_*: shardstate's)
SAFETENSORS = {n: b for n, b in _files(CORPUS / "fuzz_stheader").items()
               if n.startswith(("st_", "ss_"))}


def test_corpus_is_there() -> None:
    """The seeds the properties below mutate (an empty corpus would make
    them vacuous)."""
    assert len(METADATA) >= 4 and len(RECORDS) >= 8 and len(BYTES_ITEMS) >= 3
    assert len(ZSTD_ITEMS) >= 4 and len(PICKLES) >= 60 and len(SAFETENSORS) >= 5
    assert sum(map(len, PICKLES.values())) + sum(map(len, RECORDS.values())) < 400_000


# --------------------------------------------------------------------------
# Mutations
# --------------------------------------------------------------------------

_ZIP_FIELDS = {  # signature -> (offset, width) of its length and offset fields
    b"PK\x03\x04": [(14, 4), (18, 4), (22, 4), (26, 2), (28, 2)],
    b"PK\x01\x02": [(16, 4), (20, 4), (24, 4), (28, 2), (30, 2), (32, 2), (42, 4)],
    b"PK\x07\x08": [(4, 4), (8, 4), (12, 4), (8, 8), (16, 8)],
    b"PK\x06\x06": [(4, 8), (24, 4), (32, 8), (40, 8), (48, 8)],
    b"PK\x06\x07": [(4, 4), (8, 8), (16, 4)],
    b"PK\x05\x06": [(8, 2), (10, 2), (12, 4), (16, 4), (20, 2)],
}


# pickletools' argument sizes for arguments that are a length and its bytes
_LENGTH_PREFIX = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
                  pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}


def _fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of the length, offset and size fields in data: those
    of the zip structures it holds (found by signature), else the arguments
    of its pickle opcodes (as far as pickletools can walk)."""
    out = []
    for sig, fields in _ZIP_FIELDS.items():
        for m in re.finditer(re.escape(sig), data):
            out += [(m.start() + o, w) for o, w in fields if m.start() + o + w <= len(data)]
    if out:
        return out
    try:
        for op, _arg, pos in pickletools.genops(data):
            n = op.arg.n if op.arg is not None else 0
            width = n if n > 0 else _LENGTH_PREFIX.get(n)  # a fixed argument, or a length
            if width:
                out.append((pos + 1, width))
    except Exception:  # noqa: BLE001, S110 - a hand-made edge case; no fields then
        pass
    return out


def _ints(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of the pickle's integers (BININT1/2, BININT): in a
    .metadata, the sizes, offsets and lengths everything else trusts."""
    widths = {"BININT1": 1, "BININT2": 2, "BININT": 4}
    try:
        return [(pos + 1, widths[op.name]) for op, _arg, pos in pickletools.genops(data)
                if op.name in widths]
    except Exception:  # noqa: BLE001 - not a pickle: no integers then
        return []


def _interesting(n: int) -> list[int]:
    return [0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
            (1 << 63) - 1, (1 << 64) - 1, n - 1, n, n + 1, n // 2, 2 * n]


@st.composite
def mutated(draw: Any, seeds: dict[str, bytes], max_edits: int = 4) -> bytes:
    """One of ``seeds`` with 1..max_edits mutations."""
    names = sorted(seeds)
    name = draw(st.sampled_from(names))
    data = bytearray(seeds[name])
    note(f"seed input {name!r}; SHARDSTATE_FUZZ_SEED={SEED}")
    fields, ints = _fields(bytes(data)), _ints(bytes(data))
    for _ in range(draw(st.integers(1, max_edits))):
        n = len(data)
        kind = draw(st.sampled_from(["flip", "byte", "cut", "delete", "insert", "splice",
                                     "repeat", "field", "field", "int"]))
        pos = draw(st.integers(0, 1 << 16)) % (n + 1)
        if kind == "flip" and n:
            data[pos % n] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte" and n:
            data[pos % n] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[pos:]
        elif kind == "delete":
            del data[pos : pos + draw(st.integers(1, 64))]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "splice":
            other = seeds[draw(st.sampled_from(names))]
            a = draw(st.integers(0, 1 << 16)) % (len(other) + 1)
            chunk = other[a : a + draw(st.integers(1, 256))]
            if draw(st.booleans()):
                data[pos:pos] = chunk
            else:
                data[pos : pos + len(chunk)] = chunk
        elif kind == "repeat":
            chunk = bytes(data[pos : pos + draw(st.integers(1, 16))])
            data[pos:pos] = chunk * draw(st.integers(1, 64))
        elif kind == "field" and fields:
            at, width = draw(st.sampled_from(fields))
            if at + width <= n:
                v = draw(st.sampled_from(_interesting(n))) % (1 << (8 * width))
                data[at : at + width] = v.to_bytes(width, "little")
        elif kind == "int" and ints:
            at, width = draw(st.sampled_from(ints))
            if at + width <= n:
                v = draw(st.integers(0, 9) | st.sampled_from(_interesting(n)))
                data[at : at + width] = (v % (1 << (8 * width))).to_bytes(width, "little")
    return bytes(data)


# --------------------------------------------------------------------------
# The parsers, each with its contract
# --------------------------------------------------------------------------


def check_safetensors(data: bytes) -> None:
    """A safetensors file's header (the C parser behind
    ``_safetensors.parse_header``): SafetensorsError, or entries that lie
    inside the file, sized by dtype and shape, tiling the data exactly."""
    from shardstate.checkpoint import _safetensors as S

    if len(data) < 8:
        return
    (n,) = struct.unpack("<Q", data[:8])
    if n > S.MAX_HEADER or 8 + n > len(data):
        return
    try:
        h = S.parse_header("f", data[8:8 + n], len(data))
    except S.SafetensorsError as e:
        assert str(e).startswith("f: "), e
        return
    cursor = h.data_start
    for e in sorted(h.tensors.values(), key=lambda e: (e.begin, e.nbytes)):
        assert e.begin == cursor and e.nbytes == S.DTYPE_SIZE[e.dtype] * math.prod(e.shape)
        cursor += e.nbytes
    assert cursor == len(data)


def check_parse_record(data: bytes) -> _zipfmt.RecordInfo | None:
    """parse_record: a RecordInfo whose regions lie in the buffer, or
    RecordFormatError."""
    try:
        info = _zipfmt.parse_record(data, base_offset=1000)
    except RecordFormatError:
        return None
    assert 1000 <= info.data_offset and info.data_offset - 1000 + info.data_length <= len(data)
    for e in info.entries:
        assert 1000 <= e.header_offset < e.data_offset
        assert e.data_offset - 1000 + e.size <= len(data)
    assert len(info.shape) == len(info.stride) and info.dtype in _zipfmt.DTYPES
    assert info.data_length == info.storage_numel * _zipfmt.DTYPES[info.dtype].itemsize
    return info


def _records_for(valid: bytes, crc: bool) -> tuple[_Records, _Req]:
    """A reader's view of one tensor item whose record is ``valid``: the
    metadata describes the chunk it holds (as a save would have)."""
    info = _zipfmt.parse_record(valid)
    dtype = getattr(torch, info.dtype)
    shape = torch.Size(info.shape)
    idx = MetadataIndex("t", torch.Size([0] * len(shape)), 0)
    tmd = TensorStorageMetadata(TensorProperties(dtype=dtype), shape,
                                [ChunkStorageMetadata(torch.Size([0] * len(shape)), shape)])
    si = StorageInfo("__0_0.distcp", 0, len(valid))
    if crc:
        si.shardstate_crc32 = info.data_crc32
    md = Metadata({"t": tmd}, storage_data={idx: si})
    item = SimpleNamespace(storage_index=idx, dest_index=idx, type=SimpleNamespace(name="TENSOR"))
    return _Records(Path("/nonexistent"), md.storage_data, md), \
        _Req(item, si, _File("__0_0.distcp", "/nonexistent/__0_0.distcp", len(valid)))


_RECOGNISERS = {name: _records_for(rec, crc=i % 2 == 0)
                for i, (name, rec) in enumerate(sorted(RECORDS.items()))}


def check_recognition(records: _Records, r: _Req, data: bytes) -> None:
    """parse_buffer: a record whose data lies in the buffer, or
    StorageFormatError; where the byte comparison accepts, the strict parse
    finds the same record."""
    buf = bytearray(data)
    try:
        rec = records.parse_buffer(buf, r)
    except StorageFormatError:
        return
    assert rec.data_offset + rec.data_length <= len(buf)
    fast = records.expected(buf, r, 0, len(buf))
    if fast is not None:
        strict = _zipfmt.parse_record(bytes(buf))
        assert (strict.dtype, strict.shape, strict.stride, strict.storage_offset,
                strict.data_offset, strict.data_length, strict.data_crc32) == \
            (fast.dtype, fast.shape, fast.stride, fast.storage_offset, fast.data_offset,
             fast.data_length, fast.data_crc32)


def _outcome(data: bytes, allowed: dict, fast: bool) -> tuple:
    """What the restricted unpickler makes of data, comparable across its two
    engines: the built graph pickled, or the error's type and message."""
    try:
        built = B._build("x", U._unpickle(data, allowed, "x", fast=fast))
    except (UnsafePickleError, PickleFormatError) as e:
        return ("error", type(e).__name__, re.sub(r" at 0x[0-9a-f]+", "", str(e)))
    return ("value", pickle.dumps(built, protocol=5))


def check_pickle(data: bytes) -> None:
    """The scan, both engines under both allowlists, and loads_metadata:
    documented errors only; the engines agree."""
    try:
        proto, end = shardstate._core.pickle_scan(data)
        assert 0 <= proto <= 5 and 0 < end <= len(data) and data[end - 1 : end] == b"."
    except (ValueError, shardstate.ShardstateError):
        pass
    for allowed in (A._METADATA_GLOBALS, A._PLAIN_GLOBALS):
        if data:
            assert _outcome(data, allowed, True) == _outcome(data, allowed, False)
    try:
        md = loads_metadata(data)
    except (PickleFormatError, UnsafePickleError):
        return
    assert isinstance(md, Metadata) and isinstance(md.state_dict_metadata, dict)


def check_bytes_item(record: bytes) -> None:
    """A bytes item as the reader takes it: _check_bytes_record (ChecksumError
    / StorageFormatError), then loads_object (PickleFormatError /
    UnsafePickleError); whatever the first passes, the second reads or
    refuses the same way on its own."""
    try:
        _check_bytes_record(record, "item")
    except (ChecksumError, StorageFormatError):
        pass
    try:
        loads_object(record)
    except (PickleFormatError, UnsafePickleError):
        pass


_LIMIT = 1 << 20


def check_transformed(stored: bytes, desc: list[str], recogniser: Any) -> None:
    """ReaderTransforms.decode: at most the limit, or StorageFormatError; what
    it gives is then read as the reader reads it (a tensor record or a bytes
    item)."""
    try:
        out = ReaderTransforms().decode(desc, stored, _LIMIT, 4096, "item")
    except StorageFormatError:
        return
    assert isinstance(out, bytearray) and len(out) <= _LIMIT
    if recogniser is not None:
        check_recognition(*recogniser, bytes(out))
    else:
        check_bytes_item(bytes(out))


# --------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------


def test_safetensors_seeds_parse() -> None:
    from shardstate.checkpoint import _safetensors as S

    for name, data in SAFETENSORS.items():
        (n,) = struct.unpack("<Q", data[:8])
        h = S.parse_header(name, data[8:8 + n], len(data))  # every seed is a valid file
        assert len(h.tensors) == data[8:8 + n].count(b'"data_offsets"'), name
        check_safetensors(data)


@FUZZ
@seed(SEED)
@given(mutated(SAFETENSORS))
def test_fuzz_safetensors_header(data: bytes) -> None:
    check_safetensors(data)


@FUZZ
@seed(SEED)
@given(mutated(RECORDS))
def test_fuzz_parse_record(data: bytes) -> None:
    check_parse_record(data)


@FUZZ
@seed(SEED)
@given(st.sampled_from(sorted(RECORDS)), st.data())
def test_fuzz_record_recognition(name: str, d: st.DataObject) -> None:
    data = d.draw(mutated({name: RECORDS[name]}))
    check_recognition(*_RECOGNISERS[name], data)


@FUZZ
@seed(SEED)
@given(mutated(METADATA, max_edits=3))
def test_fuzz_loads_metadata(data: bytes) -> None:
    check_pickle(data)


@FUZZ
@seed(SEED)
@given(mutated({n: b for n, b in PICKLES.items() if not n.startswith("metadata_")}))
def test_fuzz_restricted_unpickler(data: bytes) -> None:
    check_pickle(data)


@FUZZ
@seed(SEED)
@given(mutated(BYTES_ITEMS))
def test_fuzz_bytes_item_record(data: bytes) -> None:
    check_bytes_item(data)


@FUZZ
@seed(SEED)
@given(mutated(RECORDS))
def test_fuzz_bytes_item_holding_tensors(data: bytes) -> None:
    """A bytes item may be any torch.save record; one holding tensors is
    read by torch.load(weights_only=True), whose errors are ours too."""
    check_bytes_item(data)


_BYTES_PICKLES = {n: b for n, b in PICKLES.items() if n.startswith(("bytesitem_", "plain_"))}


@FUZZ
@seed(SEED)
@given(mutated(_BYTES_PICKLES))
def test_fuzz_pickle_inside_bytes_item(data: bytes) -> None:
    check_bytes_item(_zipfmt.bytes_record(data))


def _zst_recogniser(name: str) -> Any:
    blob, desc = ZSTD_ITEMS[name]
    plain = bytes(ReaderTransforms().decode(desc, blob, _LIMIT, 4096, name))
    return _records_for(plain, crc=True) if b"data/0" in plain else None


_ZSTD_RECOGNISERS = {n: _zst_recogniser(n) for n in sorted(ZSTD_ITEMS)}


@FUZZ
@seed(SEED)
@given(st.sampled_from(sorted(ZSTD_ITEMS)), st.data())
def test_fuzz_transformed_items(name: str, d: st.DataObject) -> None:
    blob, desc = ZSTD_ITEMS[name]
    data = d.draw(mutated({name: blob}))
    check_transformed(data, desc, _ZSTD_RECOGNISERS[name])


@FUZZ
@seed(SEED)
@given(st.sampled_from(sorted(ZSTD_ITEMS)), st.data())
def test_fuzz_transformed_items_inside(name: str, d: st.DataObject) -> None:
    """The frame intact, the record inside it mutated: the transform hands
    over whatever the record holds."""
    blob, desc = ZSTD_ITEMS[name]
    plain = bytes(ReaderTransforms().decode(desc, blob, _LIMIT, 4096, name))
    data = d.draw(mutated({name: plain}))
    check_transformed(zstandard.ZstdCompressor().compress(data), desc, _ZSTD_RECOGNISERS[name])


@settings(max_examples=50, deadline=None, database=None)
@seed(SEED)
@given(st.lists(st.sampled_from(["stream.zstd/1", "stream.zstd/2", "stream.zstd", "zstd/1",
                                 "stream.nope/1", "", "/", "stream.zstd/1/1"]), max_size=3))
def test_fuzz_transform_descriptors(desc: list[str]) -> None:
    blob = next(iter(ZSTD_ITEMS.values()))[0]
    try:
        out = ReaderTransforms().decode(desc, blob, _LIMIT, 4096, "item")
    except StorageFormatError:
        return
    assert len(out) <= _LIMIT


# --------------------------------------------------------------------------
# A whole checkpoint: one of its files mutated, then loaded
# --------------------------------------------------------------------------


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=g), "s": torch.randn(6, 4, generator=g).t(),
            "b": torch.arange(5), "extra": {"step": 7, "name": "x"}}


def _zeros() -> dict[str, Any]:
    return {"w": torch.zeros(4, 3), "s": torch.zeros(4, 6), "b": torch.zeros(5, dtype=torch.int64),
            "extra": {"step": 0, "name": ""}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import shardstate.checkpoint as dcp
    from shardstate.checkpoint._extension import ZStandard
    from shardstate.checkpoint._pickle import dumps_metadata

    out = {}
    for kind in ("plain", "zstd"):
        path = tmp_path_factory.mktemp(kind)
        ext = {"_extensions": [ZStandard()]} if kind == "zstd" else {}
        dcp.save(_state(), storage_writer=dcp.FileSystemWriter(path, **ext))
        # the same bytes in every run (the path and the save's id vary), so a
        # seed mutates the same bytes each time
        md = loads_metadata((path / ".metadata").read_bytes())
        md.storage_meta.checkpoint_id, md.storage_meta.save_id = "checkpoint", "0" * 36
        (path / ".metadata").write_bytes(dumps_metadata(md))
        out[kind] = path
    return out


# What a load may raise for a damaged checkpoint (inside the CheckpointException
# every rank raises): the storage layer's errors, a missing data file (a
# damaged relative_path), and the planner's checks of metadata against the
# destination (shapes, keys, kinds of value), as torch's.
_LOAD_ERRORS = (StorageFormatError, ChecksumError, FileNotFoundError)
_PLANNER = re.compile(r"^(Size mismatch|Missing key|Invalid checkpoint metadata)")


@FUZZ
@seed(SEED)
@given(st.sampled_from(["plain", "zstd"]), st.sampled_from([".metadata", "__0_0.distcp"]),
       st.data())
def test_fuzz_checkpoint_files(checkpoints: dict[str, Path], kind: str, file: str,
                               d: st.DataObject) -> None:
    """A load of a checkpoint with one damaged file either gives exactly the
    saved values or fails with the documented errors: never a silently
    different state."""
    import shardstate.checkpoint as dcp

    path = checkpoints[kind] / file
    good = path.read_bytes()
    path.write_bytes(d.draw(mutated({file: good})))
    try:
        out = _zeros()
        dcp.load(out, checkpoint_id=checkpoints[kind])
    except dcp.CheckpointException as e:
        for exc, _frames in e.failures.values():
            assert isinstance(exc, _LOAD_ERRORS) or (
                type(exc) in (ValueError, RuntimeError) and _PLANNER.match(str(exc))), repr(exc)
        return
    finally:
        path.write_bytes(good)
    want = _state()
    for k in ("w", "s", "b"):
        assert torch.equal(out[k], want[k]), k
    assert out["extra"] == want["extra"]


# --------------------------------------------------------------------------
# Replays: every kept crash input and every corpus file, through every reader
# --------------------------------------------------------------------------


def _every_reader(data: bytes) -> None:
    check_safetensors(data)
    check_pickle(data)
    check_parse_record(data)
    check_bytes_item(data)
    check_bytes_item(_zipfmt.bytes_record(data))
    for recogniser in list(_RECOGNISERS.values())[:2]:
        check_recognition(*recogniser, data)
    check_transformed(data, ["stream.zstd/1"], None)
    check_transformed(zstandard.ZstdCompressor().compress(data), ["stream.zstd/1"], None)


@pytest.mark.parametrize("name", sorted(KEPT) or ["(none kept yet)"])
def test_kept_crash_inputs_replay(name: str) -> None:
    if name not in KEPT:
        assert not list(CRASHES.glob("*-*")), "a kept input is not replayed"
        return
    _every_reader(KEPT[name])


def test_corpus_replays_and_valid_seeds_load() -> None:
    for name, data in PICKLES.items():
        _every_reader(data)
        if name.startswith(("metadata_", "bytesitem_")) or name.startswith("plain_") and \
                name.endswith(("_p2", "_p3", "_p4", "_p5")):
            proto, end = shardstate._core.pickle_scan(data)  # what writers write passes
            assert end == len(data), name
    for name, data in METADATA.items():
        assert set(loads_metadata(data).state_dict_metadata) >= {"w", "b", "extra.step"}, name
    for name, rec in RECORDS.items():
        assert check_parse_record(rec) is not None, name
        check_bytes_item(rec)
        assert isinstance(loads_object(rec), torch.Tensor), name
        records, r = _RECOGNISERS[name]
        assert records.parse_buffer(bytearray(rec), r).data_length >= 0
    values = {"torch_extra_step.bytes": 7, "torch_extra_name.bytes": "run-1",
              "torch_extra_lr.bytes": [0.1, 0.01], "torch_extra_t.bytes": (1, 2),
              "torch_opt_param_groups_0_lr.bytes": 0.1}
    assert sorted(BYTES_ITEMS) == sorted(values)
    for name, rec in BYTES_ITEMS.items():
        _check_bytes_record(rec, name)
        assert loads_object(rec) == values[name], name
    for name, (blob, desc) in ZSTD_ITEMS.items():
        out = ReaderTransforms().decode(desc, blob, _LIMIT, 4096, name)
        if _ZSTD_RECOGNISERS[name] is not None:
            assert _ZSTD_RECOGNISERS[name][0].parse_buffer(out, _ZSTD_RECOGNISERS[name][1])
        else:
            _check_bytes_record(bytes(out), name)


# --------------------------------------------------------------------------
# Bombs: memory stays bounded (tracemalloc's peak of Python's allocations)
# --------------------------------------------------------------------------


def _peak(fn: Any) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _zstd_bomb(nbytes: int) -> bytes:
    """A zstd frame that inflates to nbytes zeros (a few KB stored)."""
    c = zstandard.ZstdCompressor(level=1).compressobj()
    piece = bytes(1 << 20)
    out = [c.compress(piece) for _ in range(nbytes >> 20)]
    return b"".join(out) + c.flush()


def _refused(fn: Any, errors: tuple) -> None:
    with pytest.raises(errors):
        fn()


_MB = 1 << 20
_PICKLE_BOMBS = {
    # lengths past the data: nothing is allocated for them
    "BINUNICODE8": b"\x80\x04\x8d" + struct.pack("<Q", 1 << 62) + b"ab.",
    "BINBYTES8": b"\x80\x04\x8e" + struct.pack("<Q", 1 << 62) + b"ab.",
    "BYTEARRAY8": b"\x80\x05\x96" + struct.pack("<Q", 1 << 62) + b"ab.",
    "BINUNICODE": b"\x80\x02X\xff\xff\xff\xffab.",
    "LONG4": b"\x80\x02\x8b\xff\xff\xff\x7fab.",
    "FRAME": b"\x80\x04\x95" + struct.pack("<Q", 1 << 62) + b"N.",
    # a memo index past the entries: the C unpickler's array memo is not sized by it
    "LONG_BINPUT": b"\x80\x04N" + b"r\xff\xff\xff\x7f" + b".",
    "PUT": b"\x80\x02Np4000000000\n.",
    # DUPs past the stream's bytes (deep tuples: tests/test_reader_bounds.py)
    "DUP": b"\x80\x02](" + b"2" * 200_000 + b"e.",
}


@pytest.mark.parametrize("name", sorted(_PICKLE_BOMBS))
def test_pickle_bombs_stay_small(name: str) -> None:
    data = _PICKLE_BOMBS[name]
    for allowed in (A._METADATA_GLOBALS, A._PLAIN_GLOBALS):
        peak = _peak(lambda a=allowed: _outcome(data, a, True))
        assert peak < 64 * _MB, f"{name}: {peak} bytes"
    peak = _peak(lambda: _refused(lambda: loads_object(_zipfmt.bytes_record(data)),
                                  (PickleFormatError, UnsafePickleError)))
    assert peak < 64 * _MB, f"{name}: {peak} bytes"


def test_zstd_bomb_is_refused_at_the_limit() -> None:
    """256 MiB of zeros in a few KB of zstd: the tensor path refuses it after
    at most its limit (here 1 MiB), never inflating the rest."""
    bomb = _zstd_bomb(256 * _MB)
    assert len(bomb) < 64 << 10
    peak = _peak(lambda: _refused(
        lambda: ReaderTransforms().decode(["stream.zstd/1"], bomb, _MB, 4096, "item"),
        (StorageFormatError,)))
    assert peak < 16 * _MB, peak


def _frame_desync(hidden: bytes) -> bytes:
    """A stream that CPython's C unpickler would read otherwise than the
    scan: a FRAME ends 5 bytes into a SHORT_BINUNICODE's data; the C
    unpickler drops those 5 bytes and reads the string from the file, and
    so runs as opcodes ``hidden``, which the scan (and pickle.py) see as a
    BINBYTES' data. (Its length bytes end up in the C string: they must be
    UTF-8, so hidden is padded to a length whose bytes are ASCII.)"""
    size = 0x7F7F if len(hidden) <= 0x7F7F else 0x047F7F
    hidden += b"." * (size - len(hidden))
    frame = b"N\x8c\x10" + b"x" * 5
    return (b"\x80\x04\x95" + struct.pack("<Q", len(frame)) + frame + b"y" * 11
            + b"B" + struct.pack("<I", len(hidden)) + hidden + b"0.")


def test_scan_refuses_frame_desync() -> None:
    """Found by test_fuzz_restricted_unpickler (kept in tests/fuzz/crashes/):
    the scan passed streams in which an opcode runs past the end of its
    FRAME. The C unpickler then ran bytes the scan had taken for data: a
    forged memo index made a 140-byte .metadata allocate 1 GiB, a tuple
    nested 290000 deep overflowed the C stack (SIGSEGV). The scan now
    refuses them; the reference reads them as the scan does."""
    memo = _frame_desync(b"r" + struct.pack("<I", 1 << 26) + b".")  # 2^27 memo slots: 1 GiB
    deep = _frame_desync(b"})" + b"\x85" * 290_000 + b"Ns.")  # hashed 290000 deep
    for data in (memo, deep):
        with pytest.raises(shardstate.ShardstateError, match="past the end of its FRAME"):
            shardstate._core.pickle_scan(data)
    peak = _peak(lambda: _refused(lambda: loads_metadata(memo), (PickleFormatError,)))
    assert peak < 64 * _MB, peak
    with pytest.raises(PickleFormatError, match="holds str"):  # the scan's reading
        loads_metadata(deep)
    assert _outcome(memo, A._PLAIN_GLOBALS, True) == _outcome(memo, A._PLAIN_GLOBALS, False)


def test_damaged_data_pkl_is_refused() -> None:
    """Found by test_fuzz_checkpoint_files (kept in tests/fuzz/crashes/): a
    bit flip in a record's data.pkl turned the stride (1,) of a 5-element
    tensor into (0,); the record still parsed, its storage bytes' CRC still
    matched, and the load gave [0, 0, 0, 0, 0] (so does torch's). Every
    entry but the storage bytes is now checked against its CRC-32."""
    rec = RECORDS["tensor_f32_dense.rec"]
    info = _zipfmt.parse_record(rec)
    pk = next(e for e in info.entries if e.name == "data.pkl")
    pkl = rec[pk.data_offset : pk.data_offset + pk.size]
    at = pk.data_offset + pkl.index(b"K\x04K\x01\x86")  # the stride (4, 1)
    for bad in (rec[: at + 1] + b"\x00" + rec[at + 2 :], rec[: at + 3] + b"\x00" + rec[at + 4 :]):
        with pytest.raises(RecordFormatError, match="CRC-32"):
            _zipfmt.parse_record(bad)
        with pytest.raises(StorageFormatError, match="CRC-32"):
            _RECOGNISERS["tensor_f32_dense.rec"][0].parse_buffer(
                bytearray(bad), _RECOGNISERS["tensor_f32_dense.rec"][1])
    with pytest.raises(RecordFormatError, match="CRC-32"):
        _zipfmt.parse_record(KEPT["py_parse_record-datapkl-stride-0"])
    # torch.save(..., with set_crc32_options(False)) writes every CRC as 0: still read
    import io

    was = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        buf = io.BytesIO()
        torch.save(torch.arange(5), buf)
    finally:
        torch.serialization.set_crc32_options(was)
    info = _zipfmt.parse_record(buf.getvalue())
    assert info.shape == (5,) and {e.crc32 for e in info.entries} == {0}


def test_metadata_chunks_outside_their_tensor_are_refused() -> None:
    """Found by mutating a checkpoint's .metadata and loading it: a chunk's
    offset moved past its tensor made the load succeed with that tensor
    left untouched (the read plan found nothing to read for it). Such a
    chunk is refused when .metadata is read; an empty chunk may sit at the
    end (torch puts some there)."""
    def md(offsets: tuple, sizes: tuple, size: tuple = (4, 6)) -> bytes:
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        t = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), [chunk])
        return pickle.dumps(Metadata({"s": t}))

    for offsets, sizes in (((213, 0), (4, 6)), ((0, 1), (4, 6)), ((0, 0), (5, 6)),
                           ((0,), (4,)), ((0, 0, 0), (4, 6, 1))):
        with pytest.raises(PickleFormatError, match="outside"):
            loads_metadata(md(offsets, sizes))
    for offsets, sizes in (((0, 0), (4, 6)), ((2, 3), (2, 3)), ((4, 0), (0, 6))):
        assert loads_metadata(md(offsets, sizes)).state_dict_metadata["s"].chunks[0].offsets == \
            torch.Size(offsets)
    assert loads_metadata(md((), (), ())).state_dict_metadata["s"].size == torch.Size([])


def test_zip_bombs_stay_small() -> None:
    """Records whose directory declares sizes far past the data: refused
    without allocating what they declare."""
    rec = next(iter(BYTES_ITEMS.values()))
    for sig, field in ((b"PK\x01\x02", 20), (b"PK\x01\x02", 24), (b"PK\x03\x04", 18)):
        for v in (0xFFFFFFFE, 0x7FFFFFFF):
            bad = bytearray(rec)
            for m in re.finditer(re.escape(sig), rec):
                bad[m.start() + field : m.start() + field + 4] = struct.pack("<I", v)
            bad = bytes(bad)
            peak = _peak(lambda b=bad: (check_bytes_item(b), check_parse_record(b)))
            assert peak < 64 * _MB, (sig, field, v, peak)


def test_crc_field_edits_are_checksum_errors() -> None:
    """A bytes item whose CRC-32 fields are edited consistently (so the zip
    is well formed) but do not match the data: ChecksumError, not a load."""
    rec = bytearray(next(iter(BYTES_ITEMS.values())))
    info = _zipfmt._parse_zip(memoryview(bytes(rec)))[1]
    pk = next(e for e in info if e.name == "data.pkl")
    bad_crc = struct.pack("<I", zlib.crc32(b"other") & 0xFFFFFFFF)
    for m in re.finditer(re.escape(b"PK\x01\x02"), bytes(rec)):
        off = struct.unpack_from("<I", rec, m.start() + 42)[0]
        if off == pk.header_offset:
            rec[m.start() + 16 : m.start() + 20] = bad_crc
    desc = pk.data_offset + pk.size
    rec[desc + 4 : desc + 8] = bad_crc
    with pytest.raises(ChecksumError):
        _check_bytes_record(bytes(rec), "item")
