"""Distributed faults at world 3 (issue 15's sweep): a fault of each kind
(raise, exit, SIGKILL, stuck forever), on each rank, in each phase of a
save or a load (plan, stage, write, finish, read, commit; where each is
exactly: tests/_rank_faults.py. In short: stage is async_save's staging,
the storage writer's ``stage()``; finish is the coordinator's
``storage_writer.finish`` and, on the other ranks, which run none, the end
of their ``write_data`` once their files are written; commit is a
Stateful's ``load_state_dict``). Every surviving rank must raise
CheckpointException naming the victim alone, saying why (the injected
error, a SystemExit, a rank gone, a rank that never arrived), within
``_BOUND`` seconds, and no rank may hang; a save that failed leaves no
``.metadata``.

The whole matrix is 72 runs of 3 processes. A plain run samples
``_SAMPLE`` of them, chosen by a seed (random unless
``SHARDSTATE_SWEEP_SEED`` gives it) so that every kind, rank and phase
appears and pairs of them are spread; ``SHARDSTATE_SWEEP_FULL=1`` runs
them all. Under ASan (libasan in ``LD_PRELOAD``, as ``make asan-test``
runs the suite) the sample is ``_SAMPLE_ASAN``: what this file reaches in
C (the writer and reader) is the same in every scenario, and the sanitizer
build is several times slower. A failure's message says the seed and the
scenario, and how to run it again.

Each run is short: ranks are forked from a server that imported torch once
(``run_distributed(start_method="forkserver")``), a dead rank's heartbeat
limit is ``_DEAD_S`` (``SHARDSTATE_DEAD_RANK_S``), and the process group's
timeout is ``_GROUP_TIMEOUT``, which is how long a rank stuck alive is
waited for (``checkpoint._liveness``).
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
from _sanitizers import UNDER_ASAN

torch = pytest.importorskip("torch")

from _rank_faults import LOAD_PHASES, Fault, scenario, survivors_failed  # noqa: E402
from shardstate.testing import DistributedTestError, run_distributed  # noqa: E402

KINDS = ("raise", "exit", "sigkill", "stuck")
PHASES = ("plan", "stage", "write", "finish", "read", "commit")
VICTIMS = (0, 1, 2)

_DEAD_S = 4  # SHARDSTATE_DEAD_RANK_S in the ranks
_GROUP_TIMEOUT = 8  # the process group's timeout, seconds
_BOUND = 30.0  # a survivor must have raised by then
_RUN_TIMEOUT = 90  # the whole run of one scenario (a hang fails it)
_SAMPLE = 16
_SAMPLE_ASAN = 6

# What each kind's CheckpointException says about the victim.
_SAYS = {
    "raise": ("injected fault on rank {v}",),
    "exit": ("SystemExit", "rank {v} is gone"),
    "sigkill": ("rank {v} is gone",),
    "stuck": ("rank {v} never arrived",),
}


def _seed() -> int:
    given = os.environ.get("SHARDSTATE_SWEEP_SEED")
    return int(given) if given else random.SystemRandom().randrange(2**31)


def _sample(seed: int, n: int) -> list[tuple[str, int, str]]:
    """``n`` scenarios, shuffled by ``seed``, picked greedily to cover as
    many (kind, phase), (kind, rank) and (phase, rank) pairs as they can."""
    rng = random.Random(seed)
    pool = list(itertools.product(KINDS, VICTIMS, PHASES))
    rng.shuffle(pool)
    covered: set[tuple] = set()

    def pairs(s: tuple[str, int, str]) -> set[tuple]:
        kind, victim, phase = s
        return {("kp", kind, phase), ("kv", kind, victim), ("pv", phase, victim)}

    picked = []
    for _ in range(min(n, len(pool))):
        best = max(pool, key=lambda s: len(pairs(s) - covered))
        pool.remove(best)
        picked.append(best)
        covered |= pairs(best)
    return picked


SEED = _seed()
if os.environ.get("SHARDSTATE_SWEEP_FULL") == "1":
    SCENARIOS = list(itertools.product(KINDS, VICTIMS, PHASES))
else:
    SCENARIOS = _sample(SEED, _SAMPLE_ASAN if UNDER_ASAN else _SAMPLE)


def _reproduce(kind: str, victim: int, phase: str) -> str:
    return (f"[sweep seed {SEED}, scenario {kind} on rank {victim} in {phase}; again: "
            f"SHARDSTATE_SWEEP_SEED={SEED} pytest tests/test_sweep_dist_faults.py "
            f"-k '{kind}-rank{victim}-{phase}'] ")


def test_sample_covers_every_kind_rank_and_phase():
    for seed in (0, 1, SEED):
        got = _sample(seed, _SAMPLE)
        assert len(set(got)) == _SAMPLE
        assert {k for k, _, _ in got} == set(KINDS), seed
        assert {v for _, v, _ in got} == set(VICTIMS), seed
        assert {p for _, _, p in got} == set(PHASES), seed
    assert _sample(SEED, _SAMPLE) == _sample(SEED, _SAMPLE)  # the seed decides
    assert sorted(_sample(0, 100)) == sorted(itertools.product(KINDS, VICTIMS, PHASES))


@pytest.mark.parametrize("kind,victim,phase", SCENARIOS,
                         ids=[f"{k}-rank{v}-{p}" for k, v, p in SCENARIOS])
def test_fault_reaches_every_survivor(tmp_path, monkeypatch, kind, victim, phase):
    where = _reproduce(kind, victim, phase)
    print(where)
    monkeypatch.setenv("SHARDSTATE_DEAD_RANK_S", str(_DEAD_S))
    fault = Fault(kind, victim, phase)
    try:
        out = run_distributed(scenario, 3, str(tmp_path), fault, timeout=_RUN_TIMEOUT,
                              group_timeout=_GROUP_TIMEOUT, may_fail={victim},
                              start_method="forkserver")
    except DistributedTestError as e:
        raise AssertionError(f"{where}a rank failed or hung:\n{e}") from None
    survivors_failed(out, fault, _BOUND, where)
    says = [s.format(v=victim) for s in _SAYS[kind]]
    for rank, got in enumerate(out):
        if rank != victim:
            assert any(s in got["text"] for s in says), f"{where}rank {rank}: {got['text']}"
    if kind == "raise":  # the victim itself fails the call as the others do
        mine = out[victim]
        assert mine["type"] == "CheckpointException" and mine["ranks"] == [victim], \
            f"{where}victim saw {mine!r}"
    if phase not in LOAD_PHASES:
        assert not (tmp_path / "ckpt" / ".metadata").exists(), f"{where}a failed save committed"
