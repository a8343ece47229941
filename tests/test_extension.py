"""Stream transforms (``_extension``): ``FileSystemWriter(_extensions=...)`` and
``FileSystemReader(_extension_registry=...)`` against torch 2.13's own.

ZStandard and custom transforms (a user's subclass of torch's
StreamTransformExtension, registered in torch's ExtensionRegistry) written by
shardstate and by torch: the same files byte for byte and the same storage
data, each read by the other; over gloo at world size 2; without zstandard
and without torch. And the refusals: an unknown descriptor, a zstd bomb, a
corrupted stored byte.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import shardstate.checkpoint as ssdcp
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint._extension as torch_ext
import zstandard  # a test dependency (pyproject's test extra, the Makefile's venv)
from _child_env import package_env
from _dtypes import DTYPES, seeded
from shardstate import ChecksumError
from shardstate.checkpoint import _extension, _fs_transform
from shardstate.checkpoint._extension import ExtensionRegistry, StreamTransformExtension, ZStandard
from shardstate.checkpoint.filesystem import FileSystemReader, FileSystemWriter, StorageFormatError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ---------------------------------------------------------------------------
# Two custom transforms, as a user would write them for torch
# ---------------------------------------------------------------------------


class _XorWriter(io.RawIOBase):
    def __init__(self, out: io.IOBase) -> None:
        super().__init__()
        self.out = out

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        data = np.frombuffer(memoryview(b), np.uint8) ^ np.uint8(0x5A)
        self.out.write(data.tobytes())
        return data.nbytes

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        if not self.closed:
            self.out.close()
        super().close()


class _XorReader(io.RawIOBase):
    """Has readinto (the reader reads into its buffer)."""

    def __init__(self, inp: io.IOBase) -> None:
        super().__init__()
        self.inp = inp

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.inp.read(len(b))
        n = len(data)
        b[:n] = (np.frombuffer(data, np.uint8) ^ np.uint8(0x5A)).tobytes()
        return n


class Xor(StreamTransformExtension):
    """XOR with a constant: the same output however its input is split."""

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> Xor:
        assert version == "1"
        return Xor()

    def get_descriptor(self) -> str:
        return "test.xor/1"

    def transform_to(self, output):
        return _XorWriter(output)

    def transform_from(self, input):  # noqa: A002 - torch's name
        return _XorReader(input)


class _HexWriter(io.RawIOBase):
    """Each write becomes one line of hex: the output shows how the input
    was split into writes."""

    def __init__(self, out: io.IOBase) -> None:
        super().__init__()
        self.out = out

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        data = bytes(b)
        self.out.write(data.hex().encode() + b"\n")
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.out.close()
        super().close()


class _HexReader:
    """Has only read() (no readinto)."""

    def __init__(self, inp: io.IOBase) -> None:
        self.inp = inp
        self.buf: bytes | None = None
        self.pos = 0

    def read(self, n: int = -1) -> bytes:
        if self.buf is None:
            self.buf = b"".join(bytes.fromhex(line.decode())
                                for line in self.inp.read().splitlines())
        end = len(self.buf) if n is None or n < 0 else self.pos + n
        out = self.buf[self.pos : end]
        self.pos += len(out)
        return out

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        pass


class Hex(StreamTransformExtension):
    @staticmethod
    def registry_name() -> str:
        return "test.hex"

    @staticmethod
    def from_descriptor(version: str) -> Hex:
        return Hex()

    def get_descriptor(self) -> str:
        return "test.hex/1"

    def transform_to(self, output):
        return _HexWriter(output)

    def transform_from(self, input):  # noqa: A002 - torch's name
        return _HexReader(input)


def _registry() -> ExtensionRegistry:
    reg = ExtensionRegistry()
    reg.register(Xor)
    reg.register(Hex)
    return reg


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _raised(exc_type: type[BaseException], match: str, fn, *args, **kwargs) -> BaseException:
    """Runs fn; returns the exception it raised, unwrapped from a
    CheckpointException, after checking its type and message."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn(*args, **kwargs)
    except (CheckpointException, ssdcp.CheckpointException) as e:
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
        "zeros": torch.zeros(256, 64),  # compresses well
        "large": torch.randn(300, 200),  # does not
        "step": 7,
        "cfg": {"lr": 0.1, "name": "adam", "betas": [0.9, 0.99]},
    })
    return sd


def _empty_like(sd: dict) -> dict:
    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        elif isinstance(v, dict):
            out[k] = _empty_like(v)
        else:
            out[k] = None
    return out


def _assert_equal(a: object, b: object, key: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), key
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), key
        for k in a:
            _assert_equal(a[k], b[k], f"{key}.{k}")
    else:
        assert a == b, key


def _load_md(path: Path) -> object:
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # trusted: written by this test


def _compare_dirs(a: Path, b: Path, descriptors: list[str]) -> None:
    """The same data files byte for byte, and the same storage data (each
    item's transform_descriptors ``descriptors``)."""
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for n in names:
        if n.endswith(".distcp"):
            assert (a / n).read_bytes() == (b / n).read_bytes(), n
    ma, mb = _load_md(a), _load_md(b)
    assert ma.state_dict_metadata == mb.state_dict_metadata
    assert ma.storage_data == mb.storage_data
    assert {tuple(v.transform_descriptors) for v in ma.storage_data.values()} == {
        tuple(descriptors)}


def _record(path: Path, key: str) -> tuple[Path, int, int]:
    for idx, info in _load_md(path).storage_data.items():
        if idx.fqn == key:
            return path / info.relative_path, info.offset, info.length
    raise KeyError(key)


def _rewrite_storage(path: Path, key: str, **changes: object) -> None:
    md = _load_md(path)
    for idx, info in md.storage_data.items():
        if idx.fqn == key:
            for k, v in changes.items():
                setattr(info, k, v)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _flip(file: Path, at: int) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


# ---------------------------------------------------------------------------
# The classes are torch's
# ---------------------------------------------------------------------------


def test_classes_are_torchs():
    assert _extension.StreamTransformExtension is torch_ext.StreamTransformExtension
    assert _extension.ZStandard is torch_ext.ZStandard
    assert _extension.ExtensionRegistry is torch_ext.ExtensionRegistry
    assert _extension.Extension is torch_ext.Extension
    assert ZStandard().get_descriptor() == "stream.zstd/1"


# ---------------------------------------------------------------------------
# ZStandard, both ways
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("thread_count", [1, 2])
def test_zstd_file_written_in_several_batches(tmp_path, monkeypatch, thread_count):
    # A file whose transformed items span several engine batches keeps what
    # every batch wrote (each batch used to create the file anew, so a file
    # over _TRANSFORM_BATCH bytes kept only its last batch), byte for byte
    # torch's.
    from shardstate.checkpoint import _fs_write

    monkeypatch.setattr(_fs_write, "_TRANSFORM_BATCH", 1000)
    sd = _state_dict()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    opts = {"thread_count": thread_count, "single_file_per_rank": True}
    dcp.save(sd, storage_writer=FileSystemWriter(ours, _extensions=[ZStandard()], **opts))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(theirs, _extensions=[ZStandard()], **opts))
    _compare_dirs(ours, theirs, ["stream.zstd/1"])
    out = _empty_like(sd)
    dcp.load(out, storage_reader=dcp.FileSystemReader(ours))
    _assert_equal(sd, out)


@pytest.mark.parametrize(("thread_count", "single_file"), [(1, True), (3, True), (1, False)])
def test_zstd_byte_identical_and_cross_load(tmp_path, thread_count, single_file):
    sd = _state_dict()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    opts = {"thread_count": thread_count, "single_file_per_rank": single_file}
    dcp.save(sd, storage_writer=FileSystemWriter(ours, _extensions=[ZStandard()], **opts))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(theirs, _extensions=[ZStandard()], **opts))
    _compare_dirs(ours, theirs, ["stream.zstd/1"])
    # What is stored is a zstd frame per item.
    file, off, length = _record(ours, "zeros")
    stored = file.read_bytes()[off : off + length]
    assert stored[:4] == b"\x28\xb5\x2f\xfd" and length < 256 * 64 * 4 // 10
    for src in (ours, theirs):
        for reader in (FileSystemReader, dcp.FileSystemReader):
            out = _empty_like(sd)
            dcp.load(out, storage_reader=reader(src))
            _assert_equal(sd, out)
    # shardstate's own save and load, and a load into other dtypes and a
    # strided destination (through the copy path).
    ssdcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "ss", _extensions=[ZStandard()]))
    out = _empty_like(sd)
    ssdcp.load(out, checkpoint_id=tmp_path / "ss")
    _assert_equal(sd, out)
    out = {"large": torch.zeros(200, 300).t(), "t_float32": torch.zeros(3, 5, dtype=torch.float64)}
    ssdcp.load(out, checkpoint_id=ours)
    assert torch.equal(out["large"], sd["large"])
    assert torch.equal(out["t_float32"], sd["t_float32"].double())


def test_no_extensions_means_none(tmp_path):
    # An empty list writes what no extensions write: no descriptors at all.
    sd = {"a": torch.arange(6.0), "n": 3}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "ours", _extensions=[]))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "theirs"))
    for n in ("__0_0.distcp",):
        assert (tmp_path / "ours" / n).read_bytes() == (tmp_path / "theirs" / n).read_bytes()
    md = _load_md(tmp_path / "ours")
    assert all(v.transform_descriptors is None for v in md.storage_data.values())
    assert b"transform_descriptors" not in (tmp_path / "ours" / ".metadata").read_bytes()


# ---------------------------------------------------------------------------
# Custom transforms, both ways
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: [Xor()],
    lambda: [Hex()],  # its bytes show every write call: torch.save's are made
    lambda: [Xor(), ZStandard()],
    lambda: [ZStandard(), Hex()],
], ids=["xor", "hex", "xor+zstd", "zstd+hex"])
def test_custom_transforms_both_ways(tmp_path, make):
    sd = _state_dict()
    exts = make()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    dcp.save(sd, storage_writer=FileSystemWriter(ours, _extensions=exts))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(theirs, _extensions=exts))
    _compare_dirs(ours, theirs, [e.get_descriptor() for e in reversed(exts)])
    readers = [lambda p: FileSystemReader(p, _extension_registry=_registry())]
    if len(exts) == 1:
        # torch 2.13's reader undoes several transforms in the stored order,
        # innermost first, so it cannot read these back (not even its own);
        # ours undoes the outermost first.
        readers.append(lambda p: dcp.FileSystemReader(p, _extension_registry=_registry()))
    for src in (ours, theirs):
        for reader in readers:
            out = _empty_like(sd)
            dcp.load(out, storage_reader=reader(src))
            _assert_equal(sd, out)


def test_descriptor_order_is_application_order(tmp_path):
    # [Xor, ZStandard]: the record goes through ZStandard first, then Xor,
    # and the descriptors say so: ["stream.zstd/1", "test.xor/1"].
    sd = {"a": torch.zeros(1000)}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path, _extensions=[Xor(), ZStandard()]))
    file, off, length = _record(tmp_path, "a")
    stored = np.frombuffer(file.read_bytes()[off : off + length], np.uint8) ^ np.uint8(0x5A)
    record = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stored.tobytes())).read()
    buf = io.BytesIO()
    torch.save(sd["a"], buf)
    assert record == buf.getvalue()
    info = next(iter(_load_md(tmp_path).storage_data.values()))
    assert info.transform_descriptors == ["stream.zstd/1", "test.xor/1"]


# ---------------------------------------------------------------------------
# World size 2 over gloo
# ---------------------------------------------------------------------------

_GLOBAL = (11, 6)


def _dist_sd(world_size: int, placement: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    w = torch.arange(66, dtype=torch.float32).reshape(_GLOBAL) * 0.5 + 1
    pl = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}[placement]
    return {"w": distribute_tensor(w, mesh, [pl]),
            "v": distribute_tensor(torch.arange(7.0), mesh, [Replicate()]),
            "step": 5}


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


def _check(sd: dict, world_size: int) -> None:
    ref = _dist_sd(world_size, "R")
    assert sd["step"] == 5
    for k in ("w", "v"):
        assert torch.equal(sd[k].full_tensor(), ref[k].full_tensor()), k


def _dist_body(rank: int, world_size: int, root: str) -> None:
    import torch.distributed as dist

    sd = _dist_sd(world_size, "S0")
    exts = [ZStandard()]
    dcp.save(sd, storage_writer=FileSystemWriter(f"{root}/ours", _extensions=exts))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{root}/theirs", _extensions=exts))
    ssdcp.save(sd, storage_writer=FileSystemWriter(f"{root}/ss", _extensions=[Xor()]))
    dist.barrier()
    if rank == 0:
        _compare_dirs(Path(root, "ours"), Path(root, "theirs"), ["stream.zstd/1"])
    for src in ("ours", "theirs"):
        for placement in ("S1", "R"):
            for reader in (FileSystemReader, dcp.FileSystemReader):
                out = _zeroed(_dist_sd(world_size, placement))
                dcp.load(out, storage_reader=reader(f"{root}/{src}"))
                _check(out, world_size)
            # shardstate's load (shared verification, and broadcast of
            # shared reads asked for: transformed items are read by each rank)
            out = _zeroed(_dist_sd(world_size, placement))
            ssdcp.load(out, storage_reader=FileSystemReader(f"{root}/{src}",
                                                            broadcast_shared_reads=True))
            _check(out, world_size)
    out = _zeroed(_dist_sd(world_size, "S1"))
    ssdcp.load(out, storage_reader=FileSystemReader(f"{root}/ss", _extension_registry=_registry()))
    _check(out, world_size)


def test_world_size_2(tmp_path, run_distributed):
    run_distributed(_dist_body, 2, str(tmp_path))
    files = sorted(n for n in os.listdir(tmp_path / "ours") if n.endswith(".distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]


# ---------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------


def test_unknown_descriptor_is_refused(tmp_path):
    dcp.save({"a": torch.ones(3), "n": {"x": 1}},
             storage_writer=FileSystemWriter(tmp_path, _extensions=[Xor()]))
    for key, dest in (("a", {"a": torch.zeros(3)}), ("n.x", {"n": {"x": 0}})):
        msg = str(_raised(StorageFormatError, "test.xor/1", dcp.load, dest,
                          storage_reader=FileSystemReader(tmp_path)))
        assert repr(key) in msg and "_extension_registry" in msg
    # A version its class refuses is named the same way.
    _rewrite_storage(tmp_path, "a", transform_descriptors=["stream.zstd/9"])
    _raised(StorageFormatError, r"'a'.*stream\.zstd/9", dcp.load, {"a": torch.zeros(3)},
            storage_reader=FileSystemReader(tmp_path))
    # Descriptors that are not a list of str are a format error.
    _rewrite_storage(tmp_path, "a", transform_descriptors=[3])
    _raised(StorageFormatError, "list of str", dcp.load, {"a": torch.zeros(3)},
            storage_reader=FileSystemReader(tmp_path, unsafe_unpickle=True))


def _bomb(prefix: bytes, zeros: int) -> bytes:
    """A zstd frame of ``prefix`` and then ``zeros`` zero bytes, made
    without holding them."""
    out = io.BytesIO()
    w = zstandard.ZstdCompressor().stream_writer(out, closefd=False)
    w.write(prefix)
    chunk = bytes(1 << 20)
    for _ in range(zeros >> 20):
        w.write(chunk)
    w.close()
    return out.getvalue()


def test_zstd_bomb_is_refused_before_inflating(tmp_path, monkeypatch):
    dcp.save({"w": torch.ones(1000), "cfg": {"s": "x"}},
             storage_writer=FileSystemWriter(tmp_path, _extensions=[ZStandard()]))
    buf = io.BytesIO()
    torch.save(torch.ones(1000), buf)
    bomb = _bomb(buf.getvalue(), 512 << 20)  # 512 MiB more than the record
    assert len(bomb) < 1 << 20
    file = tmp_path / "__0_0.distcp"
    end = file.stat().st_size
    with open(file, "ab") as f:
        f.write(bomb)
    _rewrite_storage(tmp_path, "w", offset=end, length=len(bomb))
    tracemalloc.start()
    try:
        _raised(StorageFormatError, r"'w'.*produce more than \d+ bytes", ssdcp.load,
                {"w": torch.zeros(1000)}, storage_reader=FileSystemReader(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    # A bytes item's transforms may produce at most MAX_BYTES_ITEM bytes.
    monkeypatch.setattr(_fs_transform, "MAX_BYTES_ITEM", 1 << 20)
    bomb = _bomb(b"", 8 << 20)
    end = file.stat().st_size
    with open(file, "ab") as f:
        f.write(bomb)
    _rewrite_storage(tmp_path, "cfg.s", offset=end, length=len(bomb))
    _raised(StorageFormatError, r"'cfg\.s'.*produce more than 1048576 bytes", dcp.load,
            {"cfg": {"s": ""}}, storage_reader=FileSystemReader(tmp_path))


def test_corrupted_stored_byte_is_detected(tmp_path):
    sd = {"r": torch.randn(4096), "z": torch.zeros(4096), "cfg": {"lr": 0.5}}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path, _extensions=[ZStandard()]))
    file, off, length = _record(tmp_path, "r")
    # Random values are stored raw inside the frame: a flipped byte there
    # decompresses to a wrong byte, caught by the record's CRC-32.
    _flip(file, off + length // 2)
    msg = str(_raised(ChecksumError, "CRC-32 mismatch", dcp.load, {"r": torch.zeros(4096)},
                      storage_reader=FileSystemReader(tmp_path)))
    assert "'r'" in msg and "stream.zstd/1" in msg
    out = {"r": torch.zeros(4096)}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path, verify_checksums=False))
    assert not torch.equal(out["r"], sd["r"])
    # A flipped byte in a frame's header: zstd refuses the stream.
    file, off, _ = _record(tmp_path, "z")
    _flip(file, off + 1)
    _raised(StorageFormatError, r"'z'.*undoing its stream transforms", dcp.load,
            {"z": torch.zeros(4096)}, storage_reader=FileSystemReader(tmp_path))
    # A bytes item: its entries' CRC-32s, checked after the transform.
    dest = {"cfg": {"lr": 0.0}}
    dcp.load(dest, storage_reader=FileSystemReader(tmp_path))
    assert dest["cfg"]["lr"] == 0.5
    file, off, length = _record(tmp_path, "cfg.lr")
    raw = zstandard.ZstdDecompressor().stream_reader(
        io.BytesIO(file.read_bytes()[off : off + length])).read()
    bad = bytearray(raw)
    bad[64 + 4] ^= 0x40  # inside data.pkl
    frame = _bomb(bytes(bad), 0)
    end = file.stat().st_size
    with open(file, "ab") as f:
        f.write(frame)
    _rewrite_storage(tmp_path, "cfg.lr", offset=end, length=len(frame))
    _raised(ChecksumError, "cfg.lr", dcp.load, {"cfg": {"lr": 0.0}},
            storage_reader=FileSystemReader(tmp_path))


def test_not_an_extension_is_refused():
    with pytest.raises(TypeError, match="_extensions"):
        FileSystemWriter("x", _extensions=[object()])


# ---------------------------------------------------------------------------
# Without zstandard, and without torch
# ---------------------------------------------------------------------------


def _run(code: str) -> str:
    env = package_env()
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_without_zstandard(tmp_path):
    dcp.save({"a": torch.arange(5.0)},
             storage_writer=FileSystemWriter(tmp_path / "z", _extensions=[ZStandard()]))
    out = _run(f"""
        import sys, warnings
        warnings.simplefilter("ignore")
        sys.modules["zstandard"] = None  # neither compression module imports
        sys.modules["pyzstd"] = None
        import torch
        import shardstate.checkpoint as dcp
        from shardstate.checkpoint import FileSystemReader, FileSystemWriter, StorageFormatError
        from shardstate.checkpoint._extension import ZStandard
        assert not ZStandard.is_available()
        try:
            ZStandard()
        except ValueError as e:
            assert "zstandard" in str(e), e
        else:
            raise AssertionError("ZStandard() without zstandard")
        dcp.save({{"a": torch.ones(2)}}, checkpoint_id={str(tmp_path / "plain")!r})
        out = {{"a": torch.zeros(2)}}
        dcp.load(out, checkpoint_id={str(tmp_path / "plain")!r})
        assert torch.equal(out["a"], torch.ones(2))
        try:
            dcp.load({{"a": torch.zeros(5)}}, checkpoint_id={str(tmp_path / "z")!r})
        except dcp.CheckpointException as e:
            err = next(iter(e.failures.values()))[0]
            assert isinstance(err, StorageFormatError), repr(err)
            assert "'a'" in str(err) and "zstandard" in str(err), err
        else:
            raise AssertionError("read a zstd item without zstandard")
        print("ok")
    """)
    assert out == "ok"


def test_without_torch(tmp_path):
    # NumPy state, torch never imported: shardstate's own classes, the same
    # bytes as torch's writer gives the same values.
    out = _run(f"""
        import sys
        sys.modules["torch"] = None
        import numpy as np
        import shardstate.checkpoint as dcp
        from shardstate.checkpoint import FileSystemReader, FileSystemWriter
        from shardstate.checkpoint._extension import ExtensionRegistry, ZStandard
        assert ZStandard.__module__ == "shardstate.checkpoint._extension"
        assert ZStandard().get_descriptor() == "stream.zstd/1"
        assert list(ExtensionRegistry().extensions) == ["stream.zstd"]
        sd = {{"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": 3}}
        # (no_dist: torch's stand-in None in sys.modules looks like a loaded torch)
        dcp.save(sd, storage_writer=FileSystemWriter({str(tmp_path / "np")!r},
                                                     _extensions=[ZStandard()]), no_dist=True)
        out = {{"w": np.zeros((3, 4), np.float32), "n": 0}}
        dcp.load(out, storage_reader=FileSystemReader({str(tmp_path / "np")!r}), no_dist=True)
        assert (out["w"] == sd["w"]).all() and out["n"] == 3
        assert sys.modules["torch"] is None
        print("ok")
    """)
    assert out == "ok"
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": 3}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "pt", _extensions=[ZStandard()]))
    assert (tmp_path / "np" / "__0_0.distcp").read_bytes() == \
        (tmp_path / "pt" / "__0_0.distcp").read_bytes()
    out = {"w": torch.zeros(3, 4), "n": 0}
    dcp.load(out, storage_reader=dcp.FileSystemReader(tmp_path / "np"))
    assert torch.equal(out["w"], sd["w"]) and out["n"] == 3
