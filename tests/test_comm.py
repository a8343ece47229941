"""NCCL collective transport (issue 5) without a GPU: the NcclComm type on
the stand-in libcudart/libnccl (one-rank "communicators" that copy on the
host), the unique-id exchange over real gloo groups of 1-3 processes, the
per-group communicator cache and teardown, and the torch.distributed path
that CPU tensors take through the same functions. NCCL between real GPUs
runs in benchmarks/gpu_check.sh (one GPU: world size 1)."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import shardstate
from shardstate import _core

HERE = os.path.dirname(__file__)


class _FakeCudaArray:
    def __init__(self, a: np.ndarray, readonly: bool = False) -> None:
        self.a = a
        self.__cuda_array_interface__ = {
            "shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, readonly),
            "strides": None, "version": 3,
        }


def _build_fakes(d) -> tuple[str, str]:
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc is not None
    out = []
    for src in ("fake_cudart.c", "fake_nccl.c"):
        so = os.path.join(d, f"lib{src[:-2]}_comm.so")
        subprocess.run([cc, "-std=c11", "-shared", "-fPIC", "-O1", "-o", so,
                        os.path.join(HERE, "c", src)], check=True)
        out.append(so)
    return out[0], out[1]


@pytest.fixture(scope="module")
def fakes(tmp_path_factory) -> tuple[str, str]:
    return _build_fakes(str(tmp_path_factory.mktemp("fakecomm")))


def test_ncclcomm_collectives_on_the_stand_in(fakes):
    cudart, nccl = fakes
    uid = _core.nccl_unique_id(cudart=[cudart], nccl=[nccl])
    assert uid == b"\x5a" * 128
    c = _core.NcclComm(1, 0, uid, 1, cudart=[cudart], nccl=[nccl])
    assert (c.nranks, c.rank, c.device, c.closed) == (1, 0, 1, False)
    src = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)
    for wait in (False, True):
        out = np.zeros_like(src)
        c.all_gather(_FakeCudaArray(src, readonly=True), _FakeCudaArray(out), stream=None,
                     wait=wait)
        np.testing.assert_array_equal(out, src)
        buf = src.copy()
        c.broadcast(_FakeCudaArray(buf), 0, wait=wait)
        np.testing.assert_array_equal(buf, src)
        out = np.zeros_like(src)
        c.scatter(_FakeCudaArray(src), _FakeCudaArray(out), 0, stream=5, wait=wait)
        np.testing.assert_array_equal(out, src)
        out = np.zeros_like(src)
        c.gather(_FakeCudaArray(src), _FakeCudaArray(out), 0, wait=wait)
        np.testing.assert_array_equal(out, src)
    with pytest.raises(ValueError, match="nranks"):
        c.all_gather(_FakeCudaArray(src), _FakeCudaArray(np.zeros(999, np.uint8)))
    with pytest.raises(ValueError, match="root 1"):
        c.broadcast(_FakeCudaArray(src.copy()), 1)
    with pytest.raises(ValueError, match="gather: send is required"):
        c.gather(_FakeCudaArray(src), None, 0)
    with pytest.raises(BufferError, match="writable"):
        c.broadcast(_FakeCudaArray(src, readonly=True), 0)
    with pytest.raises(TypeError, match="__cuda_array_interface__"):
        c.broadcast(src, 0)
    c.close()
    assert c.closed
    with pytest.raises(ValueError, match="closed"):
        c.broadcast(_FakeCudaArray(src.copy()), 0)
    c.close()  # twice is fine


def test_ncclcomm_errors_are_clear(fakes, tmp_path):
    cudart, nccl = fakes
    with pytest.raises(ValueError, match="128 bytes"):
        _core.NcclComm(1, 0, b"x", cudart=[cudart], nccl=[nccl])
    with pytest.raises(ValueError, match="rank 2 of 2"):
        _core.NcclComm(2, 2, b"\0" * 128, cudart=[cudart], nccl=[nccl])
    with pytest.raises(shardstate.ShardstateError, match="ncclCommInitRank: invalid argument"):
        _core.NcclComm(2, 1, b"\0" * 128, cudart=[cudart], nccl=[nccl])
    with pytest.raises(shardstate.ShardstateError, match="libnccl not found"):
        _core.nccl_unique_id(cudart=[cudart], nccl=[str(tmp_path / "libnccl.so.9")])


def _exchange(rank, world):
    import torch.distributed as dist
    from shardstate import comm

    uid = comm.exchange_unique_id(dist.group.WORLD, make=lambda: bytes(range(128)))
    bad = None
    try:
        comm.exchange_unique_id(dist.group.WORLD, make=lambda: b"short")
    except RuntimeError as e:
        bad = str(e)
    return uid, bad


@pytest.mark.parametrize("world", [1, 3])
def test_unique_id_reaches_every_rank(run_distributed, world):
    out = run_distributed(_exchange, world)
    assert all(uid == bytes(range(128)) for uid, _ in out)
    assert all(bad is not None and "malformed" in bad for _, bad in out)


def _cache_and_teardown(rank, world, cudart, nccl):
    import torch
    import torch.distributed as dist

    os.environ["SHARDSTATE_CUDART_PATH"] = cudart
    os.environ["SHARDSTATE_NCCL_PATH"] = nccl
    from shardstate import comm

    c = comm.communicator(device=0)
    same = comm.communicator(device=0) is c
    nranks = c.nranks
    sub = dist.new_group([0])
    other = comm.communicator(sub, device=0)
    comm.close_communicators(sub)
    closed_sub, open_world = other.closed, not c.closed
    os.environ["SHARDSTATE_NCCL"] = "0"
    off = comm.communicator(dist.new_group([0]), device=0)
    del os.environ["SHARDSTATE_NCCL"]
    # CPU tensors go through torch.distributed whatever NCCL can do
    out = torch.empty(world * 3)
    comm.all_gather_into(out, torch.full((3,), float(rank)), None)
    t = torch.full((4,), float(rank))
    comm.broadcast(t, 0)
    got = torch.empty(2)
    comm.scatter(got, torch.arange(world * 2, dtype=torch.float32) if rank == 0 else None, 0)
    comm.close_communicators()
    return (type(c).__name__, nranks, same, closed_sub, open_world, off, c.closed,
            out.tolist(), t.tolist(), got.tolist())


def test_communicator_cache_teardown_and_cpu_path(run_distributed, fakes):
    (r,) = run_distributed(_cache_and_teardown, 1, *fakes)
    assert r == ("NcclComm", 1, True, True, True, None, True, [0.0] * 3, [0.0] * 4, [0.0, 1.0])


def _cpu_paths(rank, world):
    import torch
    from shardstate import comm

    out = torch.empty(world * 3)
    comm.all_gather_into(out, torch.full((3,), float(rank)), None)
    t = torch.full((4,), float(rank))
    comm.broadcast(t, 1 % world)
    got = torch.empty(2)
    comm.scatter(got, torch.arange(world * 2, dtype=torch.float32) if rank == 0 else None, 0)
    full = torch.empty(world * 2) if rank == 1 % world else None
    comm.gather(full, torch.full((2,), float(rank)), 1 % world)
    return out.tolist(), t.tolist(), got.tolist(), full.tolist() if full is not None else None


def test_cpu_tensors_use_torch_distributed(run_distributed):
    out = run_distributed(_cpu_paths, 3)
    for rank, (ag, bc, sc, ga) in enumerate(out):
        assert ag == [0.0] * 3 + [1.0] * 3 + [2.0] * 3
        assert bc == [1.0] * 4
        assert sc == [2.0 * rank, 2.0 * rank + 1]
        assert ga == ([0.0, 0.0, 1.0, 1.0, 2.0, 2.0] if rank == 1 else None)


# ---------------------------------------------------------------------------
# gloo groups: all-gather and gather of CPU tensors go point to point
# ---------------------------------------------------------------------------

_P2P_DTYPES = ("float32", "bfloat16", "float64", "int8", "int64", "bool")


def _p2p_vs_gloo(rank, world):
    """Every comm.all_gather_into / comm.gather equals gloo's own collective
    on the same inputs, for several dtypes and sizes, on the world group and
    on a subgroup of the odd ranks; the point-to-point path really ran
    (counted), the collectives did not, and user messages on tag 0 queued
    before are not taken by it."""
    import torch
    import torch.distributed as dist
    from shardstate import comm

    counts = {"isend": 0, "irecv": 0, "gather": 0, "all_gather_single": 0}
    saved = {k: getattr(dist, k) for k in counts}

    def counting(k):
        def call(*a, **kw):
            counts[k] += 1
            return saved[k](*a, **kw)
        return call

    def values(dtype, n, salt):
        g = torch.Generator().manual_seed(1000 * rank + salt)
        t = torch.randint(-100, 100, (n,), generator=g)
        return (t > 0) if dtype == torch.bool else t.to(dtype)

    groups = [(None, world, rank)]
    odd = [r for r in range(world) if r % 2]
    sub = dist.new_group(odd) if odd else None  # every rank takes part in new_group
    if rank in odd:
        groups.append((sub, len(odd), odd.index(rank)))
    mismatches = []
    for group, gw, grank in groups:
        for salt, name in enumerate(_P2P_DTYPES):
            dtype = getattr(torch, name)
            for n in (1, 7, 300_001):
                x = values(dtype, n, salt + 10 * n)
                want = torch.empty(gw * n, dtype=dtype)
                dist.all_gather_single(want, x, group=group)
                for k in counts:
                    setattr(dist, k, counting(k))
                try:
                    got = torch.full((gw * n,), 1, dtype=dtype)
                    comm.all_gather_into(got, x, group)
                    dst = (n + salt) % gw
                    full = torch.zeros(gw * n, dtype=dtype) if grank == dst else None
                    comm.gather(full, x, dst, group)
                finally:
                    for k, f in saved.items():
                        setattr(dist, k, f)
                if not torch.equal(got, want):
                    mismatches.append(("all_gather", gw, name, n))
                if full is not None and not torch.equal(full, want):
                    mismatches.append(("gather", gw, name, n))
    # a user's own message on tag 0, sent before and received after, is
    # untouched by shardstate's traffic in between
    user = None
    if world >= 2 and rank < 2:
        if rank == 0:
            dist.send(torch.tensor([42.0]), dst=1)
        else:
            box = torch.zeros(1)
            w = dist.irecv(box, src=0)
    out = torch.empty(world * 2)
    comm.all_gather_into(out, torch.full((2,), float(rank)), None)
    if world >= 2 and rank == 1:
        w.wait()
        user = box.item()
    return mismatches, counts, out.tolist(), user


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gloo_gathers_go_point_to_point(run_distributed, world):
    for rank, (bad, counts, out, user) in enumerate(run_distributed(_p2p_vs_gloo, world)):
        assert bad == [], (rank, bad)
        assert counts["gather"] == 0 and counts["all_gather_single"] == 0, (rank, counts)
        if world > 1:
            assert counts["isend"] > 0 and counts["irecv"] > 0, (rank, counts)
        assert out == [float(r) for r in range(world) for _ in range(2)]
        if rank == 1:
            assert user == 42.0


def _p2p_errors(rank, world):
    import torch
    from shardstate import comm

    errs = []
    for fn in (
        lambda: comm.all_gather_into(torch.empty(world * 3 + 1), torch.zeros(3)),
        lambda: comm.all_gather_into(torch.empty(world * 3, dtype=torch.float64), torch.zeros(3)),
        lambda: comm.gather(torch.empty(5), torch.zeros(3), rank),
        lambda: comm.gather(None, torch.zeros(3), rank),
    ):
        try:
            fn()
            errs.append(None)
        except (TypeError, ValueError) as e:
            errs.append(str(e))
    os.environ["SHARDSTATE_P2P"] = "0"  # the collective path, on request
    out = torch.empty(world * 2)
    comm.all_gather_into(out, torch.full((2,), float(rank)))
    return errs, out.tolist()


def test_gloo_point_to_point_checks_its_arguments(run_distributed):
    for errs, out in run_distributed(_p2p_errors, 2):
        assert "not 2 ranks x 3" in errs[0]
        assert "torch.float64" in errs[1] and "torch.float32" in errs[1]
        assert "not 2 ranks x 3" in errs[2]
        assert "needs an out tensor" in errs[3]
        assert out == [0.0, 0.0, 1.0, 1.0]
