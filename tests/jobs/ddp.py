"""A real DistributedDataParallel job for torchrun on gloo (CPU): a tiny
linear model, a checkpoint every few steps, resume from TRAINWATCH_RESUME_FROM.
With --beat each rank beats through the client; without it the job knows
nothing of trainwatch, as most jobs do on day one."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from trainwatch import client


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--beat", action="store_true", help="beat through the trainwatch client")
    p.add_argument("--print-every", type=int, default=0, help="print progress every N steps")
    p.add_argument("--stop-rank1-at", type=int, default=0,
                   help="rank 1 stops itself (SIGSTOP) after this step, first attempt only")
    p.add_argument("--corrupt-at", type=int, default=0,
                   help="rank 0 overwrites the newest checkpoint with garbage after this step "
                        "and exits 1 (a disk that corrupted it, and the crash), first attempt")
    p.add_argument("--sleep-rank1-at", type=int, default=0,
                   help="rank 1 sleeps an hour after this step (not stopped), first attempt only")
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    resume = client.resume_from()
    if resume:
        state = torch.load(resume, weights_only=True)
        model.module.load_state_dict(state["model"])
        start = int(state["step"])
    hb = client.connect() if a.beat else client.NullHeartbeat()
    for step in range(start + 1, a.steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(16, 8, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        hb.beat(step, loss=loss.item())
        if a.print_every and step % a.print_every == 0:
            print(f"[rank{rank}]: step {step} loss {loss.item():.4f}", flush=True)
        if rank == 1 and step == a.stop_rank1_at and resume is None:
            # Stopped here, outside any collective, so its stack is not the others'
            # (a SIGSTOP from outside may land in the all-reduce they block in).
            os.kill(os.getpid(), signal.SIGSTOP)
        if rank == 1 and step == a.sleep_rank1_at and resume is None:
            time.sleep(3600)  # stuck in its own code, as a rank on a dead filesystem is
        if rank == 0 and step == a.corrupt_at and resume is None:
            newest = max(Path(a.ckpt_dir).glob("step_*.pt"), key=lambda q: int(q.stem[5:]))
            newest.write_bytes(b"\0garbage" * 64)
            raise SystemExit(1)
        if step % a.ckpt_every == 0 and rank == 0:
            path = Path(a.ckpt_dir) / f"step_{step}.pt"
            tmp = path.with_suffix(".tmp")
            torch.save({"model": model.module.state_dict(), "step": step}, tmp)
            os.replace(tmp, path)
            hb.checkpoint(step, path)
        time.sleep(a.interval)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
