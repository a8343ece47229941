"""The one ``.metadata`` writer: CPython's C pickler on stand-in classes.

``dumps_metadata(md)`` gives the bytes of ``pickle.dumps(torch_md,
protocol=4)``, what torch's ``FileSystemWriter`` writes, for the torch
``Metadata`` with the same values and the same object sharing, whether
torch is loaded or not. Sharing matters because pickle memoizes by
identity: an object referenced twice is written once. Here too strings,
lists and dicts are memoized by identity; dtypes, layouts and memory-format
encodings by name (torch's are singletons); a plain tuple standing in for a
``torch.Size`` is never shared (a real ``torch.Size`` is memoized by
identity).

How: the graph (our metadata classes or torch's) is rebuilt (``_Convert``)
with the stand-ins of ``standins``, pickled, and the placeholder module
names renamed to torch's (``standins._Placeholders.rename``); data spelling
a placeholder name makes it start again with the next set. With torch
loaded, torch's own sizes, dtypes, layouts and memory formats are written
as they are, and ``TorchName`` / tuples standing in for them become torch's
objects; without torch they become placeholders that pickle as torch's do.

The C walk. ``_core.md_dumps`` (csrc/py/mdwrite.c over csrc/core/ss_pkwrite)
serves the graphs saves make without building the stand-in graph: it walks
the source as ``_Convert.fast`` does and writes the bytes the C pickler
writes for the graph that conversion would build, opcode for opcode (the
same FRAME boundaries, memo entries keyed by the same identities), calling
back into ``_Convert.props_state`` for TensorProperties; the rename and the
placeholder sets are as above. Whatever it does not cover, or where the
fast conversion would hand over, it returns None and the conversions below
run (``_dumps_c``). About 9x torch's ``pickle.dumps`` at 192,000 chunks.

Two conversions give the same graph. ``_Convert.fast`` serves the graphs
saves make: it reuses the source's state dicts wherever they can be written
as they are, and checks the other (plain) values in one walk. Whatever it
does not cover (metadata objects or ``TorchName`` among plain values,
containers shared with the rebuilt part, types outside the allowlist) hands
the graph to ``_Convert.value``, the generic conversion, which follows the
pickler for every value and raises TypeError for what the reader would
refuse.

No torch import. Thread-safe.
"""

from __future__ import annotations

import copyreg
import functools
import pathlib
import pickle
import sys
from enum import Enum
from typing import Any

from ... import _core
from ..._util import gc_paused, loaded_torch
from .. import _mdlazy, _torchfree
from .. import metadata as _smd
from .names import (
    _FS_MOD,
    _LAYOUT_NAMES,
    _LEGACY_MOD,
    _MD_MOD,
    _MEMFMT_NAMES,
    _torch_module,
    _torch_name,
)
from .standins import _CLASSES, _MAX_SETS, _placeholder_sets, _Placeholders

# Modules whose classes of those names are written as torch's: the torch-free
# stand-ins, torch's (what metadata hands out with torch installed) and
# torch's legacy TensorProperties (written as the current one).
_OBJECT_MODULES = frozenset({_torchfree.__name__, _MD_MOD, _FS_MOD, _LEGACY_MOD})
_OURS: dict[str, type] = {name: getattr(_smd, name) for name in _CLASSES}
# Fields of a state dict that are torch.Size values (None allowed for "offset").
_SIZE_FIELDS = {"TensorStorageMetadata": frozenset({"size"}),
                "ChunkStorageMetadata": frozenset({"offsets", "sizes"}),
                "MetadataIndex": frozenset({"offset"})}
_ATOMS = frozenset({type(None), bool, int, float, str, bytes})
_INT_ONLY = frozenset({int})
_PLAIN_DEPTH = 100
_MISSING = object()


# --------------------------------------------------------------------------
# Conversion: the source graph (our classes or torch's) -> stand-ins
# --------------------------------------------------------------------------


class _Generic(Exception):
    """The fast conversion does not cover this graph; the generic one does."""


def _accepted_types(name: str) -> frozenset[type]:
    """Our class of that name, and torch's (and its legacy TensorProperties)
    where torch's module is loaded."""
    mods = (_torch_module(name), _LEGACY_MOD) if name == "TensorProperties" else (
        _torch_module(name),)
    theirs = (getattr(sys.modules.get(m), name, None) for m in mods)
    return frozenset({_OURS[name], getattr(_torchfree, name),
                      *(t for t in theirs if isinstance(t, type))})


def _kind(t: type) -> str | None:
    """The metadata class a type is written as, by module and name, or None."""
    return t.__name__ if t.__module__ in _OBJECT_MODULES and t.__name__ in _OURS else None


def _path_ok(p: pathlib.PurePath) -> bool:
    """A path the pickler writes as ``cls(*parts)`` with str parts."""
    return all(type(a) is str for a in p.__reduce__()[1])


def _is_encoding(v: Any) -> bool:
    return isinstance(v, Enum) and type(v).__name__ == "_MEM_FORMAT_ENCODING"


class _Convert:
    """Rebuilds a metadata graph with stand-ins (see the module docstring).

    ``seen`` maps each source object (by id) to what it became, so the C
    pickler's memo sees the source's sharing; ``keep`` holds the
    temporaries among those sources. ``used`` collects the placeholder tags
    the stand-ins need renamed."""

    def __init__(self, ph: _Placeholders, torch: Any) -> None:
        self.ph = ph
        self.torch = torch
        self.seen: dict[int, Any] = {}
        self.keep: list[Any] = []
        self.plain: list[Any] = []  # values the fast conversion passes on, checked at the end
        self.used: set[str] = set()
        self.resolved: dict[tuple[str, str], Any] = {}
        if torch is not None:
            self.Size: type = torch.Size
            self.native = frozenset({torch.Size, torch.dtype, torch.layout, torch.memory_format})
            self.props_native: tuple[Any, Any] = (torch.dtype, torch.layout)
        else:
            self.Size = ph.Size
            self.native = frozenset()
            self.props_native = (None, None)
        self.ok = {name: _accepted_types(name) for name in _CLASSES}

    # ---- shared by both conversions ----

    def new(self, src: Any, name: str, state: Any) -> Any:
        obj = self.ph.classes[name]()
        obj.state = state
        self.seen[id(src)] = obj
        self.used.add("fs" if name == "_StorageInfo" else "md")
        return obj

    def new_size(self, dims: tuple) -> Any:
        """A new torch.Size (or its stand-in) for a tuple standing in for one."""
        if not set(map(type, dims)) <= _INT_ONLY:
            raise TypeError(f"torch.Size dimensions must be ints, got {dims!r}")
        if self.torch is None:
            self.used.add("size")
        return self.Size(dims)

    def torch_obj(self, name: str, kind: str) -> Any:
        """torch's object for a name, if torch is loaded and has one of that
        kind (dtype, layout, memfmt); else the placeholder."""
        if self.torch is not None:
            key = (name, kind)
            obj = self.resolved.get(key, _MISSING)
            if obj is _MISSING:
                obj = self.torch
                for part in name.split(".")[1:] if name.startswith("torch.") else ():
                    obj = getattr(obj, part, None)
                want = {"dtype": "dtype", "layout": "layout", "memfmt": "memory_format"}[kind]
                t = type(obj)
                obj = self.resolved[key] = obj if (t.__module__, t.__name__) == (
                    "torch", want) else None
            if obj is not None:
                return obj
        self.used.add(kind)
        return self.ph.torch_obj(name, kind)

    def encoding(self, value: Any) -> Any:
        if type(value) is not int or not 0 <= value <= 2:
            raise TypeError(f"cannot write _MEM_FORMAT_ENCODING({value!r}) into .metadata")
        self.used.add("md")
        return self.ph.encodings[value]

    def props_state(self, st: tuple, fast: bool) -> tuple:
        """TensorProperties' 5-tuple state: dtype and layout written as such
        whatever their kind (as torch's __getstate__ leaves them), the memory
        format by its encoding. ``fast``: _Generic for anything unusual."""
        dtype, layout, rg, enc, pin = st
        out = []
        for v, kind, native in ((dtype, "dtype", self.props_native[0]),
                                (layout, "layout", self.props_native[1])):
            if type(v) is not native:
                name = _torch_name(v)
                if name is not None:
                    v = self.torch_obj(name, kind)
                elif fast:
                    raise _Generic
                else:
                    v = self.value(v)
            out.append(v)
        if isinstance(enc, Enum):
            enc = self.encoding(int(enc.value))
        elif fast:
            raise _Generic
        else:
            enc = self.value(enc)
        if not fast:
            rg, pin = self.value(rg), self.value(pin)
        elif type(rg) is not bool or type(pin) is not bool:
            raise _Generic
        return (out[0], out[1], rg, enc, pin)

    # ---- the fast conversion ----

    def fast(self, md: Any) -> Any:
        root = self.metadata(md)
        self.check_plain()
        return root

    def metadata(self, md: Any) -> Any:
        if type(md) not in self.ok["Metadata"] or not md.__dict__:
            raise _Generic
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
        return self.new(md, "Metadata", state)

    def entries(self, sdm: Any) -> dict:
        if type(sdm) is not dict:
            raise _Generic
        out = {}
        tsm, bsm = self.ok["TensorStorageMetadata"], self.ok["BytesStorageMetadata"]
        for fqn, e in sdm.items():
            if type(fqn) is not str:
                raise _Generic
            hit = self.seen.get(id(e))
            if hit is None:
                if type(e) in tsm:
                    hit = self.tensor(e)
                elif type(e) in bsm and not e.__dict__:
                    hit = self.new(e, "BytesStorageMetadata", None)
                else:
                    raise _Generic
            out[fqn] = hit
        self.seen[id(sdm)] = out
        return out

    def tensor(self, e: Any) -> Any:
        if not e.__dict__:
            raise _Generic
        state = {}
        for k, v in e.__dict__.items():
            if k == "properties":
                hit = self.seen.get(id(v))
                v = self.properties(v) if hit is None else hit
            elif k == "size":
                if type(v) is not self.Size:
                    if type(v) is not tuple:
                        raise _Generic
                    v = self.new_size(v)
            elif k == "chunks":
                hit = self.seen.get(id(v))
                v = self.chunks(v) if hit is None else hit
            else:
                self.plain.append(v)
            state[k] = v
        return self.new(e, "TensorStorageMetadata", state)

    def properties(self, p: Any) -> Any:
        if type(p) not in self.ok["TensorProperties"]:
            raise _Generic
        st = p.__getstate__()
        if type(st) is not tuple or len(st) != 5:
            raise _Generic
        return self.new(p, "TensorProperties", self.props_state(st, True))

    def sizes(self, d: dict, fields: frozenset[str]) -> dict:
        """A state dict with its tuples standing in for sizes made sizes
        (the source dict, should plain values hold it too, hands over)."""
        out = self.seen[id(d)] = {}
        for k, v in d.items():
            if k in fields and type(v) is not self.Size and not (v is None and k == "offset"):
                if type(v) is not tuple:
                    raise _Generic
                v = self.new_size(v)
            out[k] = v
        return out

    def chunks(self, chunks: Any) -> list:
        if type(chunks) is not list:
            raise _Generic
        out: list[Any] = []
        append, S, seen, ok = out.append, self.Size, self.seen, self.ok["ChunkStorageMetadata"]
        Chunk = self.ph.classes["ChunkStorageMetadata"]
        fields = _SIZE_FIELDS["ChunkStorageMetadata"]
        for c in chunks:
            hit = seen.get(id(c))
            if hit is None:
                d = c.__dict__
                if type(c) not in ok or len(d) != 2:
                    raise _Generic
                if type(d["offsets"]) is not S or type(d["sizes"]) is not S:
                    d = self.sizes(d, fields)
                hit = Chunk()
                hit.state = d
                seen[id(c)] = hit
            append(hit)
        seen[id(chunks)] = out
        return out

    def storage_data(self, sd: dict) -> dict:
        out = {}
        S, seen, plain = self.Size, self.seen, self.plain
        ok_idx, ok_info = self.ok["MetadataIndex"], self.ok["_StorageInfo"]
        Index, Info = self.ph.classes["MetadataIndex"], self.ph.classes["_StorageInfo"]
        idx_fields = _SIZE_FIELDS["MetadataIndex"]
        for idx, info in sd.items():
            # A key occurs once in a dict, and indexes only ever sit in
            # storage_data, so keys need no identity map.
            d = idx.__dict__  # {fqn, index} or {fqn, index, offset}: torch's __init__
            off = d.get("offset", _MISSING)
            if (type(idx) not in ok_idx or type(d.get("fqn")) is not str or "index" not in d
                    or type(d["index"]) not in _ATOMS or len(d) != (2 if off is _MISSING else 3)):
                raise _Generic
            if off is not _MISSING and type(off) is not S:
                if type(off) is not tuple:
                    raise _Generic
                d = self.sizes(d, idx_fields)
            key = Index()
            key.state = d
            val = seen.get(id(info))
            if val is None:
                if type(info) not in ok_info:
                    raise _Generic
                d = info.__dict__
                if len(d) == 4 and d.get("transform_descriptors", 0) is None:
                    st = d.copy()  # __getstate__'s result, the usual case: drop the None
                    del st["transform_descriptors"]
                else:
                    st = info.__getstate__()
                    plain.append(st)
                if (type(st) is not dict or type(st.get("relative_path")) is not str
                        or type(st.get("offset")) is not int or type(st.get("length")) is not int):
                    raise _Generic
                val = Info()
                val.state = st
                seen[id(info)] = val
            out[key] = val
        if out:
            self.used.add("fs")
        seen[id(sd)] = out
        return out

    def storage_meta(self, m: Any) -> Any:
        if type(m) not in self.ok["StorageMeta"] or not m.__dict__:
            raise _Generic
        d = m.__dict__
        for k, v in d.items():
            if k == "checkpoint_id" and isinstance(v, pathlib.PurePath):
                if not _path_ok(v):
                    raise _Generic
            else:
                self.plain.append(v)
        return self.new(m, "StorageMeta", d)

    def check_plain(self) -> None:
        """Every passed-on value is written as it is: plain values, torch's
        own objects and str-part paths, no deeper than _PLAIN_DEPTH, sharing
        no container with the rebuilt graph (cycles are the pickler's to
        write). Each container is walked once."""
        seen, native = self.seen, self.native
        done: set[int] = set()

        def walk(v: Any, depth: int) -> None:
            t = type(v)
            if t in _ATOMS or t in native:
                return
            key = id(v)
            if key in seen or depth > _PLAIN_DEPTH:
                raise _Generic
            if key in done:
                return
            done.add(key)
            if t is dict:
                for k, x in v.items():
                    walk(k, depth + 1)
                    walk(x, depth + 1)
            elif t is list or t is tuple or t is set or t is frozenset:
                for x in v:
                    walk(x, depth + 1)
            elif not (isinstance(v, pathlib.PurePath) and _path_ok(v)):
                raise _Generic

        for v in self.plain:
            walk(v, 0)

    # ---- the generic conversion ----

    def value(self, v: Any) -> Any:
        t = type(v)
        if t in _ATOMS:
            return v
        key = id(v)
        hit = self.seen.get(key, _MISSING)
        if hit is not _MISSING:
            return hit
        if t is list:
            out: Any = []
            self.seen[key] = out  # before the items: a list may hold itself
            out.extend([self.value(x) for x in v])
            return out
        if t is dict:
            out = self.seen[key] = {}
            for k, x in v.items():
                out[self.value(k)] = self.value(x)
            return out
        if t is tuple or t is set or t is frozenset:
            items = [self.value(x) for x in v]
            hit = self.seen.get(key, _MISSING)  # made meanwhile, through a list in it
            if hit is not _MISSING:
                return hit
            # unchanged: the object itself (a copied set may iterate in another order)
            same = all(a is b for a, b in zip(items, v))
            out = self.seen[key] = v if same else t(items)
            return out
        if t in self.native:  # torch's own sizes, dtypes, layouts, memory formats
            return v
        name = _torch_name(v)
        if name is not None:
            kind = "layout" if name in _LAYOUT_NAMES else (
                "memfmt" if name in _MEMFMT_NAMES else "dtype")
            return self.torch_obj(name, kind)
        if _is_encoding(v):
            return self.encoding(int(v.value))
        if isinstance(v, pathlib.PurePath):
            if not _path_ok(v):
                raise TypeError(f"cannot pickle path {v!r}")
            return v
        kind = _kind(t)
        if kind is None:
            raise TypeError(
                f"cannot write {t.__module__}.{t.__qualname__} into .metadata; expected the "
                "checkpoint metadata classes, torch dtypes and sizes, or plain Python values"
            )
        state = v.__getstate__()
        self.keep.append(state)
        obj = self.new(v, kind, None)  # memoized before its state, as the pickler does
        if kind == "TensorProperties" and type(state) is tuple and len(state) == 5:
            obj.state = self.props_state(state, False)
        else:
            obj.state = self.state(state, _SIZE_FIELDS.get(kind, frozenset()))
        return obj

    def state(self, st: Any, fields: frozenset[str]) -> Any:
        """An instance's state dict, its size fields made sizes."""
        if type(st) is not dict or not fields:
            return self.value(st)
        hit = self.seen.get(id(st), _MISSING)
        if hit is not _MISSING:
            return hit
        out = self.seen[id(st)] = {}
        for k, x in st.items():
            if k in fields and not (x is None and k == "offset"):
                x = self.size(x)
            else:
                x = self.value(x)
            out[self.value(k)] = x
        return out

    def size(self, v: Any) -> Any:
        """A value in a torch.Size field: a real one as it is (memoized by
        identity), a tuple as a new Size each time, anything else (a list)
        as one Size per object."""
        t = type(v)
        if t is self.Size:
            return v
        if t is tuple:
            return self.new_size(v)
        hit = self.seen.get(id(v), _MISSING)
        if hit is _MISSING:
            hit = self.seen[id(v)] = self.new_size(tuple(v))
        return hit


# --------------------------------------------------------------------------
# The writer
# --------------------------------------------------------------------------


@functools.cache
def _drops_none(cls: type) -> Any:
    """cls.__getstate__ if it gives the instance's values that are not None
    in order (torch's and _torchfree's _StorageInfo), which md_dumps then
    emulates; else None (md_dumps calls it). Checked on a probe, once per
    class."""
    fn = getattr(cls, "__getstate__", None)
    try:
        probe = cls("p", 1, 2)
        probe.__dict__.update(transform_descriptors=None, extra=[3])
        ok = list(fn(probe).items()) == [("relative_path", "p"), ("offset", 1), ("length", 2),
                                          ("extra", [3])]
    except Exception:
        ok = False
    return fn if ok else None


def _c_context(conv: _Convert) -> tuple:
    """What ``_core.md_dumps`` needs of a conversion (see csrc/py/mdwrite.c):
    the accepted types and the stand-in class of each metadata class, the
    Size class, the types plain values may hold as they are, the types
    written through their reduce value, PurePath, props_state, the known
    _StorageInfo.__getstate__, copyreg's dispatch table, torch loaded."""
    ph, torch = conv.ph, conv.torch
    reducible = [ph.dtype_cls, ph.memfmt_cls, type(ph.torch_obj("torch.strided", "layout")),
                 type(ph.encodings[0])]
    if torch is not None:
        reducible += [torch.dtype, torch.layout]
    return (tuple(tuple(conv.ok[n]) for n in _CLASSES),
            tuple(ph.classes[n] for n in _CLASSES), conv.Size, tuple(conv.native),
            tuple(reducible), pathlib.PurePath, conv.props_state,
            tuple({_drops_none(t) for t in conv.ok["_StorageInfo"]} - {None}),
            copyreg.dispatch_table, torch is not None)


_C_USED = ((1, "md"), (2, "fs"), (4, "size"))


def _dumps_c(md: Any, ph: _Placeholders, torch: Any) -> bytes | None:
    """The fast conversion and the pickler in one C walk (``_core.md_dumps``):
    the bytes ``pickle.dumps`` gives for ``_Convert.fast``'s graph, renamed;
    None where that walk does not cover ``md`` (the Python conversions do)
    or the data spells this set's names."""
    conv = _Convert(ph, torch)
    try:
        res = _core.md_dumps(md, _c_context(conv))
    except (_Generic, LookupError, AttributeError, TypeError, ValueError):
        return None
    if res is None:
        return None
    data, used = res
    conv.used.update(tag for bit, tag in _C_USED if used & bit)
    return ph.rename(data, conv.used)


def _dumps(md: Any, generic: bool | None = None, c: bool = True) -> bytes | None:
    """``dumps_metadata`` by a chosen conversion: ``generic=None`` the fast
    one (the C walk first, unless ``c`` is False), else the generic one;
    ``False`` the fast one only (None where it hands over); ``True`` the
    generic one only. Tests and the benchmark compare them."""
    torch = loaded_torch()
    # the reader's compact chunk lists (_mdlazy) are written as the lists
    # they stand for: the bytes torch writes for those
    md = _mdlazy.materialized(md)
    with gc_paused():
        for ph in _placeholder_sets():
            if c and not generic:
                data = _dumps_c(md, ph, torch)
                if data is not None:
                    return data
            conv = _Convert(ph, torch)
            if generic:
                root = conv.value(md)
            else:
                try:
                    root = conv.fast(md)
                except (_Generic, LookupError, AttributeError, TypeError, ValueError):
                    if generic is False:
                        return None
                    conv = _Convert(ph, torch)
                    root = conv.value(md)
            data = ph.rename(pickle.dumps(root, protocol=4), conv.used)
            if data is not None:
                return data
    raise ValueError(f"the data spells all {_MAX_SETS} sets of placeholder module names")


def dumps_metadata(md: Any) -> bytes:
    """The ``.metadata`` file for ``md``, as torch's FileSystemWriter writes it.

    ``md`` is a :class:`~shardstate.checkpoint.metadata.Metadata` (holding
    torch objects or stand-ins: tuples for ``torch.Size``, ``TorchName`` for
    dtypes and layouts) or torch's own ``Metadata``. torch is never imported;
    the classes are written under torch's import paths (protocol 4), so
    ``pickle.load`` in a process with torch gives torch's classes. The bytes
    equal ``pickle.dumps(torch_md)`` for the torch ``Metadata`` with the same
    values and the same object sharing (see the module docstring). TypeError
    for values outside the checkpoint metadata classes, torch's sizes,
    dtypes, layouts, memory formats, paths and plain Python values.
    """
    data = _dumps(md)
    assert data is not None
    return data
