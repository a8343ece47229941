"""The fast .metadata reader (ss_mdread + csrc/py/mdread.c) against the reference.

``_pickle.loads_metadata`` takes the C fast path (``fastread._fast``) first
and the reference (``_pickle._reference``: restricted unpickler + build)
wherever the fast path answers None. The fast path must never answer
differently: on every stream here it either gives None or a Metadata equal
to the reference's, field by field, with the same types (torch.Size, not a
tuple) and the same ``__dict__`` order; where the reference raises, it gives
None. And it must actually serve what torch and shardstate write.
"""

from __future__ import annotations

import copyreg
import pathlib
import pickle
import random
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed._shard.sharded_tensor.metadata as legacy
from _child_env import package_env
from shardstate.checkpoint import _mdlazy, _pickle
from shardstate.checkpoint._pickle import build as B
from shardstate.checkpoint._pickle import fastread
from shardstate.checkpoint._pickle.errors import PickleFormatError, UnsafePickleError
from torch.distributed.checkpoint import metadata as tmd
from torch.distributed.checkpoint.filesystem import _StorageInfo

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
           torch.uint8, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn]
_LAYOUTS = [torch.strided, torch.sparse_coo, torch.sparse_csr]
_MEMFMTS = [torch.contiguous_format, torch.channels_last, torch.preserve_format]


def deep(x: Any) -> Any:
    """A strict view: exact types, every field in __dict__ order."""
    t = type(x)
    if t is np.ndarray:
        return (t, x.dtype.str, x.tolist())
    if isinstance(x, (list, tuple)):
        return (t, [deep(v) for v in x])
    if t is dict:
        return (t, [(deep(k), deep(v)) for k, v in x.items()])
    if hasattr(x, "__dict__") and not isinstance(x, type) and t.__module__.startswith("torch.dist"):
        return (t, [(k, deep(v)) for k, v in vars(x).items()])
    return (t, x)


def reference(data: bytes) -> Any:
    try:
        return ("ok", deep(_pickle._reference(data)))
    except (UnsafePickleError, PickleFormatError) as e:
        return (type(e), str(e))


def sharing(x: Any, seen: dict[int, int] | None = None) -> Any:
    """x's graph with each container, Size, path and metadata object met
    again replaced by the order it was first met in: which are one object."""
    seen = {} if seen is None else seen
    if x is None or isinstance(x, (bool, int, float, str, bytes, torch.dtype, torch.layout,
                                   torch.memory_format)):
        return None
    if id(x) in seen:
        return ("again", seen[id(x)])
    seen[id(x)] = len(seen)
    if isinstance(x, (list, tuple)):
        return [sharing(v, seen) for v in x]
    if isinstance(x, dict):
        return [(sharing(k, seen), sharing(v, seen)) for k, v in x.items()]
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return [sharing(v, seen) for v in vars(x).values()]
    return None


def same_sharing(a: Any, b: Any) -> bool:
    """Whether a and b share objects alike."""
    return sharing(a) == sharing(b)


def check(data: bytes, served: bool | None = None) -> Any:
    """The fast path agrees with the reference on data (and loads_metadata
    with both); served: whether the fast path must take it (True) or must
    leave it (False)."""
    ref = reference(data)
    fast = fastread._fast(data)
    if served is not None:
        assert (fast is not None) == served, (served, ref)
    if fast is not None:
        assert ref == ("ok", deep(fast))
        # and the same objects shared (pickle's memo shows which are one)
        assert same_sharing(fast, _pickle._reference(data))
    try:
        got = ("ok", deep(_pickle.loads_metadata(data)))
    except (UnsafePickleError, PickleFormatError) as e:
        got = (type(e), str(e))
    assert got == ref
    return fast


# --------------------------------------------------------------------------
# Random metadata as torch builds it
# --------------------------------------------------------------------------


def plain(r: random.Random, depth: int = 0) -> Any:
    k = r.randrange(12 if depth < 3 else 7)
    if k == 0:
        return None
    if k == 1:
        return r.choice([True, False])
    if k == 2:
        return r.choice([0, 1, 255, 256, 65535, 65536, -1, -2 ** 31, 2 ** 40, 2 ** 63 - 1,
                         -2 ** 63, 2 ** 64, -2 ** 70])
    if k == 3:
        return r.choice([0.0, -1.5, float("inf"), 1e300])
    if k == 4:
        return r.choice(["", "a", "é中", "x" * 300, "\ud800"])
    if k == 5:
        return r.choice([b"", b"\x00\xff", bytes(300)])
    if k == 6:
        return r.choice(_DTYPES)  # memory formats pickle at protocol 4 only
    if k == 7:
        return tuple(plain(r, depth + 1) for _ in range(r.randrange(4)))
    if k == 8:
        return [plain(r, depth + 1) for _ in range(r.randrange(4))]
    if k == 9:
        keys = ["a", "b", 3, ("t", 1)]
        return {r.choice(keys): plain(r, depth + 1) for _ in range(r.randrange(4))}
    if k == 10:
        return torch.Size([r.randrange(5) for _ in range(r.randrange(3))])
    return r.choice(_LAYOUTS)


def random_metadata(r: random.Random) -> tmd.Metadata:
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for t in range(r.randrange(5)):
        fqn = r.choice(["w", "layers.0.weight", "é", "x" * 70]) + f".{t}"
        if r.random() < 0.25:
            sdm[fqn] = tmd.BytesStorageMetadata()
            storage[tmd.MetadataIndex(fqn)] = _StorageInfo(f"__{t}_0.distcp", r.randrange(2 ** 40),
                                                           r.randrange(100))
            continue
        shape = [r.choice([0, 1, 3, 64, 300, 70000, 2 ** 33]) for _ in range(r.randrange(4))]
        chunks = []
        n = r.randrange(1, 4)
        for i in range(n if shape else 1):
            if shape:
                lo, hi = shape[0] * i // n, shape[0] * (i + 1) // n
                off, size = [lo] + [0] * (len(shape) - 1), [hi - lo] + shape[1:]
            else:
                off, size = [], []
            chunks.append(tmd.ChunkStorageMetadata(torch.Size(off), torch.Size(size)))
            info = _StorageInfo(f"__{i}_0.distcp", r.randrange(2 ** 40), r.randrange(2 ** 33))
            if r.random() < 0.3:
                info.transform_descriptors = r.choice([["zstd"], ("a", "b"), []])
            if r.random() < 0.3:
                info.shardstate_crc32 = r.randrange(2 ** 32)
            storage[tmd.MetadataIndex(fqn, torch.Size(off), i if r.random() < 0.8 else None)] = info
        props = tmd.TensorProperties(r.choice(_DTYPES), r.choice(_LAYOUTS), r.random() < 0.5,
                                     r.choice(_MEMFMTS), r.random() < 0.5)
        sdm[fqn] = tmd.TensorStorageMetadata(props, torch.Size(shape), chunks)
    planner = r.choice([None, {}, {k: tuple(k.split(".")) for k in sdm}, plain(r)])
    meta = r.choice([None, tmd.StorageMeta(), tmd.StorageMeta(
        "ckpt/dir", "save-1", r.choice([None, "load"]), ["m.a", "b"])])
    return tmd.Metadata(sdm, planner, storage, meta, r.choice(["1.0.0", None]))


@pytest.mark.parametrize("seed", range(4))
def test_random_torch_metadata_served_and_equal(seed: int) -> None:
    r = random.Random(seed)
    served = 0
    for _ in range(60):
        md = random_metadata(r)
        for proto in (3, 4, 5):
            served += check(pickle.dumps(md, protocol=proto)) is not None
        data = _pickle.dumps_metadata(md)
        served += check(data) is not None
    # only planner_data outside the decoded set (ints past int64, bytes-free
    # oddities) may send a stream to the reference
    assert served >= 200


def test_torch_and_shardstate_writes_are_served() -> None:
    md = random_metadata(random.Random(99))
    md.planner_data = {"w": ("w",)}
    for data in (pickle.dumps(md, protocol=3), _pickle.dumps_metadata(md)):
        got = check(data, served=True)
        assert got == md
    md.planner_data = {"w": ("w",), "f": torch.channels_last, "s": torch.Size([2])}
    for data in (pickle.dumps(md), _pickle.dumps_metadata(md)):
        got = check(data, served=True)
        assert got == md


def test_sizes_and_dtypes_without_torch_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch not loaded the reference makes tuples and TorchName: so does the fast path."""
    monkeypatch.setattr(B, "loaded_torch", lambda: None)
    monkeypatch.setattr(fastread, "loaded_torch", lambda: None)
    r = random.Random(5)
    for _ in range(20):
        md = random_metadata(r)
        md.planner_data = None
        got = check(pickle.dumps(md), served=True)
        for t in got.state_dict_metadata.values():
            if isinstance(t, tmd.TensorStorageMetadata):
                assert type(t.size) is tuple and type(t.properties.dtype) is not torch.dtype


def test_torch_size_made_as_torch_makes_it() -> None:
    md = random_metadata(random.Random(1))
    got = check(pickle.dumps(md), served=True)
    for t in got.state_dict_metadata.values():
        if isinstance(t, tmd.TensorStorageMetadata):
            assert type(t.size) is torch.Size and t.size == torch.Size(tuple(t.size))
            assert t.size.numel() == torch.Size(tuple(t.size)).numel()


# --------------------------------------------------------------------------
# Older forms, and what the fast path leaves to the reference
# --------------------------------------------------------------------------


def _as_module(obj: Any, real: str, placeholder: str) -> bytes:
    """pickle.dumps(obj) with classes of module ``placeholder`` renamed to ``real``."""
    assert len(real) == len(placeholder)
    return pickle.dumps(obj).replace(placeholder.encode(), real.encode())


def test_legacy_tensor_properties_served() -> None:
    md = random_metadata(random.Random(3))
    old = legacy.TensorProperties(torch.float16, torch.strided, True, torch.channels_last, False)
    md.state_dict_metadata["legacy"] = tmd.TensorStorageMetadata(old, torch.Size([2]), [
        tmd.ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))])
    got = check(pickle.dumps(md), served=True)
    assert type(got.state_dict_metadata["legacy"].properties) is tmd.TensorProperties


def test_dict_state_tensor_properties_served() -> None:
    """Older torch pickled TensorProperties' __dict__."""
    mod = "torch.distributed.checkpoint.metadata"
    ph = "z" * len(mod)
    fake = types.ModuleType(ph)

    class TensorProperties:
        pass

    TensorProperties.__module__ = ph
    TensorProperties.__qualname__ = "TensorProperties"
    fake.TensorProperties = TensorProperties  # type: ignore[attr-defined]
    p = TensorProperties()
    p.__dict__.update(dtype=torch.int32, requires_grad=True)
    md = tmd.Metadata({"t": tmd.TensorStorageMetadata(p, torch.Size([3]), [])})  # type: ignore[arg-type]
    sys.modules[ph] = fake
    try:
        data = _as_module(md, mod, ph)
    finally:
        del sys.modules[ph]
    got = check(data, served=True)
    props = got.state_dict_metadata["t"].properties
    assert props.dtype is torch.int32 and props.requires_grad is True
    assert props.layout is torch.strided


def _md_with(planner: Any = None, **kw: Any) -> tmd.Metadata:
    md = tmd.Metadata({"w": tmd.TensorStorageMetadata(
        tmd.TensorProperties(torch.float32), torch.Size([4]),
        [tmd.ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))])}, planner, {}, **kw)
    return md


class _Evil:
    def __reduce__(self) -> Any:
        return (print, ("pwned",))


def test_left_to_the_reference() -> None:
    cyc: list[Any] = []
    cyc.append(cyc)
    deep_list: Any = []
    for _ in range(80):
        deep_list = [deep_list]
    for planner in (collections_od(), np.arange(3), {1, 2},
                    2 ** 64, bytearray(b"x"), cyc, deep_list, _Evil()):
        check(pickle.dumps(_md_with(planner)), served=False)
    # a key twice in a dict: the reference merges before it builds
    data = pickle.dumps(_md_with({"k1": 1, "k2": 2}))
    check(data.replace(b"\x8c\x02k2", b"\x8c\x02k1"), served=False)
    md = _md_with()
    md.storage_data = {tmd.MetadataIndex("fqnA"): _StorageInfo("p", 0, 1),
                       tmd.MetadataIndex("fqnB"): _StorageInfo("q", 0, 2)}
    check(pickle.dumps(md).replace(b"fqnB", b"fqnA"), served=False)
    # an unknown field (newer torch), a chunk outside its tensor
    md = _md_with()
    md.newer_field = 1  # type: ignore[attr-defined]
    check(pickle.dumps(md), served=False)
    md = _md_with()
    md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([5])
    check(pickle.dumps(md), served=False)
    # protocol 2 (names mapped through _compat_pickle), protocol 0
    check(pickle.dumps(_md_with(), protocol=2), served=False)
    check(pickle.dumps(_md_with(), protocol=0), served=False)
    # not a Metadata at the root
    check(pickle.dumps({"a": 1}), served=False)


def collections_od() -> Any:
    import collections

    return collections.OrderedDict(a=1)


def test_copyreg_reconstructor_refused() -> None:
    md = _md_with({"x": copyreg._reconstructor})  # a global outside the allowlist
    check(pickle.dumps(md), served=False)


def test_mutated_streams_never_disagree() -> None:
    """Bytes flipped, dropped, inserted and streams cut: the fast path takes
    a mutant only where the reference gives the same Metadata."""
    r = random.Random(7)
    md = random_metadata(random.Random(11))
    md.planner_data = {"a": ("b", 1)}
    bases = [pickle.dumps(md), pickle.dumps(md, protocol=3), pickle.dumps(_md_with())]
    for base in bases:
        for n in range(0, len(base), max(1, len(base) // 40)):
            check(base[:n])
    for _ in range(1500):
        b = bytearray(r.choice(bases))
        for _ in range(r.randrange(1, 4)):
            i = r.randrange(len(b))
            k = r.randrange(3)
            if k == 0:
                b[i] = r.randrange(256)
            elif k == 1:
                del b[i]
            else:
                b.insert(i, r.randrange(256))
        check(bytes(b))


_TORCH_FREE = """
import sys
sys.modules["torch"] = None  # any import of torch now fails
from shardstate.checkpoint import metadata as smd, _pickle
from shardstate.checkpoint._pickle import fastread
T = smd.TorchName
chunks = [smd.ChunkStorageMetadata((i * 2, 0), (2, 3)) for i in range(3)]
md = smd.Metadata(
    state_dict_metadata={
        "w": smd.TensorStorageMetadata(smd.TensorProperties(dtype=T("torch.float16")), (6, 3),
                                       chunks),
        "b": smd.BytesStorageMetadata()},
    storage_data={smd.MetadataIndex("w", (i * 2, 0), i): smd._StorageInfo("__0_0.distcp", i, 9)
                  for i in range(3)},
    planner_data={"w": ("w",)}, storage_meta=smd.StorageMeta("c", "s"), version="1.0.0")
data = _pickle.dumps_metadata(md)
got = fastread._fast(data)
assert type(got) is smd.Metadata and got == md == _pickle._reference(data), got
size = got.state_dict_metadata["w"].size
assert type(size) is tuple and type(got.state_dict_metadata["w"].properties.dtype) is T
assert list(vars(got)) == list(vars(_pickle._reference(data)))
print("ok")
"""


def test_torch_free_metadata_served() -> None:
    """Without torch (a NumPy-only save), _torchfree's classes, tuples and TorchName."""
    import subprocess

    env = package_env()
    r = subprocess.run([sys.executable, "-c", _TORCH_FREE], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_classes_with_descriptors_are_left_to_the_reference() -> None:
    """The C path sets attributes; where a data descriptor (a property, a
    slot) takes a field's name, that is not __dict__.update: no fast path."""

    class WithProperty:
        fqn = property(lambda self: "x", lambda self, v: None)

    class WithSlots:
        __slots__ = ("fqn",)

    class Plain:
        fqn = None

    assert not fastread._plain_attrs(WithProperty, frozenset({"fqn"}))
    assert not fastread._plain_attrs(WithSlots, frozenset({"fqn"}))
    assert fastread._plain_attrs(Plain, frozenset({"fqn"}))
    assert fastread._plain_attrs(tmd.MetadataIndex, B._F_INDEX.known)


# --------------------------------------------------------------------------
# Paths (every save's StorageMeta.checkpoint_id) and buffers
# --------------------------------------------------------------------------


class _PathOf:
    """Pickles as pathlib.<cls>(*parts), whatever the parts."""

    def __init__(self, cls: type, *parts: Any) -> None:
        self.cls, self.parts = cls, parts

    def __reduce__(self) -> Any:
        return (self.cls, self.parts)


def test_path_forms_served_as_the_reference_makes_them() -> None:
    p = pathlib.PosixPath("/ckpt", "step_1")
    for cid in (p, pathlib.PurePosixPath("rel/x"), pathlib.PureWindowsPath("C:/a/b"),
                pathlib.PurePosixPath(), "as/str"):
        md = _md_with(storage_meta=tmd.StorageMeta(cid, "s", None, ["m"]))
        for data in (pickle.dumps(md), pickle.dumps(md, protocol=3), _pickle.dumps_metadata(md)):
            got = check(data, served=True)
            assert type(got.storage_meta.checkpoint_id) is type(cid)
            assert got.storage_meta.checkpoint_id == cid
    # the names of other platforms (protocol 3: GLOBAL, renamed in place)
    base = pickle.dumps(_md_with(storage_meta=tmd.StorageMeta(pathlib.PurePosixPath("/c"))),
                        protocol=3)
    for name, want in ((b"WindowsPath", B.path_class("WindowsPath")),
                       (b"Path", B.path_class("Path")),
                       (b"PureWindowsPath", pathlib.PureWindowsPath)):
        data = base.replace(b"pathlib\nPurePosixPath\n", b"pathlib\n" + name + b"\n")
        assert data != base
        got = check(data, served=True)
        assert type(got.storage_meta.checkpoint_id) is want
    # a path anywhere the reference admits one, shared through the memo
    got = check(pickle.dumps(_md_with({"a": p, "b": p, "c": [p]})), served=True)
    assert got.planner_data["a"] is got.planner_data["b"] is got.planner_data["c"][0]
    # what the reference refuses: parts not str, a Path where a str must be
    check(pickle.dumps(_md_with({"a": _PathOf(pathlib.PurePosixPath, "a", 1)})), served=False)
    check(pickle.dumps(_md_with(storage_meta=tmd.StorageMeta(
        _PathOf(pathlib.PurePosixPath, b"x")))), served=False)
    check(pickle.dumps(_md_with(storage_meta=tmd.StorageMeta("c", p))), served=False)


def test_any_buffer_served(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bytes, bytearray, memoryview and a MappedFile, big enough for the
    decode without the GIL; the mapping is released after the call."""
    from shardstate import io as ssio

    md = random_metadata(random.Random(2))
    md.state_dict_metadata["big"] = tmd.TensorStorageMetadata(
        tmd.TensorProperties(torch.float32), torch.Size([4000, 2]),
        [tmd.ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 2])) for i in range(4000)])
    data = pickle.dumps(md)
    assert len(data) >= 65536
    (tmp_path / "md").write_bytes(data)
    want = deep(_pickle._reference(data))

    def refuse(data: Any) -> Any:
        raise AssertionError("the reference ran")

    monkeypatch.setattr(_pickle, "_reference", refuse)
    with ssio.map_file(tmp_path / "md") as mf:
        for buf in (data, bytearray(data), memoryview(data), mf):
            assert deep(_pickle.loads_metadata(buf)) == want
        mf.close()  # no view of it outlives the call
    with pytest.raises(TypeError, match="bytes-like"):
        _pickle.loads_metadata("not a buffer")


# --------------------------------------------------------------------------
# Real checkpoints, read the way a load reads them
# --------------------------------------------------------------------------


def _real_sd(world: int) -> dict:
    sd: dict[str, Any] = {"w": torch.arange(12.0).reshape(3, 4), "step": 3, "blob": b"abc",
                          "nested": {"lr": 0.1, "bufs": [torch.ones(2)], "name": "x"}}
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        sd["d"] = distribute_tensor(torch.arange(10.0), mesh, [Shard(0)], src_data_rank=None)
    return sd


def _save_real(rank: int, world: int, root: str) -> None:
    import shardstate.checkpoint as dcp
    import torch.distributed.checkpoint as tdcp

    sd = _real_sd(world)
    dcp.save(sd, checkpoint_id=f"{root}/ss_{world}")
    tdcp.save(sd, checkpoint_id=pathlib.Path(root, f"t_{world}"))


def test_real_checkpoints_served(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                 run_distributed: Any) -> None:
    """What torch and shardstate save (1 and 2 ranks, DTensor, bytes items,
    nested planner_data, async_save, torch's zstd _extensions, shardstate's
    crc32) is read by FileSystemReader.read_metadata through the fast path
    alone, equal to the reference's answer."""
    import shardstate.checkpoint as dcp
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint._extension import ZStandard

    run_distributed(_save_real, 2, str(tmp_path))
    sd = _real_sd(1)
    with pytest.warns(UserWarning, match="single process"):
        tdcp.save(sd, checkpoint_id=tmp_path / "t_1")
        tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(tmp_path / "tz_1",
                                                           _extensions=[ZStandard()]))
        tdcp.async_save(sd, checkpoint_id=tmp_path / "ta_1").result()
    dcp.save(sd, checkpoint_id=tmp_path / "ss_1")
    dcp.async_save(sd, checkpoint_id=tmp_path / "ssa_1").result()
    dirs = sorted(tmp_path.iterdir())
    assert len(dirs) == 7
    want, want_bytes = {}, {}
    for d in dirs:
        md = _pickle._reference((d / ".metadata").read_bytes())
        md.storage_meta.load_id = "L"
        want[d.name] = deep(md)
        want_bytes[d.name] = _pickle.dumps_metadata(md)
        assert isinstance(md.storage_meta.checkpoint_id, pathlib.PurePath), d.name
    infos = [i for d in dirs for i in _pickle._reference((d / ".metadata").read_bytes())
             .storage_data.values()]
    assert any(getattr(i, "shardstate_crc32", None) is not None for i in infos)
    assert any(getattr(i, "transform_descriptors", None) for i in infos)

    def refuse(data: Any) -> Any:
        raise AssertionError("the reference ran")

    monkeypatch.setattr(_pickle, "_reference", refuse)
    for d in dirs:
        reader = dcp.FileSystemReader(d)
        reader.load_id = "L"
        got = reader.read_metadata()
        assert deep(got) == want[d.name], d.name
        # what the stream shares (torch.Size objects) is shared alike:
        # written back, the same bytes as the reference's Metadata
        assert _pickle.dumps_metadata(got) == want_bytes[d.name], d.name


def test_shared_objects_stay_shared() -> None:
    """A Size used twice (a chunk the size of its tensor) and a key named as
    a field ("size", interned, so one object with the attribute name) are
    one object each, as in the reference: written back, the same bytes."""
    md = _md_with({"size": ("size", "offsets"), "fqn": "w"})
    t = md.state_dict_metadata["w"]
    t.chunks[0].sizes = t.size
    md.state_dict_metadata["size"] = tmd.BytesStorageMetadata()
    data = pickle.dumps(md)
    assert data.count(b"\x8c\x04size") == 1  # the pickler wrote it once
    got = check(data, served=True)
    assert got.state_dict_metadata["w"].chunks[0].sizes is got.state_dict_metadata["w"].size
    assert _pickle.dumps_metadata(got) == data == _pickle.dumps_metadata(_pickle._reference(data))


@pytest.mark.parametrize("torch_loaded", [True, False])
def test_folded_chunk_batches_agree(torch_loaded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk list written in APPENDS batches of 1000 is turned into rows as
    each batch completes (ss_mdread's fold hook), all but a batch with an
    object the stream fetches again later (a chunk's offsets shared with a
    storage key; a chunk used twice), which stays nodes: the list mixes
    both. The result is the reference's, sharing included, and the chunk
    keys' names fetched again as values (planner_data) come out equal.
    storage_data's SETITEMS batches of (MetadataIndex, _StorageInfo) fold
    the same way (fresh fqns as ranges of the data, a path every entry
    shares as its node), mixed with the first batch's nodes."""
    if not torch_loaded:
        monkeypatch.setattr(B, "loaded_torch", lambda: None)
        monkeypatch.setattr(fastread, "loaded_torch", lambda: None)
    cs = [tmd.ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 3])) for i in range(2500)]
    shared = cs[1500]
    cs[2200] = cs[2100]
    plain = [tmd.ChunkStorageMetadata(torch.Size([i]), torch.Size([1])) for i in range(2000)]
    md = tmd.Metadata(
        {"w": tmd.TensorStorageMetadata(tmd.TensorProperties(torch.float32),
                                        torch.Size([2500, 3]), cs),
         "v": tmd.TensorStorageMetadata(tmd.TensorProperties(torch.int8),
                                        torch.Size([2000]), plain)},
        {"names": ["offsets", "sizes"],  # chunk rows built after the tensors'
         "cs": [tmd.ChunkStorageMetadata(torch.Size([i]), torch.Size([2])) for i in range(3)]},
        {tmd.MetadataIndex("w", shared.offsets): _StorageInfo("f", 0, 12)})
    path = "".join(["__0_", "0.distcp"])
    for i in range(2500):  # fresh fqn objects, one shared path
        md.storage_data[tmd.MetadataIndex("".join(["v", str(i % 7)]), torch.Size([i]),
                                          i % 3 if i % 2 else None)] = _StorageInfo(path, i, 7)
    data = pickle.dumps(md)
    assert data.count(b"\x8c\x07offsets") == 1
    got = check(data, served=True)
    chunks = got.state_dict_metadata["w"].chunks
    assert len(chunks) == 2500 and list(chunks[7].offsets) == [7, 0]
    assert chunks[2200] is chunks[2100]
    assert got.planner_data == md.planner_data
    assert len(got.storage_data) == 2501 and type(got.storage_data) is dict
    # compact: "v" (all rows) becomes a ChunkList, "w" (shares) stays a list
    monkeypatch.setattr(_mdlazy, "LAZY_MIN", 1)
    lazy, ref = fastread._fast(data), _pickle._reference(data)
    v = lazy.state_dict_metadata["v"].chunks
    assert isinstance(v, _mdlazy.ChunkList) and v.arrays()[0][:, 0].tolist() == list(range(2000))
    assert v == ref.state_dict_metadata["v"].chunks
    assert type(lazy.state_dict_metadata["w"].chunks) is list
    assert lazy.state_dict_metadata["w"].chunks == ref.state_dict_metadata["w"].chunks
    sd = lazy.storage_data
    assert type(sd) is _mdlazy.StorageMap and len(sd) == 2501
    for k, v in ref.storage_data.items():
        assert sd[k] == v
    assert dict(sd.items()) == ref.storage_data


def test_folded_storage_rows_copied_or_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """storage_data's rows are handed over as the columns only where they are
    all the folded entries, in order: here planner_data holds a dict of
    entries folded too (made eagerly from its rows), and a batch of
    storage_data stays nodes between folded ones (an fqn the stream fetches
    again later), so the compact form is a copy mixing rows and nodes."""
    def entries(n: int, tag: str) -> dict[Any, Any]:
        out = {}
        for i in range(n):
            key = tmd.MetadataIndex("".join([tag, str(i % 5)]), torch.Size([i, 1]), i % 2 or None)
            info = out[key] = _StorageInfo("".join(["p", str(i % 3)]), i, 9)
            if i % 3 == 0:
                info.shardstate_crc32 = 2**32 - 1 - i if i % 2 else None
        return out
    storage = entries(4000, "s")
    later = next(k.fqn for k in list(storage)[2500:2501])  # in the third batch
    md = tmd.Metadata({}, {"other": entries(1500, "o")}, storage,
                      tmd.StorageMeta(checkpoint_id="c", save_id=later))
    data = pickle.dumps(md)
    got = check(data, served=True)
    assert type(got.storage_data) is dict and len(got.storage_data) == 4000
    monkeypatch.setattr(_mdlazy, "LAZY_MIN", 0)
    lazy, ref = fastread._fast(data), _pickle._reference(data)
    sd = lazy.storage_data
    assert type(sd) is _mdlazy.StorageMap and len(sd) == 4000
    assert not sd._a["fid"].flags.writeable
    assert dict(sd.items()) == ref.storage_data and lazy.planner_data == ref.planner_data
    assert [k.fqn for k in sd] == [k.fqn for k in ref.storage_data]
    assert lazy.storage_meta.save_id is list(sd)[2500].fqn


def test_compact_chunk_lists_view_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compact chunk list whose chunks were all folded, one after another,
    is a view of the rows (no copy); one mixing nodes (the stream's first
    batch, which makes the key names the rest fetch) and rows is a copy;
    chunks of no dims have no cells. All equal the reference's lists."""
    def tensor(n: int, nd: int) -> Any:
        cs = [tmd.ChunkStorageMetadata(torch.Size([i] * nd), torch.Size([1] * nd))
              for i in range(n)]
        return tmd.TensorStorageMetadata(tmd.TensorProperties(torch.float32),
                                         torch.Size([n] * nd), cs)
    md = tmd.Metadata({"a": tensor(1500, 2), "b": tensor(1200, 2), "c": tensor(1100, 0),
                       "d": tensor(3, 3)})
    data = pickle.dumps(md)
    check(data, served=True)
    monkeypatch.setattr(_mdlazy, "LAZY_MIN", 1)
    lazy, ref = fastread._fast(data), _pickle._reference(data)
    got = {k: v.chunks for k, v in lazy.state_dict_metadata.items()}
    assert all(type(v) is _mdlazy.ChunkList for v in got.values())
    for k, v in got.items():
        off, sizes = v.arrays()
        assert not off.flags.writeable and not sizes.flags.writeable
        assert v == ref.state_dict_metadata[k].chunks
    assert got["a"].arrays()[0].base is None  # nodes and rows: copied
    assert got["b"].arrays()[0].base is not None  # rows only: a view
    assert got["b"].arrays()[0][:, 0].tolist() == list(range(1200))
    assert got["c"].arrays()[0].shape == (1100, 0)
