"""A plain PyTorch loop with trainwatch.integrations.torch: a tiny MLP on CPU,
deterministic (each step's batch is a function of its step number), a
checkpoint every --ckpt-every steps, resumed from TRAINWATCH_RESUME_FROM, the
skip window honoured.

    trainwatch run --checkpoint-dir OUT/ckpt -- python examples/torch_train.py --out OUT

With --dcp each checkpoint is a torch.distributed.checkpoint folder
(OUT/ckpt/step_N/, ``.metadata`` written last) instead of one torch.save file.
With --snapshot, trainwatch.snapshot's Snapshotter takes them (OUT/ckpt/snapshot-N/):
the loop waits only for the copy to host memory, the write, its report and the
dedup of unchanged tensors happen in the background.

Drills, on the first attempt only (TRAINWATCH_ATTEMPT unset or 0):
--nan-at S fills a weight with NaN before step S, so its loss really is NaN;
--crash-at S raises after step S. OUT/progress.jsonl records each attempt's
first step, what it resumed from, the steps it skipped, and its last step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from trainwatch.integrations.torch import Watch


def record(out: Path, **event: Any) -> None:
    event["attempt"] = int(os.environ.get("TRAINWATCH_ATTEMPT", "0"))
    with open(out / "progress.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")


def batches(first: int, last: int) -> Any:
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 8, generator=g)
        yield x, x.sum(dim=1, keepdim=True) * 0.5


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep per step")
    p.add_argument("--nan-at", type=int)
    p.add_argument("--crash-at", type=int)
    p.add_argument("--dcp", action="store_true", help="save with torch.distributed.checkpoint")
    p.add_argument("--snapshot", action="store_true", help="save with trainwatch.snapshot")
    a = p.parse_args()
    ckpt = a.out / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    first_attempt = int(os.environ.get("TRAINWATCH_ATTEMPT", "0")) == 0

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = Watch()
    start, resume = 0, w.resume_from()
    snap = None
    if a.snapshot:
        from trainwatch.snapshot import Snapshotter

        snap = Snapshotter(ckpt, every_steps=a.ckpt_every)  # reports each one itself
        restored = snap.restore()  # TRAINWATCH_RESUME_FROM, every chunk's hash checked
        if restored is not None:
            start, state = restored
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
    elif resume and a.dcp:
        import torch.distributed.checkpoint as dcp

        state = {"model": model.state_dict(), "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=resume)  # in place, into these tensors
        model.load_state_dict(state["model"])
        start = int(state["step"])
    elif resume:
        state = torch.load(resume, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    # Each batch is drawn from its step (batches() below): a rollback's skip is exact.
    w.data_order("step", "each batch is drawn from a generator seeded by its step", step=start)
    record(a.out, event="start", resume_from=resume, first_step=start + 1,
           skip=list(w.window) if w.window else None)
    step = start
    for step, (x, y) in w.steps(batches(start + 1, a.steps), first=start + 1):
        if first_attempt and step == a.nan_at:
            with torch.no_grad():
                model[0].weight.fill_(float("nan"))
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the pre-clip norm
        opt.step()
        w.step(step, loss, gn)
        if snap is not None:
            snap.maybe_save(step, {"model": model.state_dict(), "opt": opt.state_dict()})
        elif step % a.ckpt_every == 0 and a.dcp:
            import torch.distributed.checkpoint as dcp

            path = ckpt / f"step_{step}"  # a folder; .metadata, written last, completes it
            dcp.save({"model": model.state_dict(), "step": torch.tensor(step)},
                     checkpoint_id=path)
            w.checkpoint(step, path)
        elif step % a.ckpt_every == 0:
            path = ckpt / f"step_{step}.pt"
            tmp = path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, path)  # complete before it is reported
            w.checkpoint(step, path)
        if first_attempt and step == a.crash_at:
            raise RuntimeError(f"injected crash after step {step}")
        time.sleep(a.step_time)
    w.close()
    if snap is not None:
        snap.close()  # waits for the save in flight (an exit does too)
    record(a.out, event="end", last_step=max(step, *w.skipped, start), skipped=w.skipped)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
