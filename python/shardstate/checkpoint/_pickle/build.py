"""The restricted reader's second pass: validate the graph of inert
stand-ins and build the real objects.

``_build(what, obj)`` walks what ``unpickler._unpickle`` made: exact types
only, no cycles, nesting bounded by ``_MAX_DEPTH``, every metadata class
with the fields it must have (fields of newer torch versions are dropped,
missing optional ones take their defaults, so older torch's files load).
It builds shardstate's metadata classes; torch objects (sizes, dtypes) when
torch is loaded, else tuples and ``TorchName``; NumPy arrays and scalars
from their bytes, never through numpy's unpickling code. Any fault raises
``PickleFormatError`` naming it.

``from_unpickled`` serves the trusted opt-in instead: what a plain
``pickle.loads`` gave, used as it is, only its ``Metadata`` made ours.

No torch import; thread-safe.
"""

from __future__ import annotations

import pathlib
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..._util import loaded_torch
from ..metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    TorchName,
    _StorageInfo,
)
from .allowlist import (
    _PROXIES,
    _EnumVal,
    _NdVal,
    _NpDtype,
    _NpScalar,
    _ObjProxy,
    _PathVal,
    _SizeVal,
    _TorchObj,
)
from .errors import PickleFormatError, UnsafePickleError

_MAX_DEPTH = 100


class _Fields:
    """The fields of one metadata class: all known names, and the required ones."""

    __slots__ = ("known", "required")

    def __init__(self, known: frozenset[str], required: tuple[str, ...]) -> None:
        self.known, self.required = known, required


_F_METADATA = _Fields(
    frozenset({'planner_data', 'state_dict_metadata', 'storage_data', 'storage_meta', 'version'}),
    ('state_dict_metadata',),
)
_F_TENSOR = _Fields(
    frozenset({'chunks', 'properties', 'size'}),
    ('properties', 'size', 'chunks'),
)
_F_PROPS = _Fields(
    frozenset({'dtype', 'layout', 'memory_format', 'pin_memory', 'requires_grad'}),
    (),
)
_F_CHUNK = _Fields(
    frozenset({'offsets', 'sizes'}),
    ('offsets', 'sizes'),
)
_F_BYTES = _Fields(
    frozenset(),
    (),
)
_F_INDEX = _Fields(
    frozenset({'fqn', 'index', 'offset'}),
    ('fqn',),
)
_F_STORAGE_META = _Fields(
    frozenset({'checkpoint_id', 'load_id', 'modules', 'save_id'}),
    (),
)
_F_STORAGE_INFO = _Fields(
    frozenset({'length', 'offset', 'relative_path', 'shardstate_crc32', 'transform_descriptors'}),
    ('relative_path', 'offset', 'length'),
)


class _Builder:
    def __init__(self, what: str) -> None:
        self.what = what
        self.done: dict[int, Any] = {}
        self.active: set[int] = set()
        self.torch = loaded_torch()

    def fail(self, msg: str) -> PickleFormatError:
        return PickleFormatError(f"{self.what}: {msg}")

    def torch_obj(self, v: _TorchObj) -> Any:
        if self.torch is not None:
            try:
                obj = TorchName(v.name).resolve()
            except AttributeError:
                raise self.fail(f"{v.name} does not exist in this torch") from None
            return obj
        return TorchName(v.name)

    def size(self, v: Any, what: str) -> Any:
        if type(v) is not _SizeVal:
            raise self.fail(f"{what} is {type(v).__name__}, expected a torch.Size")
        got = self.done.get(id(v))
        if got is None:
            got = self.torch.Size(v.dims) if self.torch is not None else v.dims
            self.done[id(v)] = got
        return got

    def value(self, v: Any, _unused: int = 0) -> Any:
        """Plain values, torch names and metadata objects; exact types only."""
        t = type(v)
        if v is None or t in (bool, int, float, complex, str, bytes):
            return v
        key = id(v)
        if key in self.done:
            return self.done[key]
        if key in self.active:
            raise self.fail("a value contains itself")
        if len(self.active) >= _MAX_DEPTH:
            raise self.fail(f"values nest deeper than {_MAX_DEPTH}")
        self.active.add(key)
        try:
            out = self._value(v, t, 0)
        finally:
            self.active.discard(key)
        self.done[key] = out
        return out

    def _value(self, v: Any, t: type, d: int) -> Any:
        build = _BUILDERS.get(t)
        if build is not None:  # a metadata class: the bulk of a .metadata
            return build(self, v)
        if t is tuple:
            items = tuple(self.value(x, d) for x in v)
            return v if all(a is b for a, b in zip(items, v)) else items
        if t is list:
            v[:] = [self.value(x, d) for x in v]
            return v
        if t is dict or t is OrderedDict:
            out = t()
            for k, x in v.items():
                k2 = self.value(k, d)
                try:
                    out[k2] = self.value(x, d)
                except TypeError:
                    raise self.fail(f"unhashable dict key {type(k2).__name__}") from None
            return out
        if t is set or t is frozenset:
            try:
                return t(self.value(x, d) for x in v)
            except TypeError:
                raise self.fail("unhashable set element") from None
        if t is bytearray:
            return bytearray(v)
        if t is slice:
            return slice(*(self.value(x, d) for x in (v.start, v.stop, v.step)))
        if t is _TorchObj:
            return self.torch_obj(v)
        if t is _SizeVal:
            return self.size(v, "value")
        if t is _EnumVal:
            return _MEM_FORMAT_ENCODING(v.value)
        if t is _PathVal:
            return path_class(v.cls)(*v.parts)
        if t is _NdVal:
            return self.ndarray(v)
        if t is _NpScalar:
            return self.np_dtype(v.dtype).type(self.np_array(v.raw, v.dtype, (), False))
        raise self.fail(f"unexpected {t.__module__}.{t.__qualname__} in the pickle")

    # ---- numpy ----

    def np_dtype(self, d: Any) -> Any:
        import numpy as np

        st = d.state if type(d) is _NpDtype else None
        if not (type(st) is tuple and len(st) == 8 and st[0] == 3 and st[1] in ("<", ">", "|", "=")
                and st[2:5] == (None, None, None)):
            raise self.fail("numpy dtype state is not that of a plain numeric dtype")
        return np.dtype(d.name).newbyteorder(st[1] if st[1] in "<>" else "=")

    def np_array(self, raw: Any, d: Any, shape: tuple[int, ...], fortran: bool) -> Any:
        import numpy as np

        dt = self.np_dtype(d)
        if type(raw) is not bytes:
            raise self.fail("numpy array data is not bytes")
        n = 1
        for s in shape:
            n *= s
        if len(raw) != n * dt.itemsize:
            raise self.fail(f"numpy array of shape {shape} {dt} has {len(raw)} bytes of data")
        arr = np.frombuffer(raw, dtype=dt).reshape(shape, order="F" if fortran else "C")
        return arr.copy(order="K") if shape else arr.reshape(())[()]

    def ndarray(self, v: _NdVal) -> Any:
        st = v.state
        if not (type(st) is tuple and len(st) == 5 and st[0] == 1 and type(st[3]) is bool):
            raise self.fail("numpy array state is not (1, shape, dtype, fortran, data)")
        shape = st[1]
        if type(shape) is not tuple or not all(type(s) is int and s >= 0 for s in shape):
            raise self.fail("numpy array shape is not a tuple of non-negative ints")
        import numpy as np

        if not shape:
            return np.array(self.np_array(st[4], st[2], (), st[3]), dtype=self.np_dtype(st[2]))
        return self.np_array(st[4], st[2], shape, st[3])

    # ---- the metadata classes ----

    def state(self, p: _ObjProxy, fields: _Fields) -> dict:
        """The proxy's BUILD dict, checked: known keys only; fields marked
        True are required."""
        st = p.state
        if type(st) is dict:
            st = dict(st)  # the builders replace values; never touch the unpickled dict
        elif st is None:
            st = {}
        elif (type(st) is tuple and len(st) == 2
                and type(st[0]) in (dict, type(None)) and type(st[1]) in (dict, type(None))):
            st = {**(st[0] or {}), **(st[1] or {})}  # (dict state, slot state)
        else:
            raise self.fail(f"{_short(p)} state is {type(st).__name__}, expected a dict")
        if not st.keys() <= fields.known:  # unknown fields (newer torch?) are dropped
            st = {k: v for k, v in st.items() if type(k) is str and k in fields.known}
        for k in fields.required:
            if k not in st:
                raise self.fail(f"{_short(p)} has no {k!r}")
        return st

    @staticmethod
    def new(cls: type, state: dict) -> Any:
        o = object.__new__(cls)
        o.__dict__.update(state)
        return o

    def _build_Metadata(self, p: _ObjProxy) -> Metadata:
        st = self.state(p, _F_METADATA)
        sdm = st["state_dict_metadata"]
        if type(sdm) is not dict:
            raise self.fail("state_dict_metadata is not a dict")
        out = {}
        for k, v in sdm.items():
            if type(k) is not str:
                raise self.fail(f"state_dict_metadata key {k!r} is not a str")
            if type(v) not in (_PROXIES["TensorStorageMetadata"], _PROXIES["BytesStorageMetadata"]):
                raise self.fail(f"state_dict_metadata[{k!r}] is {type(v).__name__}, expected "
                                "TensorStorageMetadata or BytesStorageMetadata")
            out[k] = self.value(v)
        st["state_dict_metadata"] = out
        for k in ("planner_data", "storage_data"):
            if k in st:
                st[k] = self.value(st[k])
        sm = st.get("storage_meta")
        if sm is not None and type(sm) is not _PROXIES["StorageMeta"]:
            raise self.fail(f"storage_meta is {type(sm).__name__}, expected StorageMeta")
        if sm is not None:
            st["storage_meta"] = self.value(sm)
        if type(st.get("version")) not in (str, type(None)):
            raise self.fail("version is not a str")
        return self.new(Metadata, st)

    def _build_TensorStorageMetadata(self, p: _ObjProxy) -> TensorStorageMetadata:
        st = self.state(p, _F_TENSOR)
        if type(st["properties"]) is not _PROXIES["TensorProperties"]:
            raise self.fail("TensorStorageMetadata.properties is not TensorProperties")
        st["properties"] = self.value(st["properties"])
        st["size"] = self.size(st["size"], "TensorStorageMetadata.size")
        chunks = st["chunks"]
        if type(chunks) is not list or not all(
            type(c) is _PROXIES["ChunkStorageMetadata"] for c in chunks
        ):
            raise self.fail("TensorStorageMetadata.chunks is not a list of ChunkStorageMetadata")
        st["chunks"] = self.value(chunks)
        size = st["size"]
        for c in st["chunks"]:
            # A chunk outside the tensor loads into the wrong place, or nowhere
            # (a load then leaves the destination untouched, with no error).
            # An empty chunk may sit anywhere (torch places some at the end).
            if len(c.offsets) != len(size) or not all(
                o >= 0 and n >= 0 and (n == 0 or o + n <= s)
                for o, n, s in zip(c.offsets, c.sizes, size)
            ):
                raise self.fail(f"a chunk at {tuple(c.offsets)} of {tuple(c.sizes)} lies outside "
                                f"its tensor of size {tuple(size)}")
        return self.new(TensorStorageMetadata, st)

    def _build_TensorProperties(self, p: _ObjProxy) -> TensorProperties:
        st = p.state
        if type(st) is tuple and len(st) == 5:
            st = dict(zip(("dtype", "layout", "requires_grad", "memory_format", "pin_memory"), st))
        else:  # older torch: a plain __dict__
            st = self.state(p, _F_PROPS)
        out: dict[str, Any] = {}
        for k, kind in (("dtype", "dtype"), ("layout", "layout")):
            if k in st:
                v = st[k]
                if type(v) is not _TorchObj or v.kind != kind:
                    raise self.fail(f"TensorProperties.{k} is not a torch {kind}")
                out[k] = self.torch_obj(v)
        for k in ("requires_grad", "pin_memory"):
            if k in st:
                if type(st[k]) is not bool:
                    raise self.fail(f"TensorProperties.{k} is not a bool")
                out[k] = st[k]
        if "memory_format" in st:
            v = st["memory_format"]
            if type(v) is _EnumVal:
                v = _TorchObj(("torch.contiguous_format", "torch.channels_last",
                               "torch.preserve_format")[v.value], "memory_format")
            if type(v) is not _TorchObj or v.kind != "memory_format":
                raise self.fail("TensorProperties.memory_format is not a memory format")
            out["memory_format"] = self.torch_obj(v)
        props = TensorProperties.__new__(TensorProperties)
        defaults = TensorProperties()
        props.__dict__.update({**defaults.__dict__, **out})
        return props

    def _build_ChunkStorageMetadata(self, p: _ObjProxy) -> ChunkStorageMetadata:
        st = self.state(p, _F_CHUNK)
        st["offsets"] = self.size(st["offsets"], "ChunkStorageMetadata.offsets")
        st["sizes"] = self.size(st["sizes"], "ChunkStorageMetadata.sizes")
        if len(st["offsets"]) != len(st["sizes"]):
            raise self.fail("ChunkStorageMetadata offsets and sizes differ in length")
        return self.new(ChunkStorageMetadata, st)

    def _build_BytesStorageMetadata(self, p: _ObjProxy) -> BytesStorageMetadata:
        self.state(p, _F_BYTES)
        return BytesStorageMetadata()

    def _build_MetadataIndex(self, p: _ObjProxy) -> MetadataIndex:
        st = self.state(p, _F_INDEX)
        if type(st["fqn"]) is not str:
            raise self.fail("MetadataIndex.fqn is not a str")
        if st.get("offset") is not None:
            st["offset"] = self.size(st["offset"], "MetadataIndex.offset")
        if type(st.get("index")) not in (int, type(None)):
            raise self.fail("MetadataIndex.index is not an int")
        return self.new(MetadataIndex, st)

    def _build_StorageMeta(self, p: _ObjProxy) -> StorageMeta:
        st = self.state(p, _F_STORAGE_META)
        st = {k: self.value(v) for k, v in st.items()}
        cid = st.get("checkpoint_id")
        if cid is not None and not isinstance(cid, (str, pathlib.PurePath)):
            raise self.fail("StorageMeta.checkpoint_id is not a str or path")
        for k in ("save_id", "load_id"):
            if type(st.get(k)) not in (str, type(None)):
                raise self.fail(f"StorageMeta.{k} is not a str")
        mods = st.setdefault("modules", [])
        if type(mods) is not list or not all(type(m) is str for m in mods):
            raise self.fail("StorageMeta.modules is not a list of str")
        return self.new(StorageMeta, st)

    def _build_StorageInfo(self, p: _ObjProxy) -> _StorageInfo:
        st = self.state(p, _F_STORAGE_INFO)
        if type(st["relative_path"]) is not str:
            raise self.fail("_StorageInfo.relative_path is not a str")
        for k in ("offset", "length"):
            if type(st[k]) is not int or st[k] < 0:
                raise self.fail(f"_StorageInfo.{k} is not a non-negative int")
        td = st.get("transform_descriptors")
        if td is not None:
            if type(td) not in (list, tuple) or not all(type(x) is str for x in td):
                raise self.fail("_StorageInfo.transform_descriptors is not a list of str")
        crc = st.get("shardstate_crc32")  # shardstate's binding of metadata to data (_records)
        if crc is not None and (type(crc) is not int or not 0 <= crc < 1 << 32):
            raise self.fail("_StorageInfo.shardstate_crc32 is not a 32-bit unsigned int")
        return self.new(_StorageInfo, st)


def path_class(name: str) -> type:
    """The class a pickled ``pathlib.<name>`` is made as here: the concrete
    class of another platform (a WindowsPath read on Linux) becomes its pure
    form, ``Path`` this platform's concrete class (the fast path, fastread,
    makes the same)."""
    cls = getattr(pathlib, name)
    if name in ("WindowsPath", "Path") and sys.platform != "win32":
        cls = pathlib.PureWindowsPath if name == "WindowsPath" else pathlib.PosixPath
    if name == "PosixPath" and sys.platform == "win32":
        cls = pathlib.PurePosixPath
    return cls


def _short(p: _ObjProxy) -> str:
    return p.qualname.rsplit(".", 1)[1]


# proxy type -> its _Builder method
_BUILDERS: dict[type, Callable[[_Builder, Any], Any]] = {
    t: getattr(_Builder, f"_build_{name.lstrip('_')}") for name, t in _PROXIES.items()
}


def _build(what: str, obj: Any) -> Any:
    try:
        return _Builder(what).value(obj)
    except (UnsafePickleError, PickleFormatError):
        raise
    except (TypeError, ValueError, AttributeError, KeyError, RecursionError) as e:
        raise PickleFormatError(f"{what}: malformed objects: {type(e).__name__}: {e}") from None




_METADATA_FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta",
                    "version")


def from_unpickled(obj: Any) -> Metadata:
    """What a plain ``pickle.loads`` of ``.metadata`` gave (the trusted
    opt-in), as a :class:`Metadata`: ours as it is, torch's (any class named
    Metadata) made ours field by field, fields older torch did not write
    left at their defaults. Everything in it (torch's classes, the legacy
    TensorProperties, a user's classes in planner_data) is used as it is:
    shardstate's readers and planners accept torch's classes."""
    if isinstance(obj, Metadata):
        return obj
    if type(obj).__name__ != "Metadata":
        raise PickleFormatError(f".metadata holds a {type(obj).__name__}, not a Metadata")
    fields = getattr(obj, "__dict__", {})
    if "state_dict_metadata" not in fields:
        raise PickleFormatError(".metadata's Metadata has no state_dict_metadata")
    return Metadata(**{k: fields[k] for k in _METADATA_FIELDS if k in fields})
