"""torch 2.13's ``_hf_utils``: the names, keys and file names of Hugging Face
safetensors checkpoints (``hf_storage``, ``_consolidate_hf_safetensors``).

Same constants and helpers as torch's module; ``_get_safetensors_file_metadata``
bounds the header it reads (torch's trusts the length prefix), and
``DTYPE_MAP`` is made on first access, so importing this module does not
import torch.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass
from typing import Any

from ._safetensors import _TO_TORCH, MAX_HEADER, Header, SafetensorsError, TensorEntry, _is_int

_metadata_fn: str = "model.safetensors.index.json"

FILE_NAME = "model-{cpt_idx}-of-{num_files}"
SHARDED_FILE_NAME = "shard-{shard_idx}-model-{cpt_idx}-of-{num_files}"
SUFFIX = ".safetensors"

# metadata keys
CUSTOM_METADATA_KEY = "DCP_SHARDING_INFO"
DEFAULT_EXTRA_METADATA_KEY = "__metadata__"
SAVED_OFFSETS_KEY = "saved_offsets"
SHAPE_KEY = "shape"
DATA_KEY = "data"
DTYPE_KEY = "dtype"
DATA_OFFSETS_KEY = "data_offsets"

HF_DCP_VERSION: float = 1.0
DCP_VERSION_KEY = "DCP_VERSION"
DCP_SHARDING_INFO_KEY = "DCP_SHARDING_INFO"

FORMAT_KEY = "format"
FORMAT_VALUE = "pt"

NUM_BYTES_FOR_HEADER_LEN = 8

SHARDED_DIR_NAME = "sharded"

# torch's table (the dtypes its reader maps; ours reads every safetensors dtype)
_DTYPE_MAP_NAMES = ("F16", "F32", "F64", "I8", "U8", "I16", "I32", "I64", "BF16")


def __getattr__(name: str) -> Any:
    if name == "DTYPE_MAP":
        import torch

        return {k: getattr(torch, _TO_TORCH[k]) for k in _DTYPE_MAP_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class _HFStorageInfo:
    """This is the per entry storage info."""

    relative_path: str
    shape: Any  # torch.Size
    dtype: Any  # torch.dtype


def _gen_file_name(index: int, largest_index: int, shard_index: int | None = None) -> str:
    if shard_index is not None:
        return SHARDED_FILE_NAME.format(
            shard_idx=f"{shard_index}".zfill(5), cpt_idx=f"{index}".zfill(5),
            num_files=f"{largest_index}".zfill(5)) + SUFFIX
    return FILE_NAME.format(cpt_idx=f"{index}".zfill(5),
                            num_files=f"{largest_index}".zfill(5)) + SUFFIX


def _get_safetensors_file_metadata(file_bytes: io.IOBase) -> tuple[Any, int]:
    """(the header JSON, its length with the 8-byte prefix) of a stream at
    a safetensors file's start; the length is bounded and must be there."""
    prefix = file_bytes.read(NUM_BYTES_FOR_HEADER_LEN)
    if len(prefix) != NUM_BYTES_FOR_HEADER_LEN:
        raise SafetensorsError("safetensors file shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER:
        raise SafetensorsError(f"header length {header_len} exceeds the limit {MAX_HEADER}")
    header_json = file_bytes.read(header_len)
    if len(header_json) != header_len:
        raise SafetensorsError(f"header length {header_len} reaches past the end of the file")
    try:
        metadata = json.loads(header_json)
    except (RecursionError, ValueError) as e:
        raise SafetensorsError(f"header is not valid JSON: {e}") from None
    return metadata, header_len + NUM_BYTES_FOR_HEADER_LEN


def _get_dtype(dtype_str: str) -> Any:
    import torch

    name = _TO_TORCH.get(dtype_str)
    return getattr(torch, name) if name is not None else torch.get_default_dtype()


def _get_dcp_custom_metadata(metadata: Any) -> Any | None:
    if DEFAULT_EXTRA_METADATA_KEY in metadata:
        custom_metadata = metadata[DEFAULT_EXTRA_METADATA_KEY]
        if CUSTOM_METADATA_KEY in custom_metadata:
            return json.loads(custom_metadata[CUSTOM_METADATA_KEY])
    return None


def _sharding_info(header: Header) -> dict[str, Any] | None:
    """A file's DCP sharding info (fqn -> saved offsets), checked."""
    md = header.metadata or {}
    text = md.get(CUSTOM_METADATA_KEY)
    if not text:
        return None
    try:
        info = json.loads(text)
    except (RecursionError, ValueError) as e:
        raise SafetensorsError(f"{header.path}: {CUSTOM_METADATA_KEY} is not valid JSON: "
                                  f"{e}") from None
    if not isinstance(info, dict):
        raise SafetensorsError(f"{header.path}: {CUSTOM_METADATA_KEY} is not an object")
    return info


def _saved_offsets(header: Header, info: dict[str, Any] | None,
                   e: TensorEntry) -> list[int]:
    if info is None:
        return [0] * len(e.shape)
    entry = info.get(e.name)
    offs = entry.get(SAVED_OFFSETS_KEY) if isinstance(entry, dict) else None
    if (not isinstance(offs, list) or len(offs) != len(e.shape)
            or not all(_is_int(o) and 0 <= o < 1 << 62 for o in offs)):
        raise SafetensorsError(
            f"{header.path}: tensor {e.name!r}: {CUSTOM_METADATA_KEY} has no valid "
            f"{SAVED_OFFSETS_KEY} for it (got {offs!r}, shape {list(e.shape)})")
    return offs
