"""`make demo`, first part: a training run under CheckpointManager, preempted
and resumed at another world size, then the `shardstate` command on it.

    python scripts/demo_run.py --dir D        # the whole story (the driver)

1. torchrun, 2 ranks: a small GPT-like model under FSDP2 (fully_shard on a
   CPU mesh) with AdamW trains; a CheckpointManager saves every 4 steps
   (async, keeping the last 2) with the loss and a digest of the weights as
   metrics. After step 10 the driver sends SIGTERM to torchrun, as a
   cluster scheduler does; the ranks agree on it at their next save call,
   save and commit that step, and exit.
2. `shardstate ls D`: the committed steps, the preempted one last.
3. torchrun, 3 ranks: a fresh model restores the latest committed step
   (get_state_dict / set_state_dict through a Stateful, resharded from 2
   ranks to 3), checks the weights' digest against the one saved with the
   step, and trains 4 more steps, saving at the end.
4. `shardstate inspect` and `shardstate verify` on the last step.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _model(world: int) -> tuple:
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            h = self.ln(x)
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln(x))

    class GPT(nn.Module):
        def __init__(self, vocab: int = 512, d: int = 128, layers: int = 4) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
            self.head = nn.Linear(d, vocab)

        def forward(self, idx):
            x = self.emb(idx)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    torch.manual_seed(0)
    model = GPT()
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optim


class AppState:
    """The model and optimizer as one Stateful (DCP's usual pattern)."""

    def __init__(self, model, optim) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict:
        from shardstate.checkpoint.state_dict import get_state_dict

        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd: dict) -> None:
        from shardstate.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])


def _digest(model) -> float:

    return float(sum(p.detach().full_tensor().double().pow(2).sum() for p in model.parameters()))


def train(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from shardstate.checkpoint import CheckpointManager

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = _model(world)
    app = {"app": AppState(model, optim)}
    mgr = CheckpointManager(a.dir, save_interval_steps=4, max_to_keep=2)
    step = mgr.restore(app) or 0
    if step:
        saved = mgr.metrics(step)["digest"]
        now = _digest(model)
        ok = now == saved
        if rank == 0:
            print(f"[{world} ranks] restored step {step} saved by another world size: weights "
                  f"digest {now:.6f} {'==' if ok else '!='} {saved:.6f}", flush=True)
        if not ok:
            raise SystemExit("restored weights differ from the saved ones")
    end = step + a.steps if a.steps else None
    while end is None or step < end:
        step += 1
        g = torch.Generator().manual_seed(step)
        data = torch.randint(0, 512, (world * 2, 33), generator=g)[rank * 2:(rank + 1) * 2]
        loss = F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
        if rank == 0:
            print(f"[{world} ranks] step {step} loss {loss.item():.4f}", flush=True)
        metrics = {"loss": loss.item(), "digest": _digest(model)}
        mgr.save(step, app, metrics=metrics, force=step == end)  # a SIGTERM: saved, exit
        if step == 10 and rank == 0 and a.ready:
            Path(a.ready).touch()
    mgr.close()
    dist.destroy_process_group()


def _torchrun(n: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={n}", str(Path(__file__).resolve()), *args]


def _shardstate(*args: str) -> None:
    script = Path(sys.executable).parent / "shardstate"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "shardstate"]
    print(f"$ shardstate {' '.join(args)}", flush=True)
    rc = subprocess.run(cmd + list(args)).returncode
    if rc:
        raise SystemExit(f"shardstate {args[0]} exited with {rc}")


def drive(a: argparse.Namespace) -> None:
    import shutil

    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    ready = root.parent / (root.name + ".ready")
    ready.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print("== 1. train at 2 ranks; SIGTERM after step 10", flush=True)
    proc = subprocess.Popen(_torchrun(2, "train", "--dir", a.dir, "--ready", str(ready)), env=env)
    deadline = time.monotonic() + 600
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("training ended before it was preempted")
        time.sleep(0.1)
    print("== driver: SIGTERM to torchrun (it passes it on to the workers and then reports "
          "the signal with a traceback of its own)", flush=True)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    ready.unlink(missing_ok=True)
    print("== 2. what the preempted run left", flush=True)
    _shardstate("ls", a.dir)
    print("== 3. resume at 3 ranks from the latest committed step", flush=True)
    if subprocess.run(_torchrun(3, "train", "--dir", a.dir, "--steps", "4"), env=env).returncode:
        raise SystemExit("the resumed run failed")
    print("== 4. the result", flush=True)
    from shardstate.checkpoint._steps import list_steps

    last = list_steps(a.dir)[-1]
    _shardstate("ls", a.dir)
    _shardstate("inspect", str(last.path))
    _shardstate("verify", str(last.path))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", default="drive", choices=("drive", "train"))
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=0, help="train: this many steps (0: until "
                   "preempted)")
    p.add_argument("--ready", default="", help="train: touched after step 10 (rank 0)")
    a = p.parse_args()
    (drive if a.mode == "drive" else train)(a)


if __name__ == "__main__":
    main()
