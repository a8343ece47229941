"""The restricted reader's errors.

``UnsafePickleError`` names a global or a call outside the allowlist;
``PickleFormatError`` is anything else wrong with the bytes. Both subclass
``shardstate.ShardstateError`` and ``pickle.UnpicklingError``, so callers
that catch either keep working.
"""

from __future__ import annotations

import pickle

from ... import ShardstateError


class UnsafePickleError(ShardstateError, pickle.UnpicklingError):
    """A pickle names a global, or calls something, outside the allowlist."""


class PickleFormatError(ShardstateError, pickle.UnpicklingError):
    """Bytes that are not a well-formed pickle of the expected objects."""
