"""The compact form of a large checkpoint's decoded metadata.

``ChunkList`` stands for ``TensorStorageMetadata.chunks`` (a list of
ChunkStorageMetadata) as two read-only ``(n, ndim)`` int64 arrays, the
chunks' offsets and sizes; ``StorageMap`` for ``Metadata.storage_data``
({MetadataIndex: _StorageInfo}) as columns (ids into one table of strings
for the keys' fqns and the infos' paths, the keys' offsets and indexes, the
infos' offsets, lengths and CRCs). C fills them while the ``.metadata``
stream is decoded (csrc/py/mdread.c): tens of bytes a chunk instead of the
few hundred a ChunkStorageMetadata and its two torch.Size, or a
MetadataIndex and its _StorageInfo, take. The restricted reader makes them
only for a Metadata of at least ``LAZY_MIN`` chunks, and only where the
stream shares none of their objects with anything else (but strings, which
stay one object per share), so the objects they stand for are exactly the
ones they make on demand (fastread.py, mdread.c).

Drop-ins for the list and the dict as torch's code uses them: ``len``,
indexing / lookup by key, iteration, ``in``, ``==`` (both ways), ``copy`` and
``deepcopy``. A ChunkList makes the list itself on the first access to an
element; a StorageMap makes only the entry a lookup finds, and the dict on
iteration; both on any change (``materialize``): the objects are then made
once, keep their identity, and a user's changes are kept, as in a list or a
dict. The arrays are the answer only until then (``arrays()`` gives None
afterwards), so code that reads them (the load planner, ``_records``, the
reader's ``IndexKeyView``) never sees stale values.

Differences by design: ``isinstance(x, list)`` / ``isinstance(x, dict)``
are False (a StorageMap is a ``collections.abc.Mapping``), and a plain
``pickle.dumps`` writes them as ``builtins.list(items)`` /
``builtins.dict(items)`` (which any unpickler reads back as the list or
dict); ``_pickle.dumps_metadata`` writes the bytes torch writes for the
Metadata they stand for (``materialized``).

Not thread-safe for concurrent mutation (as a list or a dict is not).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

__all__ = ["LAZY_MIN", "ChunkList", "IndexKeyView", "StorageMap", "arrays_of", "materialized"]

# A Metadata with at least this many chunks in all is read into ChunkLists
# (fastread.py passes it to C; tests lower it to cover small files).
LAZY_MIN = 65536


class ChunkList:
    """A tensor's saved chunks as arrays; the list on demand."""

    __slots__ = ("_chunk", "_items", "_off", "_size", "_sizes")
    __hash__ = None  # type: ignore[assignment]  # as a list

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray, chunk_cls: type,
                 size_type: Any) -> None:
        self._off = offsets
        self._sizes = sizes
        self._chunk = chunk_cls
        self._size = size_type
        self._items: list[Any] | None = None

    # -- the compact form ---------------------------------------------------
    def arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(offsets, sizes), read-only (n, ndim) int64; None once the list
        was made (it may have changed since)."""
        return None if self._items is not None else (self._off, self._sizes)

    def make_chunk(self, i: int) -> Any:
        """A new ChunkStorageMetadata equal to chunk ``i`` (not the list's
        element: for reading only)."""
        if self._items is not None:
            return self._items[i]
        S = self._size
        return self._chunk(offsets=S(self._off[i].tolist()), sizes=S(self._sizes[i].tolist()))

    def materialize(self) -> list[Any]:
        """The list (made once): every later access and change goes to it."""
        if self._items is None:
            self._items = self.to_list()
        return self._items

    def to_list(self) -> list[Any]:
        """The list once made, else a new list of new chunks, equal to it
        (kept by nobody: this stays compact)."""
        if self._items is not None:
            return self._items
        S, C = self._size, self._chunk
        new = C.__new__
        items = []
        append = items.append
        for o, n in zip(self._off.tolist(), self._sizes.tolist()):
            c = new(C)
            c.offsets = S(o)
            c.sizes = S(n)
            append(c)
        return items

    # -- read access ----------------------------------------------------------
    def __len__(self) -> int:
        return len(self._items) if self._items is not None else len(self._off)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __getitem__(self, i: Any) -> Any:
        return self.materialize()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.materialize())

    def __reversed__(self) -> Iterator[Any]:
        return reversed(self.materialize())

    def __contains__(self, x: Any) -> bool:
        return x in self.materialize()

    def index(self, *args: Any) -> int:
        return self.materialize().index(*args)

    def count(self, x: Any) -> int:
        return self.materialize().count(x)

    def copy(self) -> list[Any]:
        return self.materialize().copy()

    def __eq__(self, other: Any) -> Any:
        if isinstance(other, ChunkList):
            a, b = self.arrays(), other.arrays()
            if a is not None and b is not None and self._size is other._size \
                    and self._chunk is other._chunk:
                return (a[0].shape == b[0].shape and bool(np.array_equal(a[0], b[0]))
                        and bool(np.array_equal(a[1], b[1])))
            return self.to_list() == other.to_list()
        if isinstance(other, list):
            return self.to_list() == other
        return NotImplemented

    def __lt__(self, other: Any) -> Any:
        return self.materialize() < _plain(other)

    def __le__(self, other: Any) -> Any:
        return self.materialize() <= _plain(other)

    def __gt__(self, other: Any) -> Any:
        return self.materialize() > _plain(other)

    def __ge__(self, other: Any) -> Any:
        return self.materialize() >= _plain(other)

    def __add__(self, other: Any) -> list[Any]:
        return self.materialize() + _plain(other)

    def __radd__(self, other: Any) -> list[Any]:
        return _plain(other) + self.materialize()

    def __mul__(self, n: int) -> list[Any]:
        return self.materialize() * n

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return repr(self.to_list())

    # -- mutation: on the list ------------------------------------------------
    def __setitem__(self, i: Any, v: Any) -> None:
        self.materialize()[i] = v

    def __delitem__(self, i: Any) -> None:
        del self.materialize()[i]

    def __iadd__(self, other: Any) -> ChunkList:
        self.materialize().extend(other)
        return self

    def __imul__(self, n: int) -> ChunkList:
        items = self.materialize()
        items *= n
        return self

    def append(self, x: Any) -> None:
        self.materialize().append(x)

    def extend(self, xs: Any) -> None:
        self.materialize().extend(xs)

    def insert(self, i: int, x: Any) -> None:
        self.materialize().insert(i, x)

    def pop(self, *args: Any) -> Any:
        return self.materialize().pop(*args)

    def remove(self, x: Any) -> None:
        self.materialize().remove(x)

    def clear(self) -> None:
        self.materialize().clear()

    def reverse(self) -> None:
        self.materialize().reverse()

    def sort(self, **kwargs: Any) -> None:
        self.materialize().sort(**kwargs)

    # -- copies and pickling ----------------------------------------------------
    def __copy__(self) -> ChunkList:
        new = ChunkList(self._off, self._sizes, self._chunk, self._size)
        if self._items is not None:
            new._items = list(self._items)
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        import copy

        if self._items is not None:
            return copy.deepcopy(self._items, memo)
        # the arrays are read-only: shared by the copies
        return ChunkList(self._off, self._sizes, self._chunk, self._size)

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (self.to_list(),))


def _plain(x: Any) -> Any:
    return x.materialize() if isinstance(x, ChunkList) else x


# StorageMap's per-entry flags (csrc/py/mdread.c's SD_*).
_FQN_FRESH, _PATH_FRESH, _IDX_NONE, _HAS_CRC, _CRC_NONE, _OFF_ABSENT = 1, 2, 4, 8, 16, 32


def _fresh(s: str) -> str:
    """An equal str that is another object (the stream wrote it again)."""
    return s.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")


class StorageMap(Mapping):
    """``Metadata.storage_data`` ({MetadataIndex: _StorageInfo}) as arrays:
    per entry the key's fqn and the info's relative_path as ids into one
    table of strings, the key's offset and index, the info's offset, length
    and shardstate_crc32 (csrc/py/mdread.c fills them). A lookup by key
    (``[]``, ``get``, ``in``) makes only the entry it finds; anything else
    (iteration, ``items()``, ``==``) or any change makes the dict, once, and
    goes to it from then on, as with ChunkList. Entries are made as the
    reference reader makes them: the same fields in the same order, the
    strings the stream shares one object, the others each their own."""

    __slots__ = ("_a", "_cls", "_dict", "_lookup", "_order", "_size", "_strs")
    __hash__ = None  # type: ignore[assignment]  # as a dict

    def __init__(self, key_order: tuple[str, str, str], strs: list[str],
                 arrays: dict[str, np.ndarray], index_cls: type, info_cls: type,
                 size_type: Any) -> None:
        self._order = key_order  # the keys' fields as the stream set them
        self._strs = strs
        self._a = arrays  # fid pid flags kndim koff kidx off len crc (+ kstart)
        self._cls = (index_cls, info_cls)
        self._size = size_type
        self._dict: dict[Any, Any] | None = None
        self._lookup: Any = None

    # -- the compact form ---------------------------------------------------
    def _key_offset(self, p: int) -> Any:
        a = self._a
        nd = int(a["kndim"][p])
        if nd < 0:
            return None
        if "kstart" not in a:
            a["kstart"] = np.concatenate(([0], np.cumsum(np.maximum(a["kndim"], 0))))
        start = int(a["kstart"][p])
        return self._size(a["koff"][start:start + nd].tolist())

    def _entry(self, p: int) -> tuple[Any, Any]:
        """Entry p, made (key, info)."""
        a, strs = self._a, self._strs
        fl = int(a["flags"][p])
        Index, Info = self._cls
        fqn = strs[a["fid"][p]]
        fields = {"fqn": _fresh(fqn) if fl & _FQN_FRESH else fqn,
                  "offset": self._key_offset(p),
                  "index": None if fl & _IDX_NONE else int(a["kidx"][p])}
        if fl & _OFF_ABSENT:
            del fields["offset"]
        key = Index.__new__(Index)
        for name in self._order:
            if name in fields:
                object.__setattr__(key, name, fields[name])
        path = strs[a["pid"][p]]
        info = Info.__new__(Info)
        info.relative_path = _fresh(path) if fl & _PATH_FRESH else path
        info.offset = int(a["off"][p])
        info.length = int(a["len"][p])
        if fl & _HAS_CRC:
            info.shardstate_crc32 = None if fl & _CRC_NONE else int(a["crc"][p])
        return key, info

    def to_dict(self) -> dict[Any, Any]:
        """The dict once made, else a new dict of new entries (kept by
        nobody: this stays compact)."""
        if self._dict is not None:
            return self._dict
        return dict(self._entry(p) for p in range(len(self._a["fid"])))

    def materialize(self) -> dict[Any, Any]:
        if self._dict is None:
            self._dict = self.to_dict()
            self._lookup = None
        return self._dict

    def find(self, fqn: Any, offset: Any) -> int | None:
        """The position of the entry keyed (fqn, offset) (offset a tuple or
        None, compared as the dict compares keys); None if there is none.
        The entries of one fqn are compared with the offset in NumPy."""
        lk = self._lookup
        a = self._a
        if lk is None:
            order = np.argsort(a["fid"], kind="stable")
            counts = np.bincount(a["fid"], minlength=len(self._strs))
            starts = np.concatenate(([0], np.cumsum(counts)))
            by_value: dict[str, list[int]] = {}
            for i in np.flatnonzero(counts).tolist():
                by_value.setdefault(self._strs[i], []).append(i)
            if "kstart" not in a:
                a["kstart"] = np.concatenate(([0], np.cumsum(np.maximum(a["kndim"], 0))))
            lk = self._lookup = (order, starts, by_value)
        order, starts, by_value = lk
        ids = by_value.get(fqn) if type(fqn) is str else None
        if ids is None:
            return None
        for i in ids:
            pos = order[starts[i]:starts[i + 1]]
            nd = a["kndim"][pos]
            if offset is None:
                hit = pos[nd < 0]
            else:
                sel = pos[nd == len(offset)]
                if len(offset) and len(sel):
                    try:
                        want = np.array(offset)
                        cells = a["kstart"][sel][:, None] + np.arange(len(offset))
                        hit = sel[(a["koff"][cells] == want).all(axis=1)]
                    except (TypeError, ValueError, OverflowError):
                        return None
                else:
                    hit = sel
            if len(hit):
                return int(hit[0])
        return None

    def _get(self, key: Any) -> tuple[bool, Any]:
        fqn, off = getattr(key, "fqn", None), getattr(key, "offset", _NO)
        if off is _NO or type(key) is not self._cls[0]:
            return False, None  # only a MetadataIndex equals a key (dataclass eq)
        try:
            want = None if off is None else tuple(off)
        except TypeError:
            return False, None
        p = self.find(fqn, want)
        return (False, None) if p is None else (True, self._entry(p)[1])

    # -- the Mapping --------------------------------------------------------------
    def __getitem__(self, key: Any) -> Any:
        if self._dict is not None:
            return self._dict[key]
        ok, v = self._get(key)
        if not ok:
            raise KeyError(key)
        return v

    def get(self, key: Any, default: Any = None) -> Any:
        if self._dict is not None:
            return self._dict.get(key, default)
        ok, v = self._get(key)
        return v if ok else default

    def __contains__(self, key: Any) -> bool:
        if self._dict is not None:
            return key in self._dict
        return self._get(key)[0]

    def __len__(self) -> int:
        return len(self._dict) if self._dict is not None else len(self._a["fid"])

    def __iter__(self) -> Iterator[Any]:
        return iter(self.materialize())

    def keys(self) -> Any:
        return self.materialize().keys()

    def values(self) -> Any:
        return self.materialize().values()

    def items(self) -> Any:
        return self.materialize().items()

    def __eq__(self, other: Any) -> Any:
        if isinstance(other, StorageMap):
            return self.to_dict() == other.to_dict()
        if isinstance(other, Mapping):
            return self.to_dict() == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self.to_dict())

    def __or__(self, other: Any) -> Any:
        return self.to_dict() | other

    def __ror__(self, other: Any) -> Any:
        return other | self.to_dict()

    def copy(self) -> dict[Any, Any]:
        return dict(self.to_dict())

    # -- changes: on the dict -----------------------------------------------------
    def __setitem__(self, k: Any, v: Any) -> None:
        self.materialize()[k] = v

    def __delitem__(self, k: Any) -> None:
        del self.materialize()[k]

    def __ior__(self, other: Any) -> StorageMap:
        self.materialize().update(other)
        return self

    def pop(self, *args: Any) -> Any:
        return self.materialize().pop(*args)

    def popitem(self) -> Any:
        return self.materialize().popitem()

    def setdefault(self, *args: Any) -> Any:
        return self.materialize().setdefault(*args)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.materialize().update(*args, **kwargs)

    def clear(self) -> None:
        self.materialize().clear()

    # -- copies and pickling ----------------------------------------------------------
    def __copy__(self) -> StorageMap:
        new = StorageMap(self._order, self._strs, dict(self._a), *self._cls, self._size)
        if self._dict is not None:
            new._dict = dict(self._dict)
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        import copy

        if self._dict is not None:
            return copy.deepcopy(self._dict, memo)
        return StorageMap(self._order, self._strs, dict(self._a), *self._cls, self._size)

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (self.to_dict(),))


_NO = object()


class IndexKeyView:
    """A StorageMap keyed by ``(fqn, offset tuple or None)`` (``_records``'
    ``_index_key``), for the reader's lookups: ``[]`` and ``get`` find the
    entry in the arrays and make its info only."""

    __slots__ = ("_keyed", "_map")

    def __init__(self, storage: StorageMap) -> None:
        self._map = storage
        self._keyed: dict[Any, Any] | None = None

    def _find(self, key: Any) -> Any:
        m = self._map
        if m._dict is not None:  # made since: keyed once, as the reader keys a dict
            if self._keyed is None:
                self._keyed = {(k.fqn, None if k.offset is None else tuple(k.offset)): v
                               for k, v in m._dict.items()}
            return self._keyed.get(key, _NO)
        p = m.find(key[0], key[1])
        return _NO if p is None else m._entry(p)[1]

    def __getitem__(self, key: Any) -> Any:
        v = self._find(key)
        if v is _NO:
            raise KeyError(key)
        return v

    def get(self, key: Any, default: Any = None) -> Any:
        v = self._find(key)
        return default if v is _NO else v

    def __contains__(self, key: Any) -> bool:
        return self._find(key) is not _NO

    def __len__(self) -> int:
        return len(self._map)


def arrays_of(chunks: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """The (offsets, sizes) arrays of a ChunkList not yet made a list; None
    for anything else."""
    return chunks.arrays() if type(chunks) is ChunkList else None


def materialized(md: Any) -> Any:
    """``md`` (a Metadata) with every ChunkList made a list, for writers
    that need plain lists: ``md`` itself when it holds none, else a copy of
    the Metadata and of each TensorStorageMetadata holding one (the rest
    shared)."""
    sdm = getattr(md, "state_dict_metadata", None)
    storage = getattr(md, "storage_data", None)
    lazy_sdm = type(sdm) is dict and any(
        type(getattr(v, "chunks", None)) is ChunkList for v in sdm.values())
    if not lazy_sdm and type(storage) is not StorageMap:
        return md
    import copy

    new = copy.copy(md)
    if lazy_sdm:
        out = {}
        for k, v in sdm.items():
            ch = getattr(v, "chunks", None)
            if type(ch) is ChunkList:
                v = copy.copy(v)
                v.chunks = ch.to_list()
            out[k] = v
        new.state_dict_metadata = out
    if type(storage) is StorageMap:
        new.storage_data = storage.to_dict()
    return new
