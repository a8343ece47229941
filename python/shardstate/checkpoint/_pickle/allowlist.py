"""The restricted reader's allowlists and the inert stand-ins they hand out.

``_METADATA_GLOBALS`` (``.metadata``) and the narrower ``_PLAIN_GLOBALS``
(bytes items) map each admitted ``(module, name)`` to a stand-in: the
metadata classes to proxy types that only record their state
(``_ObjProxy``; torch's legacy ``TensorProperties`` to the current one's),
callables to objects that check their arguments and make inert values
(``_Call``), torch objects to names (``_TorchObj``), NumPy's reconstructors
to recorders of dtype, shape and bytes. No stand-in imports or runs
anything, and ``BUILD`` on a shared one is refused, so no shared object can
be mutated. ``build`` validates the graph and makes the real objects.

No torch or NumPy import; the allowlists are built once at import and never
change. Thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .errors import UnsafePickleError
from .names import (
    _DTYPE_NAMES,
    _LAYOUT_NAMES,
    _LEGACY_MOD,
    _MD_MOD,
    _MEMFMT_NAMES,
    _torch_module,
)

# --------------------------------------------------------------------------
# Nesting
# --------------------------------------------------------------------------

# The deepest nesting admitted: as csrc/core/ss_pickle.h's
# SS_PICKLE_DEPTH_MAX. Hashing a tuple (a dict key, a set member) recurses
# in C without a recursion guard: a tuple a million deep overflows the C
# stack. torch's .metadata nests about 10 deep; ``build`` admits 100.
_MAX_NEST = 1000


def _too_deep(x: tuple) -> bool:
    """Whether the tuple nests tuples more than ``_MAX_NEST`` deep (a tuple
    is 1 deep, one holding it 2). Iterative; each distinct tuple is walked
    once, so it costs less than hashing ``x``."""
    heights: dict[int, int] = {}
    stack: list[list[Any]] = [[x, iter(x), 0]]  # tuple, its items, highest child
    while stack:
        if len(stack) > _MAX_NEST:
            return True
        top = stack[-1]
        for y in top[1]:
            if type(y) is tuple:
                h = heights.get(id(y))
                if h is None:
                    stack.append([y, iter(y), 0])
                    break
                if len(stack) + h > _MAX_NEST:
                    return True
                top[2] = max(top[2], h)
        else:
            stack.pop()
            h = top[2] + 1
            heights[id(top[0])] = h
            if stack:
                stack[-1][2] = max(stack[-1][2], h)
    return False


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


# --------------------------------------------------------------------------
# Allowlisted callables: check the arguments, make inert values
# --------------------------------------------------------------------------

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
    if args and any(type(x) is tuple and _too_deep(x) for x in args[0]):
        raise UnsafePickleError(f"pickle calls builtins.set with a tuple nested deeper than "
                                f"{_MAX_NEST} levels")
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


# --------------------------------------------------------------------------
# The allowlists
# --------------------------------------------------------------------------


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
# config that holds a Path) as well as in .metadata (checkpoint_id, which
# every save writes; the fast path, fastread, admits the same names).
_PATH_CLASSES = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")
_PLAIN_GLOBALS = {
    **_plain_globals(),
    **{("pathlib", c): _Call(f"pathlib.{c}", _path_ctor(c)) for c in _PATH_CLASSES},
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
