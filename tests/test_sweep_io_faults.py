"""Fault injection at every I/O call of a save and of a load (issue 15).

Every file operation of ``shardstate.checkpoint.save`` and ``load`` goes
through the core's OS table (``shardstate.io``), so one FaultInjector
installed with ``io.inject_faults`` reaches all of them. A clean run counts
each operation's calls; then, for every operation and every call number k,
the same save (over a good earlier checkpoint) or load runs again with call
k failing (ENOSPC, EIO), transferring only part of its bytes, or reporting
EINTR. Every case must end in one of:

* success, and the checkpoint then loads exactly the new state (short
  transfers and EINTR must always end so: the engine completes and retries);
* a ``CheckpointException``, after which the directory loads exactly the
  old state, exactly the new one, or raises a clear error: never a mix.

And after every case: no file descriptor, thread or temp file is left over,
and another checkpoint beside it in the parent directory is byte for byte
untouched and still loads.

A failing case names itself; rerun just it with
``SHARDSTATE_SWEEP_ONLY=save:pwrite:3:EIO pytest tests/test_sweep_io_faults.py``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import shardstate.checkpoint as dcp  # noqa: E402
import shardstate.io as sio  # noqa: E402

OPS = ("open", "close", "pwrite", "pread", "preadv", "fsync", "fstat", "ftruncate", "rename",
       "unlink", "fsync_dir", "writeback", "mmap", "mkdir")
TRANSFERS = ("pwrite", "pread", "preadv")
KINDS = ("ENOSPC", "EIO", "short", "EINTR")
_ONLY = os.environ.get("SHARDSTATE_SWEEP_ONLY")
pytestmark = pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 33, generator=g),
        "b": torch.randint(0, 1000, (17,), generator=g),
        "h": torch.randn(5, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "extra": {"step": seed, "tag": f"state-{seed}", "blob": bytes([seed]) * 40},
    }


def _zeros() -> dict[str, Any]:
    s = _state(0)
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else
                {"step": -1, "tag": "", "blob": b""}) for k, v in s.items()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor):
            if v.dtype != w.dtype or v.shape != w.shape or not torch.equal(v, w):
                return False
        elif v != w:
            return False
    return True


def _load(path: Path) -> dict[str, Any]:
    out = _zeros()
    dcp.load(out, checkpoint_id=path)
    return out


def _save(path: Path, state: dict[str, Any]) -> None:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))


def _digest(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _os_threads() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def _arm(f: sio.FaultInjector, op: str, k: int, kind: str) -> None:
    if kind == "short":
        f.short(op, k, 7)
    elif kind == "EINTR":
        f.eintr(op, k)
    else:
        f.fail(op, k, getattr(errno, kind))


def _cases(phase: str, counts: dict[str, int]) -> Iterator[tuple[str, int, str]]:
    for op in OPS:
        for k in range(1, counts[op] + 1):
            for kind in KINDS:
                if kind == "short" and op not in TRANSFERS:
                    continue
                if _ONLY and _ONLY != f"{phase}:{op}:{k}:{kind}":
                    continue
                yield op, k, kind


def _count(run: Callable[[], None]) -> dict[str, int]:
    f = sio.FaultInjector()
    with sio.inject_faults(f):
        run()
    return {op: f.calls(op) for op in OPS}


class _Sweep:
    """The fixed parts of a sweep: the old and new states, a sibling
    checkpoint that must stay untouched, and the leak baseline."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.old, self.new = _state(1), _state(2)
        self.sibling = root / "sibling"
        _save(self.sibling, _state(3))
        self.sibling_digest = _digest(self.sibling)
        self.template = root / "template-old"
        _save(self.template, self.old)
        # warm up every pool and helper a save and a load start once
        warm = root / "warm"
        _save(warm, self.new)
        _load(warm)
        self.fds, self.threads = _fds(), _os_threads()
        self.py_threads = {t.name for t in threading.enumerate()}

    def check_leaks(self, case: str) -> None:
        assert _fds() == self.fds, f"{case}: file descriptors {self.fds} -> {_fds()}"
        assert _os_threads() == self.threads, f"{case}: threads {self.threads} -> {_os_threads()}"
        extra = {t.name for t in threading.enumerate()} - self.py_threads
        assert not extra, f"{case}: Python threads left running: {sorted(extra)}"
        tmps = [p.name for p in self.root.rglob("*") if p.name.endswith(".tmp")]
        assert not tmps, f"{case}: temp files left: {tmps}"
        assert _digest(self.sibling) == self.sibling_digest, f"{case}: the sibling changed"


def _outcome(case: str, ck: Path, allowed: tuple[dict[str, Any], ...]) -> str:
    """What loading ``ck`` gives: 'old'/'new' (exactly one of ``allowed``)
    or 'error' (a clear one); fails on anything else."""
    try:
        got = _load(ck)
    except (dcp.CheckpointException, FileNotFoundError, ValueError) as e:
        assert str(e), case
        return "error"
    for name, want in zip(("old", "new"), allowed):
        if want is not None and _same(want, got):
            return name
    pytest.fail(f"{case}: the checkpoint loaded a state that is neither the old nor the new one")


def test_faults_at_every_call_of_a_save(tmp_path):
    sw = _Sweep(tmp_path)
    ck = tmp_path / "ck"

    def fresh_old() -> None:
        shutil.rmtree(ck, ignore_errors=True)
        shutil.copytree(sw.template, ck)

    fresh_old()
    counts = _count(lambda: _save(ck, sw.new))
    assert counts["pwrite"] >= 4 and counts["rename"] == 1 and counts["unlink"] >= 1, counts
    outcomes: dict[str, int] = {}
    ncases = 0
    for op, k, kind in _cases("save", counts):
        case = f"SHARDSTATE_SWEEP_ONLY=save:{op}:{k}:{kind}"
        fresh_old()
        f = sio.FaultInjector()
        _arm(f, op, k, kind)
        raised: BaseException | None = None
        with sio.inject_faults(f):
            try:
                _save(ck, sw.new)
            except dcp.CheckpointException as e:
                raised = e
        assert f.calls(op) >= k, f"{case}: the call was never made ({f.calls(op)} calls)"
        if kind in ("short", "EINTR"):
            assert raised is None, f"{case}: {raised}"
        got = _outcome(case, ck, (sw.old, sw.new))
        if raised is None:
            assert got == "new", f"{case}: a save that succeeded loads {got}"
        else:
            assert os.strerror(getattr(errno, kind)) in str(raised), f"{case}: {raised}"
        outcomes[f"{kind}:{got}"] = outcomes.get(f"{kind}:{got}", 0) + 1
        sw.check_leaks(case)
        ncases += 1
    assert ncases > 0
    if not _ONLY:
        # the sweep reached failures before the old metadata was removed
        # (old stays loadable) and after (a clear error), and successes
        assert outcomes.get("EIO:old") and outcomes.get("EIO:error"), outcomes
        assert outcomes.get("EINTR:new"), outcomes
    assert sw.sibling_digest == _digest(sw.sibling)
    assert _same(_load(sw.sibling), _state(3))


def test_faults_at_every_call_of_a_load(tmp_path):
    sw = _Sweep(tmp_path)
    ck = tmp_path / "ck"
    _save(ck, sw.new)
    digest = _digest(ck)
    counts = _count(lambda: _load(ck))
    assert counts["open"] >= 2 and counts["mmap"] >= 1, counts
    ncases = 0
    for op, k, kind in _cases("load", counts):
        case = f"SHARDSTATE_SWEEP_ONLY=load:{op}:{k}:{kind}"
        f = sio.FaultInjector()
        _arm(f, op, k, kind)
        out = _zeros()
        raised: BaseException | None = None
        with sio.inject_faults(f):
            try:
                dcp.load(out, checkpoint_id=ck)
            except dcp.CheckpointException as e:
                raised = e
        assert f.calls(op) >= k, f"{case}: the call was never made"
        if raised is None:
            assert _same(sw.new, out), f"{case}: a load that succeeded gave wrong values"
        else:
            assert kind not in ("short", "EINTR"), f"{case}: {raised}"
            assert os.strerror(getattr(errno, kind)) in str(raised), f"{case}: {raised}"
        assert _digest(ck) == digest, f"{case}: a load changed the checkpoint"
        sw.check_leaks(case)
        ncases += 1
    assert ncases > 0
