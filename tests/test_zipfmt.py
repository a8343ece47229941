"""checkpoint._zipfmt against the records torch 2.13 writes inside DCP files.

The writer must reproduce torch.save's bytes exactly; the parser must read
torch's records and reject anything else with RecordFormatError, never
running code.
"""

from __future__ import annotations

import io
import mmap
import pickle
import struct
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardstate.checkpoint import _zipfmt as z
from shardstate.checkpoint._zipfmt import RecordFormatError
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

DATA = Path(__file__).parent / "data"
DTYPES = sorted(z.DTYPES)
SHAPES = [(), (0,), (2, 0, 3), (7,), (2, 3, 4)]


def make_tensor(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    td = getattr(torch, dtype)
    if td == torch.float4_e2m1fn_x2:  # no conversions into it: random bit patterns
        n = 1
        for s in shape:
            n *= s
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(td).reshape(shape)
    if td.is_complex or td.is_floating_point:
        base = torch.randn(shape, generator=g, dtype=torch.float64) * 3
        if td.is_complex:
            return torch.complex(base, -base).to(td)
        return base.to(td)
    if td == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 100, shape, generator=g).to(td)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (torch.equal has no kernel for some dtypes)."""
    return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def storage_bytes(t: torch.Tensor) -> bytes:
    """The bytes of t's whole storage (what torch.save puts in data/0)."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(s).numpy().tobytes()


def torch_save(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def our_record(t: torch.Tensor) -> bytes:
    data = storage_bytes(t)
    header, ofs, trailer = z.tensor_record(data, str(t.dtype), t.shape, t.stride())
    assert ofs == len(header)
    return header + data + trailer


def key(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype}/{'x'.join(map(str, shape)) or 'scalar'}"


def dcp_save(path: Path, sd: dict) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single")
        dcp.save(sd, storage_writer=FileSystemWriter(path, thread_count=2))


def dcp_items(path: Path) -> dict[str, tuple[bytes, int]]:
    """fqn -> (the item's record bytes, its offset in its .distcp file)."""
    md = FileSystemReader(path).read_metadata()
    out = {}
    for idx, info in md.storage_data.items():
        raw = (path / info.relative_path).read_bytes()
        out[idx.fqn] = (raw[info.offset : info.offset + info.length], info.offset)
    return out


@pytest.fixture(scope="module")
def dcp_ckpt(tmp_path_factory):
    """A real DCP checkpoint of every dtype and shape, plus views."""
    path = tmp_path_factory.mktemp("dcp")
    sd = {key(d, s): make_tensor(d, s) for d in DTYPES for s in SHAPES}
    big = torch.arange(100, dtype=torch.float32)
    sd["view"] = big[10:13]  # DCP clones a view into a bigger storage
    sd["transposed"] = make_tensor("float32", (4, 5)).t()  # dense, kept as is
    sd["step"] = 3  # a BYTE_IO item
    dcp_save(path, sd)
    return sd, dcp_items(path)


# ---- the writer --------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_record_is_byte_identical_to_torch(dtype, shape, dcp_ckpt):
    sd, items = dcp_ckpt
    t = make_tensor(dtype, shape)
    ours = our_record(t)
    assert ours == torch_save(t)
    assert same_bits(sd[key(dtype, shape)], t)
    assert ours == items[key(dtype, shape)][0]  # ... and to the item inside the .distcp
    back = torch.load(io.BytesIO(ours), weights_only=True)
    assert same_bits(back, t)


def test_dense_non_contiguous_strides(dcp_ckpt):
    sd, items = dcp_ckpt
    t = sd["transposed"]
    assert t.stride() == (1, 5)
    ours = our_record(t)
    assert ours == items["transposed"][0] == torch_save(t)
    assert torch.equal(torch.load(io.BytesIO(ours), weights_only=True), t)


def test_view_is_cloned_by_dcp(dcp_ckpt):
    sd, items = dcp_ckpt
    info = z.parse_record(items["view"][0])
    assert (info.storage_offset, info.storage_numel, info.shape) == (0, 3, (3,))
    assert items["view"][0] == our_record(sd["view"].clone())


def test_plain_torch_save_of_view_keeps_whole_storage():
    base = torch.arange(50, dtype=torch.int32)
    t = base[5:8]
    info = z.parse_record(torch_save(t))
    assert (info.storage_offset, info.storage_numel, info.data_length) == (5, 50, 200)
    # Our writer always writes storage offset 0, but the storage may be
    # larger than the tensor needs.
    data = storage_bytes(base)
    assert len(data) == 200
    h, _, tr = z.tensor_record(data, "int32", (3,), storage_numel=50)
    assert h + data + tr == torch_save(base.as_strided((3,), (1,), 0))


def test_bytes_record_matches_torch_and_dcp(dcp_ckpt):
    _, items = dcp_ckpt
    ours = z.bytes_record(pickle.dumps(3, protocol=2))
    assert ours == torch_save(3) == items["step"][0]
    assert z.bytes_record(pickle.dumps({"lr": 0.1}, protocol=2)) == torch_save({"lr": 0.1})


def test_plan_trailer_depends_only_on_crc():
    plan = z.plan_tensor_record("float32", (3, 4))
    assert plan.data_offset == len(plan.header) and plan.data_offset % 64 == 0
    assert plan.data_length == 48
    data = storage_bytes(make_tensor("float32", (3, 4)))
    rec = plan.header + data + plan.trailer(zlib.crc32(data))
    assert len(rec) == plan.total_length
    assert rec == torch_save(make_tensor("float32", (3, 4)))
    with pytest.raises(ValueError):
        plan.trailer(1 << 32)


def test_writer_validates_arguments():
    with pytest.raises(RecordFormatError, match="unsupported dtype"):
        z.plan_tensor_record("float128", (2,))
    with pytest.raises(ValueError, match="stride"):
        z.plan_tensor_record("float32", (2, 3), (1,))
    with pytest.raises(ValueError, match="too small"):
        z.plan_tensor_record("float32", (2, 3), storage_numel=5)
    with pytest.raises(ValueError, match="needs 24"):
        z.tensor_record(bytes(20), "float32", (2, 3), storage_numel=6)


def test_large_ints_in_pickle_match_torch():
    # numel > 2**31 needs LONG1 in the pickle; use a zero-size view with a
    # huge stride so nothing big is allocated: shape (2, 0) stride (2**33, 1)
    t = torch.empty(0, dtype=torch.int8).as_strided((2, 0), (2**33, 1))
    # torch.save keeps the (empty) storage; compare the pickles' shape via the parser
    info = z.parse_record(torch_save(t))
    assert info.stride == (2**33, 1)
    plan = z.plan_tensor_record("int8", (2, 0), (2**33, 1), storage_numel=0)
    assert plan.header + plan.trailer(0) == torch_save(t)
    for n in (255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**40):
        t = torch.empty(0, dtype=torch.int8).as_strided((n, 0), (1, 1))
        plan = z.plan_tensor_record("int8", (n, 0), (1, 1), storage_numel=0)
        assert plan.header + plan.trailer(0) == torch_save(t)


def test_empty_view_offset_past_its_storage_parses_as_torch_loads_it():
    # torch.save keeps the view's storage offset (1) past an empty storage
    t = torch.zeros(3, 0)[1:]
    rec = torch_save(t)
    info = z.parse_record(rec)
    back = torch.load(io.BytesIO(rec))
    assert (info.shape, info.stride, info.storage_offset) == (tuple(back.shape), back.stride(), 1)
    assert back.storage_offset() == 1


def test_zip64_layout_matches_torch(tmp_path):
    """Fixtures: head and trailer of torch.save(torch.zeros(2**32 + 100,
    dtype=torch.uint8)) written to a file object (CRC of the data a92a4ce5)."""
    n = 2**32 + 100
    plan = z.plan_tensor_record("uint8", (n,))
    head = (DATA / "zip64_u8_4GiB_head.bin").read_bytes()
    tail = (DATA / "zip64_u8_4GiB_trailer.bin").read_bytes()
    assert plan.header == head
    assert plan.trailer(0xA92A4CE5) == tail
    # The parser follows the zip64 fields; a sparse file keeps this cheap.
    f = tmp_path / "big.rec"
    with open(f, "wb") as fh:
        fh.write(head)
        fh.truncate(len(head) + n)
        fh.seek(len(head) + n)
        fh.write(tail)
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        info = z.parse_record(mm, base_offset=1000)
        assert (info.dtype, info.shape, info.data_length) == ("uint8", (n,), n)
        assert info.data_offset == 1000 + 704 and info.data_crc32 == 0xA92A4CE5
        assert info.entries[-1].header_offset - 1000 > 2**32
        del info


# ---- the parser on torch's records -------------------------------------


def test_parser_reads_every_dcp_item(dcp_ckpt):
    sd, items = dcp_ckpt
    for fqn, (rec, file_ofs) in items.items():
        if fqn == "step":
            with pytest.raises(RecordFormatError, match="data.pkl"):
                z.parse_record(rec)
            continue
        t = sd[fqn]
        info = z.parse_record(rec, base_offset=file_ofs)
        assert info.dtype == str(t.dtype).removeprefix("torch.")
        assert info.shape == tuple(t.shape) and info.stride == t.stride()
        assert info.storage_offset == 0 and info.requires_grad is False
        data = rec[info.data_offset - file_ofs : info.data_offset - file_ofs + info.data_length]
        assert data == storage_bytes(t if t.untyped_storage().nbytes() == t.nbytes else t.clone())
        assert zlib.crc32(data) == info.data_crc32
        assert info.data_offset - file_ofs == 64 * ((info.data_offset - file_ofs) // 64)
        assert [e.name for e in info.entries] == [
            "data.pkl", ".format_version", ".storage_alignment", "byteorder", "data/0",
            "version", ".data/serialization_id",
        ]


def test_parser_reads_requires_grad():
    info = z.parse_record(torch_save(torch.ones(2, requires_grad=True)))
    assert info.requires_grad is True


def test_parser_reads_conj_and_neg_bits():
    import zipfile

    c = torch.ones(2, dtype=torch.complex64)
    for t, bits in ((c.conj(), (True, False)), (torch._neg_view(torch.ones(2)), (False, True)),
                    (torch._neg_view(c.conj()), (True, True)), (c, (False, False))):
        info = z.parse_record(torch_save(t))
        assert (info.conj, info.neg) == bits
    # anything else in the metadata dict, or a conjugate real tensor, is refused
    raw = torch_save(c.conj())
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    with pytest.raises(RecordFormatError, match="metadata"):
        z.parse_record(record_with(pkl.replace(b"conj", b"cxnj"), bytes(16)))
    real = pkl.replace(b"ComplexFloatStorage", b"DoubleStorage")  # GLOBAL is line-based
    with pytest.raises(RecordFormatError, match="conjugate view of a float64"):
        z.parse_record(record_with(real, bytes(16)))


# ---- malformed and malicious records -----------------------------------

GOOD = our_record(make_tensor("float32", (3, 4)))


def record_with(pkl: bytes, data: bytes = bytes(48)) -> bytes:
    """A well-formed zip whose data.pkl is ``pkl``."""
    records = z._prefix_records(pkl) + [("data/0", data), ("version", b"3\n")]
    chunks, _ = z._assemble(records, 0)
    return b"".join(c for c in chunks if c is not None)


def good_pickle() -> bytes:
    return z._tensor_pickle(z.DTYPES["float32"], 12, (3, 4), (4, 1))


def test_record_with_helper_is_valid():
    assert z.parse_record(record_with(good_pickle())).shape == (3, 4)


@pytest.mark.parametrize("cut", [0, 1, 21, 22, 100, len(GOOD) // 2, len(GOOD) - 23, len(GOOD) - 1])
def test_truncated(cut):
    with pytest.raises(RecordFormatError):
        z.parse_record(GOOD[:cut])
    with pytest.raises(RecordFormatError):
        z.parse_record(GOOD[len(GOOD) - cut :] if cut else b"")


def patched(buf: bytes, ofs: int, fmt: str, value: int) -> bytes:
    b = bytearray(buf)
    struct.pack_into(fmt, b, ofs, value)
    return bytes(b)


def cd_offset(buf: bytes) -> int:
    return struct.unpack_from("<Q", buf, len(buf) - 22 - 20 - 56 + 48)[0]


@pytest.mark.parametrize(
    "what, mutate",
    [
        ("eocd sig", lambda b: patched(b, len(b) - 22, "<I", 0)),
        ("locator sig", lambda b: patched(b, len(b) - 42, "<I", 0)),
        ("zip64 eocd sig", lambda b: patched(b, len(b) - 98, "<I", 0)),
        ("entry count huge", lambda b: patched(b, len(b) - 98 + 24, "<Q", 1 << 60)),
        ("both counts huge", lambda b: patched(
            patched(b, len(b) - 98 + 24, "<Q", 1 << 60), len(b) - 98 + 32, "<Q", 1 << 60)),
        ("cd offset past end", lambda b: patched(b, len(b) - 98 + 48, "<Q", 1 << 40)),
        ("cd size past end", lambda b: patched(b, len(b) - 98 + 40, "<Q", 1 << 40)),
        ("locator offset", lambda b: patched(b, len(b) - 42 + 8, "<Q", 7)),
        ("lfh sig", lambda b: patched(b, 0, "<I", 0x04034B51)),
        ("cd sig", lambda b: patched(b, cd_offset(b), "<I", 0)),
        ("cd size of data.pkl huge", lambda b: patched(b, cd_offset(b) + 20, "<I", 0x7FFFFFFF)),
        ("cd size saturated without zip64", lambda b: patched(
            patched(b, cd_offset(b) + 20, "<I", 0xFFFFFFFF), cd_offset(b) + 24, "<I", 0xFFFFFFFF)),
        ("cd header offset", lambda b: patched(b, cd_offset(b) + 42, "<I", 64)),
        ("cd name length", lambda b: patched(b, cd_offset(b) + 28, "<H", 0xFFFF)),
        ("compressed", lambda b: patched(b, cd_offset(b) + 10, "<H", 8)),
        ("descriptor crc", lambda b: patched(b, GOOD.index(b"PK\x07\x08") + 4, "<I", 1)),
        ("data crc in cd", lambda b: patched(b, cd_offset(b) + 16, "<I", 1)),
        ("trailing garbage", lambda b: b + b"\0"),
        ("leading garbage", lambda b: b"\0" + b),
    ],
)
def test_structural_corruption(what, mutate):
    with pytest.raises(RecordFormatError):
        z.parse_record(mutate(GOOD))


@pytest.mark.parametrize(
    "pkl, match",
    [
        (b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.", "os.system"),
        (b"\x80\x02cbuiltins\neval\nq\x00.", "builtins.eval"),
        (b"\x80\x02c__builtin__\nexec\n.", "exec"),
        (b"cos\nsystem\n(S'true'\ntR.", "protocol-2"),
        (b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00.", "protocol-2"),
        (b"\x80\x02].", "opcode"),
        (b"\x80\x02}q\x00b.", "opcode"),
        (b"\x80\x02K\x03.", "one tensor"),
        (b"\x80\x02", "truncated"),
        (b"\x80\x02R.", "empty stack"),
        (b"\x80\x02t.", "MARK"),
        (b"\x80\x02h\x05.", "memo"),
        (b"\x80\x02c" + b"a" * 300, "GLOBAL"),
    ],
)
def test_malicious_pickles_are_rejected_without_running(pkl, match, tmp_path, monkeypatch):
    canary = tmp_path / "ran"
    monkeypatch.setattr("os.system", lambda *a: canary.write_text("ran"))
    with pytest.raises(RecordFormatError, match=match):
        z.parse_record(record_with(pkl))
    assert not canary.exists()


def swap(pkl: bytes, old: bytes, new: bytes) -> bytes:
    assert old in pkl
    return pkl.replace(old, new, 1)


@pytest.mark.parametrize(
    "pkl, match",
    [
        (swap(good_pickle(), b"_rebuild_tensor_v2", b"_rebuild_parameter"), "global"),
        (swap(good_pickle(), b"FloatStorage", b"FloatTensor\0"[:12]), "global"),
        (swap(good_pickle(), b"X\x03\x00\x00\x00cpu", b"X\x03\x00\x00\x00cud"), "location"),
        (swap(good_pickle(), b"X\x01\x00\x00\x000", b"X\x01\x00\x00\x001"), "data/1"),
        (swap(good_pickle(), b"K\x0ctq", b"K\x0btq"), "bytes"),  # storage numel 11
        (swap(good_pickle(), b"K\x04K\x01\x86", b"K\x05K\x01\x86"), "overrun"),  # stride 5
        (swap(good_pickle(), b"Q", b"\x88"), "REDUCE|arguments|malformed"),
        (swap(good_pickle(), b"collections\nOrderedDict", b"torch\nLongStorage\nq\x00)Rq"),
         "REDUCE|hooks"),
    ],
)
def test_inconsistent_tensor_pickles(pkl, match):
    with pytest.raises(RecordFormatError, match=match):
        z.parse_record(record_with(pkl))


def test_big_endian_record_rejected():
    records = [
        ("data.pkl", good_pickle()), (".format_version", b"1"), (".storage_alignment", b"64"),
        ("byteorder", b"big"), ("data/0", bytes(48)), ("version", b"3\n"),
    ]
    with pytest.raises(RecordFormatError, match="byteorder"):
        z.parse_record(b"".join(c for c in z._assemble(records, 0)[0] if c is not None))


def test_non_buffer_input():
    with pytest.raises(RecordFormatError):
        z.parse_record(memoryview(bytes(100)).cast("B", (10, 10))[::2])  # type: ignore[arg-type]


# ---- fuzz ----------------------------------------------------------------

_FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _mutate(base: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    b = bytearray(base)
    for kind, pos, data in edits:
        pos %= max(len(b), 1)
        if kind == 0:
            b[pos : pos + len(data)] = data  # overwrite
        elif kind == 1:
            b[pos:pos] = data  # insert
        else:
            del b[pos : pos + len(data) + 1]  # delete
    return bytes(b)


_edits = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=8)),
    min_size=1,
    max_size=4,
)


@_FUZZ
@given(_edits)
def test_fuzz_record_bytes(edits):
    try:
        z.parse_record(_mutate(GOOD, edits))
    except RecordFormatError:
        pass


@_FUZZ
@given(_edits)
def test_fuzz_pickle_inside_valid_zip(edits):
    try:
        z.parse_record(record_with(_mutate(good_pickle(), edits)))
    except RecordFormatError:
        pass


def test_module_works_without_torch():
    # With torch installed, shardstate.checkpoint uses torch's DCP classes
    # (and so imports torch); without it, the record format still works.
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import shardstate.checkpoint._zipfmt as z\n"
            "p = z.plan_tensor_record('float32', (2, 3))\n"
            "sys.exit(0 if p.data_length == 24 else 1)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
