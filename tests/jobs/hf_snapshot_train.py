"""A real CPU training run of a tiny transformers GPT-2 with trainwatch.snapshot:
AdamW on batches drawn from a generator seeded by the step (so any attempt sees
the same data at the same step), dropout on (so the torch RNG state matters and
is snapshotted with the weights and the optimizer).

    python tests/jobs/hf_snapshot_train.py --ckpt-dir D --out O --steps 12 --every 3
        [--crash-at 7] [--wait-saves]

--crash-at S: on the first attempt only (TRAINWATCH_ATTEMPT unset or 0), after
step S, os._exit(3): a crash that runs no cleanup. --wait-saves: wait for each save to be published
before the next step, so that none is coalesced (the steps here take
milliseconds, a save's phase 2 longer) and which snapshots exist is certain.
O/progress.jsonl records each attempt's first step and what it resumed from;
O/final.pt holds the final weights and optimizer state.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from trainwatch.snapshot import Snapshotter
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ, BATCH = 128, 16, 4


def record(out: Path, **event: Any) -> None:
    event["attempt"] = int(os.environ.get("TRAINWATCH_ATTEMPT", "0"))
    with open(out / "progress.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")


def batch(step: int) -> torch.Tensor:
    """The data of `step`, the same on every attempt."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--crash-at", type=int)
    p.add_argument("--wait-saves", action="store_true")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # one thread: the same reduction order on every attempt
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)  # GPT-2's dropouts (0.1) stay on
    model = GPT2LMHeadModel(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    snap = Snapshotter(a.ckpt_dir, every_steps=a.every, keep=3)
    first = 1
    restored = snap.restore()
    if restored is not None:
        step, state = restored
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
        first = step + 1
    record(a.out, event="start", first_step=first,
           resume_from=os.environ.get("TRAINWATCH_RESUME_FROM"))
    crash = a.crash_at if int(os.environ.get("TRAINWATCH_ATTEMPT", "0")) == 0 else None
    for step in range(first, a.steps + 1):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict(),
                 "rng": torch.get_rng_state()}
        if snap.maybe_save(step, state) and a.wait_saves:
            snap.wait()
        if step == crash:
            os._exit(3)
    snap.close()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, a.out / "final.pt")
    record(a.out, event="end", last_step=a.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
