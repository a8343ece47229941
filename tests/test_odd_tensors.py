"""Tensors off the common path, both ways with torch's DCP: every dtype torch
2.13's DCP saves (complex32, float8_e8m0fnu, float4_e2m1fn_x2 and the rest),
compared bit for bit, on the same files."""

from __future__ import annotations

from pathlib import Path

import pytest
import shardstate.checkpoint as ss
import torch
import torch.distributed.checkpoint as tdcp

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")]

_LIBS = {"shardstate": ss, "torch": tdcp}


def _dcp_dtypes() -> list[torch.dtype]:
    """Every torch dtype a dense CPU tensor can have and torch.save can write,
    except the bits* dtypes, which torch's own DCP cannot save."""
    import io

    out = []
    for name in dir(torch):
        d = getattr(torch, name)
        if not isinstance(d, torch.dtype) or d in out or str(d).startswith("torch.bits"):
            continue
        try:
            torch.save(torch.empty(2, dtype=d), io.BytesIO())
        except Exception:  # noqa: BLE001 - quantized and sub-byte dtypes: not saveable
            continue
        out.append(d)
    return out


DCP_DTYPES = _dcp_dtypes()


def _bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (any bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    n = dtype.itemsize
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if dtype != torch.bool else raw.bool().reshape(shape)


def test_every_dcp_dtype_is_covered() -> None:
    names = {str(d) for d in DCP_DTYPES}
    assert {"torch.complex32", "torch.float8_e8m0fnu", "torch.float4_e2m1fn_x2",
            "torch.uint64", "torch.float8_e5m2fnuz"} <= names


@pytest.mark.parametrize("saver,loader", [("shardstate", "shardstate"), ("torch", "shardstate"),
                                          ("shardstate", "torch")])
def test_every_dtype_both_ways(tmp_path: Path, saver: str, loader: str) -> None:
    sd = {str(d)[6:]: _bits(d, (3, 5), i) for i, d in enumerate(DCP_DTYPES)}
    _LIBS[saver].save(sd, checkpoint_id=str(tmp_path))
    out = {k: torch.zeros(v.nbytes, dtype=torch.uint8).view(v.dtype).reshape(v.shape)
           if v.dtype != torch.bool else torch.zeros(v.shape, dtype=torch.bool)
           for k, v in sd.items()}
    _LIBS[loader].load(out, checkpoint_id=str(tmp_path))
    for k, v in sd.items():
        assert out[k].dtype == v.dtype, k
        assert torch.equal(out[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def test_same_files_as_torch_for_new_dtypes(tmp_path: Path) -> None:
    sd = {n: _bits(getattr(torch, n), (4,), 9)
          for n in ("complex32", "float8_e8m0fnu", "float4_e2m1fn_x2")}
    ss.save(sd, storage_writer=ss.FileSystemWriter(str(tmp_path / "ours"), thread_count=1))
    tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(str(tmp_path / "torch"), thread_count=1))
    for f in sorted(p.name for p in (tmp_path / "torch").glob("*.distcp")):
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "torch" / f).read_bytes(), f


def _views() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    c = torch.randn(4, 6, dtype=torch.complex64, generator=g)
    f = torch.randn(4, 6, generator=g)
    return {
        "conj": c.conj(),  # conj bit set
        "neg": torch._neg_view(f),  # neg bit set
        "conj_neg": torch._neg_view(c.conj()),  # both
        "conj_imag": c.conj().imag,  # a float view with the neg bit, from torch's own ops
        "conj_t": c.t().conj(),  # strided and conjugate
    }


def test_view_bits_are_what_the_cases_claim() -> None:
    v = _views()
    assert v["conj"].is_conj() and v["neg"].is_neg() and v["conj_imag"].is_neg()
    assert v["conj_neg"].is_conj() and v["conj_neg"].is_neg()


@pytest.mark.parametrize("saver", ["torch", "shardstate"])
def test_conjugate_and_negative_views(tmp_path: Path, saver: str) -> None:
    sd = _views()
    want = {k: v.resolve_conj().resolve_neg() for k, v in sd.items()}
    _LIBS[saver].save(sd, checkpoint_id=str(tmp_path))
    for loader in ("shardstate", "torch"):
        out = {k: torch.zeros_like(v) for k, v in want.items()}
        _LIBS[loader].load(out, checkpoint_id=str(tmp_path))
        for k in want:
            assert torch.equal(out[k], want[k]), (saver, loader, k)
    # other destinations: a wider dtype (converted), NumPy arrays, part of a row
    import numpy as np

    out = {"conj": torch.zeros(4, 6, dtype=torch.complex128), "neg": np.zeros((4, 6), np.float32)}
    partial = ss.DefaultLoadPlanner(allow_partial_load=True)
    ss.load(out, checkpoint_id=str(tmp_path), planner=partial)
    assert torch.equal(out["conj"], want["conj"].to(torch.complex128))
    np.testing.assert_array_equal(out["neg"], want["neg"].numpy())


def _reshard_views(rank: int, world: int, path: str, broadcast: bool) -> bool:
    import shardstate.checkpoint as ss
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    want = {k: v.resolve_conj().resolve_neg() for k, v in _views().items()}
    mesh = init_device_mesh("cpu", (world,))
    out = {k: distribute_tensor(torch.zeros_like(v), mesh,
                                [Shard(1) if k != "neg" else Replicate()])
           for k, v in want.items()}
    ss.load(out, storage_reader=ss.FileSystemReader(path, broadcast_shared_reads=broadcast))
    return all(torch.equal(out[k].full_tensor(), want[k]) for k in want)


@pytest.mark.parametrize("broadcast", [False, True])
def test_torch_saved_views_reshard(run_distributed, tmp_path: Path, broadcast: bool) -> None:
    tdcp.save(_views(), checkpoint_id=str(tmp_path))
    assert run_distributed(_reshard_views, 2, str(tmp_path), broadcast) == [True, True]
