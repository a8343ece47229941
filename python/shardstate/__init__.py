"""shardstate: distributed checkpointing for PyTorch with a C core.

The top level exposes the core's building blocks; the torch-facing API lives
in ``shardstate.checkpoint`` (a drop-in for ``torch.distributed.checkpoint``)
and ``shardstate.fsdp``.
"""

from . import io
from ._core import (
    ChecksumError,
    GeomIndex,
    ShardstateError,
    ShardstateIOError,
    ThreadPool,
    crc32,
    crc32_combine,
    crc32c,
    crc32c_combine,
    crc_implementation,
)
from .geometry import Overlap, OverlapIndex, copy_region, overlaps
from .io import ReadJob, WriteJob

__version__ = "0.1.0"

__all__ = [
    "ChecksumError",
    "GeomIndex",
    "Overlap",
    "OverlapIndex",
    "ReadJob",
    "WriteJob",
    "copy_region",
    "overlaps",
    "ShardstateError",
    "ShardstateIOError",
    "ThreadPool",
    "crc32",
    "crc32_combine",
    "crc32c",
    "crc32c_combine",
    "crc_implementation",
    "io",
]
