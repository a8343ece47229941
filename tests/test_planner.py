"""The default planners against torch 2.13's own, item by item.

Every comparison runs torch's planner and shardstate's on the same input and
compares the plans and metadata field by field (``plain`` turns both
libraries' data classes into the same nested tuples). DTensor cases run on
real gloo processes (one 4-rank run covers meshes of 1-4 ranks).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import random
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as tdcp  # noqa: F401  (loads the submodules below)
from _child_env import package_env
from hypothesis import given, settings
from hypothesis import strategies as st
from shardstate.checkpoint import _nested_dict, _plan_reads, _traverse
from shardstate.checkpoint import default_planner as sdp
from shardstate.checkpoint import planner as splanner
from shardstate.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint import _version as torch_version
from torch.distributed.checkpoint import default_planner as tdp
from torch.distributed.checkpoint import planner as tplanner
from torch.distributed.checkpoint import planner_helpers as thelpers
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as torch_flatten
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as TChunk
from torch.distributed.checkpoint.metadata import TensorProperties as TProps
from torch.distributed.checkpoint.metadata import TensorStorageMetadata as TTensorMD

# --------------------------------------------------------------------------
# Comparing torch's objects with ours
# --------------------------------------------------------------------------


def plain(obj: Any) -> Any:
    """Both libraries' plans/metadata as nested builtins (class names kept)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__,) + tuple(
            (f.name, plain(getattr(obj, f.name))) for f in dataclasses.fields(obj)
        )
    if isinstance(obj, enum.Enum):
        return (type(obj).__name__, obj.name)
    if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
        return str(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, tuple):  # torch.Size included
        return tuple(plain(v) for v in obj)
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two ``plain`` values first differ, or None."""
    if type(a) is not type(b):
        return f"{path}: {a!r} != {b!r}"
    if isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b)):
            where = first_difference(x, y, f"{path}[{i}]")
            if where:
                return where
        return None if len(a) == len(b) else f"{path}: length {len(a)} != {len(b)}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            where = first_difference(a[k], b[k], f"{path}[{k!r}]")
            if where:
                return where
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def assert_same(ours: Any, theirs: Any, what: str = "") -> None:
    where = first_difference(plain(ours), plain(theirs))
    assert where is None, f"{what} differs from torch at {where} (ours != torch)"


def nonempty(items: list[Any]) -> list[Any]:
    """torch plans zero-element reads (an empty chunk inside another); we don't."""
    return [i for i in items if i.type.name == "BYTE_IO" or 0 not in tuple(i.lengths)]


def save_both(sds: list[dict], **kw: Any) -> tuple[Any, Any]:
    """(ours, torch's): local plans, global plans, metadata, finished plans,
    for one state dict per simulated rank (plain tensors need no group)."""
    out = []
    for cls in (sdp.DefaultSavePlanner, tdp.DefaultSavePlanner):
        planners = [cls(**kw) for _ in sds]
        local = []
        for rank, (p, sd) in enumerate(zip(planners, sds)):
            p.set_up_planner(sd, None, rank == 0)
            local.append(p.create_local_plan())
        global_plan, md = planners[0].create_global_plan(local)
        final = [p.finish_plan(g) for p, g in zip(planners, global_plan)]
        out.append((local, global_plan, md, final))
    return out[0], out[1]


def assert_save_same(sds: list[dict], **kw: Any) -> Any:
    ours, theirs = save_both(sds, **kw)
    for name, a, b in zip(("local", "global", "metadata", "final"), ours, theirs):
        assert_same(a, b, name)
    return ours


def load_both(sd_factory: Any, metadata: Any, **kw: Any) -> tuple[Any, Any]:
    out = []
    for cls in (sdp.DefaultLoadPlanner, tdp.DefaultLoadPlanner):
        p = cls(**kw)
        p.set_up_planner(sd_factory(), metadata, True)
        local = p.create_local_plan()
        out.append((local, p.create_global_plan([local])[0]))
    return out[0], out[1]


def assert_load_same(sd_factory: Any, metadata: Any, **kw: Any) -> Any:
    ours, theirs = load_both(sd_factory, metadata, **kw)
    assert_same(ours[0].items, nonempty(theirs[0].items), "load plan")
    assert_same(ours[1].items, nonempty(theirs[1].items), "global load plan")
    return ours[0]


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]


def mixed_state_dict(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {
        f"t_{str(dt).split('.')[1]}": torch.randn(3, 5, generator=g).to(dt) for dt in DTYPES
    }
    sd.update({
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "empty2": torch.empty(3, 0, dtype=torch.int64),
        "strided": torch.arange(24.0).reshape(4, 6)[:, ::2],
        "model": {"layer": {"weight": torch.ones(2, 2), "bias": torch.zeros(2)},
                  "steps": 7, "name": "m", 3: torch.ones(1)},
        "optim": {"state": {0: {"exp_avg": torch.ones(4), "step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "list_of_tensors": [torch.ones(2), torch.zeros(3), 99],
        "plain_list": [1, 2, 3],
        "tuple": (torch.ones(1), 2),
        "nested_lists": ["x", 99, [{"k3": "y"}]],
        "bytes": b"\x00\x01",
        "none": None,
        "empty_dict": {},
    })
    return sd


# --------------------------------------------------------------------------
# Flattening
# --------------------------------------------------------------------------


@pytest.mark.parametrize("v2_3", [False, True])
def test_flatten_matches_torch(v2_3: bool) -> None:
    sd = mixed_state_dict()
    sd["no_tensors"] = {"a": {"b": 1}, "c": [1, {"d": 2}]}
    torch_version._derived_version = "2_3" if v2_3 else None
    try:
        theirs = torch_flatten(sd)
    finally:
        torch_version._derived_version = None
    ours = _nested_dict.flatten_state_dict(sd, v2_3=v2_3)
    assert list(ours[0]) == list(theirs[0])
    assert all(ours[0][k] is theirs[0][k] for k in ours[0])
    assert ours[1] == theirs[1]
    # The keys differ between the two rules (that is why old checkpoints need the fallback).
    assert ("no_tensors.a.b" in ours[0]) != v2_3
    nested = _nested_dict.unflatten_state_dict(*ours)
    assert nested["model"]["layer"]["bias"] is sd["model"]["layer"]["bias"]
    assert nested["list_of_tensors"][2] == 99 and nested["optim"]["state"]["0"]["exp_avg"] is \
        sd["optim"]["state"][0]["exp_avg"]


_leaf = st.one_of(st.integers(-3, 3), st.text("ab", max_size=2), st.none(),
                 st.builds(lambda n: torch.ones(n), st.integers(0, 2)))
_tree = st.recursive(
    _leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.tuples(kids, kids),
        st.dictionaries(st.one_of(st.text("xy", min_size=1, max_size=2), st.integers(0, 2)),
                        kids, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text("kl", min_size=1, max_size=2), _tree, max_size=4),
       st.booleans())
def test_flatten_matches_torch_on_random_trees(sd: dict, v2_3: bool) -> None:
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    torch_version._derived_version = "2_3" if v2_3 else None
    try:
        theirs = torch_flatten(sd)
    except ValueError:  # a duplicated key (e.g. "1" and 1 in one dict)
        theirs = None
    finally:
        torch_version._derived_version = None
    if theirs is None:
        with pytest.raises(ValueError, match="duplicated flatten key"):
            _nested_dict.flatten_state_dict(sd, v2_3=v2_3)
        return
    ours = _nested_dict.flatten_state_dict(sd, v2_3=v2_3)
    assert list(ours[0]) == list(theirs[0]) and ours[1] == theirs[1]
    assert all(ours[0][k] is theirs[0][k] for k in ours[0])
    a, b = _nested_dict.unflatten_state_dict(*ours), unflatten_state_dict(*theirs)
    assert repr(a) == repr(b)


def test_flatten_duplicate_key_and_deep_nesting() -> None:
    with pytest.raises(ValueError, match=r"duplicated flatten key a\.b"):
        _nested_dict.flatten_state_dict({"a": {"b": 1}, "a.b": 2})
    deep: dict = {}
    cur = deep
    for _ in range(3000):  # deeper than the recursion limit
        cur["n"] = {}
        cur = cur["n"]
    cur["t"] = torch.ones(1)
    flat, mapping = _nested_dict.flatten_state_dict(deep)
    (key,) = flat
    assert len(mapping[key]) == 3001
    assert _traverse.get_element(deep, mapping[key]) is cur["t"]
    assert _traverse.get_element(deep, ("n", "x"), "missing") == "missing"


# --------------------------------------------------------------------------
# Save plans
# --------------------------------------------------------------------------


@pytest.mark.parametrize("flatten", [True, False])
def test_save_plan_single_rank_matches_torch(flatten: bool) -> None:
    sd = mixed_state_dict()
    local, global_plan, md, final = assert_save_same([sd], flatten_state_dict=flatten)
    assert any(i.type.name == "BYTE_IO" for i in local[0].items)
    assert md.planner_data is None if not flatten else "model.layer.weight" in md.planner_data


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("lowest", [False, True])
def test_dedup_of_replicated_items_matches_torch(world: int, lowest: bool) -> None:
    sds = []
    for rank in range(world):
        sd = mixed_state_dict(seed=0)
        sd[f"rank_only_{rank}"] = torch.ones(rank + 1, 100)  # unbalances the byte counts
        sd["big"] = torch.ones(1000)
        sds.append(sd)
    _, global_plan, md, _ = assert_save_same(sds, dedup_save_to_lowest_rank=lowest)
    owners = {i.index.fqn: r for r, p in enumerate(global_plan) for i in p.items}
    assert len(owners) == sum(len(p.items) for p in global_plan)  # each item once
    if lowest:
        assert {r for f, r in owners.items() if not f.startswith("rank_only")} == {0}
    else:
        assert len(set(owners.values())) > 1  # spread over the ranks


def _overlapping_plans(mod: Any, props: Any, chunk: Any, index: Any) -> list:
    """Plans whose chunks overlap, overrun and overfill a 10 x 4 tensor."""

    def mk(off: tuple, size: tuple) -> Any:
        return mod.WriteItem(
            index=index("w", torch.Size(off)), type=mod.WriteItemType.SHARD,
            tensor_data=mod.TensorWriteData(
                chunk=chunk(offsets=torch.Size(off), sizes=torch.Size(size)),
                properties=props(), size=torch.Size([10, 4])))

    return [mod.SavePlan([mk((0, 0), (6, 4))]),
            mod.SavePlan([mk((5, 0), (5, 4)), mk((8, 0), (4, 4))])]


def test_validation_errors_match_torch(caplog: pytest.LogCaptureFixture) -> None:
    messages = []
    for plans, cls in (
        (_overlapping_plans(splanner, TensorProperties, ChunkStorageMetadata, sdp.MetadataIndex),
         sdp.DefaultSavePlanner),
        (_overlapping_plans(tplanner, TProps, TChunk, tdp.MetadataIndex), tdp.DefaultSavePlanner),
    ):
        caplog.clear()
        with pytest.raises(ValueError, match="Failed to validate global plan: key:w has out of"):
            cls(flatten_state_dict=False).create_global_plan(plans)
        messages.append(sorted(r.getMessage() for r in caplog.records))
    assert messages[0] == messages[1]
    assert len(messages[0]) == 4
    assert "key:w invalid fill tensor-volume: 40 chunks-volume: 60" in messages[0]


def test_plan_caching_matches_torch() -> None:
    for cls in (splanner.SavePlanner, tplanner.SavePlanner):
        for name in ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans",
                     "_cached_global_plan", "_cached_metadata"):
            getattr(cls, name).clear()
    # One rank: the caches are per process, keyed by planner class.
    sds = [{"a": torch.ones(4), "b": {"c": torch.zeros(2, 2)}, "n": 1}]
    first = assert_save_same(sds, enable_plan_caching=True)
    second = assert_save_same(sds, enable_plan_caching=True)
    assert [p.usable for p in second[0]] == [False]  # unchanged: nothing sent
    assert [p.usable for p in second[1]] == [False]
    assert_same(second[3], first[3], "cached final plans")
    assert_same(second[2], first[2], "cached metadata")
    sds[0]["d"] = torch.ones(3)  # the structure changes
    third = assert_save_same(sds, enable_plan_caching=True)
    assert [p.usable for p in third[0]] == [True]
    assert "d" in third[2].state_dict_metadata
    # Deliberately stricter than torch: a dtype change invalidates the cache.
    sds[0]["d"] = torch.ones(3, dtype=torch.float64)
    p = sdp.DefaultSavePlanner(enable_plan_caching=True)
    p.set_up_planner(sds[0], None, True)
    assert p.create_local_plan().usable


def test_resolve_data() -> None:
    sd = {"t": torch.arange(6.0).reshape(2, 3), "obj": {"k": [1, "x"]},
          "a": np.arange(4, dtype=">i4")}
    p = sdp.DefaultSavePlanner()
    p.set_up_planner(sd, None, True)
    plan = p.finish_plan(p.create_global_plan([p.create_local_plan()])[0][0])
    by_fqn = {i.index.fqn: i for i in plan.items}
    assert p.resolve_data(by_fqn["t"]) is sd["t"]
    buf = p.resolve_data(by_fqn["obj.k"])
    assert isinstance(buf, io.BytesIO) and torch.load(buf, weights_only=True) == [1, "x"]
    arr = p.resolve_data(by_fqn["a"])
    assert arr.dtype == np.int32 and arr.dtype.isnative and arr.tolist() == [0, 1, 2, 3]
    assert by_fqn["a"].tensor_data.properties.dtype == torch.int32


def test_numpy_plans_equal_torch_tensor_plans() -> None:
    arrays = {"f": np.ones((2, 3), np.float32), "i": np.arange(5, dtype=np.int64),
              "b": np.array([True]), "u": np.zeros(2, np.uint8), "s": np.float64(1.0)}
    tensors = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
               for k, v in arrays.items()}
    ours, _ = save_both([arrays])
    _, theirs = save_both([tensors])
    for a, b in zip(ours, theirs):
        assert_same(a, b)


# --------------------------------------------------------------------------
# Load plans
# --------------------------------------------------------------------------


def saved_metadata(sd: dict) -> Any:
    p = tdp.DefaultSavePlanner()
    p.set_up_planner(sd, None, True)
    return p.create_global_plan([p.create_local_plan()])[1]


def test_load_plan_matches_torch() -> None:
    md = saved_metadata(mixed_state_dict())
    plan = assert_load_same(lambda: mixed_state_dict(seed=1), md)
    kinds = {i.dest_index.fqn: i.type.name for i in plan.items}
    assert kinds["model.steps"] == "BYTE_IO" and kinds["t_bfloat16"] == "TENSOR"
    assert kinds["scalar"] == "TENSOR" and "empty" not in kinds  # nothing to read


def test_load_into_nested_state_dict() -> None:
    sd = mixed_state_dict()
    del sd["tuple"]  # holds a tensor: the default loads refuses it (test_load_bytes_is_restricted)
    saver = sdp.DefaultSavePlanner()
    saver.set_up_planner(sd, None, True)
    plan = saver.finish_plan(saver.create_global_plan([saver.create_local_plan()])[0][0])
    md = saver.metadata
    dest = mixed_state_dict(seed=1)
    dest["model"]["steps"] = 0
    del dest["tuple"]
    loader = sdp.DefaultLoadPlanner()
    loader.set_up_planner(dest, md, True)
    lplan = loader.finish_plan(loader.create_global_plan([loader.create_local_plan()])[0])
    written = {i.index.fqn: saver.resolve_data(i) for i in plan.items}
    for ri in lplan.items:
        if ri.type.name == "BYTE_IO":
            loader.load_bytes(ri, written[ri.storage_index.fqn])
        else:
            target = loader.resolve_tensor(ri)
            src = written[ri.storage_index.fqn]
            for d, (o, n) in enumerate(zip(ri.storage_offsets, ri.lengths)):
                src = src.narrow(d, o, n)
            target.copy_(src)
            loader.commit_tensor(ri, target)
    assert dest["model"]["steps"] == 7 and dest["nested_lists"][2] == [{"k3": "y"}]
    assert dest["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    for key in ("t_bfloat16", "strided", "scalar"):
        assert torch.equal(dest[key], sd[key])
    assert torch.equal(dest["model"]["layer"]["weight"], sd["model"]["layer"]["weight"])


def test_old_checkpoint_keys_still_load() -> None:
    # Saved by the pre-2.4 rule: a dict without tensors is one bytes item.
    sd = {"m": {"w": torch.ones(2)}, "extra": {"a": 1, "b": [2, 3]}}
    torch_version._derived_version = "2_3"
    try:
        md = saved_metadata(sd)
    finally:
        torch_version._derived_version = None
    assert "extra" in md.state_dict_metadata and "extra.a" not in md.state_dict_metadata
    plan = assert_load_same(lambda: {"m": {"w": torch.zeros(2)}, "extra": {"a": 0, "b": []}}, md)
    assert {i.dest_index.fqn for i in plan.items} == {"m.w", "extra"}


def test_load_errors() -> None:
    md = saved_metadata({"a": torch.ones(2, 3), "b": 5})
    for cls in (sdp.DefaultLoadPlanner, tdp.DefaultLoadPlanner):
        p = cls()
        p.set_up_planner({"a": torch.ones(2, 3), "zz": torch.ones(1)}, md, True)
        with pytest.raises(RuntimeError, match="Missing key in checkpoint state_dict: zz"):
            p.create_local_plan()
        p = cls()
        p.set_up_planner({"a": torch.ones(3, 2)}, md, True)
        with pytest.raises(ValueError, match=r"Size mismatch between saved .*2, 3.* for a"):
            p.create_local_plan()
        p = cls()
        p.set_up_planner({"a": 7}, md, True)
        with pytest.raises(ValueError, match="Invalid checkpoint metadata for a"):
            p.create_local_plan()
    p = sdp.DefaultLoadPlanner()
    p.set_up_planner({"a": torch.ones(2, 3), "zz": torch.ones(1), "yy": {"q": 1}}, md, True)
    with pytest.raises(RuntimeError, match=r"2 keys are missing in all \('zz', 'yy\.q'\)"):
        p.create_local_plan()
    p = sdp.DefaultLoadPlanner()
    p.set_up_planner({"a": torch.ones(3, 2)}, md, True)
    with pytest.raises(ValueError, match=r"shape \(2, 3\), the destination has shape \(3, 2\)"):
        p.create_local_plan()
    assert_load_same(lambda: {"a": torch.ones(2, 3), "zz": torch.ones(1), "b": 0}, md,
                     allow_partial_load=True)


def test_load_bytes_is_restricted() -> None:
    class Boom:
        def __reduce__(self) -> Any:
            return (os.system, ("touch /tmp/ss_planner_pwned",))

    md = saved_metadata({"x": 1})
    ri = sdp.DefaultLoadPlanner
    p = ri()
    p.set_up_planner({"x": None}, md, True)
    (item,) = p.create_local_plan().items

    def archive(obj: Any) -> io.BytesIO:
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return buf

    p.load_bytes(item, archive({"k": [1, 2.5, "s", b"b", None, (1,), {3}, 1 + 2j]}))
    assert p.original_state_dict["x"] == {"k": [1, 2.5, "s", b"b", None, (1,), {3}, 1 + 2j]}
    with pytest.raises(pickle.UnpicklingError, match=r"'x'.*posix\.system"):
        p.load_bytes(item, archive(Boom()))
    assert not os.path.exists("/tmp/ss_planner_pwned")
    # a bytes item holding tensors goes through torch.load(weights_only=True)
    p.load_bytes(item, archive([torch.ones(1)]))
    assert torch.equal(p.original_state_dict["x"][0], torch.ones(1))
    with pytest.raises(pickle.UnpicklingError, match="not a torch.save"):
        p.load_bytes(item, io.BytesIO(b"garbage"))
    full = sdp.DefaultLoadPlanner(loads=lambda b: torch.load(io.BytesIO(b), weights_only=False))
    full.set_up_planner({"x": None}, md, True)
    full.load_bytes(item, archive([torch.ones(1)]))
    assert torch.equal(full.original_state_dict["x"][0], torch.ones(1))


def test_resolve_tensor_is_a_view() -> None:
    md = saved_metadata({"a": torch.ones(4, 6)})
    dest = {"a": torch.zeros(4, 6)}
    p = sdp.DefaultLoadPlanner()
    p.set_up_planner(dest, md, True)
    (ri,) = p.create_local_plan().items
    ri = dataclasses.replace(ri, dest_offsets=torch.Size([1, 2]), lengths=torch.Size([2, 3]))
    view = p.resolve_tensor(ri)
    view.fill_(5)
    p.commit_tensor(ri, view)
    assert dest["a"].sum() == 30 and dest["a"][1:3, 2:5].eq(5).all()
    # A destination outside CPU memory is read through a CPU temporary that
    # commit_tensor copies into place (meta stands in for CUDA here).
    elsewhere = torch.empty(4, 6, device="meta")
    tmp = p.transform_tensor(ri, elsewhere)
    assert tmp.device.type == "cpu" and tuple(tmp.shape) == (2, 3)
    p.commit_tensor(ri, tmp)
    assert not p._pending
    meta = {"a": torch.empty(4, 6, device="meta")}  # materialised like torch does
    p.set_up_planner(meta, md, True)
    assert meta["a"].device.type == "cpu"


@pytest.mark.parametrize("ours, theirs", [
    (splanner.SavePlanner, tplanner.SavePlanner),
    (splanner.LoadPlanner, tplanner.LoadPlanner),
    (sdp.DefaultSavePlanner, tdp.DefaultSavePlanner),
    (sdp.DefaultLoadPlanner, tdp.DefaultLoadPlanner),
])
def test_planner_interfaces_match_torch(ours: type, theirs: type) -> None:
    import inspect

    def public(cls: type) -> dict[str, list[str]]:
        out = {}
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_") or name == "__init__":
                params = inspect.signature(fn).parameters.values()
                # Extra keyword-only options (DefaultLoadPlanner's loads) are allowed.
                out[name] = [(p.name, p.kind, p.default) for p in params
                             if p.kind is not p.KEYWORD_ONLY]
        return out

    assert public(ours) == public(theirs)
    caches = [n for n in vars(theirs) if n.startswith("_cached")]
    assert caches == [n for n in vars(ours) if n.startswith("_cached")]
    assert inspect.isabstract(ours) == inspect.isabstract(theirs)


def random_tiling(rng: random.Random, shape: tuple[int, ...], pieces: int) -> list[TChunk]:
    """Split ``shape`` into a grid of boxes with random cuts (some empty)."""
    cuts = []
    for n in shape:
        k = rng.randint(1, pieces)
        points = sorted(rng.randint(0, n) for _ in range(k - 1))
        cuts.append([0, *points, n])
    chunks = []
    import itertools

    for cell in itertools.product(*[range(len(c) - 1) for c in cuts]):
        off = [cuts[d][i] for d, i in enumerate(cell)]
        size = [cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell)]
        chunks.append(TChunk(offsets=torch.Size(off), sizes=torch.Size(size)))
    rng.shuffle(chunks)
    return chunks


def test_read_items_for_random_reshards_match_torch() -> None:
    rng = random.Random(1234)
    reads = empty_reads = 0
    for case in range(300):
        ndim = rng.randint(0, 3)
        shape = tuple(rng.randint(0, 9) for _ in range(ndim))
        saved = random_tiling(rng, shape, 5)
        local = random_tiling(rng, shape, 4)
        local = local[: rng.randint(1, len(local))]
        tmd = TTensorMD(properties=TProps(), size=torch.Size(shape), chunks=saved)
        smd = TensorStorageMetadata(
            properties=TensorProperties(), size=torch.Size(shape),
            chunks=[ChunkStorageMetadata(c.offsets, c.sizes) for c in saved])
        ours = sdp.create_read_items_for_chunk_list(
            "k", smd, [ChunkStorageMetadata(c.offsets, c.sizes) for c in local])
        theirs = thelpers.create_read_items_for_chunk_list("k", tmd, local)
        assert_same(ours, nonempty(theirs), f"case {case}: {shape} {saved} {local}")
        reads += len(ours)
        empty_reads += len(theirs) - len(nonempty(theirs))
    # Interior empty chunks make torch plan zero-element reads, which we skip.
    assert reads > 500 and empty_reads > 0


def test_read_planning_is_not_quadratic(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = 5000
    saved = [ChunkStorageMetadata(torch.Size([2 * i, 0]), torch.Size([2, 3])) for i in range(rows)]
    md = TensorStorageMetadata(TensorProperties(), torch.Size([2 * rows, 3]), saved)
    bounds = [0, 1, 1500, 2999, 5000, 7001, 9000, 2 * rows]
    local = [ChunkStorageMetadata(torch.Size([a, 0]), torch.Size([b - a, 3]))
             for a, b in zip(bounds, bounds[1:])]
    built = []

    class Counting(sdp.OverlapIndex):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            built.append(self)

        @classmethod
        def from_arrays(cls, *a: Any) -> Any:  # the planner's way in
            self = super().from_arrays(*a)
            built.append(self)
            return self

    # (patched where create_read_items_for_chunk_list looks it up)
    monkeypatch.setattr(_plan_reads, "OverlapIndex", Counting)
    items = sdp.create_read_items_for_chunk_list("w", md, local)
    assert len(built) == 1  # one index for the tensor, one batched query
    visited = built[0]._index.last_visited
    assert visited < 2 * len(items), visited  # a double loop tests 7 x 5000 pairs
    assert sum(i.lengths[0] for i in items) == 2 * rows
    theirs = thelpers.create_read_items_for_chunk_list(
        "w", TTensorMD(TProps(), md.size, [TChunk(c.offsets, c.sizes) for c in saved]),
        [TChunk(c.offsets, c.sizes) for c in local])
    assert_same(items, nonempty(theirs))
    # Seven small destination chunks: the work follows the output, not the 5000 chunks.
    small = [ChunkStorageMetadata(torch.Size([a, 0]), torch.Size([1, 3])) for a in range(3, 10)]
    assert len(sdp.create_read_items_for_chunk_list("w", md, small)) == 7
    assert built[-1]._index.last_visited < 500


# --------------------------------------------------------------------------
# NumPy only, torch never imported
# --------------------------------------------------------------------------


def test_numpy_only_never_imports_torch() -> None:
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import io
        import numpy as np
        from shardstate.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
        from shardstate.checkpoint.metadata import TorchName
        sd = {"w": np.arange(6, dtype=np.float32).reshape(2, 3),
              "n": {"x": [np.zeros(2, np.int16), 3], "s": "hi"}, "z": np.array(2.0)}
        sp = DefaultSavePlanner()
        sp.set_up_planner(sd, None, True)
        gp, md = sp.create_global_plan([sp.create_local_plan()])
        plan = sp.finish_plan(gp[0])
        w = md.state_dict_metadata["w"]
        assert type(w.properties.dtype) is TorchName and w.properties.dtype == "torch.float32"
        assert w.size == (2, 3)
        assert md.state_dict_metadata["n.x.0"].properties.dtype == "torch.int16"
        assert type(md.state_dict_metadata["n.s"]).__name__ == "BytesStorageMetadata"
        written = {i.index.fqn: sp.resolve_data(i) for i in plan.items}
        dest = {"w": np.zeros((2, 3), np.float32), "n": {"x": [np.ones(2, np.int16), 0], "s": ""},
                "z": np.zeros(())}
        lp = DefaultLoadPlanner()
        lp.set_up_planner(dest, md, True)
        for ri in lp.create_local_plan().items:
            if ri.type.name == "BYTE_IO":
                lp.load_bytes(ri, written[ri.storage_index.fqn])
            else:
                view = lp.resolve_tensor(ri)
                view[...] = written[ri.storage_index.fqn]
                lp.commit_tensor(ri, view)
        assert dest["w"].tolist() == sd["w"].tolist() and dest["n"]["x"][0].tolist() == [0, 0]
        assert dest["n"]["x"][1] == 3 and dest["n"]["s"] == "hi" and dest["z"] == 2.0
        assert sys.modules["torch"] is None
        print("ok")
    """)
    env = package_env()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --------------------------------------------------------------------------
# DTensor and ShardedTensor on real processes
# --------------------------------------------------------------------------

SHAPES = [(8, 6), (5, 3), (2, 7), (3, 1)]  # even, uneven, empty shards at 3-4 ranks
PLACEMENTS_1D = ("S0", "S1", "R")
# On a 2 x 2 mesh (world size 4); S0S0 nests two splits of dim 0, which puts
# empty shards inside the tensor for short dims.
PLACEMENTS_2D = {"S0S0": ("S0", "S0"), "S0S1": ("S0", "S1"), "RS1": ("R", "S1"),
                 "S1R": ("S1", "R")}
# Loads go into a different placement than the save used.
OTHER = {"S0": "S1", "S1": "R", "R": "S0", "S0S0": "S1", "S0S1": "R", "RS1": "S0", "S1R": "S0S0"}


def _dtensor_cases(world: int) -> list[tuple[int, str, tuple[int, int]]]:
    cases = [(n, pl, shape) for n in range(1, world + 1) for pl in PLACEMENTS_1D
             for shape in SHAPES]
    if world == 4:
        cases += [(4, pl, shape) for pl in PLACEMENTS_2D for shape in SHAPES]
    return cases


def _distributed_body(rank: int, world: int) -> dict[str, int]:
    import torch
    import torch.distributed as dist
    from shardstate.checkpoint import default_planner as sdp
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed._shard.sharded_tensor import empty as st_empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.checkpoint import default_planner as tdp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    meshes = {n: DeviceMesh("cpu", list(range(n))) for n in range(1, world + 1)}
    mesh2d = DeviceMesh("cpu", [[0, 1], [2, 3]]) if world == 4 else None
    one = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}

    def dt(n: int, pl: str, shape: tuple[int, int], fill: float = 0.0) -> Any:
        full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) + fill
        if pl in PLACEMENTS_2D:
            if n != 4 or mesh2d is None:
                pl = OTHER[pl]
            else:
                outer, inner = PLACEMENTS_2D[pl]
                return distribute_tensor(full, mesh2d, [one[outer], one[inner]])
        return distribute_tensor(full, meshes[n], [one[pl]])

    counts = {"save": 0, "load": 0, "shard_items": 0, "reads": 0, "torch_empty_reads": 0}
    metadata = {}
    for n in range(1, world + 1):
        sd: dict[str, Any] = {"plain": torch.full((3,), 1.0), "obj": {"n": 1}}
        for i, (k, pl, shape) in enumerate(_dtensor_cases(world)):
            if k == n:
                sd[f"dt{i}"] = dt(n, pl, shape)
        # Save: local plans on every rank, global plans over the first n (world size n).
        local = {}
        for name, cls in (("ours", sdp.DefaultSavePlanner), ("torch", tdp.DefaultSavePlanner)):
            p = cls()
            p.set_up_planner(sd, None, rank == 0)
            local[name] = p.create_local_plan()
            if name == "ours":
                for item in local[name].items:  # resolve_data gives the local shard
                    if item.type.name == "SHARD":
                        got, want = p.resolve_data(item), sd[item.index.fqn].to_local()
                        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape
        assert_same(local["ours"], local["torch"], f"local save plan, mesh {n}, rank {rank}")
        counts["shard_items"] += sum(i.type.name == "SHARD" for i in local["ours"].items)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, local)
        for lowest in (False, True):
            results = {}
            for name, cls in (("ours", sdp.DefaultSavePlanner), ("torch", tdp.DefaultSavePlanner)):
                results[name] = cls(dedup_save_to_lowest_rank=lowest).create_global_plan(
                    [g[name] for g in gathered[:n]])
            assert_same(results["ours"], results["torch"], f"global save plan, world {n}")
            counts["save"] += 1
        metadata[n] = results["torch"][1]
    # Load: saved at world size n, loaded at m into other placements.
    for n in range(1, world + 1):
        for m in range(1, world + 1):
            dest = {"plain": torch.zeros(3), "obj": {"n": 0}}
            for i, (k, pl, shape) in enumerate(_dtensor_cases(world)):
                if k == n:
                    dest[f"dt{i}"] = dt(m, OTHER[pl], shape, fill=-1.0)
            ours, theirs = load_both(lambda: dict(dest), metadata[n])
            kept = nonempty(theirs[0].items)
            assert_same(ours[0].items, kept, f"load {n}->{m} rank {rank}")
            counts["load"] += 1
            counts["reads"] += len(ours[0].items)
            counts["torch_empty_reads"] += len(theirs[0].items) - len(kept)
            # The reads fill exactly this rank's part of every destination.
            loader = sdp.DefaultLoadPlanner()
            loader.set_up_planner(dest, metadata[n], rank == 0)
            filled: dict[str, int] = {}
            for ri in loader.create_local_plan().items:
                if ri.type.name == "TENSOR":
                    view = loader.resolve_tensor(ri)
                    assert tuple(view.shape) == tuple(ri.lengths)
                    filled[ri.dest_index.fqn] = filled.get(ri.dest_index.fqn, 0) + view.numel()
            for key, value in dest.items():
                if key.startswith("dt") and value.device_mesh.get_coordinate() is not None:
                    assert filled.get(key, 0) == value.to_local().numel(), (key, n, m)
    # Legacy ShardedTensor (needs the whole group): save plan and a reshard load plan.
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    sharded = st_empty(spec, 10, 4)
    assert isinstance(sharded, ShardedTensor)
    # Only ranks 0 and 1 hold shards of this one; the others drop it, as torch does.
    part = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
    sd = {"st": sharded, "x": torch.ones(2), "part": st_empty(part, 6, 2)}
    local = {}
    for name, cls in (("ours", sdp.DefaultSavePlanner), ("torch", tdp.DefaultSavePlanner)):
        p = cls()
        p.set_up_planner(sd, None, rank == 0)
        local[name] = p.create_local_plan()
    assert_same(local["ours"], local["torch"], "ShardedTensor save plan")
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    md = tdp.DefaultSavePlanner().create_global_plan([g["torch"] for g in gathered])[1]
    ours_md = sdp.DefaultSavePlanner().create_global_plan([g["ours"] for g in gathered])[1]
    assert_same(ours_md, md, "ShardedTensor metadata")
    spec2 = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in reversed(range(world))])
    ours, theirs = load_both(
        lambda: {"st": st_empty(spec2, 10, 4), "x": torch.zeros(2), "part": st_empty(part, 6, 2)},
        md)
    assert_same(ours[0].items, nonempty(theirs[0].items), "ShardedTensor load plan")
    assert any(i.dest_index.fqn == "st" for i in ours[0].items)
    assert any(i.dest_index.fqn == "part" for i in ours[0].items) == (rank < 2)
    # A Partial placement cannot be saved: the same error as torch's.
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(torch.ones(2), meshes[world], [Partial()])
    errors = []
    for cls in (sdp.DefaultSavePlanner, tdp.DefaultSavePlanner):
        p = cls()
        p.set_up_planner({"p": partial}, None, rank == 0)
        try:
            p.create_local_plan()
        except Exception as e:  # noqa: BLE001 (compared with torch's below)
            errors.append((type(e), str(e)))
    assert len(errors) == 2 and errors[0] == errors[1], errors
    # The plans above ran on remembered DTensor boxes (_tensors._BOXES), and
    # each remembered box is torch's helper's answer, for every case here.
    from shardstate.checkpoint import _tensors
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    cached = 0
    for n in range(1, world + 1):
        for k, pl, shape in _dtensor_cases(world):
            if k != n:
                continue
            t = dt(n, pl, shape)
            boxes = _tensors._BOXES.get(t.device_mesh, {})
            cached += len(boxes) > 0
            for _ in range(2):  # the first call may fill the cache, the second reads it
                offsets, sizes = _tensors._dtensor_box(t)
                want_sizes, want_offsets = compute_local_shape_and_global_offset(
                    t.shape, t.device_mesh, t.placements)
                assert (tuple(offsets), tuple(sizes)) == (tuple(want_offsets),
                                                          tuple(want_sizes)), (n, pl, shape)
                assert type(offsets) is torch.Size and type(sizes) is torch.Size
    assert cached > 0
    return counts


def test_dtensor_and_sharded_tensor_plans_match_torch(run_distributed: Any) -> None:
    results = run_distributed(_distributed_body, 4, timeout=240)
    assert all(r["save"] == 8 and r["load"] == 16 for r in results)
    assert all(r["shard_items"] > 0 and r["reads"] > 0 for r in results)
