"""The name of DCP's event logger, as torch 2.13's ``logging_handlers``.

With torch installed, importing torch's module registers the logger's
(null) handler with torch.distributed's logging; both libraries log to the
same ``dcp_logger``.
"""

from __future__ import annotations

from .._util import torch_dcp

__all__: list[str] = []

DCP_LOGGER_NAME = "dcp_logger"

if torch_dcp() is not None:
    import torch.distributed.checkpoint.logging_handlers  # noqa: F401 - registers the handler
