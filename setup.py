"""Build shardstate._core from csrc/core (plain C11) and csrc/py (the boundary).

Build-time switches (environment variables, "1" to enable):
  SHARDSTATE_SANITIZE  ASan + UBSan (-O1 -g, no recovery from UBSan reports)
  SHARDSTATE_DEBUG     -O0 -g with assertions on
  SHARDSTATE_WERROR    warnings are errors (CI)

CUDA and NCCL are never linked: csrc/core loads them at run time. When the
toolkit's headers are found (CUDA_HOME or CUDA_PATH if set, else the toolkit
of the nvcc on PATH; nccl.h beside cuda_runtime_api.h, or under NCCL_HOME),
SS_HAVE_CUDA_HEADERS / SS_HAVE_NCCL_HEADERS make the core check its own
declarations against them at compile time. Without them it builds the same.
"""

import glob
import os
import shutil
import subprocess

import numpy
from setuptools import Extension, setup


def _on(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


here = os.path.dirname(os.path.abspath(__file__))
os.chdir(here)

cflags = ["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
          "-fvisibility=hidden", "-pthread"]
ldflags = ["-pthread"]
if _on("SHARDSTATE_SANITIZE"):
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
           "-fno-omit-frame-pointer"]
    cflags += san + ["-O1", "-g", "-UNDEBUG"]
    ldflags += san
elif _on("SHARDSTATE_DEBUG"):
    cflags += ["-O0", "-g", "-UNDEBUG"]
else:
    cflags += ["-O2"]
if _on("SHARDSTATE_WERROR"):
    cflags += ["-Werror"]


def _nvcc_root(nvcc: str) -> list[str]:
    """Toolkit roots for an nvcc: its ../ (also through symlinks), and the
    TOP nvcc itself reports (a wrapper script elsewhere on PATH)."""
    roots = [os.path.dirname(os.path.dirname(p)) for p in (nvcc, os.path.realpath(nvcc))]
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60).stderr
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("#$ TOP="):
            roots.append(os.path.normpath(line[len("#$ TOP="):].strip()))
    return roots


def _cuda_headers() -> tuple[list[str], list[tuple[str, None]]]:
    """Include dirs and macros for the CUDA / NCCL header checks."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        # An explicit toolkit is authoritative: a wrong one means no headers.
        roots = [os.environ.get("CUDA_HOME") or os.environ["CUDA_PATH"]]
    else:
        nvcc = shutil.which("nvcc")
        roots = _nvcc_root(nvcc) if nvcc else []
    incs: list[str] = []
    macros: list[tuple[str, None]] = []
    for root in roots:
        for inc in [os.path.join(root, "include")] + sorted(
                glob.glob(os.path.join(root, "targets", "*", "include"))):
            if os.path.isfile(os.path.join(inc, "cuda_runtime_api.h")):
                incs, macros = [inc], [("SS_HAVE_CUDA_HEADERS", None)]
                break
        if incs:
            break
    if not incs:
        return [], []  # nccl.h needs cuda_runtime.h: no CUDA headers, no NCCL check
    nccl_dirs = [incs[0]]
    if os.environ.get("NCCL_HOME"):
        nccl_dirs.insert(0, os.path.join(os.environ["NCCL_HOME"], "include"))
    for inc in nccl_dirs:
        if os.path.isfile(os.path.join(inc, "nccl.h")):
            if inc not in incs:
                incs.append(inc)
            macros.append(("SS_HAVE_NCCL_HEADERS", None))
            break
    return incs, macros


cuda_incs, cuda_macros = _cuda_headers()
print("shardstate: CUDA/NCCL header checks:",
      ", ".join(m for m, _ in cuda_macros) or "none (no toolkit headers found)",
      *(["(" + ", ".join(cuda_incs) + ")"] if cuda_incs else []))

sources = sorted(glob.glob("csrc/core/*.c")) + sorted(glob.glob("csrc/py/*.c"))

setup(
    ext_modules=[
        Extension(
            "shardstate._core",
            sources=sources,
            include_dirs=["csrc/core", "csrc/py", numpy.get_include()] + cuda_incs,
            define_macros=cuda_macros,
            extra_compile_args=cflags,
            extra_link_args=ldflags,
            libraries=["dl"],
        )
    ],
)
