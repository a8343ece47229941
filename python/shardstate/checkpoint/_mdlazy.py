"""The compact form of a large checkpoint's decoded chunk lists.

``ChunkList`` stands for ``TensorStorageMetadata.chunks`` (a list of
ChunkStorageMetadata) as two read-only ``(n, ndim)`` int64 arrays, the
chunks' offsets and sizes, filled by C while the ``.metadata`` stream is
decoded (csrc/py/mdread.c): tens of bytes a chunk instead of the few
hundred a ChunkStorageMetadata and its two torch.Size take. The restricted
reader makes one only for the chunk lists of a Metadata of at least
``LAZY_MIN`` chunks, and only where the stream shares none of a chunk's
objects with anything else (so the objects it stands for are exactly the
fresh ones it makes on demand; fastread.py, mdread.c).

A drop-in for the list as torch's code uses it: ``len``, indexing, slicing,
iteration, ``in``, ``==`` (with lists and other ChunkLists), ``copy`` and
``deepcopy``. The first access to an element, and any mutation, makes the
list itself (``materialize``): the ChunkStorageMetadata objects are then
made once, keep their identity, and a user's changes (append, assignment,
an element's fields) are kept, as in a list. The arrays are the answer only
until then (``arrays()`` gives None afterwards), so code that reads them
(the load planner, ``_records``) never sees stale values.

Differences from a list, by design: ``isinstance(x, list)`` is False, and a
plain ``pickle.dumps`` writes it as ``builtins.list(items)`` (which any
unpickler reads back as the list); ``_pickle.dumps_metadata`` writes the
bytes torch writes for the list (it writes the materialized form).

Not thread-safe for concurrent mutation (as a list is not).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["LAZY_MIN", "ChunkList", "arrays_of", "materialized"]

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
    if type(sdm) is not dict or not any(
            type(getattr(v, "chunks", None)) is ChunkList for v in sdm.values()):
        return md
    import copy

    out = {}
    for k, v in sdm.items():
        ch = getattr(v, "chunks", None)
        if type(ch) is ChunkList:
            v = copy.copy(v)
            v.chunks = ch.to_list()
        out[k] = v
    new = copy.copy(md)
    new.state_dict_metadata = out
    return new
