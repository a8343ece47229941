"""``.metadata`` and bytes items: one writer, one restricted reader.

Writing. ``dumps_metadata`` (``writer``) gives the protocol-4 pickle that
torch's ``FileSystemWriter`` writes with ``pickle.dump(metadata)``
(docs/FORMAT.md, section 7), byte for byte, naming torch's classes by their
import paths, with or without torch: a C walk (``_core.md_dumps``) writes
what CPython's C pickler writes for stand-ins (``standins``: classes in
placeholder modules named with the lengths of torch's, renamed in the
output), and the pickler itself runs on them for graphs the walk does not
cover.

Reading. ``loads_metadata`` runs the restricted reader. First its fast
path (``fastread``): C decodes the stream (csrc/core/ss_mdread.c, GIL
released) and makes the metadata classes in one pass with ``build``'s
checks (csrc/py/mdread.c), for the globals and forms torch's pickle of a
Metadata uses; it answers None for anything else. Then, for those, the
reference (``_reference``), which decides, errors included: ``unpickler``
turns the bytes into a graph of inert stand-ins with ``find_class`` limited
to an allowlist (``allowlist``; on CPython's C unpickler for streams the C
scan passes, else on the pure-Python reference), and ``build`` validates
the graph and makes shardstate's metadata classes. The fast path gives the
same Metadata the reference would, or None (tests/test_mdread.py). Nothing
outside the allowlist is imported or called. ``allow_unsafe=True`` is a
plain ``pickle.loads`` instead, for trusted checkpoints.

Bytes items. ``dumps_object`` / ``loads_object`` (``objects``): the record
``torch.save`` writes for a DCP bytes item, and its restricted read.

Errors (``errors``): ``UnsafePickleError`` names a global or a call outside
the allowlist; ``PickleFormatError`` is anything else wrong with the bytes.
Both subclass ``shardstate.ShardstateError`` and ``pickle.UnpicklingError``;
no other exception escapes the restricted ``loads_*`` for any input.

Imports, without cycles: writer -> standins -> names; allowlist -> names,
errors; unpickler -> allowlist, errors; build -> allowlist, errors; fastread -> build,
allowlist, names; objects -> build, unpickler, allowlist.

Invariants: no torch import anywhere in this package (torch objects are
built only when torch is already in ``sys.modules``). Functions are
thread-safe.
"""

from __future__ import annotations

import pickle
from typing import Any

from ..._util import gc_paused
from ..metadata import Metadata
from .allowlist import _METADATA_GLOBALS, _PROXIES
from .build import _build, from_unpickled
from .errors import PickleFormatError, UnsafePickleError
from .fastread import _fast
from .objects import dumps_object, loads_object
from .unpickler import _unpickle
from .writer import dumps_metadata

__all__ = [
    "PickleFormatError",
    "UnsafePickleError",
    "dumps_metadata",
    "dumps_object",
    "gc_paused",
    "loads_metadata",
    "loads_object",
]


def loads_metadata(data: Any, *, allow_unsafe: bool = False) -> Metadata:
    """Reads a ``.metadata`` pickle (any bytes-like object: bytes, a
    ``MappedFile``) into shardstate's metadata classes.

    Only torch's checkpoint metadata classes, ``_StorageInfo``, ``torch.Size``,
    dtypes, layouts, memory formats, paths and plain Python values are
    admitted; anything else raises :class:`UnsafePickleError` naming it (and
    the trusted opt-in), and nothing it names is imported or called.
    Metadata written by older torch versions (fewer fields,
    ``TensorProperties`` as a dict or as the legacy
    ``torch.distributed._shard.sharded_tensor.metadata.TensorProperties``)
    is accepted.

    ``allow_unsafe=True`` (``FileSystemReader(path, unsafe_unpickle=True)``)
    is a plain ``pickle.loads``, which imports and runs whatever the file
    names: for trusted checkpoints only. Its objects are used as they are;
    only torch's ``Metadata`` itself is made ours (``build.from_unpickled``).
    """
    if allow_unsafe:
        return from_unpickled(pickle.loads(data))
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(".metadata must be a bytes-like object, "
                        f"got {type(data).__name__}") from None
    # Any buffer (bytes, a MappedFile): the fast path holds a view of it
    # while C decodes with the GIL released, so it cannot be unmapped or
    # resized meanwhile (writable buffers are decoded with the GIL held).
    with view, gc_paused():
        md = _fast(view)
        if md is not None:
            return md
        return _reference(view)


def _reference(data: bytes | memoryview) -> Metadata:
    """The reference reader (``unpickler`` + ``build``): what the fast path
    must agree with, and what decides every stream it does not take."""
    try:
        obj = _unpickle(data, _METADATA_GLOBALS, ".metadata")
    except UnsafePickleError as e:
        raise UnsafePickleError(
            f"{e}; a trusted checkpoint loads with FileSystemReader(path, "
            "unsafe_unpickle=True), which reads .metadata with plain pickle") from None
    if type(obj) is not _PROXIES["Metadata"]:
        raise PickleFormatError(f".metadata holds {type(obj).__name__}, not a Metadata")
    return _build(".metadata", obj)
