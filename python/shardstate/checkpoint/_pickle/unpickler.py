"""The restricted reader: allowlists, inert stand-ins, the C-scan gate and
the reference unpickler.

``_unpickle(data, allowed, what)`` turns a pickle into a graph of inert
stand-ins, with ``find_class`` limited to an allowlist (``_METADATA_GLOBALS``
for ``.metadata``, the narrower ``_PLAIN_GLOBALS`` for bytes items). Every
allowlisted global is replaced by a stand-in: the metadata classes by proxy
types that only record their state (``_ObjProxy``), callables by objects
that check their arguments (``_Call``), torch objects by names
(``_TorchObj``). Nothing outside the allowlist is imported or called, and
no shared object can be mutated by ``BUILD``. ``build`` validates the graph
and makes the real objects.

Two engines. The reference is CPython's pure-Python unpickler (its memo is
a dict, so a forged memo index cannot make it allocate gigabytes, as the C
unpickler's array memo can). A stream that the C scan ``_core.pickle_scan``
passes (no copyreg extensions, persistent ids or out-of-band buffers; memo
indices bounded by the opcodes before them; every length inside the data)
runs on CPython's C unpickler with the same allowlist instead, ten times
faster; whatever it fails on goes to the reference, whose outcome is the
answer.

Errors: ``UnsafePickleError`` names a global or a call outside the
allowlist; ``PickleFormatError`` is anything else wrong with the bytes. Both
subclass ``shardstate.ShardstateError`` and ``pickle.UnpicklingError``.

No torch import; the allowlists are built once at import. Thread-safe.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ... import ShardstateError, _core
from .names import (
    _DTYPE_NAMES,
    _LAYOUT_NAMES,
    _LEGACY_MOD,
    _MD_MOD,
    _MEMFMT_NAMES,
    _torch_module,
)


class UnsafePickleError(ShardstateError, pickle.UnpicklingError):
    """A pickle names a global, or calls something, outside the allowlist."""


class PickleFormatError(ShardstateError, pickle.UnpicklingError):
    """Bytes that are not a well-formed pickle of the expected objects."""


# --------------------------------------------------------------------------
# Inert stand-ins
# --------------------------------------------------------------------------


class _Inert:
    """Base of every object the unpickler hands out: ``BUILD`` on it is refused."""

    __slots__ = ()
    _what = "object"

    def __setstate__(self, *state: Any) -> None:
        raise UnsafePickleError(f"pickle tries to BUILD (set the state of) {self._what}")

    def __reduce__(self) -> Any:
        raise TypeError(f"{type(self).__name__} cannot be pickled")


class _TorchObj(_Inert):
    """A torch dtype, layout or memory format, by name."""

    __slots__ = ("name", "kind")

    def __init__(self, name: str, kind: str) -> None:
        self.name, self.kind = name, kind

    @property
    def _what(self) -> str:  # type: ignore[override]
        return self.name


class _SizeVal(_Inert):
    """A torch.Size read from the pickle."""

    __slots__ = ("dims",)
    _what = "a torch.Size"

    def __init__(self, dims: tuple[int, ...]) -> None:
        self.dims = dims


class _EnumVal(_Inert):
    __slots__ = ("value",)
    _what = "a _MEM_FORMAT_ENCODING member"

    def __init__(self, value: int) -> None:
        self.value = value


class _PathVal(_Inert):
    __slots__ = ("cls", "parts")
    _what = "a path"

    def __init__(self, cls: str, parts: tuple[str, ...]) -> None:
        self.cls, self.parts = cls, parts


class _Call(_Inert):
    """An allowlisted callable: checks its arguments, then builds the value."""

    __slots__ = ("qualname", "fn")

    def __init__(self, qualname: str, fn: Callable[..., Any]) -> None:
        self.qualname, self.fn = qualname, fn

    @property
    def _what(self) -> str:  # type: ignore[override]
        return self.qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise UnsafePickleError(f"pickle calls {self.qualname} with keyword arguments")
        try:
            return self.fn(*args)
        except (TypeError, ValueError, OverflowError) as e:
            raise UnsafePickleError(
                f"pickle calls {self.qualname} with unexpected arguments: {e}"
            ) from None


class _ObjProxy:
    """Instances of the metadata classes, as created by NEWOBJ and BUILD."""

    __slots__ = ("state", "built")
    qualname = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> _ObjProxy:
        if args or kwargs:
            raise UnsafePickleError(f"pickle constructs {cls.qualname} with arguments {args!r}")
        self = object.__new__(cls)
        self.state = None
        self.built = False
        return self

    def __setstate__(self, state: Any = None, *extra: Any) -> None:
        if not isinstance(self, _ObjProxy) or extra:
            raise UnsafePickleError("pickle tries to BUILD a metadata class itself")
        if self.built:
            raise UnsafePickleError(f"pickle sets the state of one {self.qualname} twice")
        self.state, self.built = state, True

    def __reduce__(self) -> Any:
        raise TypeError("proxies cannot be pickled")


def _proxy_type(qualname: str) -> type[_ObjProxy]:
    return type(f"_{qualname.rsplit('.', 1)[1]}Proxy", (_ObjProxy,),
                {"__slots__": (), "qualname": qualname})


_PROXIES = {
    name: _proxy_type(f"{_torch_module(name)}.{name}")
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                 "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_StorageInfo")
}


_INT_ONLY = frozenset({int})


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if type(v) is tuple:
        if not v or set(map(type, v)) <= _INT_ONLY:
            return v
    elif type(v) is list and set(map(type, v)) <= _INT_ONLY:
        return tuple(v)
    raise TypeError(f"{what} takes a tuple of ints, got {type(v).__name__}")


def _size_ctor(*args: Any) -> _SizeVal:
    if len(args) == 1:
        return _SizeVal(_ints(args[0], "torch.Size"))
    if args:
        raise TypeError(f"{len(args)} arguments")
    return _SizeVal(())


def _layout_ctor(name: Any) -> _TorchObj:
    if type(name) is not str or name not in _LAYOUT_NAMES:
        raise ValueError(f"unknown layout {name!r}")
    return _TorchObj(name, "layout")


def _enum_ctor(value: Any) -> _EnumVal:
    if type(value) is not int or value not in (0, 1, 2):
        raise ValueError(f"no member {value!r}")
    return _EnumVal(value)


def _path_ctor(cls: str) -> Callable[..., _PathVal]:
    def make(*parts: Any) -> _PathVal:
        if not all(type(p) is str for p in parts):
            raise TypeError("path parts must be str")
        return _PathVal(cls, parts)

    return make


def _codecs_encode(s: Any, encoding: Any = "utf-8") -> bytes:
    if type(s) is not str or encoding not in ("latin1", "latin-1"):
        raise TypeError("only _codecs.encode(str, 'latin1') (protocol-2 bytes) is allowed")
    return s.encode("latin1")


def _bytes_ctor(*args: Any) -> bytes:
    if args == ():
        return b""
    if len(args) == 1 and type(args[0]) is bytes:
        return args[0]
    if len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1"):
        return args[0].encode("latin1")
    raise TypeError("bytes() from anything but bytes or a latin-1 str is refused")


def _bytearray_ctor(*args: Any) -> bytearray:
    return bytearray(_bytes_ctor(*args))


def _set_ctor(*args: Any) -> set:
    if len(args) > 1 or (args and type(args[0]) not in (list, tuple)):
        raise TypeError("set() takes one list")
    return set(args[0]) if args else set()


def _frozenset_ctor(*args: Any) -> frozenset:
    return frozenset(_set_ctor(*args))


def _complex_ctor(*args: Any) -> complex:
    if len(args) > 2 or not all(type(a) in (int, float) for a in args):
        raise TypeError("complex() takes up to two numbers")
    return complex(*args)


def _slice_ctor(*args: Any) -> slice:
    if len(args) > 3 or not all(a is None or type(a) is int for a in args):
        raise TypeError("slice() takes up to three ints or None")
    return slice(*args)


def _odict_ctor(*args: Any) -> OrderedDict:
    if args and not (len(args) == 1 and type(args[0]) is list and not args[0]):
        if args != ((),):
            raise TypeError("OrderedDict() is built empty, then filled")
    return OrderedDict()


# ---- NumPy arrays and scalars (as pickled by numpy: _reconstruct + BUILD) ----

_NP_DTYPES = frozenset(
    ["b1", "f2", "f4", "f8", "c8", "c16"] + [f"{k}{n}" for k in "iu" for n in (1, 2, 4, 8)]
)


class _NpMarker(_Inert):
    __slots__ = ()
    _what = "numpy.ndarray"


_NDARRAY = _NpMarker()


class _NpDtype(_Inert):
    """numpy.dtype(name, align, copy), then BUILD with its 8-tuple state."""

    __slots__ = ("name", "state")
    _what = "a numpy dtype"

    def __init__(self, name: str) -> None:
        self.name, self.state = name, None

    def __setstate__(self, *state: Any) -> None:
        if len(state) != 1 or self.state is not None:
            raise UnsafePickleError("pickle sets the state of a numpy dtype twice")
        self.state = state[0]


class _NdVal(_Inert):
    """numpy's _reconstruct(ndarray, (0,), b'b'), then BUILD with the array state."""

    __slots__ = ("state",)
    _what = "a numpy array"

    def __init__(self) -> None:
        self.state = None

    def __setstate__(self, *state: Any) -> None:
        if len(state) != 1 or self.state is not None:
            raise UnsafePickleError("pickle sets the state of a numpy array twice")
        self.state = state[0]


class _NpScalar(_Inert):
    __slots__ = ("dtype", "raw")
    _what = "a numpy scalar"

    def __init__(self, dtype: _NpDtype, raw: bytes) -> None:
        self.dtype, self.raw = dtype, raw


def _np_dtype_ctor(name: Any, align: Any = False, copy: Any = True) -> _NpDtype:
    if type(name) is not str or name not in _NP_DTYPES or type(align) is not bool:
        raise ValueError(f"numpy dtype {name!r} is not a plain numeric dtype")
    return _NpDtype(name)


def _np_reconstruct(cls: Any, shape: Any, code: Any) -> _NdVal:
    if cls is not _NDARRAY or type(code) is not bytes:
        raise TypeError("only numpy.ndarray is reconstructed")
    return _NdVal()


def _np_scalar(dtype: Any, raw: Any = None) -> _NpScalar:
    if type(dtype) is not _NpDtype or type(raw) is not bytes:
        raise TypeError("scalar(dtype, bytes) expected")
    return _NpScalar(dtype, raw)


def _np_globals() -> dict[tuple[str, str], Any]:
    g: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): _NDARRAY,
        ("numpy", "dtype"): _Call("numpy.dtype", _np_dtype_ctor),
    }
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        g[(mod, "_reconstruct")] = _Call(f"{mod}._reconstruct", _np_reconstruct)
        g[(mod, "scalar")] = _Call(f"{mod}.scalar", _np_scalar)
    return g


def _plain_globals() -> dict[tuple[str, str], Any]:
    g: dict[tuple[str, str], Any] = {
        ("builtins", "set"): _Call("builtins.set", _set_ctor),
        ("builtins", "frozenset"): _Call("builtins.frozenset", _frozenset_ctor),
        ("builtins", "complex"): _Call("builtins.complex", _complex_ctor),
        ("builtins", "slice"): _Call("builtins.slice", _slice_ctor),
        ("builtins", "bytes"): _Call("builtins.bytes", _bytes_ctor),
        ("builtins", "bytearray"): _Call("builtins.bytearray", _bytearray_ctor),
        ("_codecs", "encode"): _Call("_codecs.encode", _codecs_encode),
        ("collections", "OrderedDict"): _Call("collections.OrderedDict", _odict_ctor),
        ("torch", "Size"): _Call("torch.Size", _size_ctor),
    }
    for n in _DTYPE_NAMES:
        g[("torch", n)] = _TorchObj(f"torch.{n}", "dtype")
    for n in _MEMFMT_NAMES:
        g[("torch", n.removeprefix("torch."))] = _TorchObj(n, "memory_format")
        g[("torch._utils", n)] = _TorchObj(n, "memory_format")
    g.update(_np_globals())
    return g


# Pure paths are inert values: admitted in bytes items (torch.save of a
# config that holds a Path) as well as in .metadata (checkpoint_id).
_PLAIN_GLOBALS = {
    **_plain_globals(),
    **{("pathlib", c): _Call(f"pathlib.{c}", _path_ctor(c))
       for c in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")},
}
_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **_PLAIN_GLOBALS,
    **{(_torch_module(n), n): p for n, p in _PROXIES.items()},
    (_MD_MOD, "_MEM_FORMAT_ENCODING"): _Call(f"{_MD_MOD}._MEM_FORMAT_ENCODING", _enum_ctor),
    # older torch's TensorProperties: read as the current one
    (_LEGACY_MOD, "TensorProperties"): _PROXIES["TensorProperties"],
    (_LEGACY_MOD, "MEM_FORMAT_ENCODING"): _Call(f"{_LEGACY_MOD}.MEM_FORMAT_ENCODING",
                                                 _enum_ctor),
    ("torch.serialization", "_get_layout"): _Call("torch.serialization._get_layout", _layout_ctor),
}


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

