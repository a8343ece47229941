"""The ``shardstate`` command, run as users run it: the installed console
script in a subprocess (``python -m shardstate`` where the tree is tested
in place and no script is installed), on real checkpoints written by
torch and by shardstate (good, truncated, bit-flipped, half-written), its
output and its exit codes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import shardstate.checkpoint as dcp
import torch
import torch.distributed.checkpoint as tdcp
from _child_env import package_env

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

INSTALLED = os.environ.get("SHARDSTATE_TEST_INSTALLED") == "1"


def _command() -> list[str]:
    script = Path(sys.executable).parent / "shardstate"
    if INSTALLED:  # the wheel's console script must be there
        assert script.is_file(), f"no console script {script}"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "shardstate"]


def script(*args: str | os.PathLike) -> subprocess.CompletedProcess:
    """The command as users run it: the console script, a new process."""
    return subprocess.run(_command() + [os.fspath(a) for a in args], capture_output=True,
                          text=True, env=package_env(), timeout=300)


def run(*args: str | os.PathLike) -> subprocess.CompletedProcess:
    """The same command line through ``cli.main`` in this process (each
    new process pays torch's import; the script itself is tested in
    test_console_script)."""
    from shardstate import cli

    out, err = io.StringIO(), io.StringIO()
    argv = [os.fspath(a) for a in args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(7),
            "h": torch.randn(10, generator=g).to(torch.bfloat16), "extra": {"step": 3}}


def _data_at(ckpt: Path, fqn: str) -> tuple[Path, int]:
    """A data file and the file offset of ``fqn``'s tensor bytes."""
    from shardstate.checkpoint._zipfmt import parse_record

    md = dcp.FileSystemReader(ckpt).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    f = ckpt / info.relative_path
    rec = parse_record(f.read_bytes()[info.offset:info.offset + info.length],
                       base_offset=info.offset)
    return f, rec.data_offset


def _rank_save(rank: int, world: int, path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(48.0).reshape(8, 6)
    dcp.save({"sharded": distribute_tensor(full, mesh, [Shard(0)]), "plain": torch.ones(3)},
             checkpoint_id=path)
    dist.barrier()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    out = {"ours": root / "ours", "torch": root / "torch"}
    dcp.save(_state(), checkpoint_id=out["ours"])
    tdcp.save(_state(), checkpoint_id=out["torch"])
    return out


def test_inspect_text_and_json_agree_with_the_state(ckpts):
    for ckpt in ckpts.values():
        r = run("inspect", ckpt, "--json")
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        by = {it["key"]: it for it in d["items"]}
        assert by["w"]["dtype"] == "float32" and by["w"]["shape"] == [64, 32]
        assert by["h"]["dtype"] == "bfloat16" and by["b"]["shape"] == [7]
        assert by["extra.step"]["kind"] == "bytes" and by["extra.step"]["rank"] == 0
        (chunk,) = by["w"]["chunks"]
        assert chunk["offsets"] == [0, 0] and chunk["sizes"] == [64, 32]
        assert chunk["file"] == "__0_0.distcp" and chunk["length"] > 64 * 32 * 4
        assert d["total_bytes"] == (ckpt / "__0_0.distcp").stat().st_size
        r = run("inspect", ckpt, "--chunks")
        assert r.returncode == 0, r.stderr
        assert "4 items (3 tensors, 1 bytes items)" in r.stdout
        assert "[0, 0] + [64, 32]: __0_0.distcp at" in r.stdout


def test_inspect_names_each_chunks_rank(run_distributed, tmp_path):
    run_distributed(_rank_save, 2, str(tmp_path / "c"), timeout=240)
    d = json.loads(run("inspect", tmp_path / "c", "--json").stdout)
    by = {it["key"]: it for it in d["items"]}
    chunks = sorted(by["sharded"]["chunks"], key=lambda c: c["offsets"])
    assert [(c["offsets"], c["sizes"], c["rank"]) for c in chunks] == \
        [([0, 0], [4, 6], 0), ([4, 0], [4, 6], 1)]
    assert d["ranks"] == [0, 1]
    assert run("verify", "-q", tmp_path / "c").returncode == 0


def test_verify_passes_sound_checkpoints(ckpts):
    for ckpt in ckpts.values():
        r = run("verify", ckpt)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.startswith("OK:") and "4 items, 4 records" in r.stdout
        assert r.stderr == ""  # no progress bar when stderr is not a terminal


def test_verify_reports_every_damaged_record(ckpts, tmp_path):
    for name, ckpt in ckpts.items():
        bad = tmp_path / name
        shutil.copytree(ckpt, bad)
        for fqn in ("w", "h"):
            f, at = _data_at(bad, fqn)
            with open(f, "r+b") as fh:
                fh.seek(at + 5)
                b = fh.read(1)
                fh.seek(at + 5)
                fh.write(bytes([b[0] ^ 0x40]))
        r = run("verify", bad)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "CRC-32 mismatch in item 'w'" in r.stdout
        assert "CRC-32 mismatch in item 'h'" in r.stdout
        assert "DAMAGED" in r.stdout and "2 problems" in r.stdout


def test_verify_truncated_and_half_written(ckpts, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(ckpts["ours"], cut)
    f = cut / "__0_0.distcp"
    os.truncate(f, f.stat().st_size // 2)
    r = run("verify", cut)
    assert r.returncode == 1
    assert "runs past the end of" in r.stdout
    half = tmp_path / "half"  # a save that died before publishing .metadata
    shutil.copytree(ckpts["ours"], half)
    (half / ".metadata").unlink()
    r = run("verify", half)
    assert r.returncode == 3
    assert r.stderr.startswith("shardstate: error:") and "no checkpoint metadata" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    garbled = tmp_path / "garbled"
    shutil.copytree(ckpts["ours"], garbled)
    (garbled / ".metadata").write_bytes(b"\x80\x04not a pickle")
    r = run("verify", garbled)
    assert r.returncode == 3 and "metadata" in r.stderr
    r = run("inspect", tmp_path / "nowhere")
    assert r.returncode == 3 and "no such checkpoint directory" in r.stderr


def test_diff_compares_across_writers_and_tolerances(ckpts, tmp_path):
    r = run("diff", ckpts["ours"], ckpts["torch"])
    assert r.returncode == 0 and r.stdout.strip() == "no differences", r.stdout + r.stderr
    other = _state()
    other["w"][3, 4] += 1e-3
    other["b"] = torch.arange(8)
    other["extra"] = {"step": 4}
    other["new"] = torch.zeros(2)
    dcp.save(other, checkpoint_id=tmp_path / "other")
    r = run("diff", ckpts["torch"], tmp_path / "other")
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert any(x.startswith("w: values differ in 1 of 2048") for x in lines), lines
    assert any(x.startswith("b: int64 [7]") and "int64 [8]" in x for x in lines), lines
    assert "extra.step: bytes items differ" in lines
    assert any(x.startswith("new: only in") for x in lines)
    assert lines[-1] == "4 differences"
    r = run("diff", ckpts["torch"], tmp_path / "other", "--atol", "1e-2")
    assert not any(x.startswith("w:") for x in r.stdout.splitlines())


def test_convert_both_ways_round_trips(ckpts, tmp_path):
    r = run("convert", ckpts["torch"], tmp_path / "state.pt")
    assert r.returncode == 0, r.stderr
    sd = torch.load(tmp_path / "state.pt", weights_only=True)
    assert torch.equal(sd["w"], _state()["w"]) and sd["extra"] == {"step": 3}
    r = run("convert", tmp_path / "state.pt", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    assert run("diff", ckpts["torch"], tmp_path / "back").returncode == 0
    r = run("convert", tmp_path / "missing.pt", tmp_path / "x", "--to", "dcp")
    assert r.returncode == 3


def test_convert_to_safetensors_consolidated_and_sharded_and_back(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(5)
    sd = {"a": torch.randn(300, 100, generator=g), "b": torch.randn(300, 100, generator=g),
          "c": torch.arange(10), "n": {"h": torch.randn(5, generator=g).to(torch.bfloat16)},
          "step": 7}
    tdcp.save(sd, checkpoint_id=tmp_path / "ck")  # torch wrote it
    r = run("convert", tmp_path / "ck", tmp_path / "one", "--to", "safetensors")
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in (tmp_path / "one").glob("*.safetensors"))
    assert len(files) == 1
    # the safetensors package reads every tensor back equal, under its flat name
    got = safetensors_torch.load_file(tmp_path / "one" / files[0])
    assert sorted(got) == ["a", "b", "c", "n.h"]
    assert torch.equal(got["a"], sd["a"]) and torch.equal(got["n.h"], sd["n"]["h"])
    # 120 KB a file: a and b (120 KB each) alone, c and n.h together
    r = run("convert", tmp_path / "ck", tmp_path / "sharded", "--to", "safetensors",
            "--max-shard-size", "120KB")
    assert r.returncode == 0, r.stderr
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    assert len(set(wm.values())) == 3 and wm["c"] == wm["n.h"] != wm["a"] != wm["b"]
    for name in set(wm.values()):
        part = safetensors_torch.load_file(tmp_path / "sharded" / name)
        assert sorted(part) == sorted(k for k, v in wm.items() if v == name)
    # back: a directory of safetensors files becomes a DCP checkpoint by default
    r = script("convert", tmp_path / "sharded", tmp_path / "back")
    assert r.returncode == 0 and "(dcp)" in r.stdout, r.stderr
    back = {"a": torch.zeros(300, 100), "b": torch.zeros(300, 100),
            "c": torch.zeros(10, dtype=torch.int64), "n.h": torch.zeros(5, dtype=torch.bfloat16)}
    dcp.load(back, checkpoint_id=tmp_path / "back")
    assert torch.equal(back["b"], sd["b"]) and torch.equal(back["n.h"], sd["n"]["h"])
    # bad sizes and misplaced options are usage errors; no checkpoint is exit 3
    assert run("convert", tmp_path / "ck", tmp_path / "x", "--to", "safetensors",
               "--max-shard-size", "lots").returncode == 2
    r = run("convert", tmp_path / "ck", tmp_path / "x", "--max-shard-size", "1GB")
    assert r.returncode == 2 and "--to safetensors" in r.stderr
    assert run("convert", tmp_path / "one", tmp_path / "x", "--to",
               "safetensors").returncode == 3


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_only(ckpts):
    from shardstate._progress import Progress
    from shardstate.checkpoint._inspect import diff, verify

    tty = _Terminal()
    bar = Progress("verify", 0, stream=tty)
    report = verify(ckpts["ours"], progress=bar)
    bar.close()
    assert report.ok
    shown = tty.getvalue()
    # tqdm's line: the label, bytes done of the total, a rate; full at the end
    assert shown.startswith("\r") and "verify: 100%" in shown and "B/s" in shown
    k = f"{report.checked_bytes / 1000:.1f}k"
    assert f"{k}/{k}" in shown
    tty = _Terminal()
    bar = Progress("diff", 0, stream=tty)
    assert diff(ckpts["torch"], ckpts["ours"], progress=bar) == []
    bar.close()
    assert "diff: 100%" in tty.getvalue()
    quiet = _Terminal()
    bar = Progress("verify", 10, stream=quiet, enabled=False)
    bar(10)
    bar.close()
    assert quiet.getvalue() == ""


def _step(root: Path, n: int, state: str) -> None:
    p = root / str(n)
    dcp.save({"x": torch.full((4,), float(n))}, checkpoint_id=p)
    if state == "committed":
        (p / ".shardstate-commit").write_text("")
    elif state == "incomplete":
        (p / ".metadata").unlink()


def test_ls_and_prune(tmp_path):
    root = tmp_path / "run"
    for n, state in ((100, "committed"), (200, "complete"), (250, "incomplete"),
                     (300, "committed"), (400, "incomplete")):
        _step(root, n, state)
    (root / "notes").mkdir()  # not a step
    d = json.loads(run("ls", root, "--json").stdout)
    assert [(s["step"], s["state"]) for s in d] == [
        (100, "committed"), (200, "complete"), (250, "incomplete"), (300, "committed"),
        (400, "incomplete")]
    assert all(s["size"] > 0 for s in d)
    r = run("prune", root, "--keep", "1", "--dry-run")
    assert r.returncode == 0 and sorted(p.name for p in root.iterdir()) == \
        ["100", "200", "250", "300", "400", "notes"]
    r = run("prune", root, "--keep", "1", "--incomplete")
    assert r.returncode == 0, r.stderr
    # the newest loadable step stays, and the save that may still be running
    assert sorted(p.name for p in root.iterdir()) == ["300", "400", "notes"]
    assert "removed step 100" in r.stdout and "removed step 250" in r.stdout
    assert run("prune", root, "--keep", "-1").returncode == 2
    assert run("ls", tmp_path / "nowhere").returncode == 3


def test_usage_errors_exit_2():
    r = run()
    assert r.returncode == 2 and "usage:" in r.stderr
    assert run("verify").returncode == 2
    assert run("frobnicate", "x").returncode == 2


def test_console_script(ckpts, tmp_path):
    """The installed script: output and exit status of each outcome."""
    r = script("verify", ckpts["torch"])
    assert r.returncode == 0 and r.stdout.startswith("OK:"), r.stdout + r.stderr
    assert r.stderr == ""  # no progress bar when stderr is not a terminal
    bad = tmp_path / "bad"
    shutil.copytree(ckpts["ours"], bad)
    f, at = _data_at(bad, "b")
    with open(f, "r+b") as fh:
        fh.seek(at)
        fh.write(b"\xff")
    r = script("verify", bad)
    assert r.returncode == 1 and "CRC-32 mismatch in item 'b'" in r.stdout
    r = script("inspect", tmp_path / "nowhere")
    assert r.returncode == 3 and r.stderr.startswith("shardstate: error:")
    r = script("diff", ckpts["ours"])
    assert r.returncode == 2 and "usage:" in r.stderr
