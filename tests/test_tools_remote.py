"""CheckpointManager and the ``shardstate`` command on an object store: a
real S3 API (moto's standalone server, tests/_s3server.py, through s3fs),
with checkpoints written by shardstate and by torch; and the manager
across FSDP1, DDP, FSDP2 and a plain model (``get_state_dict`` /
``set_state_dict``), resharded from 2 ranks to 3, 2 and 1."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
fsspec = pytest.importorskip("fsspec")
pytest.importorskip("s3fs")
pytest.importorskip("moto")

import shardstate.checkpoint as dcp  # noqa: E402
import torch.distributed.checkpoint as tdcp  # noqa: E402
from shardstate.checkpoint import CheckpointManager  # noqa: E402
from shardstate.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402
from shardstate.checkpoint._steps import list_steps  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import (  # noqa: E402
    FsspecWriter as TorchWriter,
)

sys.path.insert(0, str(Path(__file__).parent))
from _child_env import package_env  # noqa: E402
from _s3server import S3Server, serving  # noqa: E402

BUCKET = "shardstate-tools"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def s3():
    with serving(BUCKET) as server:
        yield server


@pytest.fixture
def s3_conf(s3, monkeypatch):
    """fsspec's configuration pointed at the server, as a user's
    environment would (``FSSPEC_S3``): what the command reads."""
    conf = {"endpoint_url": s3.endpoint_url, "key": "testing", "secret": "testing"}
    monkeypatch.setitem(fsspec.config.conf, "s3", conf)
    return conf


def _root() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(40, 30, generator=g), "b": torch.arange(7) * step,
            "extra": {"step": step, "name": f"s{step}"}}


def _keys(s3: S3Server, prefix: str) -> list[str]:
    fs = s3.fs()
    base = prefix.removeprefix("s3://")
    fs.invalidate_cache()
    return sorted(p[len(base) + 1:] for p in fs.find(base))


def test_manager_on_s3_policy_retention_restore_and_leftovers(s3):
    root = _root()
    opts = s3.storage_options
    with CheckpointManager(root, storage_options=opts, max_to_keep=2, save_interval_steps=2,
                           preemption_signals=()) as mgr:
        for step in range(1, 8):
            mgr.save(step, _state(step), metrics={"loss": 1.0 / step})
        mgr.wait()
        assert mgr.all_steps() == [4, 6] and mgr.latest_step() == 6
        assert mgr.metrics(6) == {"loss": pytest.approx(1 / 6)}
        got = {"w": torch.zeros(40, 30), "b": torch.zeros(7, dtype=torch.int64),
               "extra": {"step": 0, "name": ""}}
        assert mgr.restore(got) == 6
        want = _state(6)
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
        assert got["extra"] == want["extra"]
        mgr.restore(got, step=4)
        assert torch.equal(got["w"], _state(4)["w"])
    keys = _keys(s3, root)
    # retention removed steps 2 (and never saved odd ones); each kept step whole
    assert {k.split("/")[0] for k in keys} == {"4", "6"}
    assert {"6/.metadata", "6/.shardstate-commit", "6/__0_0.distcp"} <= set(keys)
    assert not any(k.endswith(".shardstate-pending") for k in keys)
    marker = json.loads(s3.fs().cat_file(f"{root.removeprefix('s3://')}/6/.shardstate-commit"))
    assert marker["step"] == 6 and marker["metrics"] == {"loss": pytest.approx(1 / 6)}

    # a crashed save (pending marker, a data object, no .metadata), a
    # foreign step directory, and a step torch saved (torchtitan's naming)
    fs = s3.fs()
    base = root.removeprefix("s3://")
    fs.pipe({f"{base}/8/.shardstate-pending": b"", f"{base}/8/__0_0.distcp": b"x" * 100,
             f"{base}/12/notes.txt": b"mine"})
    tdcp.save(_state(11), storage_writer=TorchWriter(f"{root}/step-11", **opts))
    with pytest.warns(UserWarning, match="step 8 .* left incomplete"):
        mgr = CheckpointManager(root, storage_options=opts, max_to_keep=1,
                                preemption_signals=())
    assert [(s.step, s.state) for s in list_steps(root, opts)] == [
        (4, "committed"), (6, "committed"), (11, "complete"), (12, "incomplete")]
    got = _state(0)
    assert mgr.restore(got) == 11 and torch.equal(got["w"], _state(11)["w"])
    with pytest.raises(FileExistsError, match="not overwriting"):
        mgr.save(12, _state(12))
    assert mgr.save(13, _state(13), force=True)
    mgr.close()
    # retention (the last 1) removed the manager's steps; torch's and the foreign stay
    assert mgr.all_steps() == [11, 13]
    assert fs.cat_file(f"{base}/12/notes.txt") == b"mine"
    assert {k.split("/")[0] for k in _keys(s3, root)} == {"step-11", "12", "13"}


def _script(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "shardstate"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "shardstate"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True,
                          env=dict(package_env(), **env), timeout=300)


def test_commands_on_s3_checkpoints_by_torch_and_by_shardstate(s3, s3_conf, tmp_path):
    from shardstate import cli

    root = _root()
    sd = _state(3)
    tdcp.save(sd, storage_writer=TorchWriter(f"{root}/step_1", **s3.storage_options))
    dcp.save(sd, storage_writer=FsspecWriter(f"{root}/step_2", **s3.storage_options))
    # the console script, configured as users configure fsspec: the environment
    env = {"FSSPEC_S3": json.dumps(s3_conf), "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    out = _script("ls", root, "--json", env=env)
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    assert [(s["step"], s["state"]) for s in listed] == [(1, "complete"), (2, "complete")]
    assert listed[0]["path"] == f"{root}/step_1" and listed[0]["size"] > 40 * 30 * 4
    out = _script("verify", "-q", f"{root}/step_1", env=env)
    assert out.returncode == 0 and out.stdout.startswith(f"OK: {root}/step_1: 4 items"), \
        out.stdout + out.stderr

    # in process, with fsspec's configuration set as the environment set it above
    r = _run(cli, "verify", "-q", f"{root}/step_2")
    assert r[0] == 0 and "4 items, 4 records" in r[1]
    r = _run(cli, "inspect", "--json", f"{root}/step_2")
    d = json.loads(r[1])
    assert {it["key"]: it.get("shape") for it in d["items"]} == {
        "w": [40, 30], "b": [7], "extra.step": None, "extra.name": None}
    assert d["files"] == [{"file": "__0_0.distcp", "rank": 0,
                           "size": s3.fs().size(f"{root.removeprefix('s3://')}/step_2/"
                                                "__0_0.distcp")}]
    assert _run(cli, "diff", f"{root}/step_1", f"{root}/step_2")[:2] == (0, "no differences\n")
    dcp.save(_state(3), checkpoint_id=tmp_path / "local")
    assert _run(cli, "diff", f"{root}/step_1", str(tmp_path / "local"))[0] == 0

    # convert: from the store to a torch.save file and to safetensors, and back
    assert _run(cli, "convert", "-q", f"{root}/step_1", str(tmp_path / "m.pt"))[0] == 0
    pt = torch.load(tmp_path / "m.pt", weights_only=True)
    assert torch.equal(pt["w"], sd["w"]) and pt["extra"] == sd["extra"]
    assert _run(cli, "convert", "-q", str(tmp_path / "m.pt"), f"{root}/from_pt")[0] == 0
    assert _run(cli, "diff", f"{root}/from_pt", f"{root}/step_1")[:2] == (0, "no differences\n")
    assert _run(cli, "convert", "-q", "--to", "safetensors", f"{root}/step_2",
                str(tmp_path / "hf"))[0] == 0
    from safetensors.torch import load_file

    (st,) = (tmp_path / "hf").glob("*.safetensors")
    assert torch.equal(load_file(st)["w"], sd["w"])
    assert _run(cli, "convert", "-q", str(tmp_path / "hf"), f"{root}/from_hf")[0] == 0
    back = {"w": torch.zeros(40, 30), "b": torch.zeros(7, dtype=torch.int64)}
    dcp.load(back, storage_reader=FsspecReader(f"{root}/from_hf", **s3.storage_options))
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["b"], sd["b"])

    # one bit of w's data flipped in the object: verify names the item and the object's URL
    fs, key = s3.fs(), f"{root.removeprefix('s3://')}/step_2/__0_0.distcp"
    data = bytearray(fs.cat_file(key))
    at = bytes(data).index(sd["w"].numpy().tobytes()[:64]) + 100
    data[at] ^= 0x10
    fs.pipe_file(key, bytes(data))
    rc, stdout, _err = _run(cli, "verify", "-q", f"{root}/step_2")
    assert rc == 1 and "DAMAGED" in stdout
    assert "CRC-32 mismatch" in stdout and "'w'" in stdout and f"{key}" in stdout
    assert "/proc/self/fd" not in stdout
    rc, stdout, _err = _run(cli, "diff", f"{root}/step_1", f"{root}/step_2")
    assert rc != 0
    # a missing checkpoint and a missing root: exit status 3, one line
    rc, _out, err = _run(cli, "verify", f"{root}/step_7")
    assert rc == 3 and err.count("\n") == 1 and f"{root}/step_7" in err
    assert _run(cli, "ls", f"s3://{BUCKET}/no-such-root")[0] == 3
    # prune keeps the newest loadable step, removes the rest, on the store
    assert _run(cli, "prune", "-q", root, "--keep", "1")[0] == 0
    assert [s.step for s in list_steps(root)] == [2]  # from_* are not steps: left alone
    left = {k.split("/")[0] for k in _keys(s3, root)}
    assert left == {"step_2", "from_pt", "from_hf"}


def _run(cli: Any, *args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(args))
    return rc, out.getvalue(), err.getvalue()


# -- FSDP1 -> DDP -> FSDP2 and a plain model, through the manager on S3 -------------------


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


class _App:
    """The training state as torch's recipes write it: a Stateful over
    get_state_dict / set_state_dict."""

    def __init__(self, model: Any, optim: Any) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])


def _train(model: Any, optim: Any, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 12, generator=g)
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()


def _full(model: Any, optim: Any) -> dict[str, Any]:
    """Model and optimizer state, whole tensors, as plain dicts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    # NumPy copies: a rank's tensors would be passed back by a shared-memory
    # handle that dies with the rank
    return {"model": {k: v.numpy().copy() for k, v in m.items()},
            "optim": {k: {n: (t.numpy().copy() if isinstance(t, torch.Tensor) else t)
                          for n, t in v.items()} for k, v in o["state"].items()}}


def _fsdp1_save(rank: int, world: int, root: str, opts: dict) -> dict | None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_model(), device_id=torch.device("cpu"), use_orig_params=True)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, optim, 3, seed=rank)
    with CheckpointManager(root, storage_options=opts, preemption_signals=()) as mgr:
        mgr.save(3, {"app": _App(model, optim)})
    full = _full(model, optim)  # a collective: every rank
    return full if rank == 0 else None


def _ddp_restore_save(rank: int, world: int, root: str, opts: dict) -> tuple:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    with CheckpointManager(root, storage_options=opts, preemption_signals=()) as mgr:
        step = mgr.restore({"app": _App(model, optim)})
        got = _full(model, optim)
        _train(model, optim, 2, seed=10 + rank)
        mgr.save(5, {"app": _App(model, optim)})
    return step, got, _full(model, optim)


def _fsdp2_restore(rank: int, world: int, root: str, opts: dict) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    with CheckpointManager(root, storage_options=opts, preemption_signals=()) as mgr:
        assert mgr.restore({"app": _App(model, optim)}) == 5
    full = _full(model, optim)  # a collective: every rank
    return full if rank == 0 else None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def test_manager_fsdp1_to_ddp_to_fsdp2_and_plain_model_on_s3(run_distributed, s3):
    root, opts = _root(), s3.storage_options
    saved = run_distributed(_fsdp1_save, 2, root, opts, timeout=300)[0]
    assert saved["optim"] and all("exp_avg" in v for v in saved["optim"].values())
    out = run_distributed(_ddp_restore_save, 3, root, opts, timeout=300)
    for step, got, _after in out:
        assert step == 3 and _same(got, saved)
    after = out[0][2]
    assert not _same(after["model"], saved["model"])  # DDP trained on
    assert _same(run_distributed(_fsdp2_restore, 2, root, opts, timeout=300)[0], after)

    model = _model()  # a plain model, one process, no process group
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    with CheckpointManager(root, storage_options=opts, preemption_signals=()) as mgr:
        assert mgr.all_steps() == [3, 5]
        assert mgr.restore({"app": _App(model, optim)}) == 5
    assert _same(_full(model, optim), after)

