"""Placeholder modules and the stand-ins in them, for the ``.metadata`` writer.

CPython's C pickler writes a global by importing its module and checking
the object is found there, so it cannot name torch's classes without
torch's modules. A set of placeholders (``_Placeholders``) is five modules,
registered in ``sys.modules``, each named with exactly the length of the
torch module it stands for::

    torch.distributed.checkpoint.metadata    metadata classes, _MEM_FORMAT_ENCODING
    torch.distributed.checkpoint.filesystem  _StorageInfo
    torch                                    dtypes and Size
    torch.serialization                      _get_layout (layouts)
    torch._utils                             memory formats

holding stand-ins that pickle as torch's objects do. The pickler writes each
module name once (a string, then memoized); ``rename`` turns it into torch's
in place, which changes no length, so every ``FRAME`` and memo index holds.
It renames only names that occur exactly as often as they were used: data
that spells a placeholder name (a string or bytes of the user's) makes the
writer take the next set (``_placeholder_sets``).

Names a pickle shares by identity: the stand-ins' class names are the
interned strings torch's classes have too; the names torch makes anew each
time (its dtypes', layouts' and Size's) are fresh strings here, shared with
nothing.

No torch import. Thread-safe: sets and stand-ins are made once, under a lock.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterable, Iterator
from enum import Enum
from typing import Any

from .names import _FS_MOD, _MD_MOD

_CLASSES = ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
            "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_StorageInfo")


# --------------------------------------------------------------------------
# Placeholder modules and their stand-ins
# --------------------------------------------------------------------------


def _fresh(s: str) -> str:
    """An equal string that is no other object (never interned): torch's
    names for sizes, dtypes and layouts are new strings, shared with nothing."""
    return s[:1] + s[1:]


def _op(name: str) -> bytes:
    """``SHORT_BINUNICODE name MEMOIZE``: how the C pickler (protocol 4)
    writes a module name the first time."""
    b = name.encode()
    return b"\x8c" + bytes((len(b),)) + b + b"\x94"


class _StandIn:
    """Base of the stand-in metadata classes: pickled as ``cls.__new__(cls)``
    and then, unless ``state`` is None, ``BUILD state``."""

    __slots__ = ("state",)

    def __getstate__(self) -> Any:
        return self.state


class _ByName:
    """A dtype or memory format: pickled as the global its name says."""

    __slots__ = ("name",)

    def __reduce__(self) -> str:
        return self.name


class _Layout:
    """A layout: pickled as ``torch.serialization._get_layout(name)``."""

    __slots__ = ("name", "fn")

    def __reduce__(self) -> tuple:
        return self.fn, (self.name,)


def _size_reduce(self: tuple) -> tuple:
    return type(self), (tuple(self),)


class _Taken(Exception):
    """A placeholder module name is already in sys.modules."""


class _Placeholders:
    """One set of placeholder modules (``variant``) and the stand-ins in them.

    ``ops[tag]`` is (the placeholder's module name as pickled, torch's) for
    each tag the converter records in ``used``: md, fs, dtype, size, layout,
    memfmt. dtype and size are two distinct strings naming one module, as
    torch's dtypes and ``torch.Size`` give two ``'torch'`` strings."""

    def __init__(self, variant: int) -> None:
        self.ops: dict[str, tuple[bytes, bytes]] = {}
        self.named: dict[tuple[str, str], Any] = {}
        mods: dict[str, Any] = {}

        def module(tag: str, real: str, alias: str | None = None) -> tuple[str, Any]:
            name = (f"_ss{variant:02x}_" + real.replace(".", "_"))[: len(real)]
            if name in sys.modules:  # another copy of this module's, or anyone's
                raise _Taken(name)
            mod = mods[name] = types.ModuleType(name, f"shardstate: stands for {real} in .metadata")
            self.ops[tag] = (_op(name), _op(real))
            if alias is not None:
                self.ops[alias] = self.ops[tag]
            return name, mod

        md_name, md = module("md", _MD_MOD)
        fs_name, fs = module("fs", _FS_MOD)
        dt_name, self.torch_mod = module("dtype", "torch", "size")
        lay_name, lay = module("layout", "torch.serialization")
        mf_name, mf = module("memfmt", "torch._utils")
        self.classes: dict[str, type] = {}
        for cls_name in _CLASSES:
            home, mod = (fs_name, fs) if cls_name == "_StorageInfo" else (md_name, md)
            cls = type(cls_name, (_StandIn,), {"__slots__": (), "__module__": home})
            setattr(mod, cls_name, cls)
            self.classes[cls_name] = cls
        enc = Enum("_MEM_FORMAT_ENCODING",  # type: ignore[misc]
                   [("TORCH_CONTIGUOUS_FORMAT", 0), ("TORCH_CHANNELS_LAST", 1),
                    ("TORCH_PRESERVE_FORMAT", 2)], module=md_name, qualname="_MEM_FORMAT_ENCODING")
        enc.__module__ = md_name  # the classes' own string: the pickler writes it once
        md._MEM_FORMAT_ENCODING = enc
        self.encodings = tuple(enc)
        size = type("Size", (tuple,), {"__slots__": (), "__module__": _fresh(dt_name),
                                       "__reduce__": _size_reduce})
        size.__qualname__ = _fresh("Size")
        self.torch_mod.Size = self.Size = size
        self.dtype_cls = type("dtype", (_ByName,), {"__slots__": (), "__module__": dt_name})
        self.memfmt_cls = type("memory_format", (_ByName,),
                               {"__slots__": (), "__module__": mf_name})
        self.memfmt_ns = mf.torch = types.SimpleNamespace()

        def _get_layout(name: str) -> Any:
            raise RuntimeError("a placeholder; never called")

        _get_layout.__module__ = lay_name
        _get_layout.__qualname__ = "_get_layout"
        lay._get_layout = self.get_layout = _get_layout
        sys.modules.update(mods)  # the pickler imports them to find the stand-ins

    def torch_obj(self, name: str, kind: str) -> Any:
        """The stand-in for torch's dtype, layout or memory format ``name``
        ("torch.float32"), one per name; TypeError for a name no global can
        spell."""
        obj = self.named.get((kind, name))
        if obj is not None:
            return obj
        with _LOCK:
            obj = self.named.get((kind, name))
            if obj is None:
                obj = self.named[(kind, name)] = self._make(name, kind)
        return obj

    def _make(self, name: str, kind: str) -> Any:
        if kind == "layout":
            obj: Any = _Layout()
            obj.name, obj.fn = _fresh(name), self.get_layout
            return obj
        short = name.removeprefix("torch.")
        if not short.isidentifier() or short.startswith("_") or short == "Size" or (
                kind == "memfmt" and short == name):
            raise TypeError(f"cannot write {name!r} into .metadata as a torch {kind}")
        if kind == "memfmt":
            obj = self.memfmt_cls()
            obj.name = _fresh(name)
            setattr(self.memfmt_ns, short, obj)
        else:
            obj = self.dtype_cls()
            obj.name = _fresh(short)
            setattr(self.torch_mod, short, obj)
        return obj

    def rename(self, data: bytes, used: Iterable[str]) -> bytes | None:
        """``data`` with the used placeholder module names renamed to torch's,
        or None when one of them occurs other than as often as it was used."""
        want: dict[bytes, list[Any]] = {}
        for tag in used:
            ph, real = self.ops[tag]
            want.setdefault(ph, [real, 0])[1] += 1
        for ph, (real, n) in want.items():
            if data.count(ph) != n:
                return None
            data = data.replace(ph, real, n)
        return data


_LOCK = threading.Lock()
_SETS: list[_Placeholders | None] = []
_MAX_SETS = 64


def _placeholder_sets() -> Iterator[_Placeholders]:
    """Set 0, then the next ones, made as first needed; a set whose names
    are taken (a reloaded copy of this module made them) is skipped."""
    for v in range(_MAX_SETS):
        if v == len(_SETS):
            with _LOCK:
                if v == len(_SETS):
                    try:
                        _SETS.append(_Placeholders(v))
                    except _Taken:
                        _SETS.append(None)
        ph = _SETS[v]
        if ph is not None:
            yield ph
