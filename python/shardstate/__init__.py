"""shardstate: distributed checkpointing for PyTorch with a C core.

The top level exposes the core's building blocks; the torch-facing API lives
in ``shardstate.checkpoint`` (a drop-in for ``torch.distributed.checkpoint``)
and ``shardstate.fsdp``.
"""

from ._core import (
    ChecksumError,
    ShardstateError,
    ShardstateIOError,
    ThreadPool,
    crc32,
    crc32_combine,
    crc32c,
    crc32c_combine,
    crc_implementation,
)

__version__ = "0.1.0"

__all__ = [
    "ChecksumError",
    "ShardstateError",
    "ShardstateIOError",
    "ThreadPool",
    "crc32",
    "crc32_combine",
    "crc32c",
    "crc32c_combine",
    "crc_implementation",
]
