"""Build shardstate._core from csrc/core (plain C11) and csrc/py (the boundary).

Build-time switches (environment variables, "1" to enable):
  SHARDSTATE_SANITIZE  ASan + UBSan (-O1 -g, no recovery from UBSan reports)
  SHARDSTATE_DEBUG     -O0 -g with assertions on
  SHARDSTATE_WERROR    warnings are errors (CI)
"""

import glob
import os

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

sources = sorted(glob.glob("csrc/core/*.c")) + sorted(glob.glob("csrc/py/*.c"))

setup(
    ext_modules=[
        Extension(
            "shardstate._core",
            sources=sources,
            include_dirs=["csrc/core", "csrc/py", numpy.get_include()],
            extra_compile_args=cflags,
            extra_link_args=ldflags,
            libraries=["dl"],
        )
    ],
)
