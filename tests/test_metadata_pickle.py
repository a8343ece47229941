"""checkpoint._pickle: .metadata and bytes items, against torch 2.13's DCP.

The writer must produce the bytes torch's FileSystemWriter writes (pickle of
torch's classes) without torch; the restricted unpickler must read torch's
files into our classes and refuse anything that would run code.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pathlib
import pickle
import re
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import shardstate
import torch
import torch.distributed.checkpoint as dcp
from _child_env import package_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardstate._util import gc_paused
from shardstate.checkpoint import _torchfree as tfree
from shardstate.checkpoint import _zipfmt
from shardstate.checkpoint import metadata as smd
from shardstate.checkpoint._pickle import (
    PickleFormatError,
    UnsafePickleError,
    dumps_metadata,
    dumps_object,
    loads_metadata,
    loads_object,
)
from shardstate.checkpoint._pickle import allowlist as A
from shardstate.checkpoint._pickle import build as B
from shardstate.checkpoint._pickle import names as N
from shardstate.checkpoint._pickle import standins as S
from shardstate.checkpoint._pickle import unpickler as U
from shardstate.checkpoint._pickle import writer as W
from shardstate.checkpoint.metadata import TorchName
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as tmd
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo as TStorageInfo

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def norm(x: Any) -> Any:
    """A class-independent view of a metadata graph: (class name, fields)."""
    if type(x).__name__ in ("dtype", "layout", "memory_format") or isinstance(x, TorchName):
        return ("torchobj", str(x) if str(x).startswith("torch.") else f"torch.{x}")
    if type(x).__name__ == "Size":
        return ("size", tuple(x))
    if isinstance(x, pathlib.PurePath):
        return ("path", type(x).__name__, str(x))
    if isinstance(x, smd._MEM_FORMAT_ENCODING | tmd._MEM_FORMAT_ENCODING):
        return ("enc", x.value)
    name = type(x).__name__
    if name in W._OURS:
        fields = ("fqn", "offset", "index") if name == "MetadataIndex" else tuple(
            f for f in type(x).__dataclass_fields__
        )
        return (name, tuple((f, norm(getattr(x, f))) for f in fields))
    if type(x) in (list, tuple):
        return (type(x).__name__, tuple(norm(v) for v in x))
    if type(x) in (dict, collections.OrderedDict):
        return (type(x).__name__, tuple((norm(k), norm(v)) for k, v in x.items()))
    return x


def torch_metadata(with_path: bool = True) -> tmd.Metadata:
    """A torch Metadata using every field, built as torch's planner would."""
    w, b, e, big = "layer.w", "step", "emb", "big.chunked"
    nested, l0 = "nested", "l"
    sdm = {
        w: tmd.TensorStorageMetadata(
            tmd.TensorProperties(torch.float32, torch.strided, True, torch.contiguous_format),
            torch.Size([4, 6]),
            [tmd.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])),
             tmd.ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 6]))],
        ),
        b: tmd.BytesStorageMetadata(),
        e: tmd.TensorStorageMetadata(
            tmd.TensorProperties(torch.bfloat16, torch.strided, False, torch.channels_last, True),
            torch.Size([]), [tmd.ChunkStorageMetadata(torch.Size([]), torch.Size([]))],
        ),
        big: tmd.TensorStorageMetadata(
            tmd.TensorProperties(torch.int64, memory_format=torch.preserve_format),
            torch.Size([70000, 3]),
            [tmd.ChunkStorageMetadata(torch.Size([i * 10000, 0]), torch.Size([10000, 3]))
             for i in range(7)],
        ),
        "nested.l.0": tmd.BytesStorageMetadata(),
    }
    planner = {w: tuple(w.split(".")), b: (b,), e: (e,), big: ("big", "chunked"),
               "nested.l.0": (nested, l0, 0)}
    f0, f1 = "__0_0.distcp", "__1_0.distcp"
    storage: dict[Any, Any] = {
        tmd.MetadataIndex(b): TStorageInfo(f0, 0, 1261),
        tmd.MetadataIndex("nested.l.0"): TStorageInfo(f0, 1261, 1300, ["zstd", "x"]),
        tmd.MetadataIndex(w, torch.Size([0, 0]), 0): TStorageInfo(f0, 2561, 1577),
        tmd.MetadataIndex(w, [2, 0], 1): TStorageInfo(f1, 0, 1577),
        tmd.MetadataIndex(e, [], 0): TStorageInfo(f1, 1577, 1500),
    }
    for i in range(7):
        storage[tmd.MetadataIndex(big, [i * 10000, 0], i)] = TStorageInfo(f1, 5000 + i, 2 ** 33 + i)
    cid: Any = pathlib.PosixPath("/tmp/some/ckpt") if with_path else "relative/ckpt"
    meta = tmd.StorageMeta(cid, "6f0a3a2e-0000-4000-8000-000000000000", None, ["mod.a", "b"])
    return tmd.Metadata(sdm, planner, storage, meta, "1.0.0")


def standin_metadata(tm: tmd.Metadata) -> tfree.Metadata:
    """The torch-free classes with tuples and TorchName for torch objects, sharing the same
    strings (so the pickles should be byte-identical)."""

    def size(s: Any) -> tuple[int, ...]:
        return tuple(int(v) for v in s)

    def tn(x: Any) -> TorchName:
        return TorchName(str(x))

    def props(p: tmd.TensorProperties) -> tfree.TensorProperties:
        return tfree.TensorProperties(tn(p.dtype), tn(p.layout), p.requires_grad,
                                    tn(p.memory_format), p.pin_memory)

    sdm: dict[str, Any] = {}
    for k, v in tm.state_dict_metadata.items():
        if isinstance(v, tmd.BytesStorageMetadata):
            sdm[k] = tfree.BytesStorageMetadata()
        else:
            sdm[k] = tfree.TensorStorageMetadata(
                props(v.properties), size(v.size),
                [tfree.ChunkStorageMetadata(size(c.offsets), size(c.sizes)) for c in v.chunks])
    storage = {}
    for k, v in tm.storage_data.items():
        idx = object.__new__(tfree.MetadataIndex)
        object.__setattr__(idx, "fqn", k.fqn)
        object.__setattr__(idx, "index", k.index)
        if k.offset is not None:
            object.__setattr__(idx, "offset", size(k.offset))
        storage[idx] = tfree._StorageInfo(v.relative_path, v.offset, v.length,
                                        v.transform_descriptors)
    m = tm.storage_meta
    return tfree.Metadata(sdm, tm.planner_data, storage,
                        tfree.StorageMeta(m.checkpoint_id, m.save_id, m.load_id, m.modules),
                        tm.version)


def dcp_save(sd: dict, path: Path, **kw: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single")
        dcp.save(sd, storage_writer=FileSystemWriter(str(path), **kw))


# --------------------------------------------------------------------------
# The writer
# --------------------------------------------------------------------------

_S = sys.intern("shared")
PLAIN = [
    None, True, False, 0, 255, 256, 65535, 65536, -1, -(2 ** 31), 2 ** 31, 2 ** 64, -(2 ** 64),
    -(2 ** 63), 10 ** 700, 1.5, float("inf"), "", "é" * 200, "x" * 256, "y" * 70000,
    b"", b"a" * 300, b"c" * 70000, [], [1], [1, 2], list(range(1000)), list(range(1001)),
    list(range(2000)), {}, {1: 2}, {i: i for i in range(1000)}, {i: -i for i in range(2001)},
    set(), {1}, set(range(1000)), set(range(2500)), frozenset(), frozenset({1, 2}), (), (1,),
    (1, 2), (1, 2, 3), (1, 2, 3, 4), [_S, _S, (_S,), {_S: [_S]}],
    [(f"s{i}", i, [i] * 3, {"k": "v"}) for i in range(12000)],
    ["z" * 70000, "q", b"w" * 65536, "a" * 65535, "b" * 65536],
]


def _plain_matches_c_pickler(value: Any) -> None:
    """A plain value, as the whole pickle and as planner data of a torch
    Metadata: the writer gives the C pickler's bytes."""
    assert dumps_metadata(value) == pickle.dumps(value, protocol=4)
    tm = torch_metadata(False)
    tm.planner_data = value
    assert dumps_metadata(tm) == pickle.dumps(tm)


@pytest.mark.parametrize("value", PLAIN, ids=range(len(PLAIN)))
def test_writer_matches_c_pickler_on_plain_values(value: Any) -> None:
    _plain_matches_c_pickler(value)


_text = st.sampled_from([sys.intern(s) for s in ("a", "bb", "fqn", "layer.0.weight", "é")])
_plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text | st.binary(),
    lambda c: st.lists(c) | st.tuples(c, c) | st.tuples(c, c, c, c) | st.dictionaries(_text, c)
    | st.frozensets(st.integers()),
    max_leaves=40,
)


@settings(max_examples=150, deadline=None)
@given(_plain)
def test_writer_matches_c_pickler_fuzz(value: Any) -> None:
    _plain_matches_c_pickler(value)


@pytest.mark.parametrize("with_path", [True, False])
def test_dumps_torch_metadata_is_pickle_dumps(with_path: bool) -> None:
    tm = torch_metadata(with_path)
    ref = pickle.dumps(tm)
    assert dumps_metadata(tm) == ref
    ours = loads_metadata(ref)
    assert type(ours) is smd.Metadata
    assert norm(ours) == norm(tm)
    assert dumps_metadata(ours) == ref  # our classes, holding torch objects
    back = pickle.loads(dumps_metadata(ours))
    assert type(back) is tmd.Metadata and back == tm


def test_dumps_standins_equal_torch_made() -> None:
    tm = torch_metadata()
    ours = standin_metadata(tm)
    assert isinstance(ours.state_dict_metadata["emb"].properties.dtype, TorchName)
    data = dumps_metadata(ours)
    assert data == pickle.dumps(tm)
    back = pickle.loads(data)  # torch's plain unpickler: torch's classes
    assert type(back) is tmd.Metadata and back == tm
    for k, v in back.storage_data.items():
        ref = tm.storage_data[k]
        assert type(v) is TStorageInfo and v == ref
        assert type(k.offset) is (type(None) if k.offset is None else torch.Size)
    assert back.state_dict_metadata["emb"].properties.memory_format is torch.channels_last
    assert back.state_dict_metadata["big.chunked"].properties.memory_format is torch.preserve_format
    assert back.storage_meta == tm.storage_meta


def test_dumps_rejects_unknown_objects() -> None:
    md = smd.Metadata({"x": smd.BytesStorageMetadata()}, planner_data={"x": object()})
    with pytest.raises(TypeError, match="builtins.object"):
        dumps_metadata(md)


def test_dtype_and_layout_allowlists_cover_torch() -> None:
    for name in dir(torch):
        obj = getattr(torch, name)
        if isinstance(obj, torch.dtype):
            assert obj.__reduce__() in N._DTYPE_NAMES, name
        if isinstance(obj, torch.layout):
            assert str(obj) in N._LAYOUT_NAMES, name


# --------------------------------------------------------------------------
# The writer: the fast and the generic conversion to stand-ins
# --------------------------------------------------------------------------


def test_placeholder_modules_have_torch_lengths() -> None:
    import importlib

    ph = next(S._placeholder_sets())
    reals = {"md": N._MD_MOD, "fs": N._FS_MOD, "dtype": "torch", "size": "torch",
             "layout": "torch.serialization", "memfmt": "torch._utils"}
    assert ph.ops.keys() == reals.keys()
    for tag, (placeholder, real) in ph.ops.items():
        assert real == S._op(reals[tag]) and len(placeholder) == len(real), tag
        assert placeholder[2:-1].decode() in sys.modules, tag
    for name, cls in ph.classes.items():
        theirs = getattr(importlib.import_module(N._torch_module(name)), name)
        assert cls.__qualname__ == theirs.__qualname__
        assert S._op(cls.__module__) == ph.ops["fs" if name == "_StorageInfo" else "md"][0]
    assert [e.value for e in ph.encodings] == [e.value for e in tmd._MEM_FORMAT_ENCODING]
    assert [e.name for e in ph.encodings] == [e.name for e in tmd._MEM_FORMAT_ENCODING]


@pytest.mark.parametrize("with_path", [True, False])
def test_fast_writer_gives_pickle_dumps(with_path: bool) -> None:
    tm = torch_metadata(with_path)
    ref = pickle.dumps(tm)
    ours = loads_metadata(ref)
    assert W._dumps(tm, False) == ref
    assert W._dumps(ours, False) == ref
    assert W._dumps(ours, True) == ref
    assert W._dumps(tm, True) == ref


def _refuse_generic(self: Any, v: Any) -> Any:
    raise AssertionError("the generic conversion ran")


def test_fast_writer_serves_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardstate.checkpoint as ss

    monkeypatch.setattr(W._Convert, "value", _refuse_generic)
    sd = {"w": torch.arange(12.0).reshape(3, 4), "step": 7, "cfg": {"lr": 0.5, "tags": ["a"]}}
    ss.save(sd, checkpoint_id=tmp_path)
    out = {"w": torch.zeros(3, 4), "step": 0, "cfg": {"lr": 0.0, "tags": []}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        dcp.load(out, checkpoint_id=str(tmp_path))  # torch reads what the fast path wrote
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 7 and out["cfg"] == sd["cfg"]


def _save_without_generic(rank: int, world: int, path: str) -> None:
    import numpy as np
    import shardstate.checkpoint as ss
    from test_checkpoint_e2e import _dist_sd

    W._Convert.value = _refuse_generic  # this process only
    sd = _dist_sd(world, rank, 1, False)  # DTensors, a ShardedTensor, plain tensors, bytes
    sd["arr"] = np.arange(6, dtype=np.float16).reshape(2, 3)
    ss.save(sd, checkpoint_id=path)


def test_fast_writer_serves_distributed_saves(tmp_path: Path) -> None:
    from shardstate.testing import run_distributed

    run_distributed(_save_without_generic, 2, str(tmp_path))
    raw = (tmp_path / ".metadata").read_bytes()
    back = pickle.loads(raw)  # torch's own classes, as torch's reader sees them
    assert type(back) is tmd.Metadata and len(back.state_dict_metadata) > 5
    assert {type(e) for e in back.state_dict_metadata.values()} == {
        tmd.TensorStorageMetadata, tmd.BytesStorageMetadata}
    assert W._dumps(loads_metadata(raw), True) == raw


def _served(md: Any) -> bytes:
    """md's bytes, checking the fast conversion serves it and the generic agrees."""
    data = dumps_metadata(md)
    assert W._dumps(md, False) == data == W._dumps(md, True)
    return data


def _declined(md: Any) -> bytes:
    """md's bytes, checking the fast conversion hands it to the generic one."""
    assert W._dumps(md, False) is None
    data = dumps_metadata(md)
    assert data == W._dumps(md, True)
    return data


def test_fast_writer_serves_stand_ins_and_cycles() -> None:
    tm = torch_metadata()
    # stand-ins for torch objects (tuples, TorchName): written as torch's
    assert _served(standin_metadata(tm)) == pickle.dumps(tm)
    ours = loads_metadata(pickle.dumps(tm))
    ours.state_dict_metadata["layer.w"].chunks[0].offsets = (0, 0)
    back = pickle.loads(_served(ours))
    assert type(back.state_dict_metadata["layer.w"].chunks[0].offsets) is torch.Size
    # planner data: a cycle is the pickler's to write; a DAG of 2**40 paths
    # is checked once per container (walking every path would not end)
    tm = torch_metadata()
    loop: list[Any] = [1]
    loop.append(loop)
    tm.planner_data["loop"] = loop
    assert _served(tm) == pickle.dumps(tm)
    tm = torch_metadata()
    dag: Any = ["leaf"]
    for _ in range(40):
        dag = [dag, dag]
    tm.planner_data["dag"] = dag
    assert _served(tm) == pickle.dumps(tm)


def test_data_spelling_a_placeholder_takes_the_next_names() -> None:
    ph0 = next(S._placeholder_sets())
    for where in ("fqn", "planner", "bytes"):
        tm = torch_metadata()
        name = ph0.ops["md"][0][2:-1].decode()
        if where == "fqn":
            tm.state_dict_metadata[name] = tmd.BytesStorageMetadata()
        elif where == "planner":
            tm.planner_data["x"] = (name,)
        else:
            tm.planner_data["x"] = b"..." + ph0.ops["md"][0] + b"..."
        data = _served(loads_metadata(pickle.dumps(tm)))
        assert data == pickle.dumps(tm)
        assert pickle.loads(data) == tm
    assert len(S._SETS) >= 2


def test_fast_writer_hands_over_what_it_does_not_cover() -> None:
    # torch objects' stand-ins where plain values were expected
    tm = torch_metadata()
    tm.planner_data["dt"] = [torch.float16, torch.int8, torch.strided, torch.channels_last]
    ours = loads_metadata(pickle.dumps(tm))
    ours.planner_data["dt"][1] = TorchName("torch.int8")
    ours.planner_data["dt"][2] = TorchName("torch.strided")
    assert _declined(ours) == pickle.dumps(tm)
    # values outside the allowlist: the generic conversion gives the error
    ours = loads_metadata(pickle.dumps(torch_metadata()))
    for odd in (collections.OrderedDict(a=1), object()):
        ours.planner_data["odd"] = odd
        assert W._dumps(ours, False) is None
        with pytest.raises(TypeError, match=type(odd).__qualname__):
            dumps_metadata(ours)
    # an empty chunk list also passed on in planner data: sharing the fast
    # conversion does not rebuild
    tm = torch_metadata()
    shared: list[Any] = []
    tm.state_dict_metadata["z"] = tmd.TensorStorageMetadata(
        tmd.TensorProperties(torch.float32), torch.Size([0]), shared)
    tm.planner_data["z"] = shared
    assert _declined(tm) == pickle.dumps(tm)
    # metadata objects among plain values
    tm = torch_metadata()
    tm.planner_data["props"] = tm.state_dict_metadata["emb"].properties
    tm.planner_data["idx"] = [tmd.MetadataIndex("x", [1, 2])]
    assert _declined(tm) == pickle.dumps(tm)


def _twin_metadata(ns: str, plan: dict[str, Any], objs: dict[str, Any]) -> Any:
    """The same metadata graph from torch's classes (ns "torch") or ours
    ("ours"), with the same sharing: ``objs`` holds the plain objects (names,
    sizes, lists) both graphs use."""
    m: Any = tmd if ns == "torch" else smd
    info_cls: Any = TStorageInfo if ns == "torch" else smd._StorageInfo
    props = [m.TensorProperties(dt, torch.strided, rg, mf) for dt, rg, mf in plan["props"]]
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    infos = [info_cls(*a) for a in plan["infos"]]
    shared_chunks = None
    for t, (fqn, n_chunks, p_i, share_size, share_list) in enumerate(plan["tensors"]):
        size = objs["sizes"][t]
        if share_list and shared_chunks is not None:
            chunks = shared_chunks
        else:
            chunks = [m.ChunkStorageMetadata(objs["offsets"][(t, c)],
                                             size if share_size else objs["csizes"][(t, c)])
                      for c in range(n_chunks)]
            shared_chunks = chunks
        sdm[fqn] = m.TensorStorageMetadata(props[p_i], size, chunks)
        for c in range(len(chunks)):
            storage[m.MetadataIndex(fqn, list(objs["offsets"][(t, c)]) if chunks else None, c)] = (
                infos[(t + c) % len(infos)])
    for fqn in plan["bytes"]:
        sdm[fqn] = m.BytesStorageMetadata()
        storage[m.MetadataIndex(fqn)] = infos[0]
    meta = m.StorageMeta(objs["cid"], "save-id", None, objs["modules"])
    return m.Metadata(sdm, objs["planner"], storage, meta, "1.0.0")


_dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool])
_memfmt = st.sampled_from([torch.contiguous_format, torch.channels_last, torch.preserve_format])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    props=st.lists(st.tuples(_dtypes, st.booleans(), _memfmt), min_size=1, max_size=3),
    tensors=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2), st.booleans(),
                               st.booleans()), min_size=1, max_size=6),
    infos=st.lists(st.tuples(st.sampled_from(["__0_0.distcp", "__1_0.distcp"]),
                             st.integers(0, 2 ** 40), st.integers(0, 2 ** 33),
                             st.sampled_from([None, ["zstd"], []])), min_size=1, max_size=4),
    n_bytes=st.integers(0, 3),
    planner=_plain,
    path=st.booleans(),
)
def test_fast_writer_matches_reference_and_torch_fuzz(
    props: list, tensors: list, infos: list, n_bytes: int, planner: Any, path: bool
) -> None:
    plan = {
        "props": props,
        "tensors": [(f"t{i}.w", n, p % len(props), ss, sl)
                    for i, (n, p, ss, sl) in enumerate(tensors)],
        "infos": infos,
        "bytes": [f"b{i}" for i in range(n_bytes)],
    }
    objs: dict[str, Any] = {
        "sizes": [torch.Size([n * 2 + 1, 3]) for n, *_ in tensors],
        "offsets": {(t, c): torch.Size([c * 2, 0]) for t in range(len(tensors))
                    for c in range(41)},
        "csizes": {(t, c): torch.Size([2, 3]) for t in range(len(tensors)) for c in range(41)},
        "cid": pathlib.PosixPath("/ck/pt") if path else "ck",
        "modules": ["a.b"],
        "planner": {"p": planner},
    }
    theirs = _twin_metadata("torch", plan, objs)
    ours = _twin_metadata("ours", plan, objs)
    ref = pickle.dumps(theirs)
    assert W._dumps(theirs, False) == ref
    assert W._dumps(theirs, True) == ref
    assert W._dumps(ours, True) == ref
    assert W._dumps(ours, False) == ref


# --------------------------------------------------------------------------
# Real torch-written checkpoints
# --------------------------------------------------------------------------

BYTES_VALUES = {
    "step": 3, "lr": 0.1, "name": "adam", "flags": [True, False, None],
    "cfg": {"betas": (0.9, 0.999), "eps": 1e-8, "tags": {"a", "b"}},
    "od": collections.OrderedDict(a=1, b=[2]), "blob": b"\x00\xffab", "empty": b"",
    "ba": bytearray(b"xy"), "c": 1 + 2j, "big": 2 ** 80, "fs": frozenset({1}),
    "sl": slice(1, None, 2), "size": torch.Size([2, 3]), "dt": torch.float16,
}


def _state_dict() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "h": torch.randn(5, generator=g).half(),
        "bf": torch.randn(2, 2, generator=g).bfloat16(),
        "i8": torch.arange(6, dtype=torch.int8).reshape(2, 3),
        "b": torch.tensor([True, False]),
        "zero_d": torch.tensor(7, dtype=torch.int64),
        "nested": {"l": [torch.zeros(2, dtype=torch.int16), "s", {"deep": 5}]},
        "pair": (torch.ones(1), 2),  # a tuple leaf: one bytes item holding a tensor
        **BYTES_VALUES,
    }


@pytest.fixture(scope="module", params=[(1, True), (2, False)], ids=["t1-single", "t2-perfile"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    threads, single = request.param
    dcp_save(_state_dict(), path, thread_count=threads, single_file_per_rank=single)
    return path


def test_loads_torch_written_metadata(saved: Path) -> None:
    raw = (saved / ".metadata").read_bytes()
    ref = FileSystemReader(str(saved)).read_metadata()
    ours = loads_metadata(raw)
    assert ref.storage_meta.load_id is not None  # the reader stamps its own load id
    ref.storage_meta.load_id = None
    assert norm(ours) == norm(ref)
    assert type(ours.storage_meta.checkpoint_id) is type(ref.storage_meta.checkpoint_id)
    assert ours.version == ref.version == "1.0.0"
    assert ours.planner_data["nested.l.0"] == ("nested", "l", 0)
    # our classes, with torch loaded, hold torch objects
    w = ours.state_dict_metadata["w"]
    assert w.properties.dtype is torch.float32 and type(w.size) is torch.Size
    assert dumps_metadata(ours) == raw  # re-written byte for byte


def test_bytes_items_round_trip(saved: Path) -> None:
    md = loads_metadata((saved / ".metadata").read_bytes())
    flat, _ = flatten_state_dict(_state_dict())
    byte_keys = {k for k, v in md.state_dict_metadata.items()
                 if isinstance(v, smd.BytesStorageMetadata)}
    assert byte_keys == {k for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    assert {"cfg.betas", "cfg.tags", "nested.l.2.deep", "pair", "size", "dt"} <= byte_keys
    for idx, info in md.storage_data.items():
        if idx.fqn not in byte_keys:
            continue
        with open(saved / info.relative_path, "rb") as f:
            f.seek(info.offset)
            rec = f.read(info.length)
        assert len(rec) == info.length
        value = loads_object(rec)
        if idx.fqn == "pair":  # holds a tensor: read by torch.load(weights_only=True)
            assert torch.equal(value[0], torch.ones(1)) and value[1] == 2
            continue
        expected = flat[idx.fqn]
        assert value == expected and type(value) is type(expected), idx.fqn
        assert dumps_object(expected) == rec, idx.fqn  # torch.save's bytes, torch-free


def test_loads_object_refuses_objects_outside_allowlist() -> None:
    import fractions

    rec = dumps_object(fractions.Fraction(1, 3))
    with pytest.raises(UnsafePickleError, match="fractions.Fraction"):
        loads_object(rec)
    assert loads_object(rec, allow_unsafe=True) == fractions.Fraction(1, 3)
    # pure paths are inert values and are admitted
    assert loads_object(dumps_object(pathlib.PurePosixPath("/x"))) == pathlib.PurePosixPath("/x")
    buf = io.BytesIO()
    torch.save({"x": torch.nn.Linear(1, 1)}, buf)  # a module: torch's weights_only refuses
    with pytest.raises(UnsafePickleError, match="Linear"):
        loads_object(buf.getvalue())


def test_allow_unsafe_reads_plainly() -> None:
    tm = torch_metadata()
    ours = loads_metadata(pickle.dumps(tm), allow_unsafe=True)
    assert type(ours) is smd.Metadata and norm(ours) == norm(tm)
    rec = dumps_object(collections.Counter("aab"))
    with pytest.raises(UnsafePickleError, match="collections.Counter"):
        loads_object(rec)
    assert loads_object(rec, allow_unsafe=True) == collections.Counter("aab")


@dataclasses.dataclass
class UserPlannerData:
    """A class of the user's own, outside the allowlist (importable, so a
    plain unpickle finds it)."""

    name: str
    n: int


def test_unsafe_unpickle_reads_any_class(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import shardstate.checkpoint as ss

    sd = {"w": torch.randn(2, 3), "step": 5}
    dcp_save(sd, tmp_path)
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    md.planner_data["user"] = UserPlannerData("x", 1)
    raw = pickle.dumps(md)
    (tmp_path / ".metadata").write_bytes(raw)
    # refused by default, naming the class and the opt-in
    refused = r"test_metadata_pickle\.UserPlannerData.*unsafe_unpickle=True"
    with pytest.raises(ss.StorageFormatError, match=refused):
        ss.FileSystemReader(tmp_path).read_metadata()
    with pytest.raises(UnsafePickleError, match=refused):
        loads_metadata(raw)
    # the opt-in: a plain unpickle, used as it is (the writer is not involved)
    monkeypatch.setattr(W, "_dumps", lambda *a, **k: pytest.fail("the writer ran"))
    ours = loads_metadata(raw, allow_unsafe=True)
    assert type(ours) is smd.Metadata and ours.planner_data["user"] == UserPlannerData("x", 1)
    assert norm(ours) == norm(md)
    got = ss.FileSystemReader(tmp_path, unsafe_unpickle=True).read_metadata()
    assert got.planner_data["user"] == UserPlannerData("x", 1)
    out = {"w": torch.zeros(2, 3), "step": 0}
    ss.load(out, storage_reader=ss.FileSystemReader(tmp_path, unsafe_unpickle=True))
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 5


def test_old_format_metadata() -> None:
    tm = torch_metadata(False)
    del tm.__dict__["storage_meta"], tm.__dict__["version"]
    props = tm.state_dict_metadata["layer.w"].properties
    props.__getstate__ = lambda: {"dtype": torch.float64, "requires_grad": True}  # type: ignore
    ours = loads_metadata(pickle.dumps(tm))
    assert ours.storage_meta is None and ours.version is None
    p = ours.state_dict_metadata["layer.w"].properties
    assert (p.dtype, p.requires_grad, p.layout) == (torch.float64, True, torch.strided)
    # a bytes-item index never has an offset in its state
    assert next(iter(ours.storage_data)).offset is None


def _legacy_metadata(path: Path) -> tuple[tmd.Metadata, bytes]:
    """The checkpoint's torch Metadata, and the same with every
    TensorProperties made torch's legacy class (what older torch wrote)."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as Legacy

    current = pickle.loads((path / ".metadata").read_bytes())
    legacy = pickle.loads((path / ".metadata").read_bytes())
    for e in legacy.state_dict_metadata.values():
        if isinstance(e, tmd.TensorStorageMetadata):
            p = e.properties
            e.properties = Legacy(p.dtype, p.layout, p.requires_grad, p.memory_format,
                                  p.pin_memory)
    raw = pickle.dumps(legacy)
    assert raw.count(b"torch.distributed._shard.sharded_tensor.metadata") == 1
    assert b"MEM_FORMAT_ENCODING" in raw and b"TensorProperties" in raw
    return current, raw


def test_legacy_tensor_properties_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardstate.checkpoint as ss

    sd = {"w": torch.randn(3, 4), "h": torch.arange(6, dtype=torch.float16).reshape(2, 3),
          "cl": torch.zeros(1, 2, 2, 2).to(memory_format=torch.channels_last), "step": 3}
    dcp_save(sd, tmp_path)
    current, raw = _legacy_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(raw)
    # both engines read it as the current class
    for fast in (True, False):
        md = B._build("x", U._unpickle(raw, A._METADATA_GLOBALS, "x", fast=fast))
        for k in ("w", "h", "cl"):
            p, ref = md.state_dict_metadata[k].properties, current.state_dict_metadata[k].properties
            assert type(p) is smd.TensorProperties
            assert (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory) == (
                ref.dtype, ref.layout, ref.requires_grad, ref.memory_format, ref.pin_memory)
    assert norm(loads_metadata(raw)) == norm(current)
    # ... and the C unpickler serves it (no fallback to the reference)
    with monkeypatch.context() as m:
        m.setattr(U._RestrictedUnpickler, "load", lambda self: pytest.fail("reference ran"))
        assert norm(loads_metadata(raw)) == norm(current)
    # written back as torch's current class
    assert dumps_metadata(pickle.loads(raw)) == pickle.dumps(current)
    # shardstate's reader and load, and torch's, read the file alike
    ours = ss.FileSystemReader(tmp_path).read_metadata()
    theirs = FileSystemReader(str(tmp_path)).read_metadata()
    assert type(ours.state_dict_metadata["w"].properties) is tmd.TensorProperties
    assert type(theirs.state_dict_metadata["w"].properties).__module__ == (
        "torch.distributed._shard.sharded_tensor.metadata")
    ours.storage_meta.load_id = theirs.storage_meta.load_id = None
    assert norm(ours) == norm(theirs)
    for load in (ss.load, dcp.load):
        out = {"w": torch.zeros(3, 4), "h": torch.zeros(2, 3, dtype=torch.float16),
               "cl": torch.ones(1, 2, 2, 2), "step": 0}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load")
            load(out, checkpoint_id=str(tmp_path))
        assert all(torch.equal(out[k], sd[k]) for k in ("w", "h", "cl")) and out["step"] == 3


# --------------------------------------------------------------------------
# Without torch
# --------------------------------------------------------------------------


def test_torch_free_round_trip(tmp_path: Path) -> None:
    tm = torch_metadata(False)
    (tmp_path / "expected").write_bytes(pickle.dumps(tm))
    # every kind of placeholder, among plain values (the generic conversion),
    # and a string that spells the one for "torch"
    tm.planner_data["objs"] = [torch.float16, torch.strided, torch.channels_last, torch.int8,
                               "_ss00", (torch.sparse_coo,)]
    (tmp_path / "expected_objs").write_bytes(pickle.dumps(tm))
    dcp_save({"w": torch.ones(2), "step": 3, "cfg": {"a": [1, "x"]}}, tmp_path / "ck")
    script = textwrap.dedent(
        """
        import sys, pickle
        sys.modules["torch"] = None  # any import of torch now fails
        from pathlib import Path
        from shardstate.checkpoint import metadata as smd
        from shardstate.checkpoint._pickle import dumps_metadata, loads_metadata, loads_object
        tmp = Path(sys.argv[1])
        expected = (tmp / "expected").read_bytes()
        md = loads_metadata(expected)
        p = md.state_dict_metadata["layer.w"].properties
        assert p.dtype == "torch.float32" and type(p.dtype) is smd.TorchName, p
        assert md.state_dict_metadata["emb"].properties.memory_format == "torch.channels_last"
        assert type(md.state_dict_metadata["layer.w"].size) is tuple
        assert dumps_metadata(md) == expected
        from shardstate.checkpoint._pickle import standins as S, writer as W
        assert len(S._SETS) == 1
        expected = (tmp / "expected_objs").read_bytes()
        md = loads_metadata(expected)
        assert md.planner_data["objs"][:3] == ["torch.float16", "torch.strided",
                                              "torch.channels_last"]
        assert dumps_metadata(md) == expected
        assert W._dumps(md, False) is None and len(S._SETS) == 2
        ck = loads_metadata((tmp / "ck" / ".metadata").read_bytes())
        assert ck.state_dict_metadata["w"].size == (2,)
        got = {}
        for idx, info in ck.storage_data.items():
            if isinstance(ck.state_dict_metadata[idx.fqn], smd.BytesStorageMetadata):
                raw = (tmp / "ck" / info.relative_path).read_bytes()
                got[idx.fqn] = loads_object(raw[info.offset : info.offset + info.length])
        assert got == {"step": 3, "cfg.a": [1, "x"]}, got
        assert sys.modules["torch"] is None
        print("OK")
        """
    )
    env = package_env()
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr


# --------------------------------------------------------------------------
# Malicious and malformed pickles
# --------------------------------------------------------------------------


def _g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _s(text: str) -> bytes:
    b = text.encode()
    return b"X" + len(b).to_bytes(4, "little") + b


def _canary_cmd(canary: Path) -> str:
    return f"open({str(canary)!r}, 'w').close()"


def _evil(canary: Path) -> list[tuple[bytes, str]]:
    code = _canary_cmd(canary)
    shell = f"touch {canary}"
    md_new = _g(N._MD_MOD, "Metadata") + b")\x81"
    return [
        (b"\x80\x02" + _g("os", "system") + _s(shell) + b"\x85R.", "os.system"),
        (b"\x80\x02" + _g("posix", "system") + _s(shell) + b"\x85R.", "posix.system"),
        (b"\x80\x02" + _g("__builtin__", "eval") + _s(code) + b"\x85R.", "__builtin__.eval"),
        (b"\x80\x04" + _s("builtins") + _s("exec") + b"\x93" + _s(code) + b"\x85R.",
         "builtins.exec"),
        (b"\x80\x02" + _g("subprocess", "Popen") + b"(" + _s("touch") + _s(str(canary))
         + b"l\x85R.", "subprocess.Popen"),
        (b"\x80\x02" + _g("torch", "load") + _s(str(canary)) + b"\x85R.", "torch.load"),
        (b"\x80\x02" + _g("torch._utils", "_rebuild_tensor_v2") + b")R.",
         "torch._utils._rebuild_tensor_v2"),
        (b"\x80\x04" + _s("pathlib") + _s("Path.write_text") + b"\x93.", "pathlib.Path.write_text"),
        (b"\x80\x02" + _g("builtins", "getattr") + b".", "builtins.getattr"),
        # allowlisted callables with weird arguments
        (b"\x80\x02" + _g("torch", "Size") + _s(code) + b"\x85R.", "torch.Size"),
        (b"\x80\x02" + _g("__builtin__", "bytes") + b"\x8a\x05\x00\x00\x00\x00\x01\x85R.",
         "builtins.bytes"),
        (b"\x80\x02" + _g("torch.serialization", "_get_layout") + _s("os.system") + b"\x85R.",
         "_get_layout"),
        (b"\x80\x02" + _g(N._MD_MOD, "_MEM_FORMAT_ENCODING") + b"K\x07\x85R.",
         "_MEM_FORMAT_ENCODING"),
        (b"\x80\x02" + _g(N._MD_MOD, "Metadata") + _s(code) + b"\x85R.", "Metadata"),
        (b"\x80\x02" + _g(N._MD_MOD, "Metadata") + _s(code) + b"\x85\x81.", "Metadata"),
        # BUILD on shared (allowlisted) objects
        (b"\x80\x02" + _g("torch", "Size") + b"N}" + _s("fn") + _g("os", "system") + b"s\x86b.",
         "os.system"),
        (b"\x80\x02" + _g("torch", "Size") + b"}" + _s("fn") + b"Ns" + b"b.", "torch.Size"),
        (b"\x80\x02" + _g("torch", "float32") + b"N}" + _s("name") + _s("x") + b"s\x86b.",
         "torch.float32"),
        (b"\x80\x02" + _g(N._MD_MOD, "Metadata") + b"}b.", "metadata class"),
        (b"\x80\x02" + _g(N._MD_MOD, "_MEM_FORMAT_ENCODING") + b"K\x00\x85R}b.",
         "_MEM_FORMAT_ENCODING"),
        (b"\x80\x02" + md_new + b"}b}b.", "twice"),
        # other ways to reach code
        (b"(" + b"i" + b"os\nsystem\n" + b".", "os.system"),  # protocol 0 INST
        (b"\x80\x02(" + _g("builtins", "exec") + _s(code) + b"o.", "builtins.exec"),  # OBJ
        (b"\x80\x04" + _g(N._MD_MOD, "Metadata") + b")}" + _s("a") + b"K\x01s\x92.",
         "Metadata"),  # NEWOBJ_EX with keyword arguments
        (b"\x80\x02" + _g("copyreg", "_reconstructor") + b".", "copyreg._reconstructor"),
        (b"\x80\x02\x82\x01.", "extension"),
        (b"\x80\x02" + _s("x") + b"Q.", "persistent id"),
    ]


def test_malicious_pickles_are_refused(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    # the canary works: a plain unpickler runs the payload
    pickle.loads(b"\x80\x02" + _g("builtins", "exec") + _s(_canary_cmd(canary)) + b"\x85R.")
    assert canary.exists()
    canary.unlink()
    for data, name in _evil(canary):
        with pytest.raises(UnsafePickleError, match=name.replace(".", r"\.")):
            loads_metadata(data)
        with pytest.raises(UnsafePickleError):  # the bytes-item allowlist is narrower
            B._Builder("x").value(U._unpickle(data, A._PLAIN_GLOBALS, "bytes item"))
        assert not canary.exists(), name
    rec = dumps_object(1)
    evil_rec = rec.replace(b"\x80\x02K\x01.", b"\x80\x02" + _g("os", "system") + b"N\x85R.")
    assert len(evil_rec) != len(rec) or evil_rec != rec
    with pytest.raises(PickleFormatError):  # sizes no longer match: the zip is rejected
        loads_object(evil_rec)
    import shardstate.checkpoint._zipfmt as z
    evil = z.bytes_record(b"\x80\x02" + _g("os", "system") + _s(f"touch {canary}") + b"\x85R.")
    with pytest.raises(UnsafePickleError, match=r"os\.system"):
        loads_object(evil)
    assert not canary.exists()


def test_errors_are_shardstate_and_unpickling_errors() -> None:
    for cls in (UnsafePickleError, PickleFormatError):
        assert issubclass(cls, shardstate.ShardstateError)
        assert issubclass(cls, pickle.UnpicklingError)


def test_forged_memo_index_does_not_allocate() -> None:
    # The C unpickler would resize its memo array to 2**33 entries here.
    t = time.perf_counter()
    with pytest.raises(PickleFormatError, match="memo index"):  # and is refused
        loads_metadata(b"\x80\x04N" + b"r\xff\xff\xff\xff" + b".")
    with pytest.raises(PickleFormatError):
        loads_metadata(b"\x80\x02N" + b"p" + b"9" * 5000 + b"\n.")
    assert time.perf_counter() - t < 1


def test_forged_lengths_do_not_allocate() -> None:
    # pickle.py's BYTEARRAY8 allocates its announced length before reading;
    # the reference path (which gets whatever the C scan refuses) checks it.
    t = time.perf_counter()
    for n in (1 << 40, (1 << 63) - 1, 1 << 33):
        data = b"\x80\x05\x96" + n.to_bytes(8, "little") + b"."
        with pytest.raises(shardstate.ShardstateError):
            shardstate._core.pickle_scan(data)
        for fast in (True, False):
            with pytest.raises(PickleFormatError, match="BYTEARRAY8"):
                U._unpickle(data, A._PLAIN_GLOBALS, "x", fast=fast)
        with pytest.raises(PickleFormatError):
            loads_object(_zipfmt.bytes_record(data))
    # a well-formed one still reads
    ok = pickle.dumps(bytearray(b"abc"), protocol=5)
    assert U._unpickle(ok, A._PLAIN_GLOBALS, "x", fast=False) == bytearray(b"abc")
    assert time.perf_counter() - t < 1


def test_structure_is_validated() -> None:
    def md_with(state: bytes) -> bytes:
        return b"\x80\x02" + _g(N._MD_MOD, "Metadata") + b")\x81" + state + b"b."

    bad = [
        (md_with(b"}"), "no 'state_dict_metadata'"),
        (md_with(b"}" + _s("state_dict_metadata") + b"]s"), "not a dict"),
        (md_with(b"}" + _s("state_dict_metadata") + b"}" + _s("k") + b"K\x01ss"),
         "expected TensorStorageMetadata"),
        (md_with(b"}" + _s("state_dict_metadata") + b"}s" + _s("version") + b"K\x01s"),
         "version"),
        (b"\x80\x02]q\x00h\x00a" + b".", "not a Metadata"),
    ]
    for data, msg in bad:
        with pytest.raises(PickleFormatError, match=msg):
            loads_metadata(data)
    with pytest.raises(PickleFormatError, match="contains itself"):
        B._Builder("x").value(U._unpickle(b"\x80\x02]q\x00h\x00a.", {}, "x"))
    deep = b"\x80\x02" + b"]" * 300 + b"a" * 299 + b"."
    with pytest.raises(PickleFormatError, match="deeper"):
        loads_object(_zipfmt.bytes_record(deep))
    # Metadata nested in planner_data, 5000 deep: refused, no RecursionError
    level = (_g(N._MD_MOD, "Metadata") + b")\x81}" + _s("state_dict_metadata") + b"}s"
             + _s("planner_data"))
    with pytest.raises(PickleFormatError, match="deeper"):
        loads_metadata(b"\x80\x02" + level * 5000 + b"N" + b"sb" * 5000 + b".")


def test_truncated_and_garbage(saved: Path) -> None:
    raw = (saved / ".metadata").read_bytes()
    for n in list(range(0, 64)) + list(range(64, len(raw), 97)):
        with pytest.raises(PickleFormatError):
            loads_metadata(raw[:n])
    for junk in (b"garbage", b"\x80\x05\x95", b"\x00" * 100, bytes(range(256))):
        with pytest.raises(PickleFormatError):
            loads_metadata(junk)
        with pytest.raises(PickleFormatError):
            loads_object(junk)


_VALID = dumps_metadata(torch_metadata(False))


def _outcome(data: bytes, allowed: dict, fast: bool) -> tuple:
    """What the restricted unpickler makes of data, comparable across the
    two engines: the built graph pickled (equal values and equal sharing
    give equal bytes), or the error's type and message."""
    try:
        built = B._build("x", U._unpickle(data, allowed, "x", fast=fast))
    except (UnsafePickleError, PickleFormatError) as e:  # reprs' addresses differ per run
        return ("error", type(e).__name__, re.sub(r" at 0x[0-9a-f]+", "", str(e)))
    return ("value", pickle.dumps(built, protocol=5))



@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1,
                max_size=6),
       st.integers(0, len(_VALID)))
def test_fuzz_mutated_metadata(edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(_VALID)
    for pos, byte in edits:
        data[pos] = byte
    for blob in (bytes(data), bytes(data[:cut]) + bytes(data[cut + 1:])):
        # the C fast path and the pure-Python reference agree (value or error)
        assert _outcome(blob, A._METADATA_GLOBALS, True) == \
            _outcome(blob, A._METADATA_GLOBALS, False)
        try:
            md = loads_metadata(blob)
        except (UnsafePickleError, PickleFormatError):
            continue
        assert type(md) is smd.Metadata
        norm(md)  # the result is a well-formed graph


_VALID_OBJ = pickle.dumps(BYTES_VALUES | {"size": (2, 3), "dt": None}, protocol=2)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_VALID_OBJ) - 1), st.integers(0, 255)),
                min_size=1, max_size=4))
def test_fuzz_mutated_bytes_item(edits: list[tuple[int, int]]) -> None:
    data = bytearray(_VALID_OBJ)
    for pos, byte in edits:
        data[pos] = byte
    try:
        loads_object(_zipfmt.bytes_record(bytes(data)))
    except (UnsafePickleError, PickleFormatError):
        pass


def test_numpy_bytes_items() -> None:
    import numpy as np

    values = [np.arange(6, dtype=np.float32).reshape(2, 3),
              np.asfortranarray(np.arange(6).reshape(2, 3)), np.array(3.5), np.float64(1.5),
              np.int8(-3), np.zeros((0, 2), dtype=">i4"), np.array([True, False]),
              np.array([1 + 2j], dtype=np.complex64), {"a": [np.uint16(7)]}]
    for v in values:
        buf = io.BytesIO()
        torch.save(v, buf)
        rec = buf.getvalue()
        assert dumps_object(v) == rec
        out = loads_object(rec)
        if isinstance(v, dict):
            assert out == v and type(out["a"][0]) is np.uint16
            continue
        assert type(out) is type(v) and out.dtype == v.dtype and out.shape == v.shape
        assert np.array_equal(out, v)
        if isinstance(v, np.ndarray):
            assert out.flags["F_CONTIGUOUS"] == v.flags["F_CONTIGUOUS"] and out.flags.writeable
    buf = io.BytesIO()
    torch.save(np.array([1, "x"], dtype=object), buf)  # object arrays hold pickled objects
    with pytest.raises(UnsafePickleError, match="numpy.dtype"):
        loads_object(buf.getvalue())
    bad = pickle.dumps(np.arange(4, dtype=np.int32), protocol=2).replace(b"i4", b"i8")
    with pytest.raises(PickleFormatError, match="bytes of data"):
        loads_object(_zipfmt.bytes_record(bad))


# --------------------------------------------------------------------------
# The fast path: _core.pickle_scan, then CPython's C unpickler
# --------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", range(6))
def test_scan_passes_what_pickle_writes(protocol: int) -> None:
    values = [BYTES_VALUES, None, [1, [2, [3]]], {"k": (1.5, "é", b"\x00" * 300)},
              list(range(3000)), {"s": "x" * 70000}]
    for v in values:
        data = pickle.dumps(v, protocol=protocol)
        if protocol >= 2:  # 0 and 1 may hold text numbers, left to the reference
            proto, end = shardstate._core.pickle_scan(data)
            assert (proto, end) == (protocol, len(data))
            assert shardstate._core.pickle_scan(data + b"junk")[1] == len(data)
        assert _outcome(data, A._PLAIN_GLOBALS, True) == _outcome(data, A._PLAIN_GLOBALS, False)
        assert _outcome(data, A._PLAIN_GLOBALS, True)[0] == "value"


def test_scan_refuses_what_the_c_unpickler_would_mishandle() -> None:
    refused = [
        (b"\x80\x02\x82\x01.", ValueError, "EXT1"),
        (b"\x80\x02\x83\x01\x00.", ValueError, "EXT2"),
        (b"\x80\x02\x84\x01\x00\x00\x00.", ValueError, "EXT4"),
        (b"\x80\x02" + _s("x") + b"Q.", ValueError, "BINPERSID"),
        (b"Pid\n.", ValueError, "PERSID"),
        (b"\x80\x05\x97.", ValueError, "NEXT_BUFFER"),
        (b"N\x80\x02.", ValueError, "PROTO"),
        (b"\x80\x04N" + b"r\xff\xff\xff\xff" + b".", shardstate.ShardstateError, "memo index"),
        (b"\x80\x02N" + b"p" + b"9" * 5000 + b"\n.", shardstate.ShardstateError, "memo index"),
        (b"\x80\x04\x95" + (1 << 40).to_bytes(8, "little") + b"N.", shardstate.ShardstateError,
         "FRAME"),
        (b"\x80\x02X\xff\xff\xff\x7fabc.", shardstate.ShardstateError, "BINUNICODE"),
        (b"\x80\x02N", shardstate.ShardstateError, "no STOP"),
        # the C unpickler reads text numbers up to a NUL; the reference refuses them
        (b"F0\x00999\n.", ValueError, "FLOAT"),
        (b"I7\x00x\n.", ValueError, "INT"),
        (b"L010\n.", ValueError, "LONG"),
        (b"Np0\ng0\x00\n.", ValueError, "GET"),
    ]
    for data, exc, name in refused:
        with pytest.raises(exc, match=name):
            shardstate._core.pickle_scan(data)
    with pytest.raises(TypeError):
        shardstate._core.pickle_scan("not bytes")


def test_c_unpickler_refuses_the_malicious_pickles(tmp_path: Path) -> None:
    """Every payload the scan lets through is refused by the C unpickler
    itself (not only by the fallback), and runs nothing."""
    canary = tmp_path / "canary"
    through = 0
    for data, name in _evil(canary):
        try:
            proto, _ = shardstate._core.pickle_scan(data)
        except (ValueError, shardstate.ShardstateError):
            continue
        through += 1
        with pytest.raises(UnsafePickleError):
            B._build("x", U._CRestrictedUnpickler(data, A._METADATA_GLOBALS, proto).load())
        assert not canary.exists(), name
    assert through >= 20


def test_fast_path_serves_real_checkpoints(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = (saved / ".metadata").read_bytes()
    want = norm(loads_metadata(raw))
    obj = dumps_object(BYTES_VALUES)

    def reference_ran(self: Any) -> Any:
        raise AssertionError("the pure-Python unpickler ran")

    monkeypatch.setattr(U._RestrictedUnpickler, "load", reference_ran)
    assert norm(loads_metadata(raw)) == want
    assert loads_object(obj) == BYTES_VALUES


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([0, 2, 4, 5]),
       st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)), min_size=1, max_size=4))
def test_fuzz_fast_path_equals_reference_objects(protocol: int,
                                                 edits: list[tuple[int, int]]) -> None:
    data = bytearray(pickle.dumps(BYTES_VALUES | {"nested": [[1], {"a": (2,)}]},
                                  protocol=protocol))
    for pos, byte in edits:
        data[pos % len(data)] = byte
    assert _outcome(bytes(data), A._PLAIN_GLOBALS, True) == \
        _outcome(bytes(data), A._PLAIN_GLOBALS, False)


def test_gc_paused_restores_the_collector(saved: Path) -> None:
    import gc

    raw = (saved / ".metadata").read_bytes()
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(PickleFormatError):  # restored on the error path too
        loads_metadata(raw[: len(raw) // 2])
    assert gc.isenabled()
    loads_metadata(raw)
    dumps_metadata(loads_metadata(raw))
    assert gc.isenabled()
    gc.disable()
    try:  # a caller that turned it off keeps it off
        loads_metadata(raw)
        assert not gc.isenabled()
    finally:
        gc.enable()
