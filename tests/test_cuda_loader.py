"""The run-time CUDA runtime / NCCL loaders seen from Python (shardstate.cuda
over _core.cuda_status): stand-in libraries compiled here from
tests/c/fake_*.c, overrides by argument and environment, refusals with
reasons, import without any library, and the real libcudart of this machine
(if it has one) against facts checked independently of the loader."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import shardstate._core as core
import shardstate.cuda as sc

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "cudart_ok": ("fake_cudart.c", []),
    "cudart_old": ("fake_cudart.c", ["-DFAKE_RUNTIME_VERSION=10020"]),
    "cudart_nosym": ("fake_cudart.c", ["-DFAKE_OMIT_EVENT_QUERY"]),
    "cudart_nodev": ("fake_cudart.c", ["-DFAKE_DEVICE_ERROR=100"]),
    "cudart_ok_11": ("fake_cudart.c", ["-DFAKE_RUNTIME_VERSION=11080",
                                       "-DFAKE_DRIVER_VERSION=12020", "-DFAKE_DEVICE_COUNT=3"]),
    "nccl_ok": ("fake_nccl.c", []),
    "nccl_old": ("fake_nccl.c", ["-DFAKE_NCCL_VERSION=21105"]),
    "nccl_nosym": ("fake_nccl.c", ["-DFAKE_OMIT_SEND"]),
}


@pytest.fixture(scope="module")
def fakes(tmp_path_factory) -> dict[str, str]:
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc is not None, "a C compiler is needed to build the extension and these stand-ins"
    d = tmp_path_factory.mktemp("fakes")
    out = {}
    for name, (src, flags) in VARIANTS.items():
        so = d / f"libfake_{name}.so"
        subprocess.run([cc, "-std=c11", "-shared", "-fPIC", "-O1", *flags, "-o", str(so),
                        str(HERE / "c" / src)], check=True)
        out[name] = str(so)
    return out


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch):
    monkeypatch.delenv(sc.CUDART_PATH_ENV, raising=False)
    monkeypatch.delenv(sc.NCCL_PATH_ENV, raising=False)


def test_missing_override_paths_are_named(tmp_path):
    cu, nc = tmp_path / "nope" / "libcudart.so.12", tmp_path / "libnccl.so.2"
    s = sc.status(cudart_path=cu, nccl_path=str(nc))
    assert not s.cuda.loaded and not s.cuda.available
    assert s.cuda.reason == f"libcudart not found: tried {cu}"
    assert s.cuda.candidates == (str(cu),)
    assert s.cuda.path is None and s.cuda.runtime_version is None and s.cuda.device_count == 0
    assert not s.nccl.loaded and not s.nccl.available
    assert s.nccl.reason == f"libnccl not found: tried {nc}"
    assert not sc.is_available(cudart_path=cu)
    assert not sc.nccl_available(cudart_path=cu, nccl_path=nc)


def test_fake_libraries_load_and_report_versions(fakes):
    s = sc.status(cudart_path=fakes["cudart_ok"], nccl_path=fakes["nccl_ok"])
    assert s.cuda.available and s.cuda.loaded and s.cuda.reason == ""
    assert s.cuda.path == os.path.realpath(fakes["cudart_ok"])
    assert s.cuda.runtime_version == (12, 4) and s.cuda.driver_version == (12, 4)
    assert s.cuda.device_count == 2 and s.cuda.device_error == 0
    assert s.nccl.available and s.nccl.loaded and s.nccl.reason == ""
    assert s.nccl.path == os.path.realpath(fakes["nccl_ok"])
    assert s.nccl.version == (2, 21, 5)
    assert sc.is_available(cudart_path=fakes["cudart_ok"])
    assert sc.nccl_available(cudart_path=fakes["cudart_ok"], nccl_path=fakes["nccl_ok"])

    other = sc.status(cudart_path=fakes["cudart_ok_11"]).cuda
    assert other.runtime_version == (11, 8) and other.driver_version == (12, 2)
    assert other.device_count == 3


def test_environment_overrides_and_argument_beats_it(fakes, monkeypatch, tmp_path):
    monkeypatch.setenv(sc.CUDART_PATH_ENV, fakes["cudart_ok_11"])
    monkeypatch.setenv(sc.NCCL_PATH_ENV, fakes["nccl_ok"])
    assert sc.candidates("cudart") == (fakes["cudart_ok_11"],)
    s = sc.status()
    assert s.cuda.path == os.path.realpath(fakes["cudart_ok_11"])
    assert s.cuda.runtime_version == (11, 8)
    assert s.nccl.version == (2, 21, 5)
    assert sc.status(cudart_path=fakes["cudart_ok"]).cuda.runtime_version == (12, 4)
    # An override that does not exist is reported, not replaced by a default.
    monkeypatch.setenv(sc.CUDART_PATH_ENV, str(tmp_path / "missing.so"))
    s = sc.status()
    assert not s.cuda.loaded
    assert s.cuda.reason == f"libcudart not found: tried {tmp_path / 'missing.so'}"


def test_too_old_versions_refused(fakes):
    s = sc.status(cudart_path=fakes["cudart_old"], nccl_path=fakes["nccl_old"])
    assert not s.cuda.loaded and not s.cuda.available
    assert s.cuda.reason == (f"libcudart not usable: tried {fakes['cudart_old']} "
                             "(CUDA runtime 10.2 is older than the minimum 11.0)")
    assert not s.nccl.loaded
    assert s.nccl.reason == (f"libnccl not usable: tried {fakes['nccl_old']} "
                             "(NCCL 2.11.5 is older than the minimum 2.12.0)")


def test_missing_symbol_named(fakes):
    s = sc.status(cudart_path=fakes["cudart_nosym"], nccl_path=fakes["nccl_nosym"])
    assert not s.cuda.loaded
    assert s.cuda.reason.endswith(f"{fakes['cudart_nosym']} (missing symbol cudaEventQuery)")
    assert not s.nccl.loaded
    assert s.nccl.reason.endswith(f"{fakes['nccl_nosym']} (missing symbol ncclSend)")


def test_no_device_and_nccl_needs_cuda(fakes):
    s = sc.status(cudart_path=fakes["cudart_nodev"], nccl_path=fakes["nccl_ok"])
    assert s.cuda.loaded and not s.cuda.available
    assert s.cuda.device_error == 100 and s.cuda.device_count == 0
    assert s.cuda.reason == ("no CUDA device: cudaGetDeviceCount returned 100 "
                             "(no CUDA-capable device is detected)")
    assert s.nccl.loaded and not s.nccl.available
    assert s.nccl.reason == "CUDA not available: " + s.cuda.reason


def test_first_usable_candidate_wins(fakes, tmp_path):
    cands = [str(tmp_path / "absent.so"), fakes["cudart_nosym"], fakes["cudart_old"]]
    r = core.cuda_status(cands + [fakes["cudart_ok"]], None)["cuda"]
    assert r["available"] and r["path"] == os.path.realpath(fakes["cudart_ok"])
    r = core.cuda_status(cands, None)["cuda"]
    assert not r["loaded"]
    assert r["reason"] == (
        f"libcudart not usable: tried {cands[0]}, {cands[1]} (missing symbol cudaEventQuery), "
        f"{cands[2]} (CUDA runtime 10.2 is older than the minimum 11.0)")


def test_not_a_library(tmp_path):
    p = tmp_path / "libcudart.so"
    p.write_text("not an ELF file\n")
    s = sc.status(cudart_path=p).cuda
    assert not s.loaded
    assert s.reason.startswith(f"libcudart not usable: tried {p} (")
    assert "not found" not in s.reason


def test_loaded_once_per_file_across_threads(fakes, tmp_path):
    # A fresh copy nothing has loaded yet, and a symlink to it: every thread
    # and both names get the one table (same file reported).
    copy = tmp_path / "libcudart_copy.so"
    shutil.copy(fakes["cudart_ok"], copy)
    link = tmp_path / "libcudart.so.12"
    link.symlink_to(copy)
    results: list[sc.Status] = []
    lock = threading.Lock()

    def probe(path):
        s = sc.status(cudart_path=path, nccl_path=fakes["nccl_ok"])
        with lock:
            results.append(s)

    threads = [threading.Thread(target=probe, args=(copy if i % 2 else link,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8
    assert {r.cuda.path for r in results} == {str(copy.resolve())}
    assert all(r.cuda.available and r.cuda.runtime_version == (12, 4) for r in results)


def test_wheel_directories_are_candidates(fakes, tmp_path, monkeypatch):
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    shutil.copy(fakes["cudart_ok"], lib / "libcudart.so.13")
    shutil.copy(fakes["nccl_ok"], lib / "libnccl.so.2")
    monkeypatch.syspath_prepend(str(tmp_path))
    cu = sc.candidates("cudart")
    assert cu[:4] == ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")
    assert str(lib / "libcudart.so.13") in cu[4:]
    nc = sc.candidates("nccl")
    assert nc[:2] == ("libnccl.so.2", "libnccl.so") and str(lib / "libnccl.so.2") in nc[2:]


def test_bad_arguments():
    with pytest.raises(TypeError, match="sequence of paths"):
        core.cuda_status("libcudart.so", None)
    with pytest.raises(ValueError, match="cudart is empty"):
        core.cuda_status([], None)
    with pytest.raises(ValueError, match=r"nccl\[1\] is an empty path"):
        core.cuda_status(None, ["libnccl.so.2", ""])
    with pytest.raises(ValueError):
        core.cuda_status([b"lib\0cudart.so"], None)
    with pytest.raises(TypeError):
        core.cuda_status([3], None)
    with pytest.raises(TypeError):
        core.cuda_status(None)
    with pytest.raises(ValueError, match="'cudart' or 'nccl'"):
        sc.candidates("cublas")
    with pytest.raises(ValueError, match="non-empty"):
        sc.status(cudart_path="")


def test_import_without_any_library(tmp_path):
    env = dict(os.environ)
    env[sc.CUDART_PATH_ENV] = str(tmp_path / "no" / "libcudart.so")
    env[sc.NCCL_PATH_ENV] = str(tmp_path / "no" / "libnccl.so")
    code = ("import json, shardstate, shardstate.cuda as c; s = c.status(); "
            "print(json.dumps([c.is_available(), c.nccl_available(), s.cuda.reason, s.nccl.reason, "
            "'torch' in __import__('sys').modules]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    avail, nccl_avail, cu_reason, nc_reason, torch_loaded = json.loads(out.stdout)
    assert avail is False and nccl_avail is False
    assert cu_reason == f"libcudart not found: tried {env[sc.CUDART_PATH_ENV]}"
    assert nc_reason == f"libnccl not found: tried {env[sc.NCCL_PATH_ENV]}"
    assert torch_loaded is False


def _toolkit_cudart() -> tuple[str | None, int | None]:
    """This machine's libcudart as the dynamic linker or the toolkit finds it
    (not through shardstate), and CUDART_VERSION from the toolkit header."""
    lib = ctypes.util.find_library("cudart")
    header_version = None
    roots = [os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or ""]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots += sorted(glob.glob("/usr/local/cuda*"))
    for root in filter(None, roots):
        header = Path(root) / "include" / "cuda_runtime_api.h"
        libs = sorted(glob.glob(os.path.join(root, "lib*", "libcudart.so.[0-9]*")))
        if header.is_file() and libs:
            m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", header.read_text(errors="replace"))
            if m:
                return libs[0], int(m.group(1))
    return lib, header_version


def _driver_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_real_cudart_consistent_with_machine():
    path, header_version = _toolkit_cudart()
    s = sc.status(cudart_path=path) if path else sc.status()
    if path is None:
        # No libcudart anywhere the linker or a toolkit would put it.
        assert not s.cuda.available
        if not s.cuda.loaded:
            assert s.cuda.reason.startswith("libcudart not found: tried libcudart.so.13, ")
        return
    assert s.cuda.loaded, s.cuda.reason
    assert s.cuda.runtime_version >= (11, 0)
    assert s.cuda.path is not None and "libcudart.so" in s.cuda.path
    if header_version is not None:
        assert s.cuda.runtime_version == (header_version // 1000, (header_version % 1000) // 10)
    if not _driver_loadable():
        # No driver library: the runtime can find no device, and says why.
        assert not s.cuda.available and s.cuda.driver_version is None
        assert s.cuda.device_error != 0
        assert s.cuda.reason.startswith(
            f"no CUDA device: cudaGetDeviceCount returned {s.cuda.device_error} (")
    else:
        assert s.cuda.available == (s.cuda.device_count > 0)


@pytest.mark.gpu
def test_gpu_visible():
    s = sc.status()
    assert s.cuda.available, s.cuda.reason
    assert s.cuda.device_count >= 1 and s.cuda.device_error == 0
    assert s.cuda.driver_version is not None and s.cuda.driver_version >= (11, 0)
    import torch

    if torch.cuda.is_available():
        assert s.cuda.device_count == torch.cuda.device_count()
