"""The .metadata writer's C walk (_core.md_dumps, csrc/py/mdwrite.c).

For every graph it serves, its bytes must be today's writer's (the C pickler
on stand-ins, ``writer._dumps(c=False)``) and torch's own
``pickle.dumps(md, protocol=4)``; what it does not serve it must hand over
(None), and dumps_metadata still gives torch's bytes. Random metadata
covers dtypes, layouts, memory formats, shared and unshared objects and
strings, bytes items, planner_data forms, storage_meta, multi-frame outputs,
more than 256 and 65536 memo entries, big ints, batch edges and empty
containers; the bytes read back with torch's pickle and shardstate's reader.
"""

from __future__ import annotations

import pathlib
import pickle
import random
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from _child_env import package_env
from shardstate.checkpoint import _torchfree as tfree
from shardstate.checkpoint._pickle import dumps_metadata, loads_metadata
from shardstate.checkpoint._pickle import writer as W
from shardstate.checkpoint._pickle.standins import _placeholder_sets
from shardstate.checkpoint.metadata import TorchName
from torch.distributed.checkpoint import metadata as tmd
from torch.distributed.checkpoint.filesystem import _StorageInfo as TInfo

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool,
          torch.float8_e4m3fn, torch.complex64]
LAYOUTS = [torch.strided, torch.sparse_coo]
FORMATS = [torch.contiguous_format, torch.channels_last, torch.preserve_format]
BIG = [2 ** 31 - 1, 2 ** 31, -2 ** 31, -2 ** 31 - 1, 2 ** 40, 2 ** 63 - 1, -2 ** 63]


def c_dumps(md: Any) -> bytes | None:
    """The C walk's bytes (renamed) for the first placeholder set, or None."""
    return W._dumps_c(md, next(iter(_placeholder_sets())), torch)


def check(md: Any, served: bool = True) -> bytes:
    ref = pickle.dumps(md, protocol=4)
    c = c_dumps(md)
    if served:
        assert c is not None, "the C walk handed over a graph it covers"
        assert c == ref
    else:
        assert c is None
    assert dumps_metadata(md) == ref
    assert W._dumps(md, c=False) == ref
    return ref


def _size(rng: random.Random, ndim: int | None = None) -> torch.Size:
    ndim = rng.randint(0, 5) if ndim is None else ndim
    return torch.Size([rng.choice([0, 1, 7, 255, 256, 65536, *BIG[:2]]) for _ in range(ndim)])


def random_metadata(rng: random.Random, tensors: int, chunks: int) -> tmd.Metadata:
    """torch's classes, with sharing where a real or odd save might have it."""
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    shared_props = tmd.TensorProperties(rng.choice(DTYPES))
    shared_size = torch.Size([3, 3])
    shared_info = TInfo("__shared.distcp", 0, 9)
    paths = [f"__{r}_0.distcp" for r in range(3)]
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        if rng.random() < 0.2:
            sdm[fqn] = tmd.BytesStorageMetadata()
            storage[tmd.MetadataIndex(fqn)] = TInfo(rng.choice(paths), t, rng.randint(0, 2 ** 35))
            planner[fqn] = tuple(fqn.split("."))
            continue
        ndim = rng.randint(0, 4)
        props = shared_props if rng.random() < 0.2 else tmd.TensorProperties(
            rng.choice(DTYPES), rng.choice(LAYOUTS), rng.random() < 0.5, rng.choice(FORMATS),
            rng.random() < 0.5)
        cs = []
        for c in range(rng.randint(1, chunks)):
            off = shared_size if ndim == 2 and rng.random() < 0.2 else _size(rng, ndim)
            cs.append(tmd.ChunkStorageMetadata(off, _size(rng, ndim)))
            if rng.random() < 0.1 and cs:
                cs.append(cs[0])  # the same chunk twice
            key_fqn = fqn if rng.random() < 0.7 else "".join(fqn)  # equal, another object
            idx = tmd.MetadataIndex(key_fqn, off if rng.random() < 0.5 else list(off), c)
            if rng.random() < 0.05:
                storage[idx] = shared_info
                continue
            path = rng.choice(paths) if rng.random() < 0.5 else f"__{c}_{t}.distcp"
            info = TInfo(path, rng.choice([0, 1, 300, 2 ** 31, 2 ** 40]), rng.randint(0, 2 ** 20),
                         rng.choice([None, None, ["zstd"], []]))
            if rng.random() < 0.3:
                info.shardstate_crc32 = rng.randint(0, 2 ** 32 - 1)  # what shardstate saves
            storage[idx] = info
        # the tensor holds its chunks (shardstate's reader checks)
        size = torch.Size([max(c.offsets[d] + c.sizes[d] for c in cs) for d in range(ndim)])
        sdm[fqn] = tmd.TensorStorageMetadata(props, size, cs)
        planner[fqn] = tuple(fqn.split(".")) if rng.random() < 0.8 else (fqn, rng.choice(BIG))
    cid: Any = rng.choice([pathlib.PosixPath("/tmp/ck/x"), "rel/ckpt", None])
    meta = rng.choice([None, tmd.StorageMeta(cid, f"id-{rng.random()}", None, ["m.a", "b"])])
    return tmd.Metadata(sdm, rng.choice([planner, None, {}]), storage, meta, "1.0.0")


@pytest.mark.parametrize("seed", range(12))
def test_random_metadata_equals_torch_pickle(seed: int) -> None:
    md = random_metadata(random.Random(seed), tensors=seed * 3 + 1, chunks=seed % 5 + 1)
    data = check(md)
    assert pickle.loads(data) == md
    back = loads_metadata(data)
    assert back.state_dict_metadata.keys() == md.state_dict_metadata.keys()
    assert len(back.storage_data) == len(md.storage_data)


def test_large_metadata_crosses_frames_and_long_memo_indices() -> None:
    """> 64 KiB in many frames, > 65536 memo entries (LONG_BINGET), a
    string past the frame target (written unframed), batch edges."""
    rng = random.Random(7)
    md = random_metadata(rng, tensors=4, chunks=1)
    cs = [tmd.ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 8])) for i in range(9000)]
    md.state_dict_metadata["big"] = tmd.TensorStorageMetadata(
        tmd.TensorProperties(torch.float16), torch.Size([9000, 8]), cs)
    for i in range(9000):
        md.storage_data[tmd.MetadataIndex("big", [i, 0], i)] = TInfo(f"__{i}.distcp", i, 16)
    md.planner_data = {"long": "x" * 70000, "b": b"y" * 70000, "l1000": list(range(1000)),
                       "d2000": {str(i): i for i in range(2000)}, "l2001": [None] * 2001,
                       "d1": {"k": 1.5}, "l1": [[]], "empty": ({}, [], (), "", b"")}
    data = check(md)
    assert len(data) > 10 * 65536 and data.count(b"j") > 0
    assert pickle.loads(data) == md


def test_plain_values() -> None:
    """planner_data as the pickler writes it: sharing, cycles through lists
    and dicts, floats, bytes, torch's sizes, dtypes and layouts, paths."""
    fqn = "a.b"
    shared = [1, 2]
    loop: list[Any] = ["x"]
    loop.append(loop)
    d: dict[str, Any] = {}
    d["self"] = d
    md = tmd.Metadata({fqn: tmd.BytesStorageMetadata()}, {
        fqn: (shared, shared, fqn), "floats": [0.0, -0.0, 1e300, float("inf")],
        "loop": loop, "d": d, "torch": [torch.Size([2]), torch.float64, torch.sparse_csr],
        "path": pathlib.PurePosixPath("a/b"), "nested": [[[[1]]]] * 3,
        "bools": (True, False, None), "tuples": ((), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)),
    }, {tmd.MetadataIndex(fqn): TInfo("f", 0, 1)})
    check(md)


@pytest.mark.parametrize("odd", ["set", "bigint", "memfmt", "surrogate", "tuple-cycle", "deep",
                                 "chunk-shared-with-plain", "subclass-int"])
def test_hands_over_what_it_does_not_cover(odd: str) -> None:
    md = random_metadata(random.Random(3), tensors=3, chunks=2)
    if odd == "set":
        md.planner_data = {"s": {1, 2}}
    elif odd == "bigint":
        md.planner_data = {"i": 2 ** 70}
    elif odd == "memfmt":
        md.planner_data = {"m": torch.channels_last}
    elif odd == "surrogate":
        md.planner_data = {"s": "\ud800"}
    elif odd == "tuple-cycle":
        lst: list[Any] = []
        t = (lst,)
        lst.append(t)
        md.planner_data = {"t": t}
    elif odd == "deep":
        v: Any = []
        for _ in range(150):
            v = [v]
        md.planner_data = {"v": v}
    elif odd == "chunk-shared-with-plain":
        e = next(e for e in md.state_dict_metadata.values() if hasattr(e, "chunks"))
        md.planner_data = {"chunks": e.chunks}
    else:
        md.version = type("I", (int,), {})(3)  # not importable: pickle fails too
    try:
        ref = pickle.dumps(md, protocol=4)
    except pickle.PicklingError:
        assert c_dumps(md) is None
        return
    assert c_dumps(md) is None
    assert dumps_metadata(md) == ref


def test_state_shared_with_plain_values_is_written_once() -> None:
    """A chunk's state dict and a size also held by planner_data: the
    pickler writes them once and refers back (BINGET), as does the walk."""
    md = random_metadata(random.Random(5), tensors=3, chunks=2)
    e = next(e for e in md.state_dict_metadata.values() if hasattr(e, "chunks"))
    md.planner_data = {"state": e.chunks[0].__dict__, "size": e.chunks[-1].sizes,
                       "props": e.properties.dtype}
    check(md)


def _torch_obj(name: TorchName) -> Any:
    return getattr(torch, str(name).removeprefix("torch."))


def test_torch_free_classes_with_stand_ins() -> None:
    """_torchfree's classes with tuples for sizes and TorchName for dtypes,
    layouts and memory formats: the bytes of torch's classes holding
    torch's objects (each tuple a new torch.Size)."""
    tm = random_metadata(random.Random(11), tensors=8, chunks=3)
    sdm: dict[str, Any] = {}
    twin: dict[str, Any] = {}
    for k, v in tm.state_dict_metadata.items():
        if isinstance(v, tmd.BytesStorageMetadata):
            sdm[k], twin[k] = tfree.BytesStorageMetadata(), tmd.BytesStorageMetadata()
            continue
        p = v.properties
        names = [TorchName(str(x)) for x in (p.dtype, p.layout, p.memory_format)]
        props = tfree.TensorProperties(names[0], names[1], p.requires_grad, names[2],
                                       p.pin_memory)
        sdm[k] = tfree.TensorStorageMetadata(props, tuple(v.size), [
            tfree.ChunkStorageMetadata(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks])
        tprops = tmd.TensorProperties(*(_torch_obj(n) for n in names[:2]), p.requires_grad,
                                      _torch_obj(names[2]), p.pin_memory)
        twin[k] = tmd.TensorStorageMetadata(tprops, torch.Size(v.size), [
            tmd.ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
            for c in v.chunks])
    md = tfree.Metadata(sdm, None, {}, None, "1.0.0")
    ref = pickle.dumps(tmd.Metadata(twin, None, {}, None, "1.0.0"), protocol=4)
    assert c_dumps(md) == ref
    assert dumps_metadata(md) == ref


def test_torch_free_process() -> None:
    """Where torch cannot be imported: the C walk serves the graph (sizes as
    tuples, dtypes as TorchName) and its bytes are torch's pickle."""
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None
        from shardstate.checkpoint import metadata as smd
        from shardstate.checkpoint._pickle import writer as W
        from shardstate.checkpoint._pickle.standins import _placeholder_sets
        p = smd.TensorProperties(dtype=smd.TorchName("torch.bfloat16"))
        cs = [smd.ChunkStorageMetadata((i, 0), (1, 4)) for i in range(3)]
        sd = {smd.MetadataIndex("w", (i, 0), i): smd._StorageInfo("f", i, 8)
              for i in range(3)}
        sd[smd.MetadataIndex("b")] = smd._StorageInfo("f", 9, 2)
        md = smd.Metadata({"w": smd.TensorStorageMetadata(p, (3, 4), cs),
                           "b": smd.BytesStorageMetadata()}, {"w": ("w",)}, sd,
                          version="1.0.0")
        data = W._dumps_c(md, next(iter(_placeholder_sets())), None)
        assert data is not None and W._dumps(md, c=False) == data
        sys.stdout.write(data.hex())
    """)
    env = package_env()
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env,
                         capture_output=True, text=True, timeout=120).stdout
    cs = [tmd.ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 4])) for i in range(3)]
    md = tmd.Metadata({"w": tmd.TensorStorageMetadata(tmd.TensorProperties(torch.bfloat16),
                                                      torch.Size([3, 4]), cs),
                       "b": tmd.BytesStorageMetadata()}, {"w": ("w",)},
                      {tmd.MetadataIndex("w", [i, 0], i): TInfo("f", i, 8) for i in range(3)}
                      | {tmd.MetadataIndex("b"): TInfo("f", 9, 2)}, version="1.0.0")
    assert bytes.fromhex(out) == pickle.dumps(md, protocol=4)


def test_storage_info_state_through_its_getstate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A _StorageInfo.__getstate__ the walk does not know is called (its
    dict written as it comes); the known one is emulated: the same bytes."""
    md = random_metadata(random.Random(4), tensors=6, chunks=3)
    ref = check(md)
    monkeypatch.setattr(W, "_drops_none", lambda cls: None)
    assert c_dumps(md) == ref
