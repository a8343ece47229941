"""Soak: hundreds of saves and loads in one process, and what they leave behind.

One seeded run mixes ``save``, ``async_save`` (THREAD; a few PROCESS; the
staging pool, a ``DefaultStager`` staging in its thread, the writer as
stager with and without its kept arena; saves still in flight while the
next one starts), ``load`` into fresh tensors, random shapes and dtypes
(empty and 0-d tensors, views), nested dicts with plain values (bytes
items), overwrites of one directory and new directories, and saves that fail
(the writer raises before or after writing its data, in the caller, in a
background thread or in the checkpoint process). Every checkpoint is loaded
back and compared bit for bit with what was saved (the tensors are
overwritten as soon as an async_save has staged them), and a directory
whose last save failed must load nothing.

After each round, with nothing in flight, the process is sampled: RSS, open
file descriptors, Python and OS threads, child processes, memory mappings,
the staging pool's arenas and shared-memory descriptors, /dev/shm, the
checkpoint process's RSS and descriptors, and no temporary file may be left
in any checkpoint directory. The first ``_WARMUP`` rounds run every kind of
save and of failure; after them descriptors, threads, children and mappings
must stay within the warm-up's highest value plus a small slack (checked
every round), and RSS must not trend upwards (a robust slope, and the last
window's median against the first's): a leak of 64 KiB a round fails.

A second test runs the same rounds on two ranks (``run_distributed``),
where every save and load is a collective, and also counts the keys on the
group's store. Both are bounded in time (see ``_ROUNDS``, ``_SECONDS`` and
their ``_2`` twins, all set by environment variables); under ASan
(libasan in LD_PRELOAD) they run fewer rounds and RSS is not judged.
``SHARDSTATE_SOAK_SEED`` replays a run: every failure names the seed and
the round.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import os
import random
import shutil
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import shardstate.checkpoint as dcp
import torch
from _sanitizers import UNDER_ASAN
from shardstate.checkpoint import _async_process, _fs_write, _records, _staging
from shardstate.checkpoint import logger as dcp_logger
from shardstate.checkpoint.staging import DefaultStager, StagingOptions
from shardstate.checkpoint.state_dict_saver import AsyncCheckpointerType

THREAD, PROCESS = AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS

_SEED = int(os.environ.get("SHARDSTATE_SOAK_SEED", "1515"))
_WARMUP = 30  # rounds before the baseline: pools, caches and the checkpoint process settle
# One process: SHARDSTATE_SOAK_ITERS rounds or SHARDSTATE_SOAK_SECONDS,
# whichever comes first, never fewer than _MIN_ROUNDS (RSS's slope needs
# about a hundred rounds after the warm-up to be known within a few KiB;
# ASan's run does not judge RSS: its quarantine holds freed memory).
_ROUNDS = int(os.environ.get("SHARDSTATE_SOAK_ITERS", "300"))
_SECONDS = float(os.environ.get("SHARDSTATE_SOAK_SECONDS", "12" if UNDER_ASAN else "30"))
_MIN_ROUNDS = _WARMUP + (40 if UNDER_ASAN else 120)
# Two ranks (real processes, every save a collective): the counts only.
# Each rank's RSS climbs by up to 3 MiB over its first ~150 rounds, then
# stays flat (measured over 600): longer than CI can wait. RSS is judged in
# one process, where the same saves and loads run without the collectives.
_ROUNDS_2 = int(os.environ.get("SHARDSTATE_SOAK_ITERS_2", "150"))
_SECONDS_2 = float(os.environ.get("SHARDSTATE_SOAK_SECONDS_2", "8" if UNDER_ASAN else "12"))
_MIN_ROUNDS_2 = _WARMUP + (30 if UNDER_ASAN else 40)

# Slack over the warm-up's highest value. Threads and descriptors are
# sampled with every background save joined, so none is in flight; one of
# each is left for a helper that torch or glibc may start late. Mappings:
# glibc's malloc and the arenas' own maps come and go in steps.
_FD_SLACK = 1
_THREAD_SLACK = 1
_MAP_SLACK = 16
# RSS (less the staging arenas alive, counted on their own), sampled after
# malloc_trim: a leak of 64 KiB a round must fail, the noise must not (a
# standard deviation of about 1 MiB from sample to sample, from allocator
# caching and the occasional large state; without a leak, slopes within
# +-4 KiB a round and window growth within 1.3 MiB over 270 rounds).
_RSS_SLOPE_KIB = 16.0  # robust slope over every round after the warm-up, KiB a round
_RSS_WINDOW_KIB = 1536  # last fifth's median over the first fifth's: this plus...
_RSS_WINDOW_PER_ROUND_KIB = 8.0  # ...this per round after the warm-up

# what a failed save or load raises (torch's CheckpointException is a
# BaseException)
_FAILURES = (Exception, dcp.CheckpointException)
_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16,
           torch.int8)
_OPS = ("save", "thread", "stager", "writer", "process", "fail")
# The first rounds: every kind of save, and a failure in each place it can
# happen (a process's first failure costs it megabytes, once: what its
# error path loads, such as the source lines of the traceback it reports).
_WARM_OPS = (("process", ""), ("save", ""), ("thread", ""), ("stager", ""), ("writer", ""),
             ("fail", "sync"), ("fail", "thread"), ("fail", "process"))


# ---------------------------------------------------------------------------
# writers that fail
# ---------------------------------------------------------------------------


class _FailBeforeWrite(dcp.FileSystemWriter):
    """Fails in write_data before any data file is written (on one rank, or
    on every rank when ``only_rank`` is None)."""

    def __init__(self, path, only_rank=None, **kw):
        super().__init__(path, **kw)
        self.only_rank = only_rank

    def write_data(self, plan, planner):
        if self.only_rank in (None, self.rank or 0):
            raise OSError(28, "No space left on device (soak)")
        return super().write_data(plan, planner)


class _FailAfterWrite(_FailBeforeWrite):
    """Writes every data file, then fails (no .metadata)."""

    def write_data(self, plan, planner):
        fut = dcp.FileSystemWriter.write_data(self, plan, planner)
        fut.wait()
        if self.only_rank in (None, self.rank or 0):
            raise OSError(5, "Input/output error (soak)")
        return fut


# ---------------------------------------------------------------------------
# resources
# ---------------------------------------------------------------------------


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def _proc_status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "Threads"):
                out[key] = int(value.split()[0])
    return out


def _children() -> list[int]:
    me, kids = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            kids.append(int(name))
    return sorted(kids)


def _fd_targets(pid: int | str = "self") -> list[str]:
    out = []
    base = f"/proc/{pid}/fd"
    for fd in os.listdir(base):
        try:
            out.append(os.readlink(f"{base}/{fd}"))
        except OSError:
            pass  # closed meanwhile (listdir's own descriptor)
    return out


def _ours_in_dev_shm(pids: list[int]) -> int:
    """Entries of /dev/shm named after shardstate or one of these processes
    (torch names its shared memory files torch_<pid>_...)."""
    if not os.path.isdir("/dev/shm"):
        return 0
    marks = ["shardstate"] + [f"_{p}_" for p in pids]
    return sum(any(m in n for m in marks) for n in os.listdir("/dev/shm"))


def _store_keys() -> int:
    """Keys on the default group's store (0 without a group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    return int(dist.distributed_c10d._get_default_store().num_keys())


def _sample() -> dict[str, int]:
    status = _proc_status()
    with open("/proc/self/maps") as f:
        maps = f.readlines()
    live = list(_staging._all_arenas.values())
    targets = _fd_targets()
    staging_fds = sum("shardstate-staging" in t for t in targets)
    kids = _children()
    sample = {
        "rss_kib": status["VmRSS"],
        # the staging arenas are populated mappings: counted on their own
        "rss_less_arenas_kib": status["VmRSS"] - sum(a.size for a in live) // 1024,
        # a shared arena keeps its memory file open: counted on their own
        "fds": len(targets) - staging_fds,
        "staging_fds": staging_fds,
        "py_threads": threading.active_count(),
        "os_threads": status["Threads"],
        "children": len(kids),
        "maps": len(maps),
        "arenas": len(live),
        "shared_arenas": sum(a.shared for a in live),
        "dev_shm": _ours_in_dev_shm([os.getpid()] + kids),
        "child_anon_kib": 0,
        "child_fds": 0,
        "store_keys": _store_keys(),
    }
    for pid in kids:  # the checkpoint process (PROCESS saves)
        try:
            # its anonymous memory: the arenas it maps are shared memory
            sample["child_anon_kib"] += _proc_status(pid).get("RssAnon", 0)  # 0: a zombie
            sample["child_fds"] += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            pass
    return sample


# ---------------------------------------------------------------------------
# states, snapshots, comparisons
# ---------------------------------------------------------------------------


def _tensor(rng: random.Random, big: bool) -> torch.Tensor:
    dtype = rng.choice(_DTYPES)
    ndim = rng.choice((0, 1, 1, 2, 2, 3))
    budget = rng.randint(1, 300_000 if big else 3_000)  # elements, at most
    shape = []
    for i in range(ndim):
        if rng.random() < 0.08:
            shape.append(rng.choice((0, 1)))  # empty, or a size-1 dimension
        else:
            shape.append(rng.randint(1, max(1, round(budget ** (1 / (ndim - i))))))
            budget = max(1, budget // shape[-1])
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 1e3).to(dtype)
        if t.numel() and rng.random() < 0.3:  # bit patterns beyond plain values
            flat = t.view(-1)
            flat[0], flat[-1] = float("nan"), -0.0
            if flat.numel() > 2:
                flat[1] = float("-inf")
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), shape,
                          generator=g, dtype=dtype)
    if t.ndim >= 2 and rng.random() < 0.2:
        t = t.transpose(0, 1)  # a non-contiguous view
    elif t.ndim >= 1 and t.shape[0] > 2 and rng.random() < 0.15:
        t = t[1:]  # a view at an offset into a larger storage
    return t


def _plain(rng: random.Random) -> Any:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.choice((0, 1, rng.randint(2, 3000))))
    if kind == 1:
        return "".join(rng.choice("abcdé漢 ") for _ in range(rng.randint(0, 40)))
    if kind == 2:
        return rng.randint(-(2**70), 2**70)
    if kind == 3:
        return rng.random() * 1e6
    if kind == 4:
        return [rng.randint(0, 9) for _ in range(rng.randint(0, 6))]
    return {"lr": rng.random(), "betas": (0.9, 0.999), "name": None}


def _state(rng: random.Random) -> dict:
    """A model/optimizer-like nested state of random tensors and plain values;
    one in ten is large (up to a few MiB: the pool's arenas are outgrown)."""
    big = rng.random() < 0.1
    model = {f"layer{i}.w": _tensor(rng, big) for i in range(rng.randint(1, 6))}
    optim = {
        "state": {str(i): {"step": _tensor(rng, False), "exp_avg": _tensor(rng, big)}
                  for i in range(rng.randint(0, 3))},
        "param_groups": {"lr": rng.random(), "params": list(range(rng.randint(0, 5)))},
    }
    sd: dict = {"model": model, "optim": optim}
    extra = {f"x{i}": _plain(rng) for i in range(rng.randint(0, 4))}
    if extra:
        sd["extra"] = extra
    if rng.random() < 0.3:
        sd["blob"] = _plain(rng)
    return sd


def _snapshot(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: _snapshot(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    return copy.deepcopy(sd)


def _template(sd: Any) -> Any:
    """Fresh destinations: tensors of the same dtype and shape full of a
    marker byte (never what was saved), other values a placeholder."""
    if isinstance(sd, dict):
        return {k: _template(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        t = torch.empty(sd.shape, dtype=sd.dtype)
        t.view(-1).view(torch.uint8).fill_(0x5A)
        return t
    return "<not loaded>"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _mismatch(got: Any, want: Any, path: str = "") -> str | None:
    """Where got differs from want (bit for bit for tensors), or None."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            return f"{path}: keys {keys} != {sorted(want)}"
        for k in want:
            bad = _mismatch(got[k], want[k], f"{path}.{k}")
            if bad:
                return bad
        return None
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: got {type(got).__name__}, want a tensor"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{path}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}" \
                   f"{tuple(want.shape)}"
        if not torch.equal(_bits(got), _bits(want)):
            n = int((_bits(got) != _bits(want)).sum())
            return f"{path}: {n} of {_bits(want).numel()} bytes differ"
        return None
    if type(got) is not type(want) or got != want:
        return f"{path}: got {got!r:.80}, want {want!r:.80}"
    return None


def _scribble(sd: Any) -> None:
    """Overwrites every tensor of sd in place: a save that staged a real
    copy does not see it."""
    if isinstance(sd, dict):
        for v in sd.values():
            _scribble(v)
    elif isinstance(sd, torch.Tensor) and sd.numel():
        sd.copy_(torch.ones_like(sd) if sd.dtype == torch.bool else sd * 0 + 7)


def _leftovers(root: Path) -> list[str]:
    """Temporary files a save left behind anywhere under root (the publish
    step's are ``.<name>.<pid>.<ns>.<try>.tmp``)."""
    return sorted(os.path.relpath(os.path.join(top, n), root)
                  for top, dirs, files in os.walk(root)  # (errors ignored: a dir just removed)
                  for n in dirs + files if ".tmp" in n or n.endswith("~"))


# ---------------------------------------------------------------------------
# the soak
# ---------------------------------------------------------------------------


class _Soak:
    """The rounds of one soak. With a group, every rank makes the same
    choices (one seed) on its own state: keys under ``rank{r}`` its own, the
    rest the same on every rank (saved once, loaded by every rank)."""

    def __init__(self, root: Path, seed: int, *, process_saves: bool = True,
                 rank: int = 0, world: int = 1) -> None:
        self.root = root
        self.seed = seed
        self.rng = random.Random(seed)
        self.own_rng = random.Random(seed * 1000 + rank)
        self.process_saves = process_saves
        self.rank, self.world = rank, world
        self.round = 0
        self.dirs: dict[Path, Any] = {}  # checkpoint dir -> what it holds (None: nothing)
        self.next_dir = 0
        self.counts: dict[str, int] = {}
        self.stager = DefaultStager(StagingOptions(False, False, True, False))

    def where(self) -> str:
        its = "_ITERS_2" if self.world > 1 else "_ITERS"
        return f"(seed {self.seed}, round {self.round - 1}, rank {self.rank}; replay with " \
               f"SHARDSTATE_SOAK_SEED={self.seed} SHARDSTATE_SOAK{its}={self.round} " \
               f"SHARDSTATE_SOAK_SECONDS{its[6:]}=600)"

    def _pick_dir(self, busy: set[Path]) -> Path:
        free = [d for d in self.dirs if d not in busy]
        if free and self.rng.random() < 0.5:
            return self.rng.choice(free)  # an overwrite
        if len(self.dirs) >= 6:  # keep the disk bounded: drop the oldest idle one
            old = next(d for d in self.dirs if d not in busy)
            if self.rank == 0:
                shutil.rmtree(old)
            del self.dirs[old]
        d = self.root / f"ckpt{self.next_dir}"
        self.next_dir += 1
        return d

    def _state(self) -> dict:
        sd = _state(self.rng)
        if self.world > 1:
            sd[f"rank{self.rank}"] = _state(self.own_rng)
        return sd

    def _verify(self, d: Path) -> None:
        want = self.dirs[d]
        if want is None:  # the last save here failed: nothing may load
            with pytest.raises(_FAILURES):
                dcp.load({"model": {}}, checkpoint_id=d)
            assert not (d / ".metadata").exists(), self.where()
            return
        got = _template(want)
        dcp.load(got, checkpoint_id=d)
        bad = _mismatch(got, want)
        assert bad is None, f"{d.name} loaded wrong {self.where()}: {bad}"

    def one_round(self) -> None:
        """One to three saves (some in flight together), then every
        directory they touched loaded back and checked, and sometimes an
        older one too; nothing is in flight when it returns."""
        rng = self.rng
        self.round += 1
        pending: list[tuple[Path, Any, Any]] = []  # dir, future, snapshot (None: fails)
        busy: set[Path] = set()
        for i in range(rng.choice((1, 1, 2, 3))):
            d = self._pick_dir(busy)
            busy.add(d)
            sd = self._state()
            want = _snapshot(sd)
            # the warm-up starts with every kind (and every way to fail)
            if i == 0 and self.round <= len(_WARM_OPS):
                op, how = _WARM_OPS[self.round - 1]
            else:
                op = rng.choices(_OPS, (30, 30, 8, 8, 4, 10))[0]
                how = rng.choices(("sync", "thread", "process"), (50, 40, 10))[0]
            if not self.process_saves:
                op, how = ("thread" if op == "process" else op), \
                    ("thread" if how == "process" else how)
            self.counts[op] = self.counts.get(op, 0) + 1
            kw: dict[str, Any] = {"checkpoint_id": d}
            if op == "save":
                if rng.random() < 0.5:  # without the fsyncs: faster
                    kw = {"storage_writer": dcp.FileSystemWriter(d, sync_files=False)}
                dcp.save(sd, **kw)
                self.dirs[d] = want
            elif op == "fail":
                cls = rng.choice((_FailBeforeWrite, _FailAfterWrite))
                only = rng.choice((None, rng.randrange(self.world)))
                kw = {"storage_writer": cls(d, only_rank=only, sync_files=False)}
                if how == "sync":
                    with pytest.raises(_FAILURES, match="soak"):
                        dcp.save(sd, **kw)
                    self.dirs[d] = None
                else:
                    kind = PROCESS if how == "process" else THREAD
                    fut = dcp.async_save(sd, async_checkpointer_type=kind, **kw)
                    pending.append((d, fut, None))
            else:
                if op == "stager":
                    kw["async_stager"] = self.stager
                elif op == "writer":  # the writer stages (its own kept arena, or the pool)
                    kw = {"storage_writer": dcp.FileSystemWriter(
                        d, single_file_per_rank=rng.random() < 0.7,
                        thread_count=rng.randint(1, 3), sync_files=rng.random() < 0.2,
                        cache_staged_state_dict=rng.random() < 0.5)}
                kind = PROCESS if op == "process" else THREAD
                fut = dcp.async_save(sd, async_checkpointer_type=kind, **kw)
                fut.staging_completion.result(timeout=120)
                _scribble(sd)  # staged: the save must not see this
                pending.append((d, fut, want))
            if rng.random() < 0.3 and pending:  # sometimes wait before the next save
                self._finish(*pending.pop(0))
        while pending:
            self._finish(*pending.pop(0))
        for d in sorted(busy):
            if d in self.dirs:
                self._verify(d)
        if self.dirs and rng.random() < 0.3:
            self._verify(rng.choice(sorted(self.dirs)))

    def _finish(self, d: Path, fut: Any, want: Any) -> None:
        if want is None:
            with pytest.raises(_FAILURES, match="soak"):
                fut.result(timeout=120)
        else:
            fut.result(timeout=120)
        self.dirs[d] = want

    def close(self) -> None:
        self.stager.close()


def _quiet_sample(soak: _Soak) -> dict[str, int]:
    """The resources, with nothing in flight."""
    # a background save's thread delivers its result just before it ends,
    # and its collectives' helper thread ends after it (the main thread's
    # helper is kept)
    for t in threading.enumerate():
        if t.name == "shardstate-async-save":
            t.join(timeout=10)
    deadline = time.monotonic() + 1  # milliseconds, normally; a leak is counted below
    while sum(t.name == "shardstate-collective" for t in threading.enumerate()) > 1 \
            and time.monotonic() < deadline:
        time.sleep(0.005)
    # The record plans of every (dtype, shape, stride) written or read are
    # kept in LRU caches of 4096 (about 3 KiB each; the save's C plans in
    # _fs_write, the reader's in _records): random shapes would fill them
    # over the whole run, a bounded growth that is not a leak.
    _records._record_plan.cache_clear()
    _fs_write._plan.cache_clear()
    gc.collect(1)  # young objects only: a full collection costs 0.2 s with torch loaded
    if _staging._pool._busy or len(_staging._all_arenas) > _staging._SLOTS:
        # a failure's traceback and the frames it names are cyclic garbage
        # that only a full collection frees: not a leak
        gc.collect()
    if _LIBC is not None:  # freed heap pages back to the system: RSS is then what is live
        _LIBC.malloc_trim(0)
    pool = _staging._pool
    assert pool._busy == 0, f"{pool._busy} staging arenas still taken {soak.where()}"
    assert len(pool._free) <= _staging._SLOTS, soak.where()
    left = _leftovers(soak.root)
    assert not left, f"temporary files left {soak.where()}: {left}"
    s = _sample()
    if s["staging_fds"] > 2 * s["shared_arenas"]:
        # a dropped arena's memory file still held by cyclic garbage (a
        # failure's frames): only a full collection frees it; not a leak
        gc.collect()
        s = _sample()
    return s


def _theil_sen(ys: list[float]) -> float:
    """Median of the pairwise slopes: a trend that a few spikes can't fake."""
    step = max(1, len(ys) // 100)  # bounded work: pairs of a thinned series
    pts = list(range(0, len(ys), step))
    return statistics.median((ys[j] - ys[i]) / (j - i)
                             for a, i in enumerate(pts) for j in pts[a + 1:])


# (ASan's allocator maps more regions as its quarantine fills: mappings
# are not counted there)
_COUNTS = (("fds", _FD_SLACK), ("py_threads", _THREAD_SLACK), ("os_threads", _THREAD_SLACK),
           ("children", 0), ("child_fds", _FD_SLACK), ("store_keys", 0)) \
    + ((("maps", _MAP_SLACK),) if not UNDER_ASAN else ())


def _check_counts(samples: list[dict[str, int]], where: str) -> None:
    """Raises at once when the latest sample holds more than it may."""
    s = samples[-1]
    # the staging pool at rest: only free arenas (at most its slots), a
    # shared one's memory file open twice (the arena's descriptor and the
    # one its mmap keeps: Python's mmap dups it); nothing of ours in /dev/shm
    assert s["arenas"] <= _staging._SLOTS, f"{s['arenas']} arenas alive {where}: {s}"
    assert s["staging_fds"] <= 2 * s["shared_arenas"], f"staging descriptors {where}: {s}"
    assert s["dev_shm"] <= samples[0]["dev_shm"], f"/dev/shm grew {where}: {s}"
    if len(samples) <= _WARMUP:
        return
    for key, slack in _COUNTS:
        peak = max(b[key] for b in samples[:_WARMUP])
        assert s[key] <= peak + slack, \
            f"{key} grew to {s[key]}, past the warm-up's {peak} + {slack} {where}: {s}"


def _judge_rss(samples: list[dict[str, int]], where: str,
               judge_rss: bool = True) -> dict[str, float]:
    """Raises unless RSS after the warm-up stays flat (here and in the
    checkpoint process); returns the measures."""
    rest = samples[_WARMUP:]
    assert len(rest) >= 30, f"only {len(rest)} samples after the warm-up {where}"
    w = max(10, len(rest) // 5)
    summary: dict[str, float] = {}
    for key in ("rss_less_arenas_kib", "child_anon_kib"):
        ys = [float(s[key]) for s in rest]
        summary[f"{key}_slope"] = round(_theil_sen(ys), 2)
        summary[f"{key}_growth"] = statistics.median(ys[-w:]) - statistics.median(ys[:w])
    if not judge_rss:
        return summary
    limit = _RSS_WINDOW_KIB + _RSS_WINDOW_PER_ROUND_KIB * len(rest)
    for key in ("rss_less_arenas_kib", "child_anon_kib"):
        slope, growth = summary[f"{key}_slope"], summary[f"{key}_growth"]
        assert slope <= _RSS_SLOPE_KIB, \
            f"{key} grows {slope:.1f} KiB a round after the warm-up {where}: {summary}"
        assert growth <= limit, f"{key} grew {growth:.0f} KiB from the first window to " \
                                f"the last (limit {limit:.0f}) {where}: {summary}"
    return summary


@contextlib.contextmanager
def _events_not_captured() -> Any:
    """pytest keeps every log record of a test (it adds its handlers to
    torch's DCP event logger too), and each save and load logs its start
    and end: kept for hundreds of rounds, they would read as a leak."""
    log = dcp_logger._dcp_logger
    kept = list(log.handlers)
    log.handlers = [h for h in kept if not type(h).__module__.startswith("_pytest")]
    try:
        yield
    finally:
        log.handlers = kept


def _run_soak(soak: _Soak, rounds: int, seconds: float, min_rounds: int, judge_rss: bool,
              stop: Any = None) -> dict[str, Any]:
    """Runs rounds until ``rounds`` or ``seconds`` (never fewer than
    ``min_rounds``); ``stop(bool) -> bool`` makes the ranks of a group agree."""
    samples: list[dict[str, int]] = []
    start = time.monotonic()
    with warnings.catch_warnings(), _events_not_captured():
        # overwriting a checkpoint warns (torch's message), in save threads too
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        try:
            while soak.round < rounds:
                late = soak.round >= min_rounds and time.monotonic() - start > seconds
                if stop(late) if stop is not None else late:
                    break
                try:
                    soak.one_round()
                except AssertionError:
                    raise
                except _FAILURES as e:
                    raise AssertionError(f"round failed {soak.where()}: {e!r}") from e
                samples.append(_quiet_sample(soak))
                _check_counts(samples, soak.where())
        finally:
            soak.close()
    summary = _judge_rss(samples, soak.where(), judge_rss)
    return {"rounds": soak.round, "seconds": round(time.monotonic() - start, 1),
            "counts": soak.counts, "first": samples[_WARMUP], "last": samples[-1], **summary}


@pytest.mark.slow
def test_soak_one_process(tmp_path):
    try:
        out = _run_soak(_Soak(tmp_path, _SEED), _ROUNDS, _SECONDS, _MIN_ROUNDS,
                        judge_rss=not UNDER_ASAN)
    finally:
        _async_process.shutdown()
    print(f"\nsoak seed {_SEED}: {out}")
    assert out["rounds"] >= min(_ROUNDS, _MIN_ROUNDS)
    for op in _OPS:  # the mix really ran
        assert out["counts"].get(op, 0) > 0, f"no {op} in {out['counts']} (seed {_SEED})"



def _soak_rank(rank: int, world: int, root: str, seed: int, rounds: int,
               seconds: float) -> dict[str, Any]:
    """One rank's soak: every rank makes the same saves (a collective each)."""
    import torch.distributed as dist

    def stop(late: bool) -> bool:  # the ranks stop together
        flag = torch.tensor([int(late)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    try:
        return _run_soak(_Soak(Path(root), seed, rank=rank, world=world), rounds, seconds,
                         _MIN_ROUNDS_2, False, stop)
    finally:
        _async_process.shutdown()


@pytest.mark.slow
@pytest.mark.distributed_timeout(300)
def test_soak_two_ranks(run_distributed, tmp_path):
    outs = run_distributed(_soak_rank, 2, str(tmp_path), _SEED, _ROUNDS_2, _SECONDS_2)
    for rank, out in enumerate(outs):
        print(f"\nsoak seed {_SEED} rank {rank}: {out}")
        assert out["rounds"] >= min(_ROUNDS_2, _MIN_ROUNDS_2)
        for op in _OPS:
            assert out["counts"].get(op, 0) > 0, f"no {op} in {out['counts']} (seed {_SEED})"
