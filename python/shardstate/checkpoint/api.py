"""CheckpointException: one failure report, raised on every rank."""

from __future__ import annotations

import traceback
from typing import Any

from .._util import torch_dcp

__all__ = ["CheckpointException"]

# (exception, its traceback as a StackSummary)
WRAPPED_EXCEPTION = tuple[BaseException, traceback.StackSummary]


def _wrap_exception(exc: BaseException) -> WRAPPED_EXCEPTION:
    """The exception and its frames, in a form that survives pickling to
    other ranks (an exception that cannot be pickled is replaced by a
    RuntimeError carrying its type and message)."""
    import pickle

    frames = traceback.extract_tb(exc.__traceback__)
    try:
        pickle.loads(pickle.dumps(exc))
        carried: BaseException = exc
    except Exception:  # noqa: BLE001 - any pickling failure
        carried = RuntimeError(f"{type(exc).__qualname__}: {exc}")
    return (carried, frames)


def _is_wrapped_exception(obj: Any) -> bool:
    return (isinstance(obj, tuple) and len(obj) == 2
            and isinstance(obj[0], BaseException)
            and isinstance(obj[1], traceback.StackSummary))


def _get_failure_dict(results: list[Any]) -> dict[int, WRAPPED_EXCEPTION]:
    return {rank: r for rank, r in enumerate(results) if _is_wrapped_exception(r)}


# With torch installed, ours is a torch CheckpointException too: code that
# catches torch's catches ours.
_Base: type[BaseException] = (torch_dcp().api.CheckpointException if torch_dcp() is not None
                              else BaseException)


class CheckpointException(_Base):  # type: ignore[misc,valid-type]
    """A save or load failed on one or more ranks.

    Raised on every rank of the group, so no rank waits forever for the
    others. ``failures`` maps each failing rank to (exception, traceback).
    With torch installed it is also a
    ``torch.distributed.checkpoint.api.CheckpointException``.
    """

    def __init__(self, msg: str, failures: dict[int, WRAPPED_EXCEPTION]):
        super().__init__(msg, failures)
        self._failures = failures

    @property
    def failures(self) -> dict[int, WRAPPED_EXCEPTION]:
        """Failing rank -> (exception, traceback frames)."""
        return self._failures

    def __str__(self) -> str:
        step = self.args[0] if self.args else "checkpoint"
        lines = [f"CheckpointException ranks:{self._failures.keys()} (step '{step}')"]
        for rank, (exc, frames) in self._failures.items():
            lines.append(f"Traceback (most recent call last): (RANK {rank})")
            lines.append("".join(traceback.format_list(frames)).rstrip("\n"))
            lines.append("".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n"))
        return "\n".join(line for line in lines if line)
