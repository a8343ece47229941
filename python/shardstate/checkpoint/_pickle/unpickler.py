"""The restricted reader's engines: the C-scan gate and the reference unpickler.

``_unpickle(data, allowed, what)`` turns a pickle into a graph of inert
stand-ins, with ``find_class`` limited to ``allowed`` (an allowlist of
``allowlist``); nothing outside it is imported or called.

Two engines. The reference is CPython's pure-Python unpickler (its memo is
a dict, so a forged memo index cannot make it allocate gigabytes, as the C
unpickler's array memo can). A stream that the C scan ``_core.pickle_scan``
passes (no copyreg extensions, persistent ids or out-of-band buffers; memo
indices bounded by the opcodes before them; every length inside the data)
runs on CPython's C unpickler with the same allowlist instead, ten times
faster; whatever it fails on goes to the reference, whose outcome is the
answer.

Raises ``UnsafePickleError`` (a global or call outside the allowlist) or
``PickleFormatError`` (anything else wrong); nothing else escapes. No torch
import. Thread-safe.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import struct
from typing import Any

from ... import ShardstateError, _core
from .errors import PickleFormatError, UnsafePickleError

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

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._data = data
        self._allowed = allowed

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
        except (ValueError, ShardstateError):
            pass  # outside what the C unpickler may run: the reference decides
        else:
            try:
                return _CRestrictedUnpickler(data, allowed, proto).load()
            except Exception:  # noqa: BLE001 - the reference names the fault
                pass
    try:
        return _RestrictedUnpickler(data, allowed).load()
    except (UnsafePickleError, PickleFormatError):
        raise
    except RecursionError:
        raise PickleFormatError(f"{what} nests too deeply") from None
    except MemoryError:
        raise PickleFormatError(f"{what} needs too much memory to unpickle") from None
    except Exception as e:  # the pure-Python unpickler raises many types for bad bytes
        raise PickleFormatError(f"{what} is not a valid pickle: {type(e).__name__}: {e}") from None

