"""The ``.metadata`` writer (two engines, to be merged)."""

from __future__ import annotations

import io
import pathlib
import pickle
import struct
import sys
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

from ..._util import gc_paused, loaded_torch
from .. import _torch_filesystem as _ph_fs
from .. import _torch_metadata as _ph_md
from .. import metadata as _smd
from .names import _FS_MOD, _LAYOUT_NAMES, _MD_MOD, _MEMFMT_NAMES, _torch_module, _torch_name

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
    {"shardstate.checkpoint.metadata", _MD_MOD, _FS_MOD}
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

