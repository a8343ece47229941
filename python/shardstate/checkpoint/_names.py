"""torch objects named without torch: dtypes, layouts and memory formats as
``TorchName`` strings, sizes as tuples, element sizes by dtype name.

For the torch-free data types (``_torchfree``) and for whatever must work on
a dtype either way (a torch dtype, or its name). Never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._util import loaded_torch

__all__ = ["TorchName", "element_size"]


class TorchName(str):
    """A torch object (dtype, layout, memory format) named without torch.

    ``TorchName("torch.float32")``; ``resolve()`` gives the torch object.
    """

    __slots__ = ()

    def resolve(self) -> Any:
        import torch

        obj: Any = torch
        for part in self.split(".")[1:]:
            obj = getattr(obj, part)
        return obj


def _size(values: Sequence[int]) -> tuple[int, ...]:
    """torch.Size when torch is loaded, else a tuple of ints."""
    torch = loaded_torch()
    if torch is not None and type(values) is torch.Size:
        return values
    values = tuple(int(v) for v in values)
    return torch.Size(values) if torch is not None else values


def _name(obj: Any) -> str:
    """'torch.float32' for a torch dtype/layout/memory format or a TorchName."""
    if isinstance(obj, str):
        return str(obj)
    return str(obj) if str(obj).startswith("torch.") else f"torch.{obj}"


_ELEMENT_SIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "bits8": 1, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits16": 2,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "complex32": 4,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
}


def element_size(dtype: Any) -> int:
    """Bytes per element of a torch dtype or a 'torch.<name>' stand-in."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    name = str(dtype).removeprefix("torch.")
    try:
        return _ELEMENT_SIZE[name]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None
