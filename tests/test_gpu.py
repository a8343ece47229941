"""CUDA tensors through shardstate on a real GPU (marked gpu: skipped where
no CUDA device is present; benchmarks/gpu_check.sh runs them on a GPU
machine). The same pipeline runs on every machine through the host backend
and the stand-in libcudart (tests/test_stage.py)."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch_cuda():
    import torch

    if not torch.cuda.is_available():  # torch without CUDA beside a GPU
        pytest.fail("torch cannot use the GPU that shardstate sees")
    return torch


def _stage():
    from shardstate import cuda as sscuda
    from shardstate.io import Stage

    return Stage("cuda", 3, 1 << 20, device=0, candidates=list(sscuda.candidates("cudart")))


def test_cuda_jobs_write_and_read(tmp_path, torch_cuda):
    torch = torch_cuda
    from shardstate import io as sio
    from shardstate.io import ReadJob, WriteJob

    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
          for n in (0, 1, 4097, (1 << 20) + 3, 5 << 20)]
    stage = _stage()
    crcs = sio.write([WriteJob(tmp_path / f"t{i}", 0, t, device=True) for i, t in enumerate(ts)],
                     stage=stage, stream=torch.cuda.current_stream().cuda_stream)
    for i, (t, c) in enumerate(zip(ts, crcs)):
        host = t.cpu().numpy().tobytes()
        assert (tmp_path / f"t{i}").read_bytes() == host
        assert c == zlib.crc32(host)
    outs = [torch.empty_like(t) for t in ts]
    sio.read([ReadJob(tmp_path / f"t{i}", 0, o, crc=c, device=True)
              for i, (o, c) in enumerate(zip(outs, crcs))], stage=stage)
    for t, o in zip(ts, outs):
        assert torch.equal(t, o)


def test_writes_wait_for_the_callers_stream(tmp_path, torch_cuda):
    """A tensor still being computed on a side stream is written as it is
    once that work is done: the copies are ordered after the stream."""
    torch = torch_cuda
    from shardstate import io as sio
    from shardstate.io import WriteJob

    side = torch.cuda.Stream()
    x = torch.zeros(64 << 20, dtype=torch.float32, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keep the stream busy ~0.1 s
        x.add_(3.0)
    sio.write([WriteJob(tmp_path / "x", 0, x, device=True)], stage=_stage(),
              stream=side.cuda_stream)
    got = np.fromfile(tmp_path / "x", dtype=np.float32)
    assert got.shape == (64 << 20,) and np.all(got == 3.0)


def test_checkpoint_of_cuda_tensors_both_ways(tmp_path, torch_cuda):
    torch = torch_cuda
    import shardstate.checkpoint as dcp
    import torch.distributed.checkpoint as tdcp

    g = torch.Generator(device="cuda").manual_seed(1)
    sd = {
        "w": torch.randn(1000, 300, device="cuda", generator=g),
        "b": torch.randn(300, device="cuda", generator=g).to(torch.bfloat16),
        "t": torch.randn(40, 50, device="cuda", generator=g).t(),  # non-contiguous
        "i": torch.arange(10, device="cuda"),
        "cpu": torch.randn(7, 7),
        "step": 3,
    }
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    dcp.save(sd, checkpoint_id=ours)
    tdcp.save(sd, checkpoint_id=theirs)
    # the data files are byte for byte torch's
    for name in sorted(os.listdir(theirs)):
        if name.endswith(".distcp"):
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    for src, reader in ((ours, tdcp), (theirs, dcp), (ours, dcp)):
        out = {k: (torch.zeros_like(v) if torch.is_tensor(v) else 0) for k, v in sd.items()}
        reader.load(out, checkpoint_id=src)
        for k, v in sd.items():
            if torch.is_tensor(v):
                assert out[k].device == v.device and torch.equal(out[k], v), (src, k)


def test_async_save_of_cuda_tensors_stages_then_allows_mutation(tmp_path, torch_cuda):
    torch = torch_cuda
    import shardstate.checkpoint as dcp
    from shardstate.checkpoint import _staging

    g = torch.Generator(device="cuda").manual_seed(2)
    sd = {"a": torch.randn(2048, 512, device="cuda", generator=g),
          "b": torch.randn(64, 32, device="cuda", generator=g).t(),
          "c": torch.randn(100)}
    want = {k: v.cpu().clone() for k, v in sd.items()}
    for i in range(3):  # the pool's arena is reused (and stays page-locked)
        fut = dcp.async_save(sd, checkpoint_id=tmp_path / f"ck{i}")
        fut.staging_completion.result()
        for v in sd.values():
            v.add_(1.0)  # the training step after staging
        fut.result()
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, checkpoint_id=tmp_path / f"ck{i}")
        for k in sd:
            assert torch.equal(out[k].cpu(), want[k]), (i, k)
        want = {k: v.cpu().clone() for k, v in sd.items()}
    assert any(a._pinned is not None for a in _staging._pool._free)


def _fsdp_on_gpu(rank, world):
    """FSDP1 on CUDA over NCCL (world 1: NCCL refuses two ranks on one GPU):
    shardstate.fsdp's full and sharded optimizer state equal torch's, and
    the full gather's bytes go over shardstate's own NCCL communicator."""
    import shardstate.fsdp as ssf
    import torch
    import torch.nn as nn
    from shardstate import comm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(33, 65), nn.ReLU(), nn.Linear(65, 7)).cuda(),
                 device_id=torch.device("cuda", 0))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(5, 33, device="cuda")).sum().backward()
        optim.step()
        optim.zero_grad()
    ours = ssf.full_optim_state_dict(model, optim)
    theirs = FSDP.full_optim_state_dict(model, optim)
    same = ours.keys() == theirs.keys() and ours["param_groups"] == theirs["param_groups"]
    for k, st in theirs["state"].items():
        for name, v in st.items():
            o = ours["state"][k][name]
            same = same and (torch.equal(o.cpu(), v.cpu()) if torch.is_tensor(v) else o == v)
    used_nccl = comm.communicator() is not None
    comm.close_communicators()
    return same, used_nccl


def test_fsdp_optim_state_on_gpu(run_distributed, torch_cuda):
    (same, used_nccl), = run_distributed(_fsdp_on_gpu, 1, backend="nccl")
    assert same
    assert used_nccl
