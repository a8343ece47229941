# Type stub for the C extension shardstate._core (csrc/py). Checked against
# the built module by tests/test_stub.py: every public name here exists
# there with the same parameters, and vice versa.
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

Buffer = Any  # any object supporting the buffer protocol
PathArg = Any  # str, bytes or os.PathLike
IntArray = npt.NDArray[np.int64] | Sequence[int]

class ShardstateError(Exception):
    op: str | None
    path: str | None
    offset: int
    job: int
    code: int

class ShardstateIOError(ShardstateError, OSError): ...
class ChecksumError(ShardstateError): ...

class ThreadPool:
    def __init__(self, threads: int) -> None: ...
    @property
    def threads(self) -> int: ...

class GeomIndex:
    def __init__(self, offsets: npt.ArrayLike, sizes: npt.ArrayLike) -> None: ...
    def __len__(self) -> int: ...
    @property
    def ndim(self) -> int: ...
    @property
    def last_visited(self) -> int: ...
    def query(
        self, offsets: npt.ArrayLike, sizes: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
    def query_many(
        self, offsets: npt.ArrayLike, sizes: npt.ArrayLike
    ) -> tuple[
        npt.NDArray[np.int64],
        npt.NDArray[np.int64],
        npt.NDArray[np.int64],
        npt.NDArray[np.int64],
        npt.NDArray[np.int64],
    ]: ...

class FaultInjector:
    def __init__(self) -> None: ...
    def fail(self, op: str, at_call: int, errno: int, /) -> None: ...
    def short(self, op: str, at_call: int, nbytes: int, /) -> None: ...
    def eintr(self, op: str, at_call: int, /) -> None: ...
    def calls(self, op: str, /) -> int: ...
    def reset(self) -> None: ...

def crc32(data: Buffer, value: int = 0) -> int: ...
def crc32c(data: Buffer, value: int = 0) -> int: ...
def crc32_combine(crc1: int, crc2: int, len2: int, /) -> int: ...
def crc32c_combine(crc1: int, crc2: int, len2: int, /) -> int: ...
def crc_implementation() -> dict[str, str]: ...
def _crc_force_portable(on: bool, /) -> bool: ...
def copy_region(
    dst: np.ndarray,
    dst_offset: Sequence[int],
    src: np.ndarray,
    src_offset: Sequence[int],
    lengths: Sequence[int],
    pool: ThreadPool | None = None,
    /,
) -> None: ...
def write_batch(
    paths: Sequence[PathArg],
    file_idx: IntArray,
    offsets: IntArray,
    buffers: Sequence[Buffer],
    pool: ThreadPool | None,
    fsync: bool,
    checksum: bool,
    piece: int,
    faults: FaultInjector | None,
    /,
) -> list[int]: ...
def read_batch(
    paths: Sequence[PathArg],
    file_idx: IntArray,
    offsets: IntArray,
    buffers: Sequence[Buffer],
    crcs: Sequence[int | None] | None,
    pool: ThreadPool | None,
    verify: bool,
    checksum: bool,
    piece: int,
    faults: FaultInjector | None,
    /,
) -> list[int]: ...
def publish(path: PathArg, data: Buffer, fsync: bool, faults: FaultInjector | None, /) -> None: ...
def _raw_pwrite(path: PathArg, buffer: Buffer, piece: int, /) -> None: ...
def _raw_pread(path: PathArg, buffer: Buffer, piece: int, /) -> None: ...
