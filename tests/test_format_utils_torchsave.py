"""Whole torch.save files through the engine (``_torchsave``, behind
``format_utils.dcp_to_torch_save`` / ``torch_save_to_dcp``), against real
torch: the file written is torch.save's byte for byte (shared storages,
views, nested containers, non-tensor values, many records), torch.load
reads it back equal; files torch.save wrote read back equal to torch.load's
with the same sharing, their CRC-32s checked, through the restricted
unpickler only."""

from __future__ import annotations

import collections
import zipfile
from pathlib import Path
from typing import Any

import pytest
import shardstate.checkpoint as dcp
import torch
from shardstate import ChecksumError
from shardstate.checkpoint import _torchsave
from shardstate.checkpoint import format_utils as sfu
from torch.distributed.checkpoint import format_utils as tfu

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _object(extra: int) -> dict[str, Any]:
    base = torch.arange(24, dtype=torch.float32)
    obj: dict[str, Any] = {
        "a": base.view(4, 6),
        "b": base[3:9],  # a view at an offset of a's storage
        "c": base.view(6, 4).t(),  # non-contiguous, same storage
        "nested": {"list": [torch.ones(2, dtype=torch.bfloat16), 3, "x", None, (1, 2.5)],
                   "empty": torch.empty(0, 3)},
        "od": collections.OrderedDict(flag=torch.tensor(True)),
        "i64": torch.arange(5, dtype=torch.int64),
        "c64": torch.tensor([1 + 2j, -3j]),
        "u16": torch.tensor([1, 65535], dtype=torch.uint16),
        "f8": torch.tensor([0.5, 2.0]).to(torch.float8_e4m3fn),
        "size": torch.Size([2, 3]),
        "dtype": torch.float16,
        "param": torch.nn.Parameter(torch.full((3,), 7.0)),
    }
    obj.update({f"t{i}": torch.full((i % 5 + 1,), float(i)) for i in range(extra)})
    return obj


def _same(got: Any, want: Any, where: str) -> None:
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert got.stride() == want.stride(), where
        assert got.storage_offset() == want.storage_offset(), where
        assert torch.equal(got.contiguous().view(torch.uint8),
                           want.contiguous().view(torch.uint8)), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def _check(got: dict[str, Any], want: dict[str, Any]) -> None:
    _same(got, want, "obj")
    ptr = got["a"].untyped_storage().data_ptr()
    assert got["b"].untyped_storage().data_ptr() == ptr == got["c"].untyped_storage().data_ptr()


@pytest.mark.parametrize("extra", [0, 300])  # 300: the record-name set rehashes many times
def test_save_writes_torch_saves_bytes(tmp_path: Path, extra: int) -> None:
    obj = _object(extra)
    (tmp_path / "t").mkdir()
    (tmp_path / "s").mkdir()
    torch.save(obj, tmp_path / "t" / "model.pt")
    _torchsave.save(obj, tmp_path / "s" / "model.pt")
    ours = (tmp_path / "s" / "model.pt").read_bytes()
    assert ours == (tmp_path / "t" / "model.pt").read_bytes()
    with zipfile.ZipFile(tmp_path / "s" / "model.pt") as z:  # an independent zip reader
        assert z.testzip() is None
    _check(torch.load(tmp_path / "s" / "model.pt", weights_only=True), obj)


def test_load_reads_torch_save_files_with_the_engine(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    obj = _object(40)
    torch.save(obj, tmp_path / "in.pt")
    want = torch.load(tmp_path / "in.pt", weights_only=True)

    def no_torch_load(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("torch.load used")

    with monkeypatch.context() as m:
        m.setattr(torch, "load", no_torch_load)
        got = _torchsave.load(tmp_path / "in.pt")
    _check(got, want)
    # a byte of a storage changed: the archive's CRC-32 catches it
    raw = bytearray((tmp_path / "in.pt").read_bytes())
    with zipfile.ZipFile(tmp_path / "in.pt") as z:
        info = z.getinfo("in/data/0")
    head = raw[info.header_offset:info.header_offset + 30]  # the local header's lengths
    at = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(
        head[28:30], "little")
    raw[at + 1] ^= 0xFF
    (tmp_path / "bad.pt").write_bytes(bytes(raw))
    with pytest.raises(ChecksumError):
        _torchsave.load(tmp_path / "bad.pt")


def test_load_falls_back_to_torch_load_where_it_must(tmp_path: Path) -> None:
    # the legacy (non-zip) format and a sparse tensor (rebuilt from its
    # storages while unpickling) are read by torch.load(weights_only=True)
    obj = {"w": torch.arange(6.0).view(2, 3), "n": 3}
    torch.save(obj, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    got = _torchsave.load(tmp_path / "legacy.pt")
    assert torch.equal(got["w"], obj["w"]) and got["n"] == 3
    sp = torch.eye(3).to_sparse()
    torch.save({"sp": sp}, tmp_path / "sparse.pt")
    assert torch.equal(_torchsave.load(tmp_path / "sparse.pt")["sp"].to_dense(), torch.eye(3))


def test_dcp_to_torch_save_is_torchs_file(tmp_path: Path) -> None:
    obj = {k: v for k, v in _object(5).items() if k not in ("b", "c", "param")}
    dcp.save(obj, checkpoint_id=tmp_path / "ckpt")
    (tmp_path / "t").mkdir()
    (tmp_path / "s").mkdir()
    tfu.dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "t" / "out.pt")
    sfu.dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "s" / "out.pt")
    assert (tmp_path / "s" / "out.pt").read_bytes() == (tmp_path / "t" / "out.pt").read_bytes()
    # and back: the engine's reader gives what torch.load gives
    sfu.torch_save_to_dcp(tmp_path / "s" / "out.pt", tmp_path / "ckpt2")
    sfu.dcp_to_torch_save(tmp_path / "ckpt2", tmp_path / "s" / "again.pt")
    again = torch.load(tmp_path / "s" / "again.pt", weights_only=True)
    want = torch.load(tmp_path / "t" / "out.pt", weights_only=True)
    assert list(again) == list(want)
    _same(again, want, "again")


def test_save_follows_torchs_serialization_options(tmp_path: Path) -> None:
    """CRC-32s off (every CRC written 0, as torch then writes them): still
    torch.save's bytes, read back unchecked; another storage alignment:
    torch.save writes the file, torch.load reads it."""
    from torch.utils.serialization import config

    obj = {"a": torch.arange(10.0), "b": [torch.ones(3, dtype=torch.int64)], "n": 5}
    (tmp_path / "t").mkdir()
    (tmp_path / "s").mkdir()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(obj, tmp_path / "t" / "m.pt")
        _torchsave.save(obj, tmp_path / "s" / "m.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    assert (tmp_path / "s" / "m.pt").read_bytes() == (tmp_path / "t" / "m.pt").read_bytes()
    _same(_torchsave.load(tmp_path / "s" / "m.pt"), obj, "nocrc")
    old = config.save.storage_alignment
    config.save.storage_alignment = 4096
    try:
        _torchsave.save(obj, tmp_path / "s" / "a.pt")
        _same(torch.load(tmp_path / "s" / "a.pt", weights_only=True), obj, "aligned")
    finally:
        config.save.storage_alignment = old
