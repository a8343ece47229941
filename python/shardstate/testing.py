"""Run a function on N real processes joined by a torch.distributed group.

    from shardstate.testing import run_distributed

    def body(rank: int, world_size: int, scale: int) -> int:
        import torch, torch.distributed as dist
        t = torch.tensor([rank * scale])
        dist.all_reduce(t)
        return int(t)

    assert run_distributed(body, 3, 10) == [30, 30, 30]

Each rank is a fresh interpreter (the ``spawn`` start method: no state is
inherited, as under torchrun). ``start_method="forkserver"`` forks the
ranks instead from one server process that imported torch, torch.distributed
and shardstate.checkpoint once (started at the first such run, kept for the
rest of the caller's life; it holds no other state): a run then starts in a
fraction of a second instead of the seconds three fresh imports of torch
take, for tests that run many short groups. Either way each rank sees the
caller's environment as it is at the call. The parent hosts the rendezvous store on a
free port chosen by the OS, so concurrent runs never collide. ``fn`` must be
picklable (a module-level function) and is called as
``fn(rank, world_size, *args, **kwargs)`` after the default process group is
initialised; its return value (picklable) comes back in rank order.

Failures surface in the caller as :class:`DistributedTestError` (an
``AssertionError``, so pytest shows it as a test failure) carrying each
failing rank's formatted traceback. A rank that dies without reporting (a
crash, ``os._exit``) is named with its exit code. If the run exceeds
``timeout`` every live rank dumps its Python stacks to stderr (faulthandler)
and is killed, so a hung collective fails the test instead of hanging the
suite. Nothing is left running afterwards.

A test of what survives a failing rank names it in ``may_fail``: such a rank
may raise or die (``os._exit``, a signal) without failing the run, and its
entry in the result is then the reason, a ``str``; the other ranks are
waited for as long as ``timeout`` allows, and report their value before
their group is destroyed (destroying a group with a peer gone may block).
Once every other rank has reported, a ``may_fail`` rank still running (one
stuck on purpose) gets ``_GRACE_MAY_FAIL`` seconds more, then is
killed; its entry says so. ``group_timeout`` (default: ``timeout``) is the
process group's own timeout (gloo's, for each collective), for tests of
what a rank stuck outside a collective does to the others.

The module is also a pytest plugin: it provides the ``run_distributed``
fixture (the same function, with the timeout taken from the
``distributed_timeout`` marker if present).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

__all__ = ["DistributedTestError", "run_distributed"]

_DEFAULT_TIMEOUT = 120.0
# After one rank fails, how long the others get to report before being
# killed (they are usually blocked in a collective that will never finish).
_GRACE_AFTER_FAILURE = 5.0
# How long a may_fail rank gets once every other rank has reported.
_GRACE_MAY_FAIL = 2.0
# What a forkserver imports once, for every rank it forks.
_PRELOAD = ["torch", "torch.distributed", "shardstate.checkpoint",
            "shardstate.checkpoint.filesystem"]


class DistributedTestError(AssertionError):
    """One or more ranks failed, crashed or timed out.

    ``failures`` maps rank -> formatted traceback or reason.
    """

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str,
    timeout: float,
    args: tuple,
    kwargs: dict,
    results: Any,
    report_first: bool = False,
    env: dict[str, str] | None = None,
) -> None:
    if env is not None:  # the caller's, at the call (a forked rank has the server's)
        os.environ.clear()
        os.environ.update(env)
    # Stack dumps on request from the parent when the run times out.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # What torchrun tells each rank about its node (all ranks are local here).
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            host, port, world_size, is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            value = fn(rank, world_size, *args, **kwargs)
            if report_first:
                # a peer may be gone, which can block the group's teardown
                results.put(("ok", rank, value))
        finally:
            dist.destroy_process_group()
        if not report_first:
            results.put(("ok", rank, value))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put(("error", rank, traceback.format_exc()))
    # Flush the queue's feeder thread before the process exits.
    results.close()
    results.join_thread()


def _kill_all(procs: list[Any], dump_stacks: bool) -> None:
    live = [p for p in procs if p.is_alive()]
    if dump_stacks:
        for p in live:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    for p in live:
        p.terminate()
    deadline = time.monotonic() + 5.0
    for p in live:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in live:
        if p.is_alive():
            p.kill()
            p.join()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = _DEFAULT_TIMEOUT,
    backend: str = "gloo",
    may_fail: Collection[int] = (),
    group_timeout: float | None = None,
    start_method: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes.

    Returns the ranks' return values in rank order; raises
    :class:`DistributedTestError` if any rank raises, crashes, or the whole
    run takes longer than ``timeout`` seconds. A rank in ``may_fail`` that
    raises or dies does not fail the run: its entry is the reason (a str).
    ``group_timeout``: the process group's timeout (default ``timeout``);
    ``start_method``: ``"spawn"`` or ``"forkserver"`` (see the module's
    docstring; None: ``$SHARDSTATE_TEST_START_METHOD``, else ``"spawn"``).
    """
    if start_method is None:
        start_method = os.environ.get("SHARDSTATE_TEST_START_METHOD") or "spawn"
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout!r}")
    if group_timeout is None:
        group_timeout = timeout
    if group_timeout <= 0:
        raise ValueError(f"group_timeout must be > 0, got {group_timeout!r}")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    may_fail = frozenset(may_fail)
    if not may_fail <= set(range(world_size)):
        raise ValueError(f"may_fail names ranks outside 0..{world_size - 1}: {sorted(may_fail)}")
    import datetime

    import torch.distributed as dist

    host = "127.0.0.1"
    # The parent hosts the store; port 0 lets the OS pick a free port.
    store = dist.TCPStore(
        host, 0, world_size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # (only read when the server starts)
    results = ctx.Queue()
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(fn, rank, world_size, host, store.port, backend, group_timeout,
                      args, kwargs, results, bool(may_fail), dict(os.environ)),
                name=f"shardstate-rank{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
        return _collect(procs, results, world_size, timeout, may_fail)
    finally:
        _kill_all(procs, dump_stacks=False)
        results.close()
        results.join_thread()
        del store


def _collect(procs: list[Any], results: Any, world_size: int, timeout: float,
             may_fail: frozenset[int] = frozenset()) -> list[Any]:
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    timed_out = False
    stragglers = False  # only may_fail ranks are left: they have a grace
    while len(values) + len(failures) < world_size:
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        if may_fail and not stragglers and all(
                r in values or r in failures for r in range(world_size) if r not in may_fail):
            # every other rank has reported: a may_fail rank still running
            # (stuck on purpose) gets a grace, not the whole timeout
            stragglers = True
            deadline = min(deadline, now + _GRACE_MAY_FAIL)
        try:
            kind, rank, payload = results.get(timeout=min(0.2, deadline - now))
        except queue.Empty:
            # A rank that exited without reporting crashed (or called _exit).
            for rank, p in enumerate(procs):
                if (rank not in values and rank not in failures
                        and p.exitcode is not None):
                    # Its last message may still be in flight; look once more.
                    try:
                        kind, r2, payload = results.get(timeout=0.5)
                    except queue.Empty:
                        failures[rank] = (
                            f"rank {rank} exited with code {p.exitcode} "
                            "without reporting a result")
                        continue
                    (values if kind == "ok" else failures)[r2] = payload
            continue
        if kind == "ok":
            values[rank] = payload
        else:
            failures[rank] = payload
            if rank not in may_fail:
                # Give the other ranks a moment, then stop waiting for them.
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)

    missing = [r for r in range(world_size) if r not in values and r not in failures]
    if missing:
        only_stragglers = stragglers and all(r in may_fail for r in missing)
        _kill_all(procs, dump_stacks=timed_out and not only_stragglers)
        if only_stragglers:
            reason = (f"was still running {_GRACE_MAY_FAIL:.0f} s after the other ranks "
                      "reported, and was killed")
        elif timed_out:
            reason = f"timed out after {timeout:.0f} s"
        else:
            reason = "stopped waiting after another rank failed"
        for r in missing:
            failures[r] = f"rank {r} {reason} (its stacks, if any, are in the captured stderr)"
    if any(r not in may_fail for r in failures):
        raise DistributedTestError(_format(failures, world_size), failures)
    if not may_fail:
        for p in procs:
            p.join(5.0)
    # (with may_fail, a survivor's teardown may block: run_distributed kills it)
    return [values[r] if r in values else failures[r] for r in range(world_size)]


def _format(failures: dict[int, str], world_size: int) -> str:
    ranks = ", ".join(str(r) for r in sorted(failures))
    parts = [f"{len(failures)} of {world_size} ranks failed (ranks {ranks})"]
    for r in sorted(failures):
        parts.append(f"\n--- rank {r} ---\n{failures[r].rstrip()}")
    return "\n".join(parts)


# ---------------------------------------------------------------- pytest plugin

def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers",
        "distributed_timeout(seconds): timeout for the run_distributed fixture",
    )


def _fixture() -> Any:
    import pytest

    @pytest.fixture(name="run_distributed")
    def run_distributed_fixture(request: Any) -> Callable[..., list[Any]]:
        """``run_distributed(fn, world_size, *args, **kwargs)`` for tests."""
        marker = request.node.get_closest_marker("distributed_timeout")
        default = float(marker.args[0]) if marker else _DEFAULT_TIMEOUT

        def runner(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any):
            kwargs.setdefault("timeout", default)
            return run_distributed(fn, world_size, *args, **kwargs)

        return runner

    return run_distributed_fixture


if "pytest" in sys.modules:  # only define the fixture inside a pytest run
    run_distributed_fixture = _fixture()
