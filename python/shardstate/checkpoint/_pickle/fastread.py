"""The restricted ``.metadata`` reader's fast path: ``_core.metadata_decode``.

``_fast(data)`` is the Metadata the reference path (``unpickler`` +
``build``) would make from ``data``, made in one pass by C
(csrc/core/ss_mdread.c decodes the stream with the GIL released,
csrc/py/mdread.c makes the objects), or None where the fast path does not
recognise the stream: anything but the globals, classes and forms torch's
pickle of a Metadata uses, or anything the reference might refuse. The
caller then runs the reference, which decides (errors included), so the fast
path never answers differently from it.

The context handed to C maps the allowlisted names the fast path decodes
(``allowlist._METADATA_GLOBALS``' metadata classes, torch.Size, dtypes,
layouts, memory formats, and the pathlib classes with the class
``build.path_class`` makes for each) to codes and the objects ``build`` would make for
them; it is made once per torch state (loaded or not), with
TensorProperties' defaults taken at each call (the default dtype may change).

A Metadata of at least ``_mdlazy.LAZY_MIN`` chunks gets its chunk lists and
its storage_data in the compact form (``_mdlazy.ChunkList``, ``StorageMap``:
int64 arrays filled by C; the objects made on demand) wherever the stream
shares nothing of them.

No torch import; thread-safe.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from ... import _core
from ..._util import loaded_torch
from .. import _mdlazy
from .. import metadata as _md
from . import build as _b
from .allowlist import _PATH_CLASSES
from .names import _DTYPE_NAMES, _LAYOUT_NAMES, _LEGACY_MOD, _MD_MOD, _MEMFMT_NAMES, _torch_module

# The class order of csrc/py/mdread.c's CLS_*, then its other codes.
_CLASSES = ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
            "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_StorageInfo")
_G_SIZE, _G_DTYPE, _G_MEMFMT, _G_LAYOUT, _G_MEMENC, _G_PATH = range(len(_CLASSES),
                                                                   len(_CLASSES) + 6)

_FIELDS = (_b._F_METADATA, _b._F_TENSOR, _b._F_PROPS, _b._F_CHUNK, _b._F_BYTES, _b._F_INDEX,
           _b._F_STORAGE_META, _b._F_STORAGE_INFO)

_cache: dict[bool, tuple[Any, ...] | None] = {}

# The columns csrc/py/mdread.c's lazy_storage hands make_storage, in order
# (read-only arrays of these types, owning the memory C filled).
_STORAGE_COLS = (("fid", np.int32), ("pid", np.int32), ("flags", np.uint8), ("kndim", np.int8),
                 ("koff", np.int64), ("kidx", np.int64), ("off", np.int64), ("len", np.int64),
                 ("crc", np.uint32))


def _plain_attrs(cls: type, names: frozenset[str]) -> bool:
    """Whether setting these attributes (the C path) is ``o.__dict__.update``
    (build.py): instances have a __dict__ and no data descriptor takes a name."""
    if not cls.__dictoffset__:
        return False
    return not any(hasattr(type(inspect.getattr_static(cls, n, None)), "__set__")
                   or hasattr(type(inspect.getattr_static(cls, n, None)), "__delete__")
                   for n in names)


def _torch_obj(name: str, torch: Any) -> Any:
    """What build.py's torch_obj makes of a name; None where it would fail."""
    if torch is None:
        return _md.TorchName(name)
    try:
        return _md.TorchName(name).resolve()
    except AttributeError:
        return None


def _context(torch: Any) -> tuple[Any, ...] | None:
    """The context for C, or None where the fast path cannot serve."""
    key = torch is not None
    if key in _cache:
        return _cache[key]
    classes = tuple(getattr(_md, n) for n in _CLASSES)
    if not all(_plain_attrs(c, f.known) for c, f in zip(classes, _FIELDS)):
        _cache[key] = None
        return None
    g: dict[tuple[str, str], tuple[int, Any]] = {
        (_torch_module(n), n): (i, None) for i, n in enumerate(_CLASSES)
    }
    g[(_LEGACY_MOD, "TensorProperties")] = (_CLASSES.index("TensorProperties"), None)
    g[("torch", "Size")] = (_G_SIZE, None)
    for n in _DTYPE_NAMES:
        obj = _torch_obj(f"torch.{n}", torch)
        if obj is not None:
            g[("torch", n)] = (_G_DTYPE, obj)
    for n in _MEMFMT_NAMES:
        obj = _torch_obj(n, torch)
        if obj is not None:
            g[("torch", n.removeprefix("torch."))] = (_G_MEMFMT, obj)
            g[("torch._utils", n)] = (_G_MEMFMT, obj)
    layouts = {n: obj for n in _LAYOUT_NAMES if (obj := _torch_obj(n, torch)) is not None}
    g[("torch.serialization", "_get_layout")] = (_G_LAYOUT, layouts)
    g[(_MD_MOD, "_MEM_FORMAT_ENCODING")] = (_G_MEMENC, None)
    g[(_LEGACY_MOD, "MEM_FORMAT_ENCODING")] = (_G_MEMENC, None)
    for n in _PATH_CLASSES:
        g[("pathlib", n)] = (_G_PATH, _b.path_class(n))
    memfmt = tuple(_torch_obj(n, torch) for n in (
        "torch.contiguous_format", "torch.channels_last", "torch.preserve_format"))
    size_type = torch.Size if torch is not None else None
    chunk_cls = _md.ChunkStorageMetadata
    size_or_tuple = size_type if size_type is not None else tuple

    def make_chunks(off: np.ndarray, sizes: np.ndarray, count: int,
                    ndim: int) -> _mdlazy.ChunkList:
        # read-only (count, ndim) int64: views of C's rows or a copy
        return _mdlazy.ChunkList(off, sizes, chunk_cls, size_or_tuple)

    index_cls, info_cls = _md.MetadataIndex, _md._StorageInfo

    def make_storage(key_order: tuple[str, str, str], strs: list[str],
                     *cols: np.ndarray) -> _mdlazy.StorageMap:
        arrays = {name: c for (name, _), c in zip(_STORAGE_COLS, cols)}
        return _mdlazy.StorageMap(key_order, strs, arrays, index_cls, info_cls, size_or_tuple)

    got = _cache[key] = (classes, g, size_type, memfmt, make_chunks, make_storage)
    return got


def _fast(data: Any) -> Any:
    """The Metadata, or None: not recognised (the reference decides).
    ``data``: any buffer (C holds a view of it for the whole call)."""
    ctx = _context(loaded_torch())
    if ctx is None:
        return None
    classes, g, size_type, memfmt, make_chunks, make_storage = ctx
    try:
        defaults = dict(_md.TensorProperties().__dict__)
    except Exception:  # noqa: BLE001 - the reference builds these itself
        return None
    return _core.metadata_decode(data, (classes, g, defaults, size_type, memfmt,
                                        (_mdlazy.LAZY_MIN, make_chunks, make_storage)))
