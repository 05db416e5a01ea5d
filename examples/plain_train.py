"""A torchrun job that knows nothing of trainwatch, as most are on day one: DDP on
gloo (CPU), rank 0 writes ``OUT/ckpt/step_N.pt`` with ``torch.save`` every
--ckpt-every steps, and ``--resume-from PATH`` loads one. No client, no reports:
trainwatch finds the checkpoints in the folder by their names, and hands the
newest complete one to the relaunch through ``--resume-arg``.

    trainwatch run --checkpoint-dir OUT/ckpt --resume-arg=--resume-from \\
        --resume-arg={checkpoint} -- torchrun --standalone --nproc-per-node=2 \\
        examples/plain_train.py --out OUT

--crash-at S raises on rank 0 after step S of the first attempt (the attempt
number is read only for this drill). OUT/progress.jsonl records each attempt's
first step, what it resumed from, and its last step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def record(out: Path, **event: Any) -> None:
    event["attempt"] = int(os.environ.get("TRAINWATCH_ATTEMPT", "0"))
    with open(out / "progress.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--resume-from", type=Path)
    p.add_argument("--crash-at", type=int)
    a = p.parse_args()
    ckpt = a.out / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if a.resume_from is not None:
        state = torch.load(a.resume_from, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    ddp = DistributedDataParallel(model)
    if rank == 0:
        record(a.out, event="start", first_step=start + 1,
               resume_from=str(a.resume_from) if a.resume_from else None)
    first_attempt = int(os.environ.get("TRAINWATCH_ATTEMPT", "0")) == 0
    for step in range(start + 1, a.steps + 1):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 100 + rank))
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % a.ckpt_every == 0:  # written in place, as most scripts do
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                       ckpt / f"step_{step}.pt")
        if rank == 0 and first_attempt and step == a.crash_at:
            raise RuntimeError(f"injected crash after step {step}")
        time.sleep(a.step_time)
    if rank == 0:
        record(a.out, event="end", last_step=a.steps)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
