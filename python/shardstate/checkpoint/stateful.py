"""Stateful: objects saved through their state_dict() and restored through
load_state_dict(), like torch.distributed.checkpoint.stateful.Stateful."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["Stateful", "StatefulT"]


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


StatefulT = TypeVar("StatefulT", bound=Stateful)
