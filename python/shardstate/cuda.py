"""Whether the CUDA runtime and NCCL can be used, found without torch.

shardstate never links against CUDA: its C core loads ``libcudart`` and
``libnccl`` at run time (once per library file, kept for the life of the
process) and refuses a CUDA runtime older than 11.0 or an NCCL older than
2.12. This module chooses where to look and reports what was found;
importing it, or shardstate, never fails for lack of a GPU or a library.

Where each library is looked for, first match wins:

1. an explicit path: the ``cudart_path`` / ``nccl_path`` argument, else the
   environment variable ``SHARDSTATE_CUDART_PATH`` / ``SHARDSTATE_NCCL_PATH``
   (read here, never by the C core). When one is given, nothing else is
   tried, so a wrong override is reported instead of silently replaced;
2. the sonames, through the dynamic linker (``libcudart.so.13``, ``.so.12``,
   ``.so.11.0``, ``.so``; ``libnccl.so.2``, ``libnccl.so``), which also finds
   a copy already loaded into the process (by torch, say);
3. the NVIDIA wheels torch depends on, ``site-packages/nvidia/*/lib``.

Counting devices initialises the CUDA driver, as ``torch.cuda.is_available()``
does: call these in a process that will use CUDA, not in a parent that forks
CUDA-using children.
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass

from . import _core

__all__ = [
    "CUDART_PATH_ENV",
    "NCCL_PATH_ENV",
    "CudaStatus",
    "NcclStatus",
    "Status",
    "candidates",
    "is_available",
    "nccl_available",
    "status",
]

CUDART_PATH_ENV = "SHARDSTATE_CUDART_PATH"
NCCL_PATH_ENV = "SHARDSTATE_NCCL_PATH"

_SONAMES = {
    "cudart": ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"),
    "nccl": ("libnccl.so.2", "libnccl.so"),
}
_ENV = {"cudart": CUDART_PATH_ENV, "nccl": NCCL_PATH_ENV}

PathArg = str | os.PathLike[str]


@dataclass(frozen=True)
class CudaStatus:
    """The CUDA runtime as loaded by the core.

    ``loaded``: a libcudart was found, has every symbol and is new enough;
    ``available``: loaded and at least one device is visible. ``reason`` says
    why not ("" when available). Versions are ``(major, minor)``;
    ``driver_version`` is None when no driver is installed.
    """

    available: bool
    loaded: bool
    reason: str
    path: str | None
    runtime_version: tuple[int, int] | None
    driver_version: tuple[int, int] | None
    device_count: int
    device_error: int
    candidates: tuple[str, ...]


@dataclass(frozen=True)
class NcclStatus:
    """NCCL as loaded by the core.

    ``loaded``: a libnccl was found, has every symbol and is new enough;
    ``available``: loaded and CUDA is available too (NCCL needs a device).
    ``version`` is ``(major, minor, patch)``.
    """

    available: bool
    loaded: bool
    reason: str
    path: str | None
    version: tuple[int, int, int] | None
    candidates: tuple[str, ...]


@dataclass(frozen=True)
class Status:
    cuda: CudaStatus
    nccl: NcclStatus


def _wheel_libs(pattern: str) -> list[str]:
    """Libraries in pip's NVIDIA wheels (nvidia/<pkg>/lib) on sys.path."""
    found: list[str] = []
    for entry in sys.path:
        if not entry or not os.path.isdir(os.path.join(entry, "nvidia")):
            continue
        for p in sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", pattern))):
            if p not in found:
                found.append(p)
    return found


def candidates(library: str, path: PathArg | None = None) -> tuple[str, ...]:
    """The names and paths tried, in order, for ``library`` ("cudart" or
    "nccl"): ``path`` alone if given, else the environment override alone if
    set, else the sonames then the NVIDIA wheels' copies."""
    if library not in _SONAMES:
        raise ValueError(f"library must be 'cudart' or 'nccl', not {library!r}")
    if path is not None:
        p = os.fspath(path)
        if not isinstance(p, str) or not p:
            raise ValueError(f"{library} path must be a non-empty str path, got {path!r}")
        return (p,)
    env = os.environ.get(_ENV[library], "")
    if env:
        return (env,)
    stem = "libcudart.so.*" if library == "cudart" else "libnccl.so.*"
    return _SONAMES[library] + tuple(_wheel_libs(stem))


def _pair(v: int) -> tuple[int, int] | None:
    return (v // 1000, (v % 1000) // 10) if v > 0 else None


def status(cudart_path: PathArg | None = None, nccl_path: PathArg | None = None) -> Status:
    """Load (once) and report the CUDA runtime and NCCL. Never raises for a
    missing, broken or too-old library; the result says why."""
    cu_c = candidates("cudart", cudart_path)
    nc_c = candidates("nccl", nccl_path)
    raw = _core.cuda_status(list(cu_c), list(nc_c))
    c, n = raw["cuda"], raw["nccl"]
    cuda = CudaStatus(
        available=c["available"],
        loaded=c["loaded"],
        reason=c["reason"],
        path=c["path"],
        runtime_version=_pair(c["runtime_version"]),
        driver_version=_pair(c["driver_version"]),
        device_count=c["device_count"],
        device_error=c["device_error"],
        candidates=cu_c,
    )
    v = n["version"]
    reason = n["reason"]
    if n["loaded"] and not cuda.available:
        reason = f"CUDA not available: {cuda.reason}"
    nccl = NcclStatus(
        available=n["loaded"] and cuda.available,
        loaded=n["loaded"],
        reason=reason,
        path=n["path"],
        version=(v // 10000, (v % 10000) // 100, v % 100) if v > 0 else None,
        candidates=nc_c,
    )
    return Status(cuda=cuda, nccl=nccl)


def is_available(cudart_path: PathArg | None = None) -> bool:
    """True when a usable CUDA runtime is loaded and a device is visible."""
    return status(cudart_path=cudart_path).cuda.available


def nccl_available(cudart_path: PathArg | None = None, nccl_path: PathArg | None = None) -> bool:
    """True when NCCL is loaded and CUDA is available."""
    return status(cudart_path=cudart_path, nccl_path=nccl_path).nccl.available
