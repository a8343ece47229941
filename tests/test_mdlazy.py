"""The restricted reader's compact chunk lists (``_mdlazy.ChunkList``).

A Metadata of at least ``_mdlazy.LAZY_MIN`` chunks is read with each
tensor's chunks as int64 arrays (filled by C during the decode) and the
ChunkStorageMetadata objects made on demand. The tests lower the threshold
to 0 and check that the compact form is the reference reader's Metadata in
every way a user or torch sees it: equal (both ways), the same bytes written
back, pickling, copies, mutation; and that the load planner and the reader's
chunk lookup, which read the arrays, answer as over the lists (and as torch).
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random
from typing import Any

import numpy as np
import pytest
import torch
from shardstate.checkpoint import _mdlazy, _pickle
from shardstate.checkpoint import default_planner as sdp
from shardstate.checkpoint._pickle import fastread
from shardstate.checkpoint._records import _Records
from test_mdread import deep, random_metadata, same_sharing
from torch.distributed.checkpoint import default_planner as tdp
from torch.distributed.checkpoint import metadata as tmd
from torch.distributed.checkpoint import planner_helpers as tph
from torch.distributed.checkpoint.filesystem import _StorageInfo

ChunkList = _mdlazy.ChunkList
StorageMap = _mdlazy.StorageMap


@pytest.fixture
def lazy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Metadata read in the compact form (where the stream allows)."""
    monkeypatch.setattr(_mdlazy, "LAZY_MIN", 0)


def lists(x: Any) -> Any:
    """x with every ChunkList as the list it stands for (copies made)."""
    return _mdlazy.materialized(x)


@dataclasses.dataclass(frozen=True)
class _SubIndex(tmd.MetadataIndex):
    """Equal to no MetadataIndex as a dict key (dataclass eq)."""


def _lookups_agree(got: Any, ref: Any) -> None:
    """Every key of the reference's storage_data (and the same key with a
    wrong index hint, and keys that are not there) looked up in the compact
    form without making its dict."""
    sd = got.storage_data
    assert type(sd) is StorageMap and len(sd) == len(ref.storage_data)
    for k, v in ref.storage_data.items():
        assert sd[k] == v and k in sd and sd.get(k) == v
        assert deep(sd[k]) == deep(v)
        other = tmd.MetadataIndex(k.fqn, k.offset, None if k.index else 7)
        assert sd[other] == v
        assert tmd.MetadataIndex(k.fqn + "x", k.offset) not in sd
        if k.offset is not None:
            assert sd.get(tmd.MetadataIndex(k.fqn, [*k.offset, 0]), "no") == "no"
    assert "w" not in sd and sd.get(("w", None)) is None
    for k in list(ref.storage_data)[:1]:
        sub = _SubIndex(k.fqn, k.offset)
        assert sub not in sd and sub not in ref.storage_data
    with pytest.raises(KeyError):
        sd[tmd.MetadataIndex("nope")]
    assert sd._dict is None


def _compact(md: Any) -> list[Any]:
    return [v.chunks for v in md.state_dict_metadata.values()
            if type(getattr(v, "chunks", None)) is ChunkList]


def _tiled(fqn_count: int, rows: int, cols: int, grid: tuple[int, int]) -> tmd.Metadata:
    """Tensors of (rows, cols) cut in a grid of chunks, as a multi-rank save
    holds them (no object shared between chunks and storage_data keys)."""
    sdm, storage = {}, {}
    gr, gc = grid
    for t in range(fqn_count):
        fqn = f"layers.{t}.w"
        chunks = []
        for i in range(gr):
            for j in range(gc):
                r0, r1 = rows * i // gr, rows * (i + 1) // gr
                c0, c1 = cols * j // gc, cols * (j + 1) // gc
                k = len(chunks)
                chunks.append(tmd.ChunkStorageMetadata(torch.Size([r0, c0]),
                                                       torch.Size([r1 - r0, c1 - c0])))
                storage[tmd.MetadataIndex(fqn, torch.Size([r0, c0]), k)] = _StorageInfo(
                    f"__{k}_0.distcp", 4096 * t, (r1 - r0) * (c1 - c0) * 4)
        sdm[fqn] = tmd.TensorStorageMetadata(tmd.TensorProperties(dtype=torch.float32),
                                             torch.Size([rows, cols]), chunks)
    return tmd.Metadata(sdm, storage_data=storage, version="1.0.0")


@pytest.mark.usefixtures("lazy")
@pytest.mark.parametrize("seed", range(3))
def test_random_metadata_compact_equals_reference(seed: int) -> None:
    r = random.Random(seed)
    compact = maps = 0
    for _ in range(40):
        md = random_metadata(r)
        for data in (pickle.dumps(md, protocol=4), _pickle.dumps_metadata(md)):
            ref = _pickle._reference(data)
            got = _pickle.loads_metadata(data)
            compact += len(_compact(got))
            if type(got.storage_data) is StorageMap:
                maps += 1
                _lookups_agree(got, ref)
                _lookups_agree(_pickle.loads_metadata(data), ref)
            assert deep(lists(got)) == deep(ref)
            assert got == ref and ref == got and got == md and not got != ref
            # written back: the bytes of the reference's Metadata, which
            # torch reads to an equal Metadata; the compact form untouched
            out = _pickle.dumps_metadata(got)
            assert out == _pickle.dumps_metadata(ref)
            assert pickle.loads(out) == md
            assert all(c.arrays() is not None for c in _compact(got))
            assert getattr(got.storage_data, "_dict", None) is None
            # plain pickle and copies give lists of equal chunks
            assert pickle.loads(pickle.dumps(got)) == md
            assert copy.deepcopy(got) == md and copy.copy(got) == md
    assert compact > 50 and maps > 10


def test_threshold_keeps_small_files_as_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _pickle.dumps_metadata(_tiled(2, 8, 8, (2, 2)))  # 8 chunks
    monkeypatch.setattr(_mdlazy, "LAZY_MIN", 9)
    assert not _compact(_pickle.loads_metadata(data))
    monkeypatch.setattr(_mdlazy, "LAZY_MIN", 8)
    got = _pickle.loads_metadata(data)
    assert len(_compact(got)) == 2
    off, sizes = _compact(got)[0].arrays()
    assert off.dtype == np.int64 and off.tolist() == [[0, 0], [0, 4], [4, 0], [4, 4]]
    assert sizes.tolist() == [[4, 4]] * 4 and not off.flags.writeable


@pytest.mark.usefixtures("lazy")
def test_shared_chunk_objects_stay_lists() -> None:
    """A stream that shares a chunk's Size elsewhere (here a storage key's
    offset; MetadataIndex copies the Size it is given, so it takes a setattr)
    keeps that tensor a list, so what is shared stays one object and is
    written back the same."""
    md = _tiled(2, 8, 8, (2, 1))
    t = md.state_dict_metadata["layers.0.w"]
    key = next(k for k in md.storage_data if k.fqn == "layers.0.w")
    object.__setattr__(key, "offset", t.chunks[0].offsets)
    data = pickle.dumps(md)
    got = _pickle.loads_metadata(data)
    assert type(got.state_dict_metadata["layers.0.w"].chunks) is list
    assert type(got.state_dict_metadata["layers.1.w"].chunks) is ChunkList
    assert _pickle.dumps_metadata(got) == data


@pytest.mark.usefixtures("lazy")
def test_list_semantics_and_mutation() -> None:
    md = _tiled(1, 6, 4, (3, 1))
    data = _pickle.dumps_metadata(md)
    got = _pickle.loads_metadata(data)
    ch = got.state_dict_metadata["layers.0.w"].chunks
    want = md.state_dict_metadata["layers.0.w"].chunks
    assert type(ch) is ChunkList and len(ch) == 3 and bool(ch)
    assert repr(ch) == repr(want) and ch == want and want == ch and ch != want[:2]
    assert ch.make_chunk(2) == want[2] and ch.arrays() is not None  # no list made
    with pytest.raises(TypeError):
        hash(ch)
    # element access makes the list once: identity kept, changes kept
    first = ch[0]
    assert ch.arrays() is None and first is ch[0] and ch[-1] == want[-1]
    assert ch[1:] == want[1:] and list(ch) == want and want[1] in ch and ch.index(want[2]) == 2
    first.sizes = torch.Size([1, 4])
    assert ch[0].sizes == torch.Size([1, 4])
    extra = tmd.ChunkStorageMetadata(torch.Size([5, 0]), torch.Size([1, 4]))
    ch.append(extra)
    assert len(ch) == 4 and ch[3] is extra and ch + [] == [*ch] and [] + ch == list(ch)
    del ch[3]
    ch[0] = want[0]
    assert ch == want
    # the writer writes the list as it now is
    ch.append(extra)
    back = _pickle._reference(_pickle.dumps_metadata(got))
    assert back.state_dict_metadata["layers.0.w"].chunks == [*want, extra]


@pytest.mark.usefixtures("lazy")
def test_copies() -> None:
    got = _pickle.loads_metadata(_pickle.dumps_metadata(_tiled(1, 4, 4, (2, 2))))
    ch = got.state_dict_metadata["layers.0.w"].chunks
    deep_md = copy.deepcopy(got)
    dch = deep_md.state_dict_metadata["layers.0.w"].chunks
    assert dch == ch and dch is not ch
    dch.append(tmd.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([1, 1])))
    assert len(ch) == 4 and ch.arrays() is not None  # the original is untouched
    shallow = copy.copy(ch)
    assert shallow == ch and shallow is not ch
    shallow.pop()
    assert len(ch) == 4 and len(shallow) == 3
    ch[0]  # noqa: B018 - made a list: its copies are lists of the same chunks
    deep_list = copy.deepcopy(ch)
    assert type(deep_list) is list and deep_list == ch and deep_list[0] is not ch[0]


@pytest.mark.usefixtures("lazy")
def test_records_chunk_lookup_on_arrays() -> None:
    """The reader's lookup of a read item's saved chunk (by its index hint,
    else by offset) answers from the arrays, as from the lists."""
    md = _tiled(1, 8, 6, (2, 3))
    got = _pickle.loads_metadata(_pickle.dumps_metadata(md))
    rec_lazy, rec_list = _Records.__new__(_Records), _Records.__new__(_Records)
    rec_lazy.metadata, rec_list.metadata = got, md
    rec_lazy._chunk_maps, rec_list._chunk_maps = {}, {}
    for k in list(md.storage_data) + [tmd.MetadataIndex("layers.0.w", torch.Size([4, 2]), 0),
                                      tmd.MetadataIndex("layers.0.w", torch.Size([4, 2]), 99),
                                      tmd.MetadataIndex("layers.0.w", torch.Size([1, 1]), 0),
                                      tmd.MetadataIndex("layers.0.w", None, 0),
                                      tmd.MetadataIndex("nope", torch.Size([0, 0]), 0)]:
        a, b = rec_lazy.chunk(k), rec_list.chunk(k)
        assert (a is None) == (b is None)
        if a is not None:
            assert a[1] == b[1] and a[0] is got.state_dict_metadata[k.fqn]
    assert _compact(got)[0].arrays() is not None


def _random_local(rng: random.Random, shape: list[int], n: int) -> list[Any]:
    out = []
    for _ in range(n):
        off = [rng.randrange(s) for s in shape]
        size = [rng.randrange(s - o + 1) if rng.random() < 0.05 else rng.randint(1, s - o)
                for s, o in zip(shape, off)]
        out.append(tmd.ChunkStorageMetadata(torch.Size(off), torch.Size(size)))
    return out


@pytest.mark.usefixtures("lazy")
def test_read_items_on_arrays_match_torch() -> None:
    """Resharding reads planned over the compact form: torch's items (its
    planner over the reference lists), for 1-3 dims, one saved chunk or many,
    a few destination chunks (the scan) or many (the index)."""
    rng = random.Random(5)
    compared = 0
    for _ in range(80):
        ndim = rng.randint(1, 3)
        shape = [rng.randint(1, 12) for _ in range(ndim)]
        cuts = rng.choice([1, 2, 3, 5])
        chunks = []
        for i in range(cuts):
            lo, hi = shape[0] * i // cuts, shape[0] * (i + 1) // cuts
            chunks.append(tmd.ChunkStorageMetadata(torch.Size([lo] + [0] * (ndim - 1)),
                                                   torch.Size([hi - lo] + shape[1:])))
        md = tmd.Metadata({"w": tmd.TensorStorageMetadata(tmd.TensorProperties(),
                                                          torch.Size(shape), chunks)}, None, {})
        got = _pickle.loads_metadata(_pickle.dumps_metadata(md)).state_dict_metadata["w"]
        assert type(got.chunks) is ChunkList
        local = _random_local(rng, shape, rng.choice([1, 2, 4, 9]))
        if rng.random() < 0.2:
            local = [tmd.ChunkStorageMetadata(c.offsets, c.sizes) for c in chunks]
        ours = sdp.create_read_items_for_chunk_list("w", got, local)
        eager = sdp.create_read_items_for_chunk_list("w", md.state_dict_metadata["w"], local)
        assert ours == eager
        assert got.chunks.arrays() is not None
        if any(0 in c.sizes for c in local + chunks):
            continue  # torch plans empty reads for some empty boxes; shardstate none
        theirs = tph.create_read_items_for_chunk_list("w", md.state_dict_metadata["w"], local)
        assert ours == theirs
        assert [deep(i) for i in ours] == [deep(i) for i in theirs]
        compared += 1
    assert compared > 50


@pytest.mark.usefixtures("lazy")
def test_load_planner_over_compact_metadata_matches_torch() -> None:
    """Both planners over the compact Metadata give torch's plan over the
    reference's (torch's iterates, making the lists)."""
    md = _tiled(3, 16, 8, (4, 2))
    data = _pickle.dumps_metadata(md)
    sd = {f"layers.{t}.w": torch.empty(16, 8) for t in range(3)}

    def plan(mod: Any, meta: Any) -> Any:
        p = mod.DefaultLoadPlanner()
        p.set_up_planner(sd, meta, is_coordinator=False)
        return p.create_local_plan()

    want = plan(tdp, pickle.loads(data))
    ours_md = _pickle.loads_metadata(data)
    assert plan(sdp, ours_md) == want
    assert all(c.arrays() is not None for c in _compact(ours_md))
    assert plan(tdp, _pickle.loads_metadata(data)) == want


def _save_both(rank: int, world: int, root: str) -> None:
    import shardstate.checkpoint as dcp
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {"rows": distribute_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0)],
                                    src_data_rank=None),
          "cols": distribute_tensor(torch.arange(30.0).reshape(3, 10), mesh, [Shard(1)],
                                    src_data_rank=None),
          "plain": torch.arange(5.0), "step": 7}
    tdcp.save(sd, checkpoint_id=f"{root}/torch")
    dcp.save(sd, checkpoint_id=f"{root}/ours")


@pytest.mark.usefixtures("lazy")
def test_real_checkpoints_read_compact_and_load(tmp_path: Any, run_distributed: Any) -> None:
    """Checkpoints torch and shardstate wrote on 2 ranks: read in the compact
    form (the sharded tensors), equal to the reference, written back to the
    same bytes, and loaded at world size 1 (every destination reads both
    saved chunks) with the right values; shardstate's is read by torch."""
    import shardstate.checkpoint as dcp
    import torch.distributed.checkpoint as tdcp

    run_distributed(_save_both, 2, str(tmp_path))
    for name in ("torch", "ours"):
        d = tmp_path / name
        data = (d / ".metadata").read_bytes()
        reader = dcp.FileSystemReader(d)
        reader.load_id = "L"
        md = reader.read_metadata()
        ref = _pickle._reference(data)
        ref.storage_meta.load_id = "L"
        kinds = {k: type(v.chunks) for k, v in md.state_dict_metadata.items()
                 if hasattr(v, "chunks")}
        assert kinds["rows"] is ChunkList and kinds["cols"] is ChunkList, (name, kinds)
        assert type(md.storage_data) is StorageMap
        _lookups_agree(md, ref)
        assert md == ref and deep(lists(md)) == deep(ref)
        assert _pickle.dumps_metadata(md) == _pickle.dumps_metadata(ref)
        sd = {"rows": torch.zeros(6, 4), "cols": torch.zeros(3, 10),
              "plain": torch.zeros(5), "step": 0}
        dcp.load(sd, checkpoint_id=d)
        assert torch.equal(sd["rows"], torch.arange(24.0).reshape(6, 4))
        assert torch.equal(sd["cols"], torch.arange(30.0).reshape(3, 10))
        assert torch.equal(sd["plain"], torch.arange(5.0)) and sd["step"] == 7
        if name == "ours":
            theirs = {"rows": torch.zeros(6, 4), "cols": torch.zeros(3, 10),
                      "plain": torch.zeros(5), "step": 0}
            with pytest.warns(UserWarning, match="single process"):
                tdcp.load(theirs, checkpoint_id=d)
            assert all(torch.equal(theirs[k], sd[k]) for k in ("rows", "cols", "plain"))


@pytest.mark.usefixtures("lazy")
def test_storage_map_semantics() -> None:
    md = _tiled(2, 4, 4, (2, 1))
    for info in md.storage_data.values():
        info.shardstate_crc32 = 5
    md.storage_data[tmd.MetadataIndex("b")] = _StorageInfo("__0_0.distcp", 9, 3)
    data = _pickle.dumps_metadata(md)
    got = _pickle.loads_metadata(data)
    sd = got.storage_data
    assert type(sd) is StorageMap
    ref = _pickle._reference(data)
    _lookups_agree(got, ref)
    assert sd == md.storage_data and md.storage_data == sd and not sd != md.storage_data
    assert repr(sd) == repr(md.storage_data)
    assert _pickle.dumps_metadata(got) == _pickle.dumps_metadata(ref) == data
    with pytest.raises(TypeError):
        hash(sd)
    # the reader's view keyed by (fqn, offset tuple), before and after the
    # dict is made
    made_sd = _pickle.loads_metadata(data).storage_data
    for made in (False, True):
        view = _mdlazy.IndexKeyView(made_sd if made else sd)
        if made:
            dict(made_sd)
        for k, v in ref.storage_data.items():
            key = (k.fqn, None if k.offset is None else tuple(k.offset))
            assert view[key] == v and view.get(key) == v and key in view
        assert view.get(("b", (0,)), "no") == "no" and ("layers.0.w", None) not in view
        with pytest.raises(KeyError):
            view[("layers.0.w", (1, 0))]
        assert (made_sd._dict is not None) == made and sd._dict is None
    # the strings the stream shares (a file name used by many entries) are
    # one object, as the reference makes them; the others each their own
    assert same_sharing(lists(got), ref)
    # copies, pickling
    assert copy.deepcopy(sd) == md.storage_data and copy.copy(sd) == sd
    assert pickle.loads(pickle.dumps(sd)) == md.storage_data
    assert copy.deepcopy(got) == md and pickle.loads(pickle.dumps(got)) == md
    assert sd._dict is None
    # iteration makes the dict once; changes go to it and are written
    keys = list(sd)
    assert keys == list(md.storage_data) and sd._dict is not None
    assert next(iter(sd)) is keys[0] and list(sd.items()) == list(md.storage_data.items())
    extra = tmd.MetadataIndex("c")
    sd[extra] = _StorageInfo("__1_0.distcp", 1, 1)
    del sd[keys[0]]
    assert len(sd) == len(md.storage_data) and extra in sd and keys[0] not in sd
    back = _pickle._reference(_pickle.dumps_metadata(got))
    assert extra in back.storage_data and keys[0] not in back.storage_data


@pytest.mark.usefixtures("lazy")
def test_storage_data_with_a_key_twice_goes_to_the_reference() -> None:
    """Two keys equal as dict keys (same fqn and offset) are one entry in a
    dict: the fast path leaves such a stream to the reference, which
    decides, in the compact form as in the dict walk."""
    md = _tiled(1, 4, 4, (2, 1))
    k0, k1 = list(md.storage_data)
    object.__setattr__(k1, "offset", torch.Size([0, 0]))
    data = pickle.dumps(md)
    assert data.count(b"MetadataIndex") == 1
    assert fastread._fast(data) is None
    assert _pickle.loads_metadata(data) == _pickle._reference(data)


@pytest.mark.usefixtures("lazy")
def test_mutated_streams_compact_never_disagree() -> None:
    """Bytes flipped, dropped, inserted: where the fast path takes a mutant
    in the compact form, the reference gives the same Metadata; where the
    reference refuses it, the fast path does too."""
    r = random.Random(3)
    md = _tiled(2, 4, 6, (2, 2))
    for info in md.storage_data.values():
        info.shardstate_crc32 = 7
    md.storage_data[tmd.MetadataIndex("b")] = _StorageInfo("__0_0.distcp", 9, 3)
    bases = [pickle.dumps(md), _pickle.dumps_metadata(md)]
    taken = compact = 0
    for _ in range(1500):
        b = bytearray(r.choice(bases))
        for _ in range(r.choice([1, 1, 1, 2])):
            i = r.randrange(len(b))
            k = r.randrange(3)
            if k == 0:
                b[i] = r.randrange(256)
            elif k == 1:
                del b[i]
            else:
                b.insert(i, r.randrange(256))
        data = bytes(b)
        fast = fastread._fast(data)
        if fast is None:
            continue
        taken += 1
        compact += type(fast.storage_data) is StorageMap and len(_compact(fast)) > 0
        assert deep(lists(fast)) == deep(_pickle._reference(data))
    assert taken > 25 and compact > 20


_TORCH_FREE = """
import sys
sys.modules["torch"] = None  # any import of torch now fails
from shardstate.checkpoint import metadata as smd, _pickle, _mdlazy
_mdlazy.LAZY_MIN = 0
chunks = [smd.ChunkStorageMetadata((i * 2, 0), (2, 3)) for i in range(3)]
md = smd.Metadata(
    state_dict_metadata={"w": smd.TensorStorageMetadata(smd.TensorProperties(), (6, 3), chunks)},
    storage_data={smd.MetadataIndex("w", (i * 2, 0), i): smd._StorageInfo("__0_0.distcp", i, 9)
                  for i in range(3)}, version="1.0.0")
data = _pickle.dumps_metadata(md)
got = _pickle.loads_metadata(data)
assert type(got.state_dict_metadata["w"].chunks) is _mdlazy.ChunkList
assert type(got.storage_data) is _mdlazy.StorageMap
assert got == md and _pickle.dumps_metadata(got) == data
k = smd.MetadataIndex("w", (2, 0), 1)
assert got.storage_data[k] == md.storage_data[k]
c = got.state_dict_metadata["w"].chunks.make_chunk(1)
assert type(c.offsets) is tuple and c == chunks[1]
print("ok")
"""


def test_torch_free_compact() -> None:
    import subprocess
    import sys

    from _child_env import package_env

    out = subprocess.run([sys.executable, "-c", _TORCH_FREE], capture_output=True, text=True,
                         env=package_env(), timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-2000:]
