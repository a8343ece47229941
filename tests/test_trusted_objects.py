"""One switch for trusted objects: ``FileSystemReader(path, unsafe_unpickle=True)``
alone loads bytes items holding any class (as torch's reader does), the
refusal without it names exactly that switch, and the opt-in still checks
every CRC."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import shardstate.checkpoint as ss
import torch
import torch.distributed.checkpoint as tdcp
from shardstate import ChecksumError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@dataclasses.dataclass
class RunConfig:  # a user's class: not on any allowlist
    name: str
    lr: float


def _state() -> dict:
    return {"w": torch.arange(5.0), "cfg": RunConfig("run", 0.5)}


def _record(path: Path, key: str) -> tuple[Path, int, int]:
    md = ss.FileSystemReader(str(path)).read_metadata()
    for idx, info in md.storage_data.items():
        if idx.fqn == key:
            return path / info.relative_path, info.offset, info.length
    raise KeyError(key)


@pytest.mark.parametrize("saver", [ss, tdcp])
def test_refused_by_default_with_the_switch_named(tmp_path: Path, saver) -> None:
    saver.save(_state(), checkpoint_id=str(tmp_path))
    out = {"w": torch.zeros(5), "cfg": None}
    with pytest.raises(ss.CheckpointException) as e:
        ss.load(out, checkpoint_id=str(tmp_path))
    text = str(e.value)
    assert "RunConfig" in text and "FileSystemReader(path, unsafe_unpickle=True)" in text
    assert out["cfg"] is None


@pytest.mark.parametrize("saver", [ss, tdcp])
def test_the_switch_alone_admits_the_class(tmp_path: Path, saver) -> None:
    saver.save(_state(), checkpoint_id=str(tmp_path))
    out = {"w": torch.zeros(5), "cfg": None}
    ss.load(out, storage_reader=ss.FileSystemReader(str(tmp_path), unsafe_unpickle=True))
    assert out["cfg"] == RunConfig("run", 0.5) and torch.equal(out["w"], torch.arange(5.0))


def test_the_switch_still_checks_crcs(tmp_path: Path) -> None:
    ss.save(_state(), checkpoint_id=str(tmp_path))
    file, off, length = _record(tmp_path, "cfg")
    data = bytearray(file.read_bytes())
    at = off + 64 + 8  # inside data.pkl, past its local header
    data[at] ^= 0x20
    file.write_bytes(bytes(data))
    out = {"w": torch.zeros(5), "cfg": None}
    with pytest.raises(ss.CheckpointException) as e:
        ss.load(out, storage_reader=ss.FileSystemReader(str(tmp_path), unsafe_unpickle=True))
    assert any(isinstance(exc, ChecksumError) for exc, _ in e.value.failures.values())


def test_dcp_to_torch_save_takes_the_switch(tmp_path: Path) -> None:
    from shardstate.checkpoint.format_utils import dcp_to_torch_save

    ss.save(_state(), checkpoint_id=str(tmp_path / "ck"))
    with pytest.raises(ss.CheckpointException, match="unsafe_unpickle=True"):
        dcp_to_torch_save(tmp_path / "ck", tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "out.pt", unsafe_unpickle=True)
    back = torch.load(tmp_path / "out.pt", weights_only=False)  # the test's own trusted file
    assert back["cfg"] == RunConfig("run", 0.5) and torch.equal(back["w"], torch.arange(5.0))
