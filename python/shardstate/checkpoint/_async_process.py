"""The PROCESS checkpointer of ``async_save``: one long-lived checkpoint
process per training rank, which writes and commits the checkpoints, so the
training process's GIL never touches the write.

* Started on first use (by the background thread of the first PROCESS save
  on a group), reused by every later save on that group, shut down at exit
  or by :func:`shutdown`. The checkpoint processes of a group's ranks join
  their own gloo process group, on their own TCPStore: the group's rank 0's
  checkpoint process hosts it on a port the OS picks, and tells the others
  through the training group.
* A save sends its process a small request: the staged state dict pickled
  with each tensor and ndarray that lives in a shared staging arena
  (``_staging``) replaced by a descriptor (arena, offset, dtype, shape,
  strides). The process maps each arena once (its memory file is passed
  over the socket the first time) and saves views of it: the bytes are
  never copied between the processes. Anything else pickles as usual.
* The process runs shardstate's save (plan, write, ``.metadata``) on its
  group and answers with the Metadata or the exception, a
  CheckpointException that names the failing ranks. One that dies fails
  the save waiting on it; later PROCESS saves on its group then raise at the
  call until :func:`shutdown`.
* Every save sends exactly one request to each live checkpoint process of
  the group, even one whose staging failed (it then takes part failing),
  so no checkpoint process waits in a collective for a request that never
  comes.

The process is started with ``subprocess`` (not multiprocessing, which a
daemonic process may not use) and prepared as a multiprocessing "spawn"
child is (same ``sys.path`` and working directory, so the classes of a
pickled storage writer or planner import there as here), except that the
main module is not run again there.

Thread safety: one request at a time per process (a lock); the registry of
processes has its own lock.
"""

from __future__ import annotations

import atexit
import io
import mmap
import os
import pickle
import socket
import subprocess
import sys
import threading
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from . import _staging
from ._dist import _Coordinator
from .api import CheckpointException, _wrap_exception

__all__ = ["CheckpointProcess", "checkpoint_process", "shutdown"]

# How long a checkpoint process may take to start and join its group.
_INIT_TIMEOUT = timedelta(minutes=10)
# How long shutdown waits for a save in progress before killing the process.
_CLOSE_TIMEOUT = 60.0

_BOOT = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "import multiprocessing.spawn as sp\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "sp.prepare(conn.recv())\n"
    "from shardstate.checkpoint._async_process import _serve\n"
    "_serve(conn)\n"
)


def _preparation() -> dict[str, Any]:
    """What a multiprocessing spawn child is told about its parent, less
    the main module: a training script run again in the checkpoint process
    would train there (spawn needs an ``if __name__ == "__main__"`` guard;
    many torchrun scripts have none). What ``__main__`` defines can't be
    sent, and is refused (``_Pickler``)."""
    import multiprocessing.spawn as sp

    try:
        data = sp.get_preparation_data("shardstate-checkpoint")
    except Exception:  # noqa: BLE001 - called while bootstrapping: the path suffices
        data = {"sys_path": list(sys.path), "dir": os.getcwd()}
    for key in ("sys_argv", "init_main_from_name", "init_main_from_path"):
        data.pop(key, None)
    if "authkey" in data:
        data["authkey"] = bytes(data["authkey"])  # multiprocessing pickles it only to its children
    return data


class CheckpointProcess:
    """A training rank's checkpoint process, and the socket to it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.dead: str | None = None  # why, once it has died
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), close_fds=True)
        finally:
            theirs.close()
        self._sock = ours
        self._conn = Connection(os.dup(ours.fileno()))
        self._lock = threading.Lock()
        self._sent: dict[int, weakref.ref] = {}  # arenas the process has mapped
        self._conn.send(_preparation())

    @property
    def pid(self) -> int:
        return self._proc.pid

    # ---- start-up

    def init(self, world: int | None, rank: int, addr: str | None, port: int | None) -> Any:
        """Tells the process how to join its group: ``world`` None for no
        group; ``port`` None on the group's rank 0, whose process hosts the
        store and answers with its port."""
        self._conn.send({"world": world, "rank": rank, "addr": addr, "port": port,
                         "timeout": _INIT_TIMEOUT.total_seconds()})
        if port is None and world is not None:
            return self._answer(_INIT_TIMEOUT.total_seconds(), "port")
        return None

    def wait_ready(self) -> None:
        self._answer(_INIT_TIMEOUT.total_seconds() + 60, "ready")

    def _answer(self, timeout: float, what: str) -> Any:
        if not self._conn.poll(timeout):
            raise RuntimeError(f"checkpoint process (pid {self.pid}) sent no {what} "
                               f"within {timeout:.0f}s")
        kind, value = self._recv()
        if kind == "error":
            raise value
        return value

    def _recv(self) -> Any:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait()
            self.dead = f"the checkpoint process (pid {self.pid}) died, exit code {code}"
            raise RuntimeError(self.dead) from None

    # ---- saves

    def save(self, payload: bytes | None, arenas: list[_staging._Arena],
             use_collectives: bool, error: Any = None) -> Any:
        """Sends one save request and waits for its answer: returns the
        Metadata, or raises the CheckpointException from the process (also
        when it dies). ``payload``: (state dict, writer, planner) from
        :func:`dumps`; ``error``: this rank already failed (a wrapped
        exception, payload None), and the process takes part failing."""
        with self._lock:
            try:
                return self._save(payload, arenas, use_collectives, error)
            except CheckpointException:
                raise
            except BaseException as e:  # noqa: BLE001 - a dead or unreachable process
                raise CheckpointException("checkpoint process",
                                          {self.rank: _wrap_exception(e)}) from e

    def _save(self, payload: bytes | None, arenas: list[_staging._Arena],
              use_collectives: bool, error: Any) -> Any:
        if self.dead is not None:
            raise RuntimeError(self.dead)
        drop = [aid for aid, ref in self._sent.items() if ref() is None]
        for aid in drop:
            del self._sent[aid]
        new = [a for a in arenas if a.id not in self._sent]
        self._conn.send({"payload": payload, "use_collectives": use_collectives,
                         "error": error, "drop": drop, "new": [(a.id, a.size) for a in new]})
        if new:
            socket.send_fds(self._sock, [b"F"], [a.fd for a in new])
            for a in new:
                self._sent[a.id] = weakref.ref(a)
        kind, value = self._recv()
        if kind == "error":
            raise value
        return value

    # ---- shutdown

    def close(self, timeout: float = _CLOSE_TIMEOUT) -> None:
        """Asks the process to exit after the save in progress (if any);
        kills it if it has not within ``timeout`` seconds."""
        got = self._lock.acquire(timeout=timeout)
        try:
            if got and self.dead is None and self._proc.poll() is None:
                try:
                    self._conn.send(None)
                except OSError:
                    pass
            try:
                self._proc.wait(timeout=timeout if got else 1.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        finally:
            self.dead = self.dead or "the checkpoint process was shut down"
            self._conn.close()
            self._sock.close()
            if got:
                self._lock.release()


# ---------------------------------------------------------------- registry

# One checkpoint process per group (by its global ranks) this rank saves on;
# ("local",) for saves without a group.
_processes: dict[tuple, CheckpointProcess] = {}
_lock = threading.Lock()


def group_key(coord: _Coordinator) -> tuple:
    if not coord.use_dist:
        return ("local",)
    import torch.distributed as dist

    if coord.group is None:
        return ("dist", tuple(range(dist.get_world_size())))
    return ("dist", tuple(dist.get_process_group_ranks(coord.group)))


def check_alive(key: tuple) -> None:
    """Raises (at the call of async_save) when the group's checkpoint
    process has died: starting another on this rank alone would leave it
    out of the group the other ranks' processes are in."""
    with _lock:
        proc = _processes.get(key)
    if proc is not None and proc.dead is not None:
        raise RuntimeError(
            f"async_save(async_checkpointer_type=PROCESS): {proc.dead}; PROCESS saves on "
            f"this group are not possible until every rank has called "
            f"shardstate.checkpoint._async_process.shutdown()")


def checkpoint_process(coord: _Coordinator) -> CheckpointProcess:
    """The checkpoint process for coord's group, started (on every rank of
    it: every rank must call this together) if there is none yet."""
    key = group_key(coord)
    with _lock:
        proc = _processes.get(key)
    if proc is not None:
        return proc
    proc = _start(coord)
    with _lock:
        _processes[key] = proc
    return proc


def _start(coord: _Coordinator) -> CheckpointProcess:
    started: list[CheckpointProcess] = []

    def start(addr: str | None, port: int | None) -> Any:
        proc = CheckpointProcess(coord.rank)
        started.append(proc)
        world = coord.world_size if coord.use_dist else None
        return proc.init(world, coord.rank, addr, port)

    try:
        if not coord.use_dist:
            start(None, None)
            started[0].wait_ready()
            return started[0]

        def host() -> tuple[str, int]:
            return _address(), start(None, None)

        addr, port = coord.broadcast("checkpoint process", host)

        def join() -> None:
            if not started:
                start(addr, port)
            started[0].wait_ready()

        coord.all_gather("checkpoint process", join)
        return started[0]
    except BaseException:
        for proc in started:
            proc.close(timeout=1.0)
        raise


def _address() -> str:
    """An address of this host the other ranks reach: the one its route to
    the training group's store goes out from (MASTER_ADDR, else this host's
    name, where that store is not a TCPStore)."""
    try:
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        host, port = store.host, store.port
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except Exception:  # noqa: BLE001 - no TCPStore to route to
        return os.environ.get("MASTER_ADDR") or socket.gethostname()


def shutdown(timeout: float = _CLOSE_TIMEOUT) -> None:
    """Stops this rank's checkpoint processes, each after the save it is
    writing (if any; killed after ``timeout`` seconds). Runs at exit; call
    it on every rank to start afresh (the next PROCESS save starts new
    ones)."""
    with _lock:
        procs = list(_processes.values())
        _processes.clear()
    for proc in procs:
        proc.close(timeout)


atexit.register(shutdown)


# ---------------------------------------------------------------- requests


class _Pickler(pickle.Pickler):
    """Pickles for a checkpoint process: a class or function of
    ``__main__`` is refused (the process does not run the main module);
    with ``arenas``, every tensor and ndarray that lives in a shared arena
    becomes a descriptor of where it lies."""

    def __init__(self, file: Any, arenas: bool = True) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arenas: dict[int, _staging._Arena] = {}
        self._torch = sys.modules.get("torch")
        if not arenas:
            self.persistent_id = lambda obj: None  # type: ignore[method-assign]

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) or callable(obj):
            if getattr(obj, "__module__", None) == "__main__":
                raise pickle.PicklingError(
                    f"{getattr(obj, '__qualname__', obj)!s} is defined in __main__, which the "
                    f"checkpoint process does not run: define it in a module")
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        torch = self._torch
        if type(obj) is np.ndarray:
            if obj.nbytes == 0 or not obj.flags.c_contiguous or obj.dtype.hasobject:
                return None
            found = _staging.locate(int(obj.__array_interface__["data"][0]), obj.nbytes)
            if found is None:
                return None
            self.arenas[found[0].id] = found[0]
            return ("ndarray", found[0].id, found[1], obj.dtype.str, obj.shape)
        if torch is None or type(obj) is not torch.Tensor:
            return None
        if (obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_quantized
                or obj.is_conj() or obj.is_neg()):
            return None
        st = obj.untyped_storage()
        nbytes = st.nbytes()
        found = _staging.locate(st.data_ptr(), nbytes) if nbytes else None
        if found is None:
            return None
        self.arenas[found[0].id] = found[0]
        return ("tensor", found[0].id, found[1], nbytes, str(obj.dtype).removeprefix("torch."),
                tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(), obj.requires_grad)


def dumps(obj: Any, arenas: bool = True) -> tuple[bytes, list[_staging._Arena]]:
    """obj pickled for a checkpoint process, and the arenas it refers to."""
    buf = io.BytesIO()
    p = _Pickler(buf, arenas)
    p.dump(obj)
    return buf.getvalue(), list(p.arenas.values())


def needs_restaging(state_dict: Any) -> bool:
    """Whether some staged tensor or ndarray of state_dict does not live in
    a shared arena (it would be pickled whole): then the state is staged
    again into shared memory before it is sent."""
    torch = sys.modules.get("torch")
    sources: list[Any] = []
    _staging._collect(state_dict, torch, sources)
    for src in sources:
        n = _staging._nbytes(src)
        if n == 0:
            continue
        if isinstance(src, np.ndarray):
            if not src.flags.c_contiguous or _staging.locate(_staging._address(src), n) is None:
                return True
        elif src.is_cuda or _staging.locate(_staging._address(src),
                                            src.untyped_storage().nbytes()) is None:
            return True
    return False


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, maps: dict[int, mmap.mmap]) -> None:
        super().__init__(file)
        self._maps = maps

    def persistent_load(self, pid: Any) -> Any:
        kind, aid, off = pid[0], pid[1], pid[2]
        buf = self._maps[aid]
        if kind == "ndarray":
            dtype, shape = np.dtype(pid[3]), pid[4]
            return np.ndarray(shape, dtype, buffer=buf, offset=off)
        import torch

        nbytes, dtype, shape, stride, storage_offset, requires_grad = pid[3:]
        raw = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=off))
        t = raw.view(getattr(torch, dtype)).as_strided(shape, stride, storage_offset)
        return t.requires_grad_(requires_grad) if requires_grad else t


# ---------------------------------------------------------------- the process


def _serve(conn: Connection) -> None:
    """The checkpoint process: join the group, then serve save requests
    until told to stop or the training process goes away."""
    import signal

    # Ctrl-C in the terminal reaches the whole process group: the training
    # process decides, and a checkpoint being written is finished first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    init = conn.recv()
    coord = None
    try:
        coord = _join(conn, init)
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - reported to the training process
        conn.send(("error", CheckpointException("checkpoint process",
                                                {init["rank"]: _wrap_exception(e)})))
        return
    maps: dict[int, mmap.mmap] = {}
    code = 0
    try:
        while True:
            try:
                req = conn.recv()
            except (EOFError, OSError):
                return  # the training process is gone
            if req is None:
                return
            for aid in req["drop"]:
                maps.pop(aid, None)
            if req["new"]:
                _, fds, _, _ = socket.recv_fds(sock, 1, len(req["new"]))
                for (aid, size), fd in zip(req["new"], fds):
                    try:
                        maps[aid] = mmap.mmap(fd, size, flags=mmap.MAP_SHARED
                                              | getattr(mmap, "MAP_POPULATE", 0))
                    finally:
                        os.close(fd)
            conn.send(_run_save(req, maps, coord, init["rank"]))
    except BaseException:  # noqa: BLE001 - a broken request stream: say why, then exit
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        if coord is not None and coord.use_dist:
            import torch.distributed as dist

            dist.destroy_process_group()
        # every file is written and closed: skip the interpreter's teardown
        # (seconds with torch loaded), which the training process waits for
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _join(conn: Connection, init: dict[str, Any]) -> _Coordinator:
    if init["world"] is None:
        return _Coordinator(None, False)
    import torch.distributed as dist

    timeout = timedelta(seconds=init["timeout"])
    if init["port"] is None:
        store = dist.TCPStore("0.0.0.0", 0, init["world"], is_master=True,
                              wait_for_workers=False, timeout=timeout)
        conn.send(("port", store.port))
    else:
        store = dist.TCPStore(init["addr"], init["port"], init["world"], is_master=False,
                              timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=init["rank"], world_size=init["world"],
                            timeout=timeout)
    return _Coordinator(None, True)


def _run_save(req: dict[str, Any], maps: dict[int, mmap.mmap], coord: _Coordinator,
              rank: int) -> tuple[str, Any]:
    from .state_dict_saver import _save_state_dict

    error: BaseException | None = req["error"][0] if req["error"] is not None else None
    state, writer, planner = {}, None, None
    if error is None:
        try:
            state, writer, planner = _Unpickler(io.BytesIO(req["payload"]), maps).load()
        except BaseException as e:  # noqa: BLE001 - the others must hear of it
            error = e
    try:
        return ("ok", _save_state_dict(state, writer, coord, planner, req["use_collectives"],
                                       error))
    except CheckpointException as e:
        return ("error", e)
    except BaseException as e:  # noqa: BLE001 - reported to the training process
        return ("error", CheckpointException("checkpoint process", {rank: _wrap_exception(e)}))
