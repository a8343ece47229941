"""The coordinator's and the load planner's fast paths (dedup on arrays, index
hints by dict copy, chunk checks on arrays, chunk boxes read in C) against
torch's planners and against the chunk-by-chunk checks they replace."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import ChainMap
from typing import Any

import numpy as np
import pytest
import torch
from shardstate._core import chunk_boxes, with_index_hints
from shardstate.checkpoint import default_planner as sdp
from torch.distributed.checkpoint import default_planner as tdp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)


def _shard(fqn: str, off: tuple, size: tuple, shape: tuple, dtype: Any = torch.float32,
           cls: type = WriteItem, kind: WriteItemType = WriteItemType.SHARD) -> Any:
    return cls(index=MetadataIndex(fqn, torch.Size(off)), type=kind,
               tensor_data=TensorWriteData(
                   chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(size)),
                   properties=TensorProperties(dtype=dtype), size=torch.Size(shape)))


def _bytes(fqn: str) -> Any:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


class _Heavy(WriteItem):
    """A subclass that reports its own size: dedup must ask it."""

    def tensor_storage_size(self) -> int | None:
        return 10**6


def _random_plans(rng: random.Random, world: int) -> list[SavePlan]:
    """Row shards of a few tensors, replicated tensors and bytes items in
    random subsets of the plans, with repeats of the same index."""
    plans: list[list[Any]] = [[] for _ in range(world)]
    for t in range(rng.randint(1, 4)):
        rows = rng.randint(1, 3 * world)
        cuts = sorted(rng.sample(range(1, rows), min(rows - 1, world - 1))) if rows > 1 else []
        bounds = [0, *cuts, rows]
        for r, (a, b) in enumerate(zip(bounds, bounds[1:])):
            plans[r % world].append(_shard(f"s{t}", (a, 0), (b - a, 3), (rows, 3)))
    for t in range(rng.randint(1, 6)):
        owners = rng.sample(range(world), rng.randint(1, world))
        shape = (rng.randint(0, 5),)
        cls = _Heavy if rng.random() < 0.1 else WriteItem
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64])
        for r in sorted(owners):
            plans[r].append(_shard(f"r{t}", (0,), shape, shape, dtype, cls, WriteItemType.TENSOR))
    for t in range(rng.randint(0, 3)):
        for r in rng.sample(range(world), rng.randint(1, world)):
            plans[r].append(_bytes(f"b{t}"))
    for p in plans:
        rng.shuffle(p)
    return [SavePlan(items, planner_data={"x": r}) for r, items in enumerate(plans)]


def _same_plans(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.items == b.items
        assert [i.index.index for i in a.items] == [i.index.index for i in b.items]
        assert [type(i) for i in a.items] == [type(i) for i in b.items]
        assert a.planner_data == b.planner_data


@pytest.mark.parametrize("lowest", [False, True])
def test_dedup_matches_torch_on_random_plans(lowest: bool) -> None:
    rng = random.Random(7 + lowest)
    for _ in range(150):
        plans = _random_plans(rng, rng.randint(1, 12))
        _same_plans(sdp.dedup_save_plans(plans, lowest), tdp.dedup_save_plans(plans, lowest))


def test_dedup_ties_follow_set_order() -> None:
    # Plans {3, 8}: a set of them iterates 8 first (8 lands in slot 0 of an
    # 8-slot table); with equal bytes so far torch keeps the item on plan 8.
    plans = [SavePlan([]) for _ in range(9)]
    plans[3] = SavePlan([_shard("t", (0,), (4,), (4,), kind=WriteItemType.TENSOR)])
    plans[8] = SavePlan([_shard("t", (0,), (4,), (4,), kind=WriteItemType.TENSOR)])
    ours, theirs = sdp.dedup_save_plans(plans), tdp.dedup_save_plans(plans)
    _same_plans(ours, theirs)
    assert [len(p.items) for p in ours] == [0] * 8 + [1]


def test_global_save_plan_matches_torch() -> None:
    rng = random.Random(3)
    for _ in range(60):
        plans = tdp.dedup_save_plans(_random_plans(rng, rng.randint(1, 10)))
        for hints in (True, False):
            ours, ours_md = sdp.create_default_global_save_plan(plans, hints)
            theirs, theirs_md = tdp.create_default_global_save_plan(plans, hints)
            _same_plans(ours, theirs)
            assert ours_md == theirs_md
            # The source plans are left as they were.
            assert all(i.index.index is None for p in plans for i in p.items)


def test_index_hint_copies_are_full_objects() -> None:
    item = _shard("w", (2, 0), (2, 3), (4, 3))
    (plan,), _ = sdp.create_default_global_save_plan([SavePlan([item])])
    new = plan.items[0]
    assert new is not item and new.index is not item.index
    assert new.index.index == 0 and item.index.index is None
    assert new == item and hash(new.index) == hash(item.index)
    assert type(new) is WriteItem and type(new.index) is MetadataIndex
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.index.index = 3  # type: ignore[misc]
    sub = _shard("w", (0, 0), (2, 3), (4, 3), cls=_Heavy)  # a subclass: dataclasses.replace
    (plan,), md = sdp.create_default_global_save_plan([SavePlan([sub, item])])
    assert type(plan.items[0]) is _Heavy and [i.index.index for i in plan.items] == [0, 1]
    assert md.state_dict_metadata["w"].chunks == [sub.tensor_data.chunk, item.tensor_data.chunk]


def test_global_save_plan_refuses_what_torch_refuses() -> None:
    twice = [SavePlan([_bytes("b")]), SavePlan([_bytes("b")])]
    both = [SavePlan([_bytes("b"), _shard("b", (0,), (1,), (1,))])]
    for plans in (twice, both):
        with pytest.raises(AssertionError, match="key 'b' is planned"):
            sdp.create_default_global_save_plan(plans)
        with pytest.raises((AssertionError, AttributeError)):  # torch: either
            tdp.create_default_global_save_plan(plans)


def test_planner_data_merge_is_chainmaps() -> None:
    plans = [SavePlan([_bytes(f"b{r}")], planner_data={"a": r, f"k{r}": r, "z": -r})
             for r in range(5)]
    plans[2] = dataclasses.replace(plans[2], planner_data=None)
    _, md = sdp.DefaultSavePlanner().create_global_plan(plans)
    expected = dict(ChainMap(*[p.planner_data or {} for p in plans]))
    assert md.planner_data == expected
    assert list(md.planner_data) == list(expected)  # same order: same .metadata bytes


def _random_chunks(rng: random.Random, shape: tuple) -> list[Any]:
    chunks = []
    for _ in range(rng.randint(1, 12)):
        nd = len(shape) if rng.random() < 0.95 else len(shape) + 1
        off = [rng.randint(-1, s) if rng.random() < 0.1 else rng.randint(0, max(s - 1, 0))
               for s in (shape + (3,))[:nd]]
        size = [rng.randint(-1, s) if rng.random() < 0.05 else rng.randint(0, s)
                for s in (shape + (3,))[:nd]]
        chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(size)))
    return chunks


def test_chunk_checks_on_arrays_match_chunk_by_chunk() -> None:
    rng = random.Random(11)
    seen = set()
    for case in range(400):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        chunks = _random_chunks(rng, shape)
        value = TensorStorageMetadata(TensorProperties(), torch.Size(shape), chunks)
        slow: list[str] = []
        sdp._validate_chunks_slow("k", value, True, slow)
        arrays = sdp._valid_chunk_arrays(chunks, shape)
        if arrays is None:
            assert any(len(c.offsets) != len(shape) for c in chunks)
            continue
        fast: list[str] = []
        sdp._validate_chunks("k", value, arrays, True, fast)
        assert fast == slow, f"case {case}: {shape} {chunks}"
        seen.update(m.split(" has ")[-1].split(":")[0] for m in slow)
    assert {"out of bounds chunk", "overlapping chunks"} <= seen


def test_validation_matches_torch_on_random_chunks(caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(5)
    caplog.set_level(logging.CRITICAL)
    for _ in range(150):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        # (torch also calls an empty chunk inside another, or one at a
        # negative offset, overlapping; shardstate never has: an empty chunk
        # holds no element, a negative one is reported out of bounds.)
        chunks = [c for c in _random_chunks(rng, shape)
                  if len(c.offsets) == len(shape) and min(c.sizes) > 0 and min(c.offsets) >= 0]
        md = sdp.Metadata({"k": TensorStorageMetadata(TensorProperties(), torch.Size(shape),
                                                      chunks)})
        ours = sdp._validate_global_plan([SavePlan([]), SavePlan([])], md)
        theirs = tdp._validate_global_plan([SavePlan([]), SavePlan([])], md)
        # torch names each overlapping pair in its sweep's order.
        assert sorted(map(_pair_key, ours)) == sorted(map(_pair_key, theirs))


def _pair_key(msg: str) -> Any:
    head, _, rest = msg.partition("overlapping chunks: ")
    if not rest:
        return msg, ()
    a, b = rest.split(") C")
    return head, tuple(sorted([a + ")", "C" + b]))


def test_big_values_take_the_chunk_by_chunk_checks() -> None:
    big = 1 << 62
    value = TensorStorageMetadata(TensorProperties(), torch.Size([big, 4]), [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([big, 2])),
        ChunkStorageMetadata(torch.Size([1, 1]), torch.Size([big - 1, 3])),
    ])
    assert sdp._valid_chunk_arrays(value.chunks, tuple(value.size)) is None
    errors = sdp._validate_global_plan([SavePlan([]), SavePlan([])],
                                       sdp.Metadata({"k": value}))
    assert len(errors) == 2 and "overlapping" in errors[0] and "fill" in errors[1]


def test_chunk_boxes() -> None:
    chunks = [ChunkStorageMetadata(torch.Size([1, 2]), torch.Size([3, 4])),
              ChunkStorageMetadata((5, 6), [7, 8]),  # any sequence of ints
              ChunkStorageMetadata(np.array([9, 10]), (np.int32(11), 2**62))]
    off, size = chunk_boxes(chunks, 2)
    assert off.dtype == np.int64 and off.tolist() == [[1, 2], [5, 6], [9, 10]]
    assert size.tolist() == [[3, 4], [7, 8], [11, 2**62]]
    assert chunk_boxes(chunks, 3) is None  # another ndim
    assert chunk_boxes(chunks[:1] + [ChunkStorageMetadata((1,), (2, 3))], 2) is None
    empty = chunk_boxes([], 3)
    assert empty is not None and empty[0].shape == (0, 3)
    scalar = chunk_boxes([ChunkStorageMetadata(torch.Size([]), torch.Size([]))] * 2, 0)
    assert scalar is not None and scalar[1].shape == (2, 0)
    with pytest.raises(OverflowError):
        chunk_boxes([ChunkStorageMetadata((2**63,), (1,))], 1)
    with pytest.raises(TypeError):
        chunk_boxes([ChunkStorageMetadata((1.5,), (1,))], 1)
    with pytest.raises(AttributeError):
        chunk_boxes([object()], 1)
    with pytest.raises(TypeError):
        chunk_boxes(5, 1)
    with pytest.raises(ValueError):
        chunk_boxes([], -1)


def test_read_items_fall_back_for_odd_chunks() -> None:
    # Saved chunks whose sizes are not all of the destination's ndim cannot
    # go into arrays: the planner still answers as before (as torch does).
    saved = [ChunkStorageMetadata(torch.Size([0]), torch.Size([2])),
             ChunkStorageMetadata(torch.Size([2]), torch.Size([2]))]
    md = TensorStorageMetadata(TensorProperties(), torch.Size([4]), saved)
    local = [ChunkStorageMetadata(torch.Size([1]), torch.Size([2]))]
    ours = sdp.create_read_items_for_chunk_list("w", md, local)
    assert [(i.storage_index.index, tuple(i.storage_offsets), tuple(i.dest_offsets),
             tuple(i.lengths)) for i in ours] == [(0, (1,), (0,), (1,)), (1, (0,), (1,), (1,))]
    odd = TensorStorageMetadata(TensorProperties(), torch.Size([4]),
                                saved + [ChunkStorageMetadata((0, 0), (1, 1))])
    with pytest.raises(ValueError):
        sdp.create_read_items_for_chunk_list("w", odd, local)


def test_with_index_hints() -> None:
    items = [_shard("w", (i,), (1,), (3,)) for i in range(3)]
    out = with_index_hints(items, [5, 6, 7])
    assert [i.index.index for i in out] == [5, 6, 7]
    assert out == items and all(a is not b and a.index is not b.index
                                for a, b in zip(out, items))
    assert [i.index.index for i in items] == [None] * 3  # the inputs are untouched
    assert out[0].tensor_data is items[0].tensor_data  # a shallow copy, as replace makes
    with pytest.raises(ValueError, match="3 items but 1 hints"):
        with_index_hints(items, [1])
    with pytest.raises(AttributeError):
        with_index_hints([object()], [1])
    assert with_index_hints((), []) == []


def test_overlap_scan_matches_the_index() -> None:
    rng = random.Random(13)
    for _ in range(300):
        ndim = rng.randint(1, 3)
        boxes = [([rng.randint(0, 8) for _ in range(ndim)],
                  [rng.randint(0, 4) for _ in range(ndim)]) for _ in range(rng.randint(1, 20))]
        requests = [([rng.randint(0, 8) for _ in range(ndim)],
                     [rng.randint(0, 5) for _ in range(ndim)]) for _ in range(rng.randint(1, 4))]
        off = np.array([b[0] for b in boxes], dtype=np.int64)
        size = np.array([b[1] for b in boxes], dtype=np.int64)
        scanned = sdp._scan_overlaps(off, size, requests)
        indexed = sdp.OverlapIndex.from_arrays(off, size).query_many(requests)
        assert scanned == [[tuple(o) for o in hits] for hits in indexed]
    # Values the scan does not take: the index answers (or refuses) instead.
    one = np.array([[1]], dtype=np.int64)
    assert sdp._scan_overlaps(-one, one, [((0,), (1,))]) is None
    assert sdp._scan_overlaps(one, one, [((-1,), (1,))]) is None
    assert sdp._scan_overlaps(one, one, [((1 << 62,), (1,))]) is None
    assert sdp._scan_overlaps(one, one, [((0, 0), (1, 1))]) is None
