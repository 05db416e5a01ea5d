"""PyTorch's torchrun tutorial job, as it saves: one ``snapshot.pt`` overwritten
in place every --save-every epochs by rank 0 (keys MODEL_STATE and EPOCHS_RUN),
loaded back if it exists; DDP on gloo (CPU). The one line added for trainwatch:
``hb.checkpoint(epoch, path)`` after each save, so the fixed layout knows which
epoch the file on disk holds.

    trainwatch run --checkpoint-dir OUT --layout fixed --checkpoint-pattern snapshot.pt \\
        -- torchrun --standalone --nproc-per-node=2 examples/snapshot_train.py --out OUT

--crash-at E raises after epoch E on the first attempt. OUT/progress.jsonl
records each attempt's first epoch and its last.
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
from trainwatch import client


def record(out: Path, **event: Any) -> None:
    event["attempt"] = int(os.environ.get("TRAINWATCH_ATTEMPT", "0"))
    with open(out / "progress.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--epochs", type=int, default=9)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--epoch-time", type=float, default=0.05)
    p.add_argument("--crash-at", type=int)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    snapshot = a.out / "snapshot.pt"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    epochs_run = 0
    if snapshot.exists():  # as the tutorial: load the snapshot if there is one
        state = torch.load(snapshot, weights_only=True)
        model.load_state_dict(state["MODEL_STATE"])
        epochs_run = int(state["EPOCHS_RUN"])
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    hb = client.connect(rank=rank)
    if rank == 0:
        record(a.out, event="start", first_epoch=epochs_run + 1)
    first_attempt = int(os.environ.get("TRAINWATCH_ATTEMPT", "0")) == 0
    for epoch in range(epochs_run + 1, a.epochs + 1):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(epoch * 10 + rank))
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        hb.beat(epoch, loss=loss.item())
        if rank == 0 and epoch % a.save_every == 0:
            torch.save({"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": epoch}, snapshot)
            hb.checkpoint(epoch, snapshot)  # the one line trainwatch needs
        if first_attempt and epoch == a.crash_at:
            raise RuntimeError(f"injected crash after epoch {epoch}")
        time.sleep(a.epoch_time)
    if rank == 0:
        record(a.out, event="end", last_epoch=a.epochs)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
