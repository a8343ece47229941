"""Chunk geometry: the overlap index against a brute-force double loop, and
copy_region against NumPy slice assignment."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading

import numpy as np
import pytest
import shardstate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardstate import geometry
from shardstate._core import GeomIndex
from shardstate._core import copy_region as core_copy_region
from shardstate.geometry import Overlap, OverlapIndex, copy_region, overlaps

SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# ---- reference ---------------------------------------------------------------


def brute_overlaps(boxes, request):
    """The double loop: every saved box with a non-empty intersection."""
    qoff, qsize = request
    out = []
    for i, (off, size) in enumerate(boxes):
        lo = [max(a, b) for a, b in zip(off, qoff)]
        hi = [min(a + s, b + t) for a, s, b, t in zip(off, size, qoff, qsize)]
        if all(h > lo_ for lo_, h in zip(lo, hi)):
            out.append(
                Overlap(
                    i,
                    tuple(x - a for x, a in zip(lo, off)),
                    tuple(x - b for x, b in zip(lo, qoff)),
                    tuple(h - x for x, h in zip(lo, hi)),
                )
            )
    return out


def region(arr, off, size):
    """arr[off : off + size] as an array view (also for 0-d arrays)."""
    return arr[tuple(slice(o, o + n) for o, n in zip(off, size))] if off else arr[...]


# ---- strategies --------------------------------------------------------------


@st.composite
def box(draw, ndim, max_off=20, max_size=8):
    off = tuple(draw(st.integers(0, max_off)) for _ in range(ndim))
    size = tuple(draw(st.integers(0, max_size)) for _ in range(ndim))
    return off, size


@st.composite
def unstructured(draw):
    ndim = draw(st.integers(0, 4))
    boxes = draw(st.lists(box(ndim), max_size=30))
    if boxes and draw(st.booleans()):  # replicas of one box
        boxes += [boxes[0]] * draw(st.integers(1, 3))
    requests = draw(st.lists(box(ndim, 24, 12), min_size=1, max_size=5))
    return ndim, boxes, requests


def split_points(draw, length):
    """Uneven cut of [0, length) into pieces, some possibly empty."""
    cuts = sorted(draw(st.lists(st.integers(0, length), max_size=4)))
    edges = [0, *cuts, length]
    return [(a, b - a) for a, b in zip(edges, edges[1:])]


@st.composite
def tiling(draw, shape):
    """Shard shape along a random subset of dims, as DCP does."""
    sharded = [draw(st.booleans()) for _ in shape]
    pieces = [split_points(draw, n) if s else [(0, n)] for n, s in zip(shape, sharded)]
    boxes = [
        (tuple(p[0] for p in combo), tuple(p[1] for p in combo))
        for combo in itertools.product(*pieces)
    ]
    return draw(st.permutations(boxes)) if draw(st.booleans()) else boxes


@st.composite
def tiled_case(draw):
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.integers(0, 12)) for _ in range(ndim))
    saved = draw(tiling(shape))
    requested = draw(tiling(shape))  # a resharded load
    return shape, saved, requested


# ---- the index ---------------------------------------------------------------


@SETTINGS
@given(unstructured())
def test_random_boxes_match_brute_force(case):
    ndim, boxes, requests = case
    index = OverlapIndex(boxes, ndim=ndim)
    assert len(index) == len(boxes) and index.ndim == ndim
    for req in requests:
        # Exact equality: the same overlaps, ordered by saved index.
        assert index.query(*req) == brute_overlaps(boxes, req)


@SETTINGS
@given(tiled_case(), st.integers(0, 2**32 - 1))
def test_tilings_match_brute_force_and_reassemble(case, seed):
    shape, saved, requested = case
    rng = np.random.default_rng(seed)
    full = rng.integers(0, 1000, size=shape).astype(np.int32)
    chunks = [region(full, off, size).copy() for off, size in saved]
    index = OverlapIndex(saved, ndim=len(shape))
    for req in requested:
        got = index.query(*req)
        assert got == brute_overlaps(saved, req)
        # Load the request from the saved chunks, as a resharded DCP load.
        dest = np.full(req[1], -1, dtype=np.int32)
        for ov in got:
            copy_region(dest, ov.request_offset, chunks[ov.saved_index], ov.saved_offset,
                        ov.lengths)
        want = region(full, *req)
        np.testing.assert_array_equal(dest, want)


@SETTINGS
@given(unstructured())
def test_query_many_is_the_queries_concatenated(case):
    ndim, boxes, requests = case
    m, n = len(requests), len(boxes)
    offsets = np.array([r[0] for r in requests], dtype=np.int64).reshape(m, ndim)
    sizes = np.array([r[1] for r in requests], dtype=np.int64).reshape(m, ndim)
    index = GeomIndex(
        np.array([b[0] for b in boxes], dtype=np.int64).reshape(n, ndim),
        np.array([b[1] for b in boxes], dtype=np.int64).reshape(n, ndim),
    )
    req_idx, *cols = index.query_many(offsets, sizes)
    for j, (o, s) in enumerate(requests):
        single = index.query(o, s)
        mask = req_idx == j
        for got, want in zip(cols, single):
            np.testing.assert_array_equal(got[mask], want)
    assert len(req_idx) == sum(len(index.query(o, s)[0]) for o, s in requests)
    wrapped = OverlapIndex(boxes, ndim=ndim)
    assert wrapped.query_many(requests) == [brute_overlaps(boxes, r) for r in requests]


def test_scalar_and_empty_boxes():
    assert overlaps([((), ()), ((), ())], ((), ())) == [
        Overlap(0, (), (), ()),
        Overlap(1, (), (), ()),
    ]
    # A zero-size box overlaps nothing, nor does a zero-size request.
    assert overlaps([((0, 0), (0, 4)), ((0, 0), (4, 4))], ((0, 0), (2, 2))) == [
        Overlap(1, (0, 0), (0, 0), (2, 2))
    ]
    assert overlaps([((0, 0), (4, 4))], ((1, 1), (0, 2))) == []
    assert OverlapIndex([], ndim=3).query((0, 0, 0), (5, 5, 5)) == []
    # Replicas: all returned, in order.
    rep = [((2,), (3,))] * 3
    assert [o.saved_index for o in overlaps(rep, ((0,), (10,)))] == [0, 1, 2]


def test_row_wise_tiling_query_visits_few_boxes():
    n = 10000
    offsets = np.stack([np.arange(n) * 4, np.zeros(n, np.int64)], axis=1)
    sizes = np.tile(np.array([4, 16], np.int64), (n, 1))
    index = GeomIndex(offsets, sizes)
    saved_index, *_ = index.query([4 * 6000 + 2, 3], [8, 5])  # rows of 3 chunks
    assert saved_index.tolist() == [6000, 6001, 6002]
    assert index.last_visited < 200  # a double loop would test all 10000


def test_grid_query_visits_few_boxes():
    g = 100  # a 100 x 100 grid of 10000 chunks, each 3 x 5
    ij = np.array([(i, j) for i in range(g) for j in range(g)], np.int64)
    index = GeomIndex(ij * [3, 5], np.tile([3, 5], (g * g, 1)))
    saved_index, _, _, lengths = index.query([30, 50], [30, 50])  # a 10 x 10 block
    assert sorted(saved_index.tolist()) == saved_index.tolist()
    assert len(saved_index) == 100 and (lengths == [3, 5]).all()
    assert index.last_visited < 1000


def test_queries_from_many_threads():
    boxes = [((i * 3,), (3,)) for i in range(300)]
    index = OverlapIndex(boxes)
    errors = []

    def worker(k):
        for j in range(100):
            req = ((k * 7 + j * 5) % 950,), (11,)
            if index.query(*req) != brute_overlaps(boxes, req):
                errors.append(req)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_index_validation():
    with pytest.raises(ValueError, match="2-d arrays of shape"):
        GeomIndex([0, 1], [1, 1])
    with pytest.raises(ValueError, match="different shapes"):
        GeomIndex([[0, 1]], [[1, 1, 1]])
    with pytest.raises(ValueError, match="box 1 dim 0"):
        GeomIndex([[0], [-1]], [[1], [1]])
    with pytest.raises(ValueError, match="box 0 dim 1"):
        GeomIndex([[0, 2**63 - 2]], [[1, 5]])
    with pytest.raises(TypeError, match="must be integers, got dtype float64"):
        GeomIndex([[0.5]], [[1.0]])
    with pytest.raises(TypeError, match="must be integers, got dtype bool"):
        GeomIndex([[True]], [[1]])
    # Other integer dtypes are fine; uint64 beyond int64 fails validation.
    assert len(GeomIndex(np.zeros((2, 1), np.uint16), np.ones((2, 1), np.int8))) == 2
    with pytest.raises(ValueError, match="box 0 dim 0"):
        GeomIndex(np.array([[2**63]], np.uint64), [[1]])
    index = GeomIndex([[0, 0]], [[2, 2]])
    with pytest.raises(ValueError, match="boxes have 3 dims but the index has 2"):
        index.query([0, 0, 0], [1, 1, 1])
    with pytest.raises(ValueError, match="box 0 dim 1"):
        index.query([0, 0], [1, -1])
    with pytest.raises(ValueError, match="ndim is needed"):
        OverlapIndex([])
    with pytest.raises(ValueError, match="box 1 has 1 offsets"):
        OverlapIndex([((0, 0), (1, 1)), ((0,), (1,))])


# ---- copy_region -------------------------------------------------------------

DTYPES = [
    np.dtype(np.uint8),
    np.dtype(np.int16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.complex128),
    np.dtype([("a", "u1"), ("b", "<u2")]),  # itemsize 3
    np.dtype([("x", "<f4"), ("y", "<i8")]),  # itemsize 12
]
assert [d.itemsize for d in DTYPES] == [1, 2, 4, 8, 16, 3, 12]


def random_base(rng, shape, dtype):
    n = int(np.prod(shape)) * dtype.itemsize
    return np.frombuffer(bytearray(rng.bytes(n)), dtype=dtype).reshape(shape)


@st.composite
def layout(draw, shape):
    """How to cut a view of `shape` from a bigger base: axis order, steps."""
    perm = draw(st.permutations(range(len(shape))))
    steps = [draw(st.sampled_from([1, 1, 2, -1, -3])) for _ in shape]
    pads = [draw(st.integers(0, 1)) for _ in shape]
    return perm, steps, pads


def make_view(base_alloc, shape, lay):
    """Two identical bases and the same strided view of `shape` on each."""
    perm, steps, pads = lay
    # Base axis k holds view axis perm[k], stepping by steps[k].
    base_shape = tuple(shape[p] * abs(s) + pad for p, s, pad in zip(perm, steps, pads))
    base = base_alloc(base_shape)
    sl = []
    for p, s in zip(perm, steps):
        n = shape[p]
        if n == 0:
            sl.append(slice(0, 0))
        elif s > 0:
            sl.append(slice(0, n * s, s))
        else:
            sl.append(slice(n * -s - 1, None, s))
    view = base[tuple(sl)] if sl else base[...]
    view = view.transpose(np.argsort(perm))
    assert view.shape == tuple(shape)
    return base, view


@st.composite
def copy_case(draw, ndims=(0, 4), max_len=5):
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(*ndims))
    lengths = [draw(st.integers(0, max_len)) for _ in range(ndim)]
    dshape = [n + draw(st.integers(0, 3)) for n in lengths]
    sshape = [n + draw(st.integers(0, 3)) for n in lengths]
    doff = [draw(st.integers(0, a - n)) for a, n in zip(dshape, lengths)]
    soff = [draw(st.integers(0, a - n)) for a, n in zip(sshape, lengths)]
    return (dtype, lengths, dshape, doff, draw(layout(dshape)), sshape, soff,
            draw(layout(sshape)), draw(st.integers(0, 2**32 - 1)))


@SETTINGS
@given(copy_case(), st.sampled_from([None, 2]))
def test_copy_matches_numpy(case, threads):
    check_copy(case, threads)


@settings(max_examples=40, deadline=None)
@given(copy_case(ndims=(2, 3), max_len=40), st.sampled_from([None, 2]))
def test_copy_long_dims_matches_numpy(case, threads):
    # Long enough dims for the tiled path taken by transposing copies.
    check_copy(case, threads)


def check_copy(case, threads):
    dtype, lengths, dshape, doff, dlay, sshape, soff, slay, seed = case
    rng = np.random.default_rng(seed)
    dbase, dst = make_view(lambda s: random_base(rng, s, dtype), dshape, dlay)
    ebase = dbase.copy()
    expect = make_view(lambda s: ebase, dshape, dlay)[1]
    _, src = make_view(lambda s: random_base(rng, s, dtype), sshape, slay)
    dsl = tuple(slice(o, o + n) for o, n in zip(doff, lengths))
    ssl = tuple(slice(o, o + n) for o, n in zip(soff, lengths))
    pool = shardstate.ThreadPool(threads) if threads else None
    copy_region(dst, doff, src, soff, lengths, pool=pool)
    expect[dsl] = src[ssl]
    # Bitwise, over the whole base: nothing written outside the region.
    assert dbase.tobytes() == ebase.tobytes()


@pytest.mark.parametrize("threads", [2, 4])
def test_large_copy_with_pool(threads):
    rng = np.random.default_rng(threads)
    src = rng.standard_normal((1100, 1300)).astype(np.float32)  # 5.7 MB
    pool = shardstate.ThreadPool(threads)
    # Contiguous rows, then a transposing copy, then a 3-byte strided one.
    dst = np.zeros((1200, 1300), np.float32)
    copy_region(dst, (100, 0), src, (0, 0), (1100, 1300), pool)
    np.testing.assert_array_equal(dst[100:], src)
    assert not dst[:100].any()
    dst_t = np.zeros((1300, 1100), np.float32)
    copy_region(dst_t, (0, 0), src.T, (0, 0), (1300, 1100), pool)
    np.testing.assert_array_equal(dst_t, src.T)
    dt = np.dtype([("a", "u1"), ("b", "<u2")])
    s3 = np.frombuffer(rng.bytes(1500 * 1000 * 3), dt).reshape(1500, 1000)
    d3 = np.zeros((1000, 1500), dt)[:, ::-1]
    copy_region(d3, (0, 0), s3.T, (0, 0), (1000, 1500), pool)
    assert d3.tobytes() == np.ascontiguousarray(s3.T).tobytes()


def test_copy_scalar_arrays():
    dst, src = np.zeros((), np.float64), np.array(2.5)
    copy_region(dst, (), src, (), ())
    assert dst == 2.5


def test_copy_errors():
    a = np.zeros((4, 6), np.float32)
    b = np.ones((4, 6), np.float32)
    with pytest.raises(ValueError, match="dim 1: dst offset 3 \\+ length 4 outside dst shape 6"):
        copy_region(a, (0, 3), b, (0, 0), (2, 4))
    with pytest.raises(ValueError, match="dim 0: src offset 3"):
        copy_region(a, (0, 0), b, (3, 0), (2, 4))
    with pytest.raises(ValueError, match="dim 0: negative length"):
        copy_region(a, (0, 0), b, (0, 0), (-1, 4))
    with pytest.raises(ValueError, match="dim 0: dst offset -1"):
        copy_region(a, (-1, 0), b, (0, 0), (1, 1))
    with pytest.raises(ValueError, match="lengths has 1 entries"):
        copy_region(a, (0, 0), b, (0, 0), (1,))
    ro = np.zeros((4, 6), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_region(ro, (0, 0), b, (0, 0), (1, 1))
    with pytest.raises(TypeError, match="dtype"):
        copy_region(a, (0, 0), b.astype(np.int32), (0, 0), (1, 1))
    with pytest.raises(TypeError, match="items are 4 bytes, src items 8"):
        core_copy_region(a, (0, 0), b.astype(np.float64), (0, 0), (1, 1))
    with pytest.raises(ValueError, match="dst has 2 dims, src 1"):
        core_copy_region(a, (0, 0), b[0], (0,), (1, 1))
    with pytest.raises(TypeError, match="Python objects"):
        core_copy_region(np.zeros(2, object), (0,), np.zeros(2, object), (0,), (1,))
    with pytest.raises(TypeError, match="ThreadPool or None"):
        copy_region(a, (0, 0), b, (0, 0), (1, 1), pool=3)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        copy_region([1, 2], (0,), np.zeros(2), (0,), (1,))
    # Overlapping memory in one array is refused; disjoint parts are fine.
    with pytest.raises(shardstate.ShardstateError, match="intersect"):
        copy_region(a, (1, 0), a, (0, 0), (2, 6))
    b[:2] = 7
    copy_region(b, (2, 0), b, (0, 0), (2, 6))
    assert (b == 7).all()
    a[:] = np.arange(24).reshape(4, 6)
    copy_region(a, (0, 0), a, (0, 0), (4, 6))  # onto itself: a no-op
    assert (a == np.arange(24).reshape(4, 6)).all()
    # Nothing happened to a after the errors above, and zero lengths copy nothing.
    copy_region(a, (4, 6), b, (0, 0), (0, 0))
    assert (a == np.arange(24).reshape(4, 6)).all()


def test_copy_torch_tensors():
    import torch

    src = torch.randn(8, 6).to(torch.bfloat16)
    dst = torch.zeros(6, 8, dtype=torch.bfloat16).t()  # non-contiguous
    copy_region(dst, (1, 2), src, (0, 1), (5, 4))
    expect = torch.zeros(6, 8, dtype=torch.bfloat16).t()
    expect[1:6, 2:6] = src[0:5, 1:5]
    assert torch.equal(dst, expect)
    f8 = torch.randn(4, 4).to(torch.float8_e4m3fn)
    g8 = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    copy_region(g8, (1, 0), f8, (0, 0), (3, 4))
    assert torch.equal(g8[1:].view(torch.uint8), f8[:3].view(torch.uint8))
    assert not g8[0].view(torch.uint8).any()
    # Mixed with NumPy, and a tensor that requires grad as the source.
    w = torch.arange(12.0, requires_grad=True).reshape(3, 4)
    out = np.zeros((3, 4), np.float32)
    copy_region(out, (0, 0), w, (0, 0), (3, 4))
    np.testing.assert_array_equal(out, np.arange(12.0).reshape(3, 4))
    with pytest.raises(TypeError, match="dtype"):
        copy_region(torch.zeros(2, dtype=torch.float16), (0,),
                    torch.zeros(2, dtype=torch.bfloat16), (0,), (2,))


def test_geometry_import_does_not_import_torch():
    code = "import sys, shardstate.geometry; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert geometry.__all__
