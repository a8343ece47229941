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
