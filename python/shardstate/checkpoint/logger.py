"""DCP's event logging, as torch 2.13's ``logger``: ``_dcp_method_logger``
wraps a save or load step and logs its start, end (with the time spent) and,
if asked, its exception, as dicts on the ``dcp_logger`` logger (torch's
c10d logger of that name when torch is installed, so the events of both
libraries go to one place)."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from .._util import torch_dcp
from .logging_handlers import DCP_LOGGER_NAME

__all__: list[str] = []

logger = logging.getLogger()

_T = TypeVar("_T")


def _make_dcp_logger() -> logging.Logger:
    if torch_dcp() is not None:
        import torch.distributed.c10d_logger as c10d_logger

        return c10d_logger._get_or_create_logger(DCP_LOGGER_NAME)
    log = logging.getLogger(f"shardstate-{DCP_LOGGER_NAME}")
    log.addHandler(logging.NullHandler())
    log.propagate = False
    return log


_dcp_logger = _make_dcp_logger()


def _msg_dict_from_dcp_method_args(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """The checkpoint id, storage and planner class names of a call."""
    msg: dict[str, Any] = {}
    writer, reader = kwargs.get("storage_writer"), kwargs.get("storage_reader")
    planner = kwargs.get("planner")
    checkpoint_id = kwargs.get("checkpoint_id")
    if not checkpoint_id and (serializer := writer or reader):
        checkpoint_id = getattr(serializer, "checkpoint_id", None)
    msg["checkpoint_id"] = str(checkpoint_id) if checkpoint_id is not None else None
    msg["uuid"] = str(uuid.uuid4().int)  # one call, start to end
    if writer:
        msg["storage_writer"] = writer.__class__.__name__
    if reader:
        msg["storage_reader"] = reader.__class__.__name__
    if planner:
        msg["planner"] = planner.__class__.__name__
    return msg


def _get_msg_dict(func_name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    msg = _msg_dict_from_dcp_method_args(*args, **kwargs)
    if torch_dcp() is not None:
        import torch.distributed.c10d_logger as c10d_logger

        msg.update(c10d_logger._get_msg_dict(func_name, *args, **kwargs))
    else:
        msg["func_name"] = func_name
    return msg


def _dcp_method_logger(
    log_exceptions: bool = False, **wrapper_kwargs: Any
) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """A decorator logging the start, end and (with ``log_exceptions``) the
    exception of each call, at DEBUG (ERROR for the exception)."""

    def decorator(func: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> _T:
            if not _dcp_logger.isEnabledFor(logging.DEBUG) and not log_exceptions:
                return func(*args, **kwargs)
            msg = _get_msg_dict(func.__name__, *args, **{**wrapper_kwargs, **kwargs})
            t0 = time.time_ns()
            msg.update(event="start", time=t0, log_exceptions=log_exceptions)
            _dcp_logger.debug(dict(msg))  # a copy per event: records format later
            try:
                result = func(*args, **kwargs)
            except BaseException as error:
                if log_exceptions:
                    msg.update(event="exception", error=f"{error}", time=time.time_ns())
                    _dcp_logger.error(dict(msg))
                raise
            t1 = time.time_ns()
            msg.update(event="end", time=t1, times_spent=t1 - t0)
            _dcp_logger.debug(dict(msg))
            return result

        return wrapper

    return decorator


def _init_logger(rank: int) -> None:
    """INFO and above from the root logger to stderr, each line with ``rank``."""
    logger.setLevel(logging.INFO)
    handler = logging.StreamHandler()
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(
        f"[{rank}] %(asctime)s - %(name)s - %(levelname)s - %(message)s"))
    logger.addHandler(handler)
