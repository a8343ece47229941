"""The restricted reader's engines: the C-scan gate and the reference unpickler.

``_unpickle(data, allowed, what)`` turns a pickle into a graph of inert
stand-ins, with ``find_class`` limited to ``allowed`` (an allowlist of
``allowlist``); nothing outside it is imported or called.

Two engines. The reference is CPython's pure-Python unpickler (its memo is
a dict, so a forged memo index cannot make it allocate gigabytes, as the C
unpickler's array memo can). A stream that the C scan ``_core.pickle_scan``
passes (no copyreg extensions, persistent ids or out-of-band buffers; memo
indices bounded by the opcodes before them; every length inside the data;
no opcode across the end of its FRAME, which the C unpickler would read
otherwise)
runs on CPython's C unpickler with the same allowlist instead, ten times
faster; whatever it fails on goes to the reference, whose outcome is the
answer.

Bounds, in both engines (the scan's in C, the reference's here, with the
same limits, so both give the same answer): no tuple used as a dict key
or set member nests deeper than ``allowlist._MAX_NEST`` (1000; hashing a
deeper one would overflow the C stack: the scan bounds every value as it
is built, the reference each key before it is hashed); a memo index is at
most the number of entries stored before it (picklers number them 0, 1,
2, ...); DUP, which no pickler writes, adds at most as many values as the
stream's other bytes plus ``_DUP_SLACK``, so every value built is paid for
by a byte of the stream (a 30 MB stream cannot DUP a 30M-element list).

Raises ``UnsafePickleError`` (a global or call outside the allowlist) or
``PickleFormatError`` (anything else wrong); nothing else escapes. No torch
import. Thread-safe.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import struct
from collections.abc import Callable
from typing import Any

from ... import ShardstateError, _core
from .allowlist import _MAX_NEST, _too_deep
from .errors import PickleFormatError, UnsafePickleError

# DUPs admitted beyond the stream's other bytes: as ss_pickle.h's
# SS_PICKLE_DUP_SLACK.
_DUP_SLACK = 65536

# --------------------------------------------------------------------------
# The two engines: the C unpickler behind the scan, and the reference
# --------------------------------------------------------------------------


def _refuse_ext(self: Any) -> None:
    raise UnsafePickleError("pickle uses a copyreg extension code (EXT1/EXT2/EXT4)")


def _refuse_persistent(self: Any, pid: Any) -> Any:
    raise UnsafePickleError("pickle uses a persistent id (BINPERSID), which is not allowed")


def _find_class(allowed: dict[tuple[str, str], Any], proto: int, module: str, name: str) -> Any:
    """The stand-in for an allowlisted global (names of protocols < 3
    mapped as pickle maps them); UnsafePickleError for any other."""
    key = (module, name)
    if proto < 3:
        if key in _compat_pickle.NAME_MAPPING:
            key = _compat_pickle.NAME_MAPPING[key]
        elif module in _compat_pickle.IMPORT_MAPPING:
            key = (_compat_pickle.IMPORT_MAPPING[module], name)
    obj = allowed.get(key) if type(module) is str and type(name) is str else None
    if obj is None:
        raise UnsafePickleError(
            f"pickle references {module}.{name}, which is not on the allowlist of "
            "checkpoint metadata classes, torch dtypes/sizes and plain Python values"
        )
    return obj


class _RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _refuse_ext
    del _op

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any],
                 what: str = "pickle") -> None:
        super().__init__(io.BytesIO(data))
        self._data = data
        self._allowed = allowed
        self._what = what
        self._dups = 0

    # ---- bounds (see the module docstring) ----

    def _refuse_deep(self, keys: Any) -> None:
        for k in keys:
            if type(k) is tuple and _too_deep(k):
                raise PickleFormatError(f"{self._what} nests deeper than {_MAX_NEST} levels "
                                        "(a tuple used as a dict key or set member)")

    def _hashing(op: bytes, keys: Callable[[list[Any]], Any]) -> Callable[[Any], None]:
        load = pickle._Unpickler.dispatch[op[0]]  # type: ignore[attr-defined]

        def checked(self: Any) -> None:
            self._refuse_deep(keys(self.stack))
            load(self)

        return checked

    # the frame above the mark, or the top of the stack: what will be hashed
    dispatch[pickle.SETITEM[0]] = _hashing(pickle.SETITEM, lambda s: s[-2:-1])
    dispatch[pickle.SETITEMS[0]] = _hashing(pickle.SETITEMS, lambda s: s[0::2])
    dispatch[pickle.DICT[0]] = _hashing(pickle.DICT, lambda s: s[0::2])
    dispatch[pickle.ADDITEMS[0]] = _hashing(pickle.ADDITEMS, lambda s: s)
    dispatch[pickle.FROZENSET[0]] = _hashing(pickle.FROZENSET, lambda s: s)
    del _hashing

    def _memo_put(self, i: int) -> None:
        if i > len(self.memo):
            raise PickleFormatError(f"{self._what}: memo index {i} out of bounds (at most "
                                    f"{len(self.memo)} here)")
        self.memo[i] = self.stack[-1]

    def _load_put(self) -> None:
        i = int(self.readline()[:-1])
        if i < 0:
            raise ValueError("negative PUT argument")
        self._memo_put(i)

    def _load_binput(self) -> None:
        self._memo_put(self.read(1)[0])

    def _load_long_binput(self) -> None:
        (i,) = struct.unpack("<I", self.read(4))
        self._memo_put(i)

    dispatch[pickle.PUT[0]] = _load_put
    dispatch[pickle.BINPUT[0]] = _load_binput
    dispatch[pickle.LONG_BINPUT[0]] = _load_long_binput

    def _load_dup(self) -> None:
        self._dups += 1
        if 2 * self._dups > self._tell() + _DUP_SLACK:
            raise PickleFormatError(f"{self._what}: {self._dups} DUPs in {self._tell()} bytes: "
                                    "more values than the stream holds")
        self.append(self.stack[-1])

    dispatch[pickle.DUP[0]] = _load_dup

    def find_class(self, module: str, name: str) -> Any:
        return _find_class(self._allowed, self.proto, module, name)

    def _skip_frame(self) -> None:
        # A FRAME only announces how many bytes follow; they are read inline.
        (n,) = struct.unpack("<Q", self.read(8))
        if n > len(self._data):
            raise PickleFormatError(f"FRAME of {n} bytes in a {len(self._data)}-byte pickle")

    dispatch[pickle.FRAME[0]] = _skip_frame

    def _load_bytearray8(self) -> None:
        # pickle.py allocates the announced length before reading: a forged
        # one would make it allocate (and zero) up to sys.maxsize bytes.
        (n,) = struct.unpack("<Q", self.read(8))
        if n > len(self._data):
            raise PickleFormatError(
                f"BYTEARRAY8 of {n} bytes in a {len(self._data)}-byte pickle")
        b = self.read(n)
        if len(b) != n:
            raise PickleFormatError("pickle data was truncated")
        self.append(bytearray(b))

    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8

    def load(self) -> Any:
        """pickle._Unpickler.load, reading the in-memory bytes directly (no
        per-read frame bookkeeping: frames are skipped, see _skip_frame)."""
        f = io.BytesIO(self._data)
        self.read = read = f.read
        self.readinto = f.readinto
        self.readline = f.readline
        self._tell = f.tell
        self.metastack = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        dispatch = self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError("pickle data was truncated")
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    persistent_load = _refuse_persistent


class _CRestrictedUnpickler(pickle.Unpickler):
    """CPython's C unpickler with the same allowlist, for streams that
    ``_core.pickle_scan`` has passed: the scan refuses what this unpickler
    would handle differently from ``_RestrictedUnpickler`` (copyreg
    extensions, persistent ids, out-of-band buffers) and bounds every memo
    index by the opcodes before it, so its array memo stays linear in the
    data. About ten times faster on a large ``.metadata``."""

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any], proto: int) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._proto = proto  # the scan admits PROTO only as the first opcode

    def find_class(self, module: str, name: str) -> Any:
        return _find_class(self._allowed, self._proto, module, name)

    persistent_load = _refuse_persistent  # refused by the scan already


def _unpickle(data: bytes, allowed: dict[tuple[str, str], Any], what: str,
              fast: bool = True) -> Any:
    """The pickle's object graph of inert stand-ins. A stream the C scan
    passes runs on the C unpickler; any other stream, and any stream the C
    unpickler fails on, on the pure-Python reference, whose outcome (value
    or error) is the answer. ``fast=False``: the reference only (tests)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise PickleFormatError(f"{what} is empty")
    if fast:
        try:
            proto, _end = _core.pickle_scan(data)
        except (ValueError, ShardstateError, MemoryError):
            pass  # outside what the C unpickler may run: the reference decides
        else:
            try:
                return _CRestrictedUnpickler(data, allowed, proto).load()
            except Exception:  # noqa: BLE001 - the reference names the fault
                pass
    try:
        return _RestrictedUnpickler(data, allowed, what).load()
    except (UnsafePickleError, PickleFormatError):
        raise
    except RecursionError:
        raise PickleFormatError(f"{what} nests too deeply") from None
    except MemoryError:
        raise PickleFormatError(f"{what} needs too much memory to unpickle") from None
    except Exception as e:  # the pure-Python unpickler raises many types for bad bytes
        raise PickleFormatError(f"{what} is not a valid pickle: {type(e).__name__}: {e}") from None

