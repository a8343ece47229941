"""Torch's names in ``.metadata``, without importing torch.

The import paths of the checkpoint metadata classes (current and legacy),
and the canonical names of torch's dtypes, layouts and memory formats as
torch pickles them. Shared by the writer and the restricted reader.
Constants only; thread-safe.
"""

from __future__ import annotations

from typing import Any

from ..metadata import TorchName

_MD_MOD = "torch.distributed.checkpoint.metadata"
_FS_MOD = "torch.distributed.checkpoint.filesystem"
# Where TensorProperties (and its MEM_FORMAT_ENCODING) lived before torch's
# checkpoint metadata had its own; older torch wrote .metadata naming it, and
# torch still loads such files (the class is there, with the same fields and
# 5-tuple state).
_LEGACY_MOD = "torch.distributed._shard.sharded_tensor.metadata"


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
def _torch_name(obj: Any) -> str | None:
    """'torch.float32' for a torch dtype/layout/memory format or a TorchName."""
    if isinstance(obj, TorchName):
        return str(obj)
    t = type(obj)
    if t.__module__ == "torch" and t.__name__ in ("dtype", "layout", "memory_format"):
        s = str(obj)
        return s if s.startswith("torch.") else f"torch.{s}"
    return None

