"""The FSDP1 flat layout (the C core's ``FlatLayout``) and ``shardstate.fsdp._flatops``'
copy batches against torch 2.13's own FlatParameter code.

The oracle is torch itself: ``FlatParamHandle`` built on CPU for any rank
and world size (it reads only ``rank()`` and ``size()`` from its process
group before ``shard()``, so a two-method stand-in lets one process build
every rank's handle), its ``_get_shard_metadata`` for arbitrary ranges,
``_optim_utils._flatten_tensor_optim_state`` + ``_get_shard`` for optimizer
state, and real FSDP1 units (FullyShardedDataParallel on gloo, world sizes
2-4, nested units, tied weights) for the end-to-end check. Layout fields,
shard infos and flattened shards (bitwise, four float dtypes) must equal
torch's; unflatten must round-trip; bad input must raise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from shardstate import ShardstateError
from shardstate._core import FlatLayout
from shardstate.fsdp._flatops import (
    FLAT_PARAM_PADDING_VALUE,
    ShardParamInfo,
    flat_views,
    flatten_many,
    shard_infos,
    unflatten_many,
    unit_layout,
)
from torch.distributed.fsdp._flat_param import FlatParamHandle, HandleShardingStrategy
from torch.distributed.fsdp._optim_utils import _flatten_tensor_optim_state

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _PG:
    """The two methods FlatParamHandle asks of its process group."""

    def __init__(self, rank: int, world_size: int) -> None:
        self._rank, self._size = rank, world_size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Params(nn.Module):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        for i, t in enumerate(tensors):
            self.register_parameter(f"p{i}", nn.Parameter(t.clone()))


def _values(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _handle(values, rank, world_size, use_orig_params):
    """A sharded FlatParamHandle over copies of values, as rank sees it."""
    module = _Params(values)
    h = FlatParamHandle(
        list(module.parameters()), module, torch.device("cpu"),
        HandleShardingStrategy.FULL_SHARD, False, None, None, False,
        _PG(rank, world_size), use_orig_params,
    )
    h.shard()
    return h


def _aligned_numel(itemsize: int) -> int:
    """torch's ``_get_aligned_numel`` for use_orig_params=True: elements per 16 bytes."""
    return 16 // itemsize


def _layout_for(values, world_size, use_orig_params):
    itemsize = values[0].element_size()
    return FlatLayout(
        [v.numel() for v in values], world_size,
        align_numel=_aligned_numel(itemsize) if use_orig_params else 0,
    )


def _flatten(layout, pieces, rank, out, **kw):
    """One flatten job: rank's shard of the flat parameter built from pieces, into out."""
    flatten_many([(layout, rank, pieces, out)], **kw)


def _unflatten_into(layout, shard, rank, outs):
    """One unflatten job: rank's shard into the parameters' buffers."""
    unflatten_many([(layout, rank, shard, outs)])


def _bits(t: torch.Tensor) -> np.ndarray:
    """The raw bits of a CPU tensor, for bitwise comparison."""
    return t.detach().contiguous().view(_INTS[t.element_size()]).numpy().copy()


# torch's test_fsdp_flatten_params modules and more: uneven sizes, params
# smaller than the world size, zero-numel params, empty tail shards.
SHAPE_SETS = [
    [(10, 10), (10, 10), (10, 10)],  # three Linear(10, 10, bias=False)
    [(7, 10), (7,), (3, 7), (3,)],  # Linear(10, 7) + Linear(7, 3)
    [(5, 3), (5,), (1, 5), (1,)],
    [(1,)],
    [(2,), (1,)],
    [(3,), (0,), (1,)],
    [(0,), (5,), (0, 4), (2, 2)],
    [(1,), (3,), (1, 1)],  # (torch's FlatParamHandle refuses 0-d params)
    [(17,)],
    [(4, 4, 3), (9,), (1, 1), (31,)],
    [(13,), (6,), (11,), (2,), (2,)],
]


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shapes", SHAPE_SETS, ids=lambda s: "x".join(map(str, s)) or "0d")
def test_layout_and_shard_equal_flat_param_handle(shapes, dtype, use_orig_params):
    values = _values(shapes, dtype, seed=len(shapes))
    for world_size in range(1, 5):
        layout = _layout_for(values, world_size, use_orig_params)
        for rank in range(world_size):
            h = _handle(values, rank, world_size, use_orig_params)
            fp = h.flat_param
            assert layout.numels == tuple(fp._numels)
            assert layout.numels_with_padding == tuple(fp._numels_with_padding)
            assert layout.is_padding_mask == tuple(fp._is_padding_mask)
            assert layout.align_numel == h._aligned_numel
            assert layout.flat_numel == fp._unpadded_unsharded_size.numel()
            assert layout.shard_numel == fp.numel() == fp._sharded_size.numel()
            assert layout.padded_numel == layout.shard_numel * world_size
            start, end = layout.shard_range(rank)
            assert (start, end) == (rank * fp.numel(), (rank + 1) * fp.numel())
            # the numel torch padded this rank's chunk with
            assert fp._shard_numel_padded == end - max(start, min(end, layout.flat_numel))
            offsets = [s for s, _ in h._get_flat_param_offsets()]
            real = [o for o, pad in zip(offsets, fp._is_padding_mask) if not pad]
            assert layout.offsets == tuple(real)
            assert layout.unpadded_numel == real[-1] + layout.numels[-1]
            infos = shard_infos(layout, rank)
            assert all(type(i) is ShardParamInfo for i in infos)
            assert [tuple(i) for i in infos] == [tuple(i) for i in fp._shard_param_infos]
            # the unit layout _flatops builds from the handle is the same layout
            unit = unit_layout(h, world_size, rank, True)
            assert unit.shard_infos == infos
            assert (unit.flat.numels, unit.flat.world_size, unit.flat.align_numel) == (
                layout.numels, world_size, layout.align_numel)
            assert (unit.offsets, unit.shard_numel, unit.padded_numel) == (
                layout.offsets, layout.shard_numel, layout.padded_numel)
            # flatten of the original values is torch's local shard, bit for bit
            out = torch.full((layout.shard_numel,), -7.0, dtype=dtype)
            _flatten(layout, values, rank, out)
            assert np.array_equal(_bits(out), _bits(fp))


def test_shard_metadata_cases_of_torch_tests():
    """The (start, end) cases of torch's flat-param shard-metadata tests:
    three Linear(10, 10, bias=False), unaligned and aligned."""
    values = _values([(10, 10)] * 3, torch.float32)
    cases = [(0, 0), (0, 50), (0, 99), (50, 149), (50, 199), (99, 199), (100, 199),
             (100, 299), (100, 1000), (299, 299), (1, 1), (99, 100), (150, 250)]
    for use_orig_params in (False, True):
        h = _handle(values, 0, 1, use_orig_params)
        layout = _layout_for(values, 1, use_orig_params)
        for start, end_incl in cases:
            want = [tuple(i) for i in h._get_shard_metadata(start, end_incl)]
            assert [tuple(i) for i in layout.range_infos(start, end_incl + 1)] == want
    # aligned with real padding: Linear(10, 7) + Linear(7, 3) in float32
    values = _values([(7, 10), (7,), (3, 7), (3,)], torch.float32)
    h = _handle(values, 0, 1, True)
    layout = _layout_for(values, 1, True)
    assert any(layout.is_padding_mask)
    n = layout.flat_numel
    for start in range(0, n, 3):
        for end_incl in range(start, n + 2, 5):
            want = [tuple(i) for i in h._get_shard_metadata(start, end_incl)]
            assert [tuple(i) for i in layout.range_infos(start, end_incl + 1)] == want


@pytest.mark.parametrize("dtype", FLOATS)
def test_flatten_optimizer_state_equals_torch(dtype):
    """Optimizer state (another dtype than the parameters, some parameters
    without state) flattens as _flatten_tensor_optim_state + _get_shard."""
    shapes = [(5, 3), (5,), (1, 5), (4,), (7,)]
    params = _values(shapes, torch.float32, seed=3)
    states = _values(shapes, dtype, seed=4)
    states[1] = None
    states[3] = None
    for world_size in range(1, 5):
        layout = _layout_for(params, world_size, False)
        for rank in range(world_size):
            h = _handle(params, rank, world_size, False)
            names = [f"p{i}" for i in range(len(shapes))]
            flat = _flatten_tensor_optim_state("exp_avg", states, names,
                                               [torch.Size(s) for s in shapes], h)
            want, _ = FlatParamHandle._get_shard(flat, rank, world_size)
            out = torch.empty(layout.shard_numel, dtype=dtype)
            _flatten(layout, states, rank, out)
            assert np.array_equal(_bits(out), _bits(want))


@pytest.mark.parametrize("dtype", FLOATS)
def test_flatten_tensors_aligned_equal_torch(dtype):
    """Aligned mode (use_orig_params=True) with state in another dtype:
    handle.flatten_tensors pads with 42 in the state's dtype."""
    shapes = [(3,), (5, 2), (1,), (9,)]
    params = _values(shapes, torch.float32, seed=5)
    states = _values(shapes, dtype, seed=6)
    for world_size in (1, 3, 4):
        layout = _layout_for(params, world_size, True)
        for rank in range(world_size):
            h = _handle(params, rank, world_size, True)
            flat = h.flatten_tensors([s.flatten() for s in states], h._aligned_numel)
            want, _ = FlatParamHandle._get_shard(flat, rank, world_size)
            out = torch.empty(layout.shard_numel, dtype=dtype)
            _flatten(layout, states, rank, out)
            assert np.array_equal(_bits(out), _bits(want))
            if any(layout.is_padding_mask):
                assert FLAT_PARAM_PADDING_VALUE in out.float().tolist()


def test_unflatten_views_and_round_trip():
    shapes = [(3, 4), (5,), (1,), (2, 3)]
    values = _values(shapes, torch.float32, seed=7)
    for use_orig_params in (False, True):
        for world_size in range(1, 5):
            layout = _layout_for(values, world_size, use_orig_params)
            shards = [torch.empty(layout.shard_numel) for _ in range(world_size)]
            flatten_many([(layout, r, values, shards[r]) for r in range(world_size)], threads=2)
            full = torch.cat(shards)
            assert full.numel() == layout.padded_numel
            views = flat_views(layout, full)
            for v, t in zip(views, values):
                assert torch.equal(v, t.flatten())
                assert v.data_ptr() >= full.data_ptr()  # a view, not a copy
            views[0][0] = 123.0
            assert full[layout.offsets[0]] == 123.0
            # numpy in, numpy views out; flat_numel long also accepted
            arr = full.numpy()[: layout.flat_numel]
            assert all(np.shares_memory(a, arr) for a in flat_views(layout, arr) if a.size)
            # scatter every rank's shard back into fresh buffers
            back = [torch.zeros(t.numel()) for t in values]
            unflatten_many([(layout, r, shards[r], back) for r in range(world_size)])
            full[layout.offsets[0]] = values[0].flatten()[0]
            for b, t in zip(back, values):
                assert torch.equal(b, t.flatten())


def test_unflatten_into_partial_pieces_and_skips():
    """Pieces may be dim-0 parts of a parameter as (buffer, start), or None."""
    values = _values([(6, 2), (4,)], torch.float64, seed=8)
    layout = FlatLayout([12, 4], 2, 0)  # shards of 8: rank 1 = p0[8:12], p1[0:4]
    shard = torch.empty(8, dtype=torch.float64)
    flat0 = values[0].flatten()
    _flatten(layout, [(flat0[6:].clone(), 6), values[1]], 1, shard)
    assert torch.equal(shard, torch.cat([flat0[8:], values[1]]))
    part = torch.zeros(4, dtype=torch.float64)  # rows 3..4 of p0 = elements [6, 10)
    _unflatten_into(layout, shard, 1, [(part, 6), None])
    assert torch.equal(part, torch.cat([torch.zeros(2, dtype=torch.float64), flat0[8:10]]))
    with pytest.raises(ShardstateError, match="parameter 0"):  # misses element 8
        _flatten(layout, [(flat0[9:].clone(), 9), values[1]], 1, shard)


def test_many_units_one_call_on_threads():
    """A batch of several units, states and ranks (some copies past the
    1 MiB task size), with pad_value overridden."""
    rng = np.random.default_rng(9)
    jobs, want = [], []
    for u, numels in enumerate([[300_000, 7, 250_001], [5, 3], [1, 1, 1], [700_000]]):
        for world_size in (2, 3):
            layout = FlatLayout(numels, world_size, align_numel=4 if u % 2 else 0)
            pieces = [rng.standard_normal(n).astype(np.float32) for n in numels]
            full = np.full(layout.padded_numel, -1.0, dtype=np.float32)
            for o, p in zip(layout.offsets, pieces):
                full[o : o + p.size] = p
            for rank in range(world_size):
                out = np.empty(layout.shard_numel, dtype=np.float32)
                jobs.append((layout, rank, pieces, out))
                s, e = layout.shard_range(rank)
                want.append(full[s:e])
    flatten_many(jobs, pad_value=-1.0, threads=3)
    for (_, _, _, out), w in zip(jobs, want):
        assert np.array_equal(out, w)


def test_bad_inputs_raise():
    layout = FlatLayout([4, 3], 2, 0)  # shards of 4
    good = [np.zeros(4, np.float32), np.zeros(3, np.float32)]
    out = np.empty(4, np.float32)
    with pytest.raises(ValueError, match="at least one"):
        FlatLayout([], 2, 0)
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout([1], 0, 0)
    with pytest.raises(ValueError, match="parameter 1 has numel -1"):
        FlatLayout([1, -1], 2, 0)
    with pytest.raises(ValueError, match="align_numel"):
        FlatLayout([1], 2, align_numel=-4)
    with pytest.raises(TypeError):
        FlatLayout([1.5], 2, 0)
    with pytest.raises(ShardstateError, match="overflows"):
        FlatLayout([2**62, 2**62], 2, 0)
    with pytest.raises(ValueError, match="rank 2"):
        layout.shard_infos(2)
    with pytest.raises(ValueError, match="rank -1"):
        _flatten(layout, good, -1, out)
    with pytest.raises(ValueError, match="bad range"):
        layout.range_infos(3, 2)
    with pytest.raises(ValueError, match="out has 5 elements"):
        _flatten(layout, good, 0, np.empty(5, np.float32))
    with pytest.raises(ValueError, match="dtype float64, expected float32"):
        _flatten(layout, [good[0], np.zeros(3)], 0, out)
    with pytest.raises(ValueError, match="dtype int16, expected bfloat16"):
        _flatten(layout, [torch.zeros(4, dtype=torch.int16), None], 0,
                 torch.empty(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"pieces\[1\] has 2 elements"):
        _flatten(layout, [good[0], np.zeros(2, np.float32)], 0, out)
    with pytest.raises(ValueError, match="2 pieces for 3"):
        _flatten(FlatLayout([1, 1, 1], 1, 0), good, 0, np.empty(3, np.float32))
    with pytest.raises(ValueError, match="byte order"):
        _flatten(layout, [np.zeros(4, ">f4"), None], 0, out)
    with pytest.raises(ValueError, match="C-contiguous"):
        _flatten(layout, [np.zeros(8, np.float32)[::2], good[1]], 0, out)
    with pytest.raises(ValueError, match="contiguous"):
        _flatten(layout, [torch.zeros(2, 2).t(), None], 0, out)
    ro = np.empty(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _flatten(layout, good, 0, ro)
    with pytest.raises(TypeError, match="numpy.ndarray or a CPU torch.Tensor"):
        _flatten(layout, [[0.0] * 4, None], 0, out)
    with pytest.raises(ValueError, match=r"holds elements \[2, 6\)"):
        _unflatten_into(layout, out, 0, [(np.zeros(4, np.float32), 2), None])
    with pytest.raises(ValueError, match="1-D"):
        flat_views(layout, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="expected 7 .* or 8"):
        flat_views(layout, np.zeros(6, np.float32))
    with pytest.raises(TypeError, match="FlatLayout"):
        flatten_many([("layout", 0, good, out)])
    # the same out twice, and writing into a source
    with pytest.raises(ShardstateError, match="overlap"):
        flatten_many([(layout, 0, good, out), (layout, 1, good, out)])
    with pytest.raises(ShardstateError, match="overlap"):
        buf = np.zeros(8, np.float32)
        _flatten(layout, [buf[2:6], None], 0, buf[4:])
    # nothing was written by a failed batch
    out[:] = 5.0
    with pytest.raises(ValueError):
        flatten_many([(layout, 0, good, out), (layout, 1, good, np.empty(3, np.float32))])
    assert (out == 5.0).all()


def test_bfloat16_padding_value_is_torchs():
    layout = FlatLayout([1, 3], 2, align_numel=8)
    out = torch.empty(layout.shard_numel, dtype=torch.bfloat16)
    _flatten(layout, [torch.ones(1, dtype=torch.bfloat16), None], 0, out)
    assert out.tolist() == [1.0] + [42.0] * 5  # [p0, 7 alignment pad | ...]
    _flatten(layout, [None, torch.ones(3, dtype=torch.bfloat16)], 1, out)
    assert out.tolist() == [42.0, 42.0, 1.0, 1.0, 1.0, 42.0]  # p1 at 8, 1 world-size pad
    _flatten(layout, [None, torch.full((3,), 2.0, dtype=torch.bfloat16)], 1, out, pad_value=0)
    assert out.tolist() == [0.0, 0.0, 2.0, 2.0, 2.0, 0.0]


# ---- property test against a real FlatParamHandle -------------------------

@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    world_size=st.integers(1, 5),
    use_orig_params=st.booleans(),
    dtype=st.sampled_from(FLOATS),
    data=st.data(),
)
def test_property_against_flat_param_handle(numels, world_size, use_orig_params, dtype, data):
    rank = data.draw(st.integers(0, world_size - 1))
    values = _values([(n,) for n in numels], dtype, seed=sum(numels))
    if sum(numels) == 0:  # torch cannot shard an empty flat parameter
        layout = _layout_for(values, world_size, use_orig_params)
        assert layout.shard_numel == 0
        assert not any(i.in_shard for i in shard_infos(layout, rank))
        return
    h = _handle(values, rank, world_size, use_orig_params)
    layout = _layout_for(values, world_size, use_orig_params)
    assert layout.numels_with_padding == tuple(h.flat_param._numels_with_padding)
    assert [tuple(i) for i in layout.shard_infos(rank)] == [
        tuple(i) for i in h.flat_param._shard_param_infos]
    out = torch.empty(layout.shard_numel, dtype=dtype)
    _flatten(layout, values, rank, out)
    assert np.array_equal(_bits(out), _bits(h.flat_param))
    back = [torch.zeros_like(v) for v in values]
    _unflatten_into(layout, out, rank, back)
    for b, v, info in zip(back, values, shard_infos(layout, rank)):
        if info.in_shard:
            sl = slice(info.intra_param_start_idx, info.intra_param_end_idx + 1)
            assert torch.equal(b[sl], v[sl])
            b[sl] = 0
        assert not b.any()


# ---- real FSDP1 units ------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d, bias=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.Sequential(_Block(6, 5), _Block(6, 3))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.head(self.blocks(self.emb(x))) * self.scale


def _fsdp_units(rank: int, world_size: int):
    """For use_orig_params False (float32) and True (bfloat16): every FSDP1
    unit's full fqns, numels, infos and local shard bits, and the unsharded
    originals' bits."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    runs = []
    for use_orig_params, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        torch.manual_seed(0)
        model = _Model().to(dtype)
        originals = {n: _bits(p) for n, p in model.named_parameters()}
        fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=use_orig_params,
                    auto_wrap_policy=ModuleWrapPolicy({_Block}))
        units = []
        for name, m in fsdp.named_modules():
            if not isinstance(m, FSDP) or m._handle is None:
                continue
            h = m._handle
            fp = h.flat_param
            prefix = name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
            units.append({
                "fqns": [f"{prefix}.{f}" if prefix else f for f in fp._fqns],
                "numels": list(fp._numels),
                "align": h._aligned_numel,
                "with_padding": list(fp._numels_with_padding),
                "infos": [tuple(i) for i in fp._shard_param_infos],
                "shard": _bits(fp),
            })
        runs.append((use_orig_params, str(dtype).removeprefix("torch."), units, originals))
    return runs


@pytest.mark.parametrize("world_size", [3, 4])
def test_real_fsdp1_units(run_distributed, world_size):
    """Nested FSDP1 units (two blocks and a root holding a tied weight) on
    gloo, use_orig_params False and True: layout, infos and local shards
    equal torch's on every rank."""
    for rank, runs in enumerate(run_distributed(_fsdp_units, world_size)):
        assert [r[0] for r in runs] == [False, True]
        for use_orig_params, dtype_name, units, originals in runs:
            dtype = getattr(torch, dtype_name)
            assert len(units) == 3
            assert sorted(f for u in units for f in u["fqns"]) == sorted(originals)
            for u in units:
                assert (u["align"] > 0) == use_orig_params
                layout = FlatLayout(u["numels"], world_size, align_numel=u["align"])
                assert list(layout.numels_with_padding) == u["with_padding"]
                assert [tuple(i) for i in layout.shard_infos(rank)] == u["infos"]
                pieces = [torch.from_numpy(originals[f]).view(dtype) for f in u["fqns"]]
                out = torch.empty(layout.shard_numel, dtype=dtype)
                _flatten(layout, pieces, rank, out)
                assert np.array_equal(_bits(out), u["shard"]), (rank, u["fqns"])


def test_unit_layout_refuses_no_shard():
    module = _Params(_values([(3,)], torch.float32))
    h = FlatParamHandle(
        list(module.parameters()), module, torch.device("cpu"), HandleShardingStrategy.NO_SHARD,
        False, None, None, False, _PG(0, 2), True,
    )
    with pytest.raises(ValueError, match="NO_SHARD"):
        unit_layout(h, 2, 0, True)


def test_batch_mixes_dtypes_and_units():
    """One call with float64 numpy state, bfloat16 tensors and float16 state
    of different units: each job uses its own element size and padding."""
    a = FlatLayout([5, 2], 3, 0)
    b = FlatLayout([3, 9], 2, align_numel=8)
    pa = [np.arange(5, dtype=np.float64), np.arange(2, dtype=np.float64) + 10]
    pb = [torch.arange(3, dtype=torch.bfloat16), torch.arange(9, dtype=torch.bfloat16) + 20]
    pc = [None, torch.full((9,), 3.0, dtype=torch.float16)]
    oa = np.empty(a.shard_numel)
    ob = torch.empty(b.shard_numel, dtype=torch.bfloat16)
    oc = torch.empty(b.shard_numel, dtype=torch.float16)
    flatten_many([(a, 2, pa, oa), (b, 0, pb, ob), (b, 1, pc, oc)])
    assert oa.tolist() == [11.0, 0.0, 0.0]  # [p1[1], F.pad tail]
    # b: p0 at 0..2, 5 alignment pad, p1 at 8..16, 1 world-size pad; shards of 9
    assert ob.tolist() == [0.0, 1.0, 2.0] + [42.0] * 5 + [20.0]
    assert oc.tolist() == [3.0] * 8 + [42.0]
