"""shardstate.fsdp._flatops and _dim0 on the C layout, in one process, against torch-op
references.

The multi-process checks against torch's own FlatParamHandle live in
tests/test_fsdp_optim.py; here every operation runs on layouts of many
shapes, world sizes and both alignment modes, and on the dtypes the C path
views as integers (bfloat16), and the all-to-all of a SHARDED save is
simulated rank by rank: every rank's dim-0 chunk of every parameter must
come out equal to ``torch.chunk(param, W, dim=0)[rank]``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardstate.fsdp import _dim0, _flatops

DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64)


def _handle(shapes: list[tuple[int, ...]], world_size: int, align: int) -> SimpleNamespace:
    """What unit_layout reads of an FSDP1 FlatParamHandle."""
    return SimpleNamespace(
        flat_param=SimpleNamespace(_shapes=[torch.Size(s) for s in shapes]),
        world_size=world_size,
        _aligned_numel=align,
        uses_sharded_strategy=True,
    )


def _reference_flat(layout: _flatops.UnitLayout, pieces, dtype) -> torch.Tensor:
    """The padded unsharded flat buffer by torch ops: pieces at their offsets, zeros elsewhere."""
    flat = torch.zeros(layout.padded_numel, dtype=dtype)
    for off, n, p in zip(layout.offsets, layout.numels, pieces):
        if p is not None:
            flat[off : off + n] = p.reshape(-1)
    return flat


def _pieces(shapes, dtype, seed: int, missing: int | None = None) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor | None] = []
    for i, s in enumerate(shapes):
        if i == missing:
            out.append(None)
        elif dtype.is_floating_point:
            out.append(torch.randn(s, generator=g).to(dtype))
        else:
            out.append(torch.randint(-1000, 1000, s, generator=g, dtype=dtype))
    return out


def _ranks(shapes, world_size: int, align: int) -> tuple[list[Any], list[Any]]:
    """Every rank's sharded unit layout and dim-0 plan."""
    handle = _handle(shapes, world_size, align)
    layouts = [_flatops.unit_layout(handle, world_size, r, True) for r in range(world_size)]
    return layouts, [_dim0.dim0_plan(lay) for lay in layouts]


def _chunk_ref(p: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """torch.chunk(p, world_size, dim=0)[rank], flat (empty past the last chunk)."""
    ref = torch.chunk(p, world_size, dim=0)
    return ref[rank].reshape(-1) if rank < len(ref) else p.new_empty(0)


shapes_st = st.lists(
    st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple), min_size=1, max_size=6
)


@settings(max_examples=60, deadline=None)
@given(
    shapes=shapes_st,
    world_size=st.integers(1, 5),
    align=st.sampled_from([0, 4, 8]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_layout_flatten_unflatten_pack(shapes, world_size, align, dtype, seed) -> None:
    sharded = world_size > 1
    handle = _handle(shapes, world_size, align)
    numels = [math.prod(s) for s in shapes]
    missing = seed % (len(shapes) + 1)
    pieces = _pieces(shapes, dtype, seed, missing if missing < len(shapes) else None)
    for rank in range(world_size):
        layout = _flatops.unit_layout(handle, world_size, rank, sharded)
        assert layout.numels == tuple(numels)
        assert layout.shapes == tuple(torch.Size(s) for s in shapes)
        assert layout.shard_numel * layout.world_size == layout.padded_numel
        assert layout.padded_numel >= layout.unpadded_numel >= layout.offsets[-1] + numels[-1]
        ref = _reference_flat(layout, pieces, dtype)
        start, end = layout.shard_range(layout.rank)
        # flatten_shard_into: the shard of the zero-padded flat buffer
        out = torch.full((layout.shard_numel,), 7, dtype=dtype)
        _flatops.flatten_shard_into(layout, pieces, layout.rank, out)
        assert torch.equal(out, ref[start:end])
        # flatten_full_into: every rank's shard in one batch
        full = torch.full((layout.padded_numel,), 7, dtype=dtype)
        _flatops.flatten_full_into(layout, pieces, full)
        assert torch.equal(full, ref)
        # unflatten: shaped views of the flat buffer, no copy
        views = _flatops.unflatten(layout, full[: layout.unpadded_numel])
        for v, p, s in zip(views, pieces, shapes):
            assert v.shape == torch.Size(s)
            assert v.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
            assert torch.equal(v, p if p is not None else torch.zeros(s, dtype=dtype))
        # slice_local / pack_local_into: the local pieces round-trip through the shard
        local = [
            _flatops.slice_local(layout, i, p, full=True) if p is not None else None
            for i, p in enumerate(pieces)
        ]
        for i, info in enumerate(layout.shard_infos):
            if pieces[i] is None:
                continue
            if not info.in_shard:
                assert local[i] is None
                continue
            lo = start + info.offset_in_shard
            assert torch.equal(local[i], ref[lo : lo + info.numel_in_shard])
            assert torch.equal(local[i], _flatops.slice_local(layout, i, out, full=False))
        packed = torch.full((layout.shard_numel,), 7, dtype=dtype)
        _flatops.pack_local_into(layout, local, packed)
        assert torch.equal(packed, ref[start:end])


@settings(max_examples=60, deadline=None)
@given(
    shapes=shapes_st,
    world_size=st.integers(2, 5),
    align=st.sampled_from([0, 4]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_dim0_all_to_all_simulated(shapes, world_size, align, dtype, seed) -> None:
    pieces = _pieces(shapes, dtype, seed)
    layouts, plans = _ranks(shapes, world_size, align)
    shards = []
    sends = []
    for lay, plan in zip(layouts, plans):
        shard = torch.empty(lay.shard_numel, dtype=dtype)
        _flatops.flatten_shard_into(lay, pieces, lay.rank, shard)
        send = torch.full((sum(plan.send_sizes),), 7, dtype=dtype)
        _flatops.pack_segments(shard, plan.send_segments, send)
        # use_orig_params: the same send buffer straight from the local pieces
        local = [_flatops.slice_local(lay, i, p, full=True) for i, p in enumerate(pieces)]
        direct = torch.full_like(send, 7)
        _flatops.pack_local_segments_into(lay, local, plan.send_segments, direct)
        assert torch.equal(direct, send)
        shards.append(shard)
        sends.append(list(send.split(list(plan.send_sizes))))
    for me, plan in enumerate(plans):
        for s in range(world_size):
            assert plan.recv_sizes[s] == plans[s].send_sizes[me]
        recv = torch.cat([sends[s][me] for s in range(world_size)])
        jobs, chunks = [], []
        for i, n in enumerate(plan.chunk_numels):
            chunk = torch.full((n,), 7, dtype=dtype)
            jobs.append((recv, plan.recv_segments[i], chunk))
            chunks.append(chunk)
        _flatops.pack_segments_many(jobs)
        for i, p in enumerate(pieces):
            assert torch.equal(chunks[i], _chunk_ref(p, world_size, me)), (i, me)


@settings(max_examples=60, deadline=None)
@given(
    shapes=shapes_st,
    world_size=st.integers(2, 5),
    align=st.sampled_from([0, 4]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_dim0_all_to_all_backwards_simulated(shapes, world_size, align, dtype, seed) -> None:
    # A sharded load: every rank holds torch.chunk(param, W, dim=0)[rank] of
    # every parameter (one may have no state: zeros); after the reverse
    # all-to-all each rank's flat shard must equal flatten_shard_into's.
    missing = seed % (len(shapes) + 1)
    pieces = _pieces(shapes, dtype, seed, missing if missing < len(shapes) else None)
    layouts, plans = _ranks(shapes, world_size, align)
    sends = []
    for me, plan in enumerate(plans):
        chunks = [
            None if p is None else torch.chunk(p, world_size, dim=0)[me]
            if me < len(torch.chunk(p, world_size, dim=0))
            else p.new_empty((0, *p.shape[1:]))
            for p in pieces
        ]
        send = torch.full((sum(plan.recv_sizes),), 7, dtype=dtype)
        _dim0.pack_chunks_into(plan, chunks, send)
        sends.append(list(send.split(list(plan.recv_sizes))))
    for me, (lay, plan) in enumerate(zip(layouts, plans)):
        recv = torch.cat([sends[s][me] for s in range(world_size)])
        shard = torch.full((lay.shard_numel,), 7, dtype=dtype)
        _flatops.place_many([(shard, _dim0.shard_pieces(plan, recv))])
        want = torch.empty(lay.shard_numel, dtype=dtype)
        _flatops.flatten_shard_into(lay, pieces, me, want)
        assert torch.equal(shard, want), me


@settings(max_examples=60, deadline=None)
@given(
    shapes=shapes_st,
    world_size=st.integers(2, 5),
    align=st.sampled_from([0, 4]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_dim0_messages_simulated(shapes, world_size, align, dtype, seed) -> None:
    # The point-to-point form of both exchanges (gloo), rank by rank:
    # rank s's shard_side[d] and rank d's chunk_side[s] are the same messages
    # in the same order, sizes matching one for one; delivered that way, a
    # save gives every rank torch.chunk(param, W, dim=0)[rank] and a load
    # gives back flatten_shard_into's flat shard (padding zeroed).
    pieces = _pieces(shapes, dtype, seed)
    layouts, plans = _ranks(shapes, world_size, align)
    msgs = [_dim0.dim0_messages(plan) for plan in plans]
    shards = []
    for lay in layouts:
        shard = torch.empty(lay.shard_numel, dtype=dtype)
        _flatops.flatten_shard_into(lay, pieces, lay.rank, shard)
        shards.append(shard)
    for s in range(world_size):
        # use_orig_params: the same segments as views of the local pieces
        local = [_flatops.slice_local(layouts[s], i, p, full=True) for i, p in enumerate(pieces)]
        for d in range(world_size):
            a, b = msgs[s].shard_side[d], msgs[d].chunk_side[s]
            assert [n for _, n in a] == [k for _, _, k in b], (s, d)
            assert sum(n for _, n in a) == plans[s].send_sizes[d]
            views = _flatops.local_segment_views(layouts[s], local, a)
            for v, (off, n) in zip(views, a):
                assert v is not None and torch.equal(v, shards[s][off : off + n])
    # save: shard segments -> chunks
    chunks = [[torch.full((n,), 7, dtype=dtype) for n in plan.chunk_numels] for plan in plans]
    for s in range(world_size):
        for d in range(world_size):
            for (off, n), (i, at, k) in zip(msgs[s].shard_side[d], msgs[d].chunk_side[s]):
                chunks[d][i][at : at + k] = shards[s][off : off + n]
    for d in range(world_size):
        for i, p in enumerate(pieces):
            assert torch.equal(chunks[d][i], _chunk_ref(p, world_size, d)), (i, d)
    # load: chunks -> shard segments, the padding zeroed afterwards
    for d, lay in enumerate(layouts):
        got = torch.full((lay.shard_numel,), 7, dtype=dtype)
        for s in range(world_size):
            for (off, n), (i, at, k) in zip(msgs[d].shard_side[s], msgs[s].chunk_side[d]):
                got[off : off + n] = chunks[s][i][at : at + k]
        _flatops.zero_padding(lay, got)
        assert torch.equal(got, shards[d]), d


def test_place_many_and_chunk_numels() -> None:
    out = torch.full((8,), 7.0)
    _flatops.place_many([(out, [(5, torch.tensor([3.0, 4.0])), (1, torch.tensor([[1.0, 2.0]]))])])
    assert out.tolist() == [0, 1, 2, 0, 0, 3, 4, 0]
    with pytest.raises(ValueError, match="overlaps"):
        _flatops.place_many([(out, [(0, torch.ones(3)), (2, torch.ones(2))])])
    with pytest.raises(ValueError, match="past out's 8 elements"):
        _flatops.place_many([(out, [(7, torch.ones(2))])])
    shapes = [torch.Size([5, 2]), torch.Size([1]), torch.Size([4])]
    chunks = [torch.chunk(torch.empty(s), 3) for s in shapes]
    assert _dim0.dim0_chunk_numels(shapes, 3) == [
        [c[r].numel() if r < len(c) else 0 for c in chunks] for r in range(3)
    ]
    assert _dim0.dim0_chunk_numels([torch.Size([0, 2])], 2) is None
    plan = _dim0.dim0_plan(_flatops.unit_layout(_handle([(4,), (3,)], 2, 0), 2, 0, True))
    with pytest.raises(ValueError, match="chunk has 1 elements, expected 2"):
        _dim0.pack_chunks_into(plan, [torch.ones(1), None], torch.empty(4))
    with pytest.raises(ValueError, match="receive buffer needs"):
        _dim0.shard_pieces(plan, torch.empty(1))


def test_no_shard_aligned_world_padding_is_zeroed() -> None:
    # NO_SHARD over 3 ranks, use_orig_params=True: torch's flat parameter is
    # padded to a multiple of the world size; the local state is all of it.
    shapes = [(3,), (5,)]
    layout = _flatops.unit_layout(_handle(shapes, 3, 4), 3, 1, sharded=False)
    assert (layout.world_size, layout.rank) == (1, 0)
    assert layout.offsets == (0, 4)
    assert layout.unpadded_numel == layout.shard_numel == 9
    pieces = _pieces(shapes, torch.float32, 0)
    out = torch.full((9,), 7.0)
    _flatops.flatten_shard_into(layout, pieces, 0, out)
    want = torch.zeros(9)
    want[0:3], want[4:9] = pieces[0], pieces[1]
    assert torch.equal(out, want)
    views = _flatops.unflatten(layout, out)
    assert torch.equal(views[1], pieces[1])


def test_pieces_off_the_fast_path() -> None:
    # A non-contiguous piece (a transposed weight) is read as its logical order.
    w = torch.arange(12.0).reshape(3, 4)
    layout = _flatops.unit_layout(_handle([(4, 3), (2,)], 2, 0), 2, 0, True)
    out = torch.empty(layout.shard_numel)
    _flatops.flatten_shard_into(layout, [w.t(), torch.tensor([1.0, 2.0])], 0, out)
    assert torch.equal(out, w.t().reshape(-1)[: layout.shard_numel])


def test_bad_input_is_refused() -> None:
    layout = _flatops.unit_layout(_handle([(2, 3), (4,)], 2, 0), 2, 0, True)
    with pytest.raises(ValueError, match="expected 2 pieces"):
        _flatops.flatten_shard_into(layout, [torch.zeros(6)], 0, torch.empty(5))
    with pytest.raises(ValueError, match="piece 1 has 3 elements"):
        _flatops.flatten_shard_into(layout, [torch.zeros(6), torch.zeros(3)], 0, torch.empty(5))
    with pytest.raises(ValueError, match="needs 5 elements"):
        _flatops.flatten_shard_into(layout, [None, None], 0, torch.empty(4))
    with pytest.raises(ValueError, match="dtype"):
        _flatops.flatten_shard_into(
            layout, [torch.zeros(6, dtype=torch.float64), None], 0, torch.empty(5)
        )
    with pytest.raises(ValueError, match="local state has 2 elements"):
        _flatops.pack_local_into(layout, [None, torch.zeros(2)], torch.empty(5))
    with pytest.raises(ValueError, match="outside a buffer"):
        _flatops.pack_segments(torch.zeros(4), [(3, 2)], torch.empty(2))
    with pytest.raises(ValueError, match="cover 2 of 3"):
        _flatops.pack_segments(torch.zeros(4), [(0, 2)], torch.empty(3))
    with pytest.raises(ValueError, match="not inside one parameter"):
        _flatops.pack_local_segments_into(
            layout, [torch.zeros(5), None], [(3, 3)], torch.empty(3)
        )
    with pytest.raises(AssertionError, match="world size 2, its state 3"):
        _flatops.unit_layout(_handle([(2,)], 2, 0), 3, 0, True)
    assert _dim0.dim0_plan(_flatops.unit_layout(_handle([(2,), ()], 2, 0), 2, 0, True)) is None
