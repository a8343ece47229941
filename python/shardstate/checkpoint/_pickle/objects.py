"""Bytes items (DCP ``BYTE_IO``): one ``torch.save`` record holding a plain object.

``dumps_object`` writes the record ``torch.save`` writes for a DCP bytes
item (byte-identical for objects without tensors; torch-free) and
``loads_object`` reads one with the bytes-item allowlist (plain Python
values, torch sizes and dtypes, NumPy arrays and scalars of numeric
dtypes), through the restricted reader. Records holding tensors go to
torch itself. Thread-safe.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from ..._util import loaded_torch
from .. import _zipfmt
from .allowlist import _PLAIN_GLOBALS
from .build import _build
from .errors import PickleFormatError, UnsafePickleError
from .unpickler import _unpickle


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
            except Exception as e:  # noqa: BLE001 - torch's zip reader and unpickler
                # raise many types for bad bytes (RuntimeError, UnicodeDecodeError,
                # struct.error, IndexError, ...); the trusted path passes them on
                if allow_unsafe:
                    raise
                raise PickleFormatError(f"bytes item holding tensors is not a readable "
                                        f"torch.save record: {type(e).__name__}: {e}") from None
        if has_storage:
            raise PickleFormatError("bytes item holds tensor storages; reading it needs torch")
    pkl = bytes(mv[pk.data_offset : pk.data_offset + pk.size])
    if allow_unsafe:
        return pickle.loads(pkl)
    try:
        obj = _unpickle(pkl, _PLAIN_GLOBALS, "bytes item")
    except UnsafePickleError as e:
        raise UnsafePickleError(f"{e}; pass allow_unsafe=True only for trusted checkpoints") \
            from None
    return _build("bytes item", obj)
