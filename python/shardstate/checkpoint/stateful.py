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


def _plain_types() -> tuple[type, ...]:
    """Classes none of whose MRO defines state_dict or load_state_dict (so
    only an instance's own ``__dict__`` could make one Stateful)."""
    import sys

    types: list[type] = [int, float, bool, str, bytes, type(None), dict, list, tuple]
    np = sys.modules.get("numpy")
    if np is not None:
        types.append(np.ndarray)
    torch = sys.modules.get("torch")
    if torch is not None:
        types += [torch.Tensor, torch.nn.Parameter]
    return tuple(t for t in types
                 if not any(hasattr(t, a) for a in ("state_dict", "load_state_dict")))


_PLAIN: tuple[type, ...] | None = None


def is_stateful(value: object) -> bool:
    """``isinstance(value, Stateful)``, answered without the protocol check
    (tens of microseconds: it looks every method up statically) for values
    of the plain types a state dict is made of: a save of 20,000 top-level
    tensors spent most of a second there."""
    global _PLAIN
    if _PLAIN is None:
        _PLAIN = _plain_types()
    if type(value) in _PLAIN:
        own = getattr(value, "__dict__", None)
        if not own or "state_dict" not in own or "load_state_dict" not in own:
            return False
    return isinstance(value, Stateful)
