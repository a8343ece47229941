"""``.metadata`` and bytes items: a torch-free pickle writer and a restricted unpickler.

Writing. ``dumps_metadata`` emits the protocol-4 pickle that torch's
``FileSystemWriter`` writes with ``pickle.dump(metadata)`` (docs/FORMAT.md,
section 7), naming torch's classes by their import paths, without importing
torch's checkpoint package. The reference is a small opcode writer that
reproduces CPython's C pickler (memo by object identity, ``FRAME`` s of
64 KiB, batches of 1000), so the output is byte-identical to ``pickle.dumps``
of the equivalent torch objects whenever the two object graphs share the same
objects (see ``dumps_metadata``); it needs no torch at all. When torch is
loaded, the fast path rebuilds the graph with stand-in classes that pickle as
torch's do (``_torch_metadata``, ``_torch_filesystem``: modules whose names
have the length of torch's), runs the C pickler on it, and renames the two
module strings in place; it declines whatever it cannot promise the
reference's bytes for.

Bytes items. ``dumps_object`` writes the record ``torch.save`` writes for a
DCP bytes item (byte-identical for objects without tensors) and
``loads_object`` reads one with a narrower allowlist: plain Python values,
torch sizes and dtypes, NumPy arrays and scalars of numeric dtypes.

Reading. ``loads_metadata`` and ``loads_object`` run an unpickler with
``find_class`` limited to an allowlist. The reference is CPython's pure-Python
unpickler (its memo is a dict, so a forged memo index cannot make it allocate
gigabytes, as the C unpickler's array memo can). A stream that the C scan
``_core.pickle_scan`` passes (no copyreg extensions, persistent ids or
out-of-band buffers; memo indices bounded by the opcodes before them; every
length inside the data) runs on CPython's C unpickler with the same
allowlist instead, ten times faster; whatever it fails on goes to the
reference, whose outcome is the answer. Every allowlisted global is
replaced by an inert stand-in: the
metadata classes by proxy types that only record their state, callables by
objects that check their arguments, torch objects by names. Nothing outside
the allowlist is imported or called, and no shared object can be mutated by
``BUILD``. A second pass validates the whole graph (exact types, no cycles,
bounded depth) and builds the real objects.

Errors: ``UnsafePickleError`` names a global or a call outside the allowlist;
``PickleFormatError`` is anything else wrong with the bytes. Both subclass
``shardstate.ShardstateError`` and ``pickle.UnpicklingError``; no other
exception escapes ``loads_*`` for any input.

Invariants: no torch import anywhere in this module (torch objects are built
only when torch is already in ``sys.modules``). Functions are thread-safe.
"""

from __future__ import annotations

import _compat_pickle
import io
import pathlib
import pickle
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

from .. import ShardstateError, _core
from .._util import gc_paused, loaded_torch
from . import _torch_filesystem as _ph_fs
from . import _torch_metadata as _ph_md
from . import _zipfmt
from . import metadata as _smd
from .metadata import (
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

__all__ = [
    "PickleFormatError",
    "UnsafePickleError",
    "dumps_metadata",
    "dumps_object",
    "loads_metadata",
    "loads_object",
]


class UnsafePickleError(ShardstateError, pickle.UnpicklingError):
    """A pickle names a global, or calls something, outside the allowlist."""


class PickleFormatError(ShardstateError, pickle.UnpicklingError):
    """Bytes that are not a well-formed pickle of the expected objects."""


# --------------------------------------------------------------------------
# Torch names (no torch import)
# --------------------------------------------------------------------------

_MD_MOD = "torch.distributed.checkpoint.metadata"
_FS_MOD = "torch.distributed.checkpoint.filesystem"


def _torch_module(name: str) -> str:
    """The torch module of a metadata class: _StorageInfo lives in filesystem."""
    return _FS_MOD if name == "_StorageInfo" else _MD_MOD

# Canonical dtype names, as torch pickles them (``GLOBAL torch <name>``).
_DTYPE_NAMES = frozenset(
    "float32 float64 float16 bfloat16 complex32 complex64 complex128 uint8 uint16 uint32 "
    "uint64 int8 int16 int32 int64 bool qint8 quint8 qint32 quint4x2 quint2x4 bits1x8 "
    "bits2x4 bits4x2 bits8 bits16 float8_e5m2 float8_e4m3fn float8_e5m2fnuz "
    "float8_e4m3fnuz float8_e8m0fnu float4_e2m1fn_x2 int1 int2 int3 int4 int5 int6 int7 "
    "uint1 uint2 uint3 uint4 uint5 uint6 uint7".split()
)
_LAYOUT_NAMES = frozenset(
    "torch.strided torch.sparse_coo torch.sparse_csr torch.sparse_csc torch.sparse_bsr "
    "torch.sparse_bsc torch._mkldnn torch.jagged".split()
)
_MEMFMT_NAMES = frozenset(
    "torch.contiguous_format torch.channels_last torch.channels_last_3d "
    "torch.preserve_format".split()
)
_MEM_ENCODING_BY_NAME = {
    "torch.contiguous_format": 0,
    "torch.channels_last": 1,
    "torch.preserve_format": 2,
}


def _torch_name(obj: Any) -> str | None:
    """'torch.float32' for a torch dtype/layout/memory format or a TorchName."""
    if isinstance(obj, TorchName):
        return str(obj)
    t = type(obj)
    if t.__module__ == "torch" and t.__name__ in ("dtype", "layout", "memory_format"):
        s = str(obj)
        return s if s.startswith("torch.") else f"torch.{s}"
    return None


# --------------------------------------------------------------------------
# Writer: CPython's C pickler, protocol 4, for the objects in .metadata
# --------------------------------------------------------------------------

_FRAME_TARGET = 64 * 1024
_BATCH = 1000
_TORCH_MOD = "torch"  # module name of dtype globals (one shared object, as in torch)


def _small_int(v: int) -> bytes:
    """A non-negative int below 2**31, as save_int writes it."""
    if v <= 0xFF:
        return b"K" + bytes((v,))
    if v <= 0xFFFF:
        return b"M" + struct.pack("<H", v)
    return b"J" + struct.pack("<i", v)


class _Writer:
    """Emits opcodes exactly as ``_pickle.Pickler(protocol=4)`` would.

    ``save_*`` methods mirror the C pickler's ``save()``: a frame boundary
    check first, then atoms (never memoized), then the memo, then the type.
    Memo keys are ``id(obj)`` for real objects (kept alive in ``_keep``) and
    tagged tuples for torch singletons named by stand-ins."""

    def __init__(self) -> None:
        self.buf = bytearray(b"\x80\x04")
        self.frame_start = -1
        self.memo: dict[Any, int] = {}
        self._keep: list[Any] = []
        self._fresh = 0

    # ---- framing ----
    def w(self, b: bytes | bytearray) -> None:
        if self.frame_start < 0:
            self.frame_start = len(self.buf)
            self.buf += bytes(9)
        self.buf += b

    def commit(self) -> None:
        fs = self.frame_start
        if fs < 0:
            return
        n = len(self.buf) - fs - 9
        if n >= 4:
            self.buf[fs : fs + 9] = b"\x95" + struct.pack("<Q", n)
        else:
            del self.buf[fs : fs + 9]
        self.frame_start = -1

    def boundary(self) -> None:
        if self.frame_start >= 0 and len(self.buf) - self.frame_start - 9 >= _FRAME_TARGET:
            self.commit()

    def payload(self, header: bytes, data: bytes) -> None:
        if len(data) >= _FRAME_TARGET:  # large payloads go outside frames
            self.commit()
            self.buf += header
            self.buf += data
        else:
            self.w(header + data)

    # ---- memo ----
    def get(self, key: Any) -> bool:
        idx = self.memo.get(key)
        if idx is None:
            return False
        self.w(b"h" + bytes((idx,)) if idx < 256 else b"j" + struct.pack("<I", idx))
        return True

    def put(self, key: Any, obj: Any = None) -> None:
        self.memo[key] = len(self.memo)
        if obj is not None:
            self._keep.append(obj)
        self.w(b"\x94")

    def fresh_key(self) -> tuple[str, int]:
        self._fresh += 1
        return ("fresh", self._fresh)

    # ---- generic values ----
    def save(self, obj: Any) -> None:
        self.boundary()
        t = type(obj)
        if obj is None:
            self.w(b"N")
        elif t is bool:
            self.w(b"\x88" if obj else b"\x89")
        elif t is int:
            self.save_int(obj)
        elif t is float:
            self.w(b"G" + struct.pack(">d", obj))
        elif self.get(id(obj)):
            pass
        elif t is str:
            self.save_str(obj)
        elif t is bytes:
            n = len(obj)
            if n <= 0xFF:
                head = b"C" + bytes((n,))
            elif n <= 0xFFFFFFFF:
                head = b"B" + struct.pack("<I", n)
            else:
                head = b"\x8e" + struct.pack("<Q", n)
            self.payload(head, obj)
            self.put(id(obj), obj)
        elif t is tuple:
            self.save_tuple(obj, self.save)
        elif t is list:
            self.w(b"]")
            self.put(id(obj), obj)
            self.batch_list(obj, self.save)
        elif t is dict:
            self.save_dict(obj)
        elif t is set:
            self.w(b"\x8f")
            self.put(id(obj), obj)
            self.batch_set(obj)
        elif t is frozenset:
            self.w(b"(")
            for x in obj:
                self.save(x)
            self.w(b"\x91")
            self.put(id(obj), obj)
        else:
            self.save_special(obj)

    def save_int(self, v: int) -> None:
        if 0 <= v <= 0xFF:
            self.w(b"K" + bytes((v,)))
        elif 0 <= v <= 0xFFFF:
            self.w(b"M" + struct.pack("<H", v))
        elif -0x80000000 <= v <= 0x7FFFFFFF:
            self.w(b"J" + struct.pack("<i", v))
        else:
            n = (v.bit_length() >> 3) + 1
            enc = v.to_bytes(n, "little", signed=True)
            if v < 0 and n > 1 and enc[-1] == 0xFF and enc[-2] & 0x80:
                enc = enc[:-1]
            if len(enc) < 256:
                self.w(b"\x8a" + bytes((len(enc),)) + enc)
            else:
                self.w(b"\x8b" + struct.pack("<i", len(enc)) + enc)

    def save_str(self, s: str, key: Any = None) -> None:
        b = s.encode("utf-8", "surrogatepass")
        n = len(b)
        if n <= 0xFF:
            head = b"\x8c" + bytes((n,))
        elif n <= 0xFFFFFFFF:
            head = b"X" + struct.pack("<I", n)
        else:
            head = b"\x8d" + struct.pack("<Q", n)
        self.payload(head, b)
        self.put(id(s) if key is None else key, s)

    def save_tuple(self, obj: tuple, save_item: Callable[[Any], None], memo: bool = True) -> None:
        n = len(obj)
        if n == 0:
            self.w(b")")
            return
        if n > 3:
            self.w(b"(")
        for x in obj:
            save_item(x)
        self.w(b"t" if n > 3 else b"\x85\x86\x87"[n - 1 : n])
        self.put(id(obj) if memo else self.fresh_key(), obj)

    def batch_list(self, items: list, save_item: Callable[[Any], None]) -> None:
        n = len(items)
        if n == 0:
            return
        if n == 1:
            save_item(items[0])
            self.w(b"a")
            return
        total = 0
        while total < n:
            self.w(b"(")
            for x in items[total : total + _BATCH]:
                save_item(x)
            total += min(_BATCH, n - total)
            self.w(b"e")

    def save_dict(self, d: dict, key: Any = None,
                  savers: dict[str, Callable[[Any], None]] | None = None) -> None:
        """EMPTY_DICT, then the items; ``savers`` maps some keys to the
        functions that save their values (instance state with torch.Size fields)."""
        self.w(b"}")
        self.put(id(d) if key is None else key, d)
        n = len(d)
        if n == 0:
            return
        sv = savers or {}
        if n == 1:
            ((k, v),) = d.items()
            self.save(k)
            sv.get(k, self.save)(v)
            self.w(b"s")
            return
        it = iter(d.items())
        while True:  # as the C pickler: a full last batch is followed by an empty one
            self.w(b"(")
            i = 0
            for k, v in it:
                self.save(k)
                sv.get(k, self.save)(v)
                i += 1
                if i == _BATCH:
                    break
            self.w(b"u")
            if i != _BATCH:
                return

    def batch_set(self, s: set) -> None:
        if not s:
            return
        it = iter(s)
        while True:
            self.w(b"(")
            i = 0
            for x in it:
                self.save(x)
                i += 1
                if i == _BATCH:
                    break
            self.w(b"\x90")
            if i != _BATCH:
                return

    # ---- globals and torch objects ----
    def save_global(self, module: str, name: str, key: Any) -> None:
        self.boundary()
        if self.get(key):
            return
        self.save(module)
        self.save(name)
        self.w(b"\x93")
        self.put(key)

    def save_dtype(self, name: str) -> None:
        self.save_global(_TORCH_MOD, name.removeprefix("torch."), ("dtype", name))

    def save_reduce_global(self, module: str, name: str, args: tuple, key: Any) -> None:
        """``module.name(*args)`` as ``STACK_GLOBAL args REDUCE``; result memoized under key."""
        self.boundary()
        if self.get(key):
            return
        self.save_global(module, name, ("global", module, name))
        self.boundary()
        self.save_tuple(args, self.save, memo=False)
        self.w(b"R")
        self.put(key)

    def save_layout(self, name: str) -> None:
        self.save_reduce_global("torch.serialization", "_get_layout", (name,), ("layout", name))

    def save_mem_encoding(self, value: int) -> None:
        self.save_reduce_global(_MD_MOD, "_MEM_FORMAT_ENCODING", (value,), ("memfmt", value))

    def save_size(self, obj: Any) -> None:
        """A torch.Size (or a tuple standing in for one): REDUCE(torch.Size, (tuple,))."""
        self.boundary()
        real = type(obj) is not tuple  # a real torch.Size: memoized by identity
        if real and self.get(id(obj)):
            return
        dims = tuple(obj)
        if not all(type(d) is int for d in dims):
            raise TypeError(f"torch.Size dimensions must be ints, got {obj!r}")
        size_global = self.memo.get(("global", "torch", "Size"))
        fs = self.frame_start
        if (size_global is not None and fs >= 0 and 0 < len(dims) <= 3
                and len(self.buf) - fs - 9 + 48 < _FRAME_TARGET
                and all(0 <= d <= 0x7FFFFFFF for d in dims)):
            # Fast path, same bytes: no frame boundary can fall inside this object.
            n = len(self.memo)
            m = self.memo
            m[self.fresh_key()] = n
            m[self.fresh_key()] = n + 1
            if real:
                m[id(obj)] = n + 2
                self._keep.append(obj)
            else:
                m[self.fresh_key()] = n + 2
            get = b"h" + bytes((size_global,)) if size_global < 256 else (
                b"j" + struct.pack("<I", size_global))
            self.buf += get + b"".join(map(_small_int, dims)) + (
                b"\x85\x86\x87"[len(dims) - 1 : len(dims)] + b"\x94\x85\x94R\x94")
            return
        # torch.Size.__module__ is a new string each time it is read
        if not self.get(("global", "torch", "Size")):
            self.boundary()
            self.save_str("".join(("tor", "ch")), self.fresh_key())
            self.save("Size")
            self.w(b"\x93")
            self.put(("global", "torch", "Size"))
        self.boundary()

        def inner(x: tuple) -> None:
            self.boundary()
            self.save_tuple(x, self.save, memo=False)

        self.save_tuple((dims,), inner, memo=False)
        self.w(b"R")
        self.put(id(obj) if real else self.fresh_key(), obj)

    def save_special(self, obj: Any) -> None:
        name = _torch_name(obj)
        if name is not None:
            if name in _LAYOUT_NAMES:
                self.save_layout(name)
            elif name in _MEMFMT_NAMES:
                # torch.memory_format pickles as a global of torch._utils
                self.save_global("torch._utils", name, ("memfmt_global", name))
            else:
                self.save_dtype(name)
            return
        t = type(obj)
        if t.__module__ == "torch" and t.__name__ == "Size":
            self.save_size(obj)
            return
        if isinstance(obj, Enum) and t.__name__ == "_MEM_FORMAT_ENCODING":
            self.save_mem_encoding(int(obj.value))
            return
        if isinstance(obj, pathlib.PurePath):
            cls, args = obj.__reduce__()
            if not all(type(a) is str for a in args):
                raise TypeError(f"cannot pickle path {obj!r}")
            self.save_reduce_global(cls.__module__, cls.__qualname__, tuple(args), id(obj))
            self._keep.append(obj)
            return
        saver = _OBJECT_SAVERS.get(t.__name__)
        if saver is None or t.__module__ not in _OBJECT_MODULES:
            raise TypeError(
                f"cannot write {t.__module__}.{t.__qualname__} into .metadata; expected the "
                "checkpoint metadata classes, torch dtypes and sizes, or plain Python values"
            )
        saver(self, obj)

    def save_object(self, obj: Any, module: str, name: str, state: Any,
                    save_state: Callable[[Any], None] | None = None) -> None:
        """An instance pickled as ``cls.__new__(cls)`` then ``BUILD state``."""
        self.save_global(module, name, ("global", module, name))
        self.boundary()
        self.w(b")\x81")
        self.put(id(obj), obj)
        if state is not None:
            self.boundary()
            if save_state is None:
                self.save(state)
            else:
                save_state(state)
            self.w(b"b")

    def save_state_dict(self, state: Any, savers: dict[str, Callable[[Any], None]]) -> None:
        """An instance ``__dict__`` whose fields have their own savers."""
        if type(state) is not dict:
            self.save(state)
        elif not self.get(id(state)):
            self.save_dict(state, savers=savers)


def _state(obj: Any) -> Any:
    return obj.__getstate__()


def _save_metadata(w: _Writer, md: Any) -> None:
    w.save_object(md, _MD_MOD, "Metadata", _state(md))


def _save_tsm(w: _Writer, obj: Any) -> None:
    w.save_object(obj, _MD_MOD, "TensorStorageMetadata", _state(obj),
                  lambda st: w.save_state_dict(st, {"size": w.save_size}))


def _save_props(w: _Writer, obj: Any) -> None:
    state = _state(obj)

    def save_state(st: Any) -> None:
        if type(st) is not tuple or len(st) != 5:
            w.save(st)
            return
        dtype, layout, rg, enc, pin = st
        if w.get(id(st)):
            return
        w.w(b"(")
        w.boundary()
        dn = _torch_name(dtype)
        w.save_dtype(dn) if dn is not None else w.save(dtype)
        w.boundary()
        ln = _torch_name(layout)
        w.save_layout(ln) if ln is not None else w.save(layout)
        w.save(rg)
        w.boundary()
        if isinstance(enc, Enum):
            w.save_mem_encoding(int(enc.value))
        else:
            w.save(enc)
        w.save(pin)
        w.w(b"t")
        w.put(id(st), st)

    w.save_object(obj, _MD_MOD, "TensorProperties", state, save_state)


def _save_chunk(w: _Writer, obj: Any) -> None:
    w.save_object(obj, _MD_MOD, "ChunkStorageMetadata", _state(obj),
                  lambda st: w.save_state_dict(st, {"offsets": w.save_size, "sizes": w.save_size}))


def _save_bytes_md(w: _Writer, obj: Any) -> None:
    w.save_object(obj, _MD_MOD, "BytesStorageMetadata", _state(obj))


def _save_index(w: _Writer, obj: Any) -> None:
    def off(v: Any) -> None:
        w.save(v) if v is None else w.save_size(v)

    w.save_object(obj, _MD_MOD, "MetadataIndex", _state(obj),
                  lambda st: w.save_state_dict(st, {"offset": off}))


def _save_storage_meta(w: _Writer, obj: Any) -> None:
    w.save_object(obj, _MD_MOD, "StorageMeta", _state(obj),
                  lambda st: w.save_state_dict(st, {}))


def _save_storage_info(w: _Writer, obj: Any) -> None:
    w.save_object(obj, _FS_MOD, "_StorageInfo", _state(obj),
                  lambda st: w.save_state_dict(st, {}))


_OBJECT_MODULES = frozenset(
    {"shardstate.checkpoint._torchfree", _MD_MOD, _FS_MOD}
)
_OBJECT_SAVERS: dict[str, Callable[[_Writer, Any], None]] = {
    "Metadata": _save_metadata,
    "TensorStorageMetadata": _save_tsm,
    "TensorProperties": _save_props,
    "ChunkStorageMetadata": _save_chunk,
    "BytesStorageMetadata": _save_bytes_md,
    "MetadataIndex": _save_index,
    "StorageMeta": _save_storage_meta,
    "_StorageInfo": _save_storage_info,
}


# --------------------------------------------------------------------------
# Writer, fast path: CPython's C pickler on stand-in classes
# --------------------------------------------------------------------------


class _Decline(Exception):
    """The fast writer cannot promise the reference writer's bytes for this graph."""


# "<SHORT_BINUNICODE n>name<MEMOIZE>": how the C pickler (protocol 4) writes a
# class's module string, once per module (later classes reuse it by BINGET).
def _module_op(name: str) -> bytes:
    b = name.encode()
    return b"\x8c" + bytes((len(b),)) + b + b"\x94"


_RENAMES = (
    (_module_op(_ph_md.__name__), _module_op(_MD_MOD)),
    (_module_op(_ph_fs.__name__), _module_op(_FS_MOD)),
)
_PLAIN_ATOMS = frozenset({type(None), bool, int, float, str, bytes})
_PLAIN_DEPTH = 100
_OURS: dict[str, type] = {name: getattr(_smd, name) for name in _OBJECT_SAVERS}


def _accepted_types(name: str) -> frozenset[type]:
    """Our class of that name, and torch's if torch's module is loaded."""
    mod = sys.modules.get(_torch_module(name))
    theirs = getattr(mod, name, None)
    return frozenset({_OURS[name], theirs} if isinstance(theirs, type) else {_OURS[name]})


class _StandIns:
    """Rebuilds a metadata graph (our classes or torch's) with the stand-in
    classes of ``_torch_metadata`` / ``_torch_filesystem``, which the C
    pickler writes exactly as it writes torch's classes.

    Each source object (and each list or dict rebuilt around converted
    objects) maps to one stand-in, so the C pickler's memo (by identity)
    sees the same sharing as it would in the source graph. Values that are
    not rebuilt (strings, ints, torch.Size, planner data) are passed on as
    they are, so their sharing is the source's own. Anything whose native
    pickling could differ from the reference writer's raises ``_Decline``:
    stand-ins for torch objects (tuples as sizes, TorchName), types outside
    plain values, cycles, a container both rebuilt and passed on."""

    def __init__(self, torch: Any) -> None:
        self.Size = torch.Size
        self.dtype = torch.dtype
        self.layout = torch.layout
        self.seen: dict[int, Any] = {}
        self.plain: list[Any] = []  # values checked once the graph is rebuilt
        self.storage_info = False
        self.ok = {name: _accepted_types(name) for name in _OURS}

    def new(self, src: Any, cls: type, state: Any) -> Any:
        obj = cls.__new__(cls)
        obj.__dict__ = state
        self.seen[id(src)] = obj
        return obj

    def metadata(self, md: Any) -> Any:
        if type(md) not in self.ok["Metadata"]:
            raise _Decline
        state = {}
        for k, v in md.__dict__.items():
            if k == "state_dict_metadata":
                v = self.entries(v)
            elif k == "storage_data" and type(v) is dict:
                v = self.storage_data(v)
            elif k == "storage_meta" and v is not None:
                v = self.storage_meta(v)
            else:
                self.plain.append(v)
            state[k] = v
        return self.new(md, _ph_md.Metadata, state)

    def entries(self, sdm: Any) -> dict:
        if type(sdm) is not dict:
            raise _Decline
        out = {}
        tsm, bsm = self.ok["TensorStorageMetadata"], self.ok["BytesStorageMetadata"]
        for fqn, e in sdm.items():
            if type(fqn) is not str:
                raise _Decline
            hit = self.seen.get(id(e))
            if hit is None:
                if type(e) in tsm:
                    hit = self.tensor(e)
                elif type(e) in bsm and not e.__dict__:
                    hit = self.new(e, _ph_md.BytesStorageMetadata, e.__dict__)
                else:
                    raise _Decline
            out[fqn] = hit
        self.seen[id(sdm)] = out
        return out

    def tensor(self, e: Any) -> Any:
        state = {}
        for k, v in e.__dict__.items():
            if k == "properties":
                hit = self.seen.get(id(v))
                v = self.properties(v) if hit is None else hit
            elif k == "size":
                if type(v) is not self.Size:
                    raise _Decline
            elif k == "chunks":
                hit = self.seen.get(id(v))
                v = self.chunks(v) if hit is None else hit
            else:
                self.plain.append(v)
            state[k] = v
        return self.new(e, _ph_md.TensorStorageMetadata, state)

    def properties(self, p: Any) -> Any:
        if type(p) not in self.ok["TensorProperties"]:
            raise _Decline
        st = p.__getstate__()
        if type(st) is not tuple or len(st) != 5:
            raise _Decline
        dtype, layout, rg, enc, pin = st
        if (type(dtype) is not self.dtype or type(layout) is not self.layout
                or type(rg) is not bool or type(pin) is not bool
                or not isinstance(enc, Enum) or type(enc).__name__ != "_MEM_FORMAT_ENCODING"):
            raise _Decline
        obj = _ph_md.TensorProperties.__new__(_ph_md.TensorProperties)
        obj.state = (dtype, layout, rg, _ph_md._MEM_FORMAT_ENCODING(enc.value), pin)
        self.seen[id(p)] = obj
        return obj

    def chunks(self, chunks: Any) -> list:
        if type(chunks) is not list:
            raise _Decline
        out: list[Any] = []
        append, S, seen, ok = out.append, self.Size, self.seen, self.ok["ChunkStorageMetadata"]
        Chunk = _ph_md.ChunkStorageMetadata
        new = Chunk.__new__
        for c in chunks:
            hit = seen.get(id(c))
            if hit is None:
                d = c.__dict__
                if (type(c) not in ok or len(d) != 2 or type(d["offsets"]) is not S
                        or type(d["sizes"]) is not S):
                    raise _Decline
                hit = new(Chunk)
                hit.__dict__ = d
                seen[id(c)] = hit
            append(hit)
        seen[id(chunks)] = out
        return out

    def storage_data(self, sd: dict) -> dict:
        out = {}
        S, seen, plain = self.Size, self.seen, self.plain
        ok_idx, ok_info = self.ok["MetadataIndex"], self.ok["_StorageInfo"]
        Index, Info = _ph_md.MetadataIndex, _ph_fs._StorageInfo
        new_idx, new_info = Index.__new__, Info.__new__
        for idx, info in sd.items():
            # A key occurs once in a dict, and indexes only ever sit in
            # storage_data, so keys need no identity map.
            d = idx.__dict__  # {fqn, index} or {fqn, index, offset}: torch's __init__
            n = len(d)
            if (type(idx) not in ok_idx or type(d["fqn"]) is not str
                    or type(d["index"]) not in _PLAIN_ATOMS
                    or not (n == 2 or (n == 3 and type(d.get("offset")) is S))):
                raise _Decline
            key = new_idx(Index)
            key.__dict__ = d
            val = seen.get(id(info))
            if val is None:
                if type(info) not in ok_info:
                    raise _Decline
                d = info.__dict__
                if len(d) == 4 and d.get("transform_descriptors", 0) is None:
                    st = d.copy()  # __getstate__'s result, the usual case: drop the None
                    del st["transform_descriptors"]
                else:
                    st = info.__getstate__()
                    plain.append(st)
                if (type(st) is not dict or type(st["relative_path"]) is not str
                        or type(st["offset"]) is not int or type(st["length"]) is not int):
                    raise _Decline
                val = new_info(Info)
                val.__dict__ = st
                seen[id(info)] = val
            out[key] = val
        self.storage_info = self.storage_info or bool(out)
        seen[id(sd)] = out
        return out

    def storage_meta(self, m: Any) -> Any:
        if type(m) not in self.ok["StorageMeta"]:
            raise _Decline
        d = m.__dict__
        for k, v in d.items():
            if k == "checkpoint_id" and isinstance(v, pathlib.PurePath):
                if not all(type(a) is str for a in v.__reduce__()[1]):
                    raise _Decline
            else:
                self.plain.append(v)
        return self.new(m, _ph_md.StorageMeta, d)

    def check_plain(self) -> None:
        """Every passed-on value is a tree (or DAG) of plain values and
        torch.Sizes, without cycles, no deeper than _PLAIN_DEPTH, sharing no
        container with the rebuilt graph. Each container is walked once."""
        S, seen = self.Size, self.seen
        done: set[int] = set()
        active: set[int] = set()

        def walk(v: Any, depth: int) -> None:
            t = type(v)
            if t in _PLAIN_ATOMS or id(v) in done:
                return
            if depth > _PLAIN_DEPTH or id(v) in seen or id(v) in active:
                raise _Decline
            if t is dict:
                items: Iterable[Any] = (x for kv in v.items() for x in kv)
            elif t in (list, tuple, set, frozenset) or t is S:
                items = v
            else:
                raise _Decline
            active.add(id(v))
            for x in items:
                walk(x, depth + 1)
            active.discard(id(v))
            done.add(id(v))

        for v in self.plain:
            walk(v, 0)


def _dumps_fast(md: Any) -> bytes | None:
    """``md``'s ``.metadata`` through CPython's C pickler, or None when only
    the reference writer can promise its bytes (torch not loaded, stand-ins
    for torch objects, values outside the plain types). The graph is rebuilt
    with stand-in classes (``_StandIns``), pickled, and the stand-ins' two
    module names, written once each, are renamed to torch's in place: the
    same length, so frames and offsets hold. A rename is made only when its
    module string occurs exactly as often as the graph used the module
    (a user string spelling the stand-in's module makes it decline)."""
    torch = loaded_torch()
    if torch is None:
        return None
    try:
        conv = _StandIns(torch)
        root = conv.metadata(md)
        conv.check_plain()
        f = io.BytesIO()
        pickle.Pickler(f, protocol=4).dump(root)
    except Exception:  # _Decline, or anything the reference should answer for
        return None
    data = f.getvalue()
    for (ph, real), used in zip(_RENAMES, (True, conv.storage_info)):
        if data.count(ph) != int(used):
            return None
        if used:
            data = data.replace(ph, real)
    return data


def dumps_metadata(md: Any) -> bytes:
    """The ``.metadata`` file for ``md``, as torch's FileSystemWriter writes it.

    ``md`` is a :class:`~shardstate.checkpoint.metadata.Metadata` (holding
    torch objects or stand-ins: tuples for ``torch.Size``, ``TorchName`` for
    dtypes and layouts) or torch's own ``Metadata``. torch is never imported;
    the classes are written under torch's import paths (protocol 4), so
    ``pickle.load`` in a process with torch gives torch's classes.

    The bytes equal ``pickle.dumps(torch_md)`` for the torch ``Metadata`` with
    the same values and the same object sharing. Sharing matters because
    pickle memoizes by identity: an object referenced twice is written once.
    Strings, lists and dicts are memoized by identity here too; dtypes, layouts
    and memory-format encodings by name (torch's are singletons); a plain tuple
    standing in for a ``torch.Size`` is never shared (a real ``torch.Size``
    is memoized by identity).

    Two writers give these bytes. When torch is loaded and the graph holds
    real torch objects and plain values (every save of torch tensors),
    ``_dumps_fast`` runs CPython's C pickler on stand-in classes: three times
    faster, about torch's own speed. Otherwise (torch absent, stand-ins,
    anything it cannot promise) ``_dumps_reference``, the opcode writer,
    answers, errors included.
    """
    with gc_paused():
        data = _dumps_fast(md)
        return data if data is not None else _dumps_reference(md)


def _dumps_reference(md: Any) -> bytes:
    """``dumps_metadata`` by the pure-Python opcode writer: any graph, torch
    loaded or not; three to four times slower than the C pickler."""
    w = _Writer()
    with gc_paused():
        w.save(md)
        w.w(b".")
        w.commit()
    return bytes(w.buf)


# --------------------------------------------------------------------------
# Restricted unpickler
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
            "checkpoint metadata classes, torch dtypes/sizes and plain Python values; "
            "pass allow_unsafe=True only for trusted checkpoints"
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


# ---- second pass: validate and build real objects ----

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
    frozenset({'length', 'offset', 'relative_path', 'transform_descriptors'}),
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
            cls = getattr(pathlib, v.cls)
            if v.cls in ("WindowsPath", "Path") and sys.platform != "win32":
                cls = pathlib.PureWindowsPath if v.cls == "WindowsPath" else pathlib.PosixPath
            if v.cls == "PosixPath" and sys.platform == "win32":
                cls = pathlib.PurePosixPath
            return cls(*v.parts)
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
        return self.new(_StorageInfo, st)


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


def loads_metadata(data: bytes, *, allow_unsafe: bool = False) -> Metadata:
    """Reads a ``.metadata`` pickle into shardstate's metadata classes.

    Only torch's checkpoint metadata classes, ``_StorageInfo``, ``torch.Size``,
    dtypes, layouts, memory formats, paths and plain Python values are
    admitted; anything else raises :class:`UnsafePickleError` naming it, and
    nothing it names is imported or called. Metadata written by older torch
    versions (fewer fields, ``TensorProperties`` as a dict) is accepted.

    ``allow_unsafe=True`` runs a plain ``pickle.loads`` (which can run
    arbitrary code: for trusted checkpoints only) and converts torch's classes
    to ours.
    """
    if allow_unsafe:
        obj = pickle.loads(data)
        if type(obj).__name__ != "Metadata":
            raise PickleFormatError(f".metadata holds a {type(obj).__name__}, not a Metadata")
        if isinstance(obj, Metadata):
            return obj
        # torch's classes: re-read through the restricted path from its bytes
        return loads_metadata(dumps_metadata(obj))
    with gc_paused():
        obj = _unpickle(data, _METADATA_GLOBALS, ".metadata")
        if type(obj) is not _PROXIES["Metadata"]:
            raise PickleFormatError(f".metadata holds {type(obj).__name__}, not a Metadata")
        return _build(".metadata", obj)


# --------------------------------------------------------------------------
# Bytes items (DCP BYTE_IO): one torch.save record holding a plain object
# --------------------------------------------------------------------------


class _StorageFound(Exception):
    pass


class _ProbePickler(pickle.Pickler):
    """pickle.Pickler as torch.save uses it, refusing tensors and storages."""

    def persistent_id(self, obj: Any) -> None:
        t = type(obj)
        if t.__module__.startswith("torch") and (
            "Storage" in t.__name__ or t.__name__ in ("Tensor", "Parameter")
        ):
            raise _StorageFound
        return None


def dumps_object(obj: Any) -> bytes:
    """The record ``torch.save(obj, buf)`` writes for a DCP bytes item.

    For objects without tensors or storages it is built here, torch-free, and
    is byte-identical to torch's (a protocol-2 pickle in torch's zip framing).
    Objects containing tensors are handed to ``torch.save`` itself."""
    buf = io.BytesIO()
    try:
        _ProbePickler(buf, protocol=2).dump(obj)
    except _StorageFound:
        torch = loaded_torch()
        if torch is None:  # a torch object cannot exist without torch loaded
            raise TypeError("object holds torch storages but torch is not loaded") from None
        out = io.BytesIO()
        torch.save(obj, out)
        return out.getvalue()
    return _zipfmt.bytes_record(buf.getvalue())


def loads_object(data: bytes, *, allow_unsafe: bool = False) -> Any:
    """Reads one DCP bytes item (a ``torch.save`` record) back into its object.

    Admits plain Python values (None, bool, int, float, complex, str, bytes,
    bytearray, list, tuple, dict, set, frozenset, OrderedDict, slice), torch
    sizes and dtypes, and NumPy arrays and scalars of bool/int/uint/float/complex
    dtypes (rebuilt from their bytes, never through numpy's unpickling code);
    anything else raises :class:`UnsafePickleError`
    naming the class. A record that holds tensors is loaded with
    ``torch.load(weights_only=True)`` (torch's own allowlist; torch must be
    installed). ``allow_unsafe=True`` means ``torch.load(weights_only=False)``
    when torch is available, else a plain unpickle: trusted data only."""
    try:
        mv = memoryview(data).cast("B")
        _archive, entries = _zipfmt._parse_zip(mv)
    except _zipfmt.RecordFormatError as e:
        raise PickleFormatError(f"bytes item is not a torch.save record: {e}") from None
    by_name = {e.name: e for e in entries}
    pk = by_name.get("data.pkl")
    if pk is None:
        raise PickleFormatError("bytes item has no data.pkl")
    has_storage = any(n.startswith("data/") for n in by_name)
    if has_storage or allow_unsafe:
        torch = loaded_torch()
        if torch is None:
            try:
                import torch  # noqa: F811  (only for records that need it)
            except ImportError:
                torch = None
        if torch is not None:
            try:
                return torch.load(io.BytesIO(bytes(mv)), map_location="cpu",
                                  weights_only=not allow_unsafe)
            except pickle.UnpicklingError as e:
                raise UnsafePickleError(f"torch.load(weights_only=True) refused the item: {e}") \
                    from None
        if has_storage:
            raise PickleFormatError("bytes item holds tensor storages; reading it needs torch")
    pkl = bytes(mv[pk.data_offset : pk.data_offset + pk.size])
    if allow_unsafe:
        return pickle.loads(pkl)
    return _build("bytes item", _unpickle(pkl, _PLAIN_GLOBALS, "bytes item"))
