"""Stateful: objects saved through their state_dict() and restored through
load_state_dict(): torch's own protocol whenever torch is installed
(``torch.distributed.checkpoint.stateful``), the torch-free one otherwise."""

from __future__ import annotations

from .metadata import TORCH_TYPES

__all__ = ["Stateful", "StatefulT"]

if TORCH_TYPES:
    from torch.distributed.checkpoint.stateful import Stateful, StatefulT
else:
    from ._torchfree import Stateful, StatefulT
