"""A Hugging Face Trainer with trainwatch's TrainwatchCallback: a tiny GPT-2
(one layer, 16 wide) learning random token sequences on CPU, with the
Trainer's default arguments except the output folder, the step count, the
save interval and the batch size. Checkpoints are OUT/ckpt/checkpoint-N.

    trainwatch run --checkpoint-dir OUT/ckpt --checkpoint-pattern 'checkpoint-{step}' \
        -- python examples/hf_train.py --out OUT

Drills, on the first attempt only (TRAINWATCH_ATTEMPT unset or 0):
--nan-at S fills the token embeddings with NaN before step S, so its loss
really is NaN (the Trainer's own logs would show a finite loss: its
logging_nan_inf_filter); --crash-at S raises after step S.
OUT/progress.jsonl records each attempt's first step, what it resumed from,
the steps it skipped, and its last step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from trainwatch.integrations.hf import TrainwatchCallback, resume_from
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


def record(out: Path, **event: Any) -> None:
    event["attempt"] = int(os.environ.get("TRAINWATCH_ATTEMPT", "0"))
    with open(out / "progress.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Seeded random sequences; the labels are the inputs (causal LM)."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Drill(TrainerCallback):  # type: ignore[misc]
    def __init__(self, out: Path, a: argparse.Namespace, tw: TrainwatchCallback) -> None:
        self.out, self.a, self.tw = out, a, tw
        self.first_attempt = int(os.environ.get("TRAINWATCH_ATTEMPT", "0")) == 0
        self.started = False

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                      **kw: Any) -> None:
        step = state.global_step + 1
        if not self.started:
            self.started = True
            record(self.out, event="start", resume_from=resume_from(), first_step=step,
                   skip=list(self.tw.window) if self.tw.window else None)
        if self.first_attempt and step == self.a.nan_at:
            with torch.no_grad():
                model.transformer.wte.weight.fill_(float("nan"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.first_attempt and state.global_step == self.a.crash_at:
            raise RuntimeError(f"injected crash after step {state.global_step}")
        time.sleep(self.a.step_time)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        record(self.out, event="end", last_step=state.global_step, skipped=self.tw.skipped)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep per step")
    p.add_argument("--nan-at", type=int)
    p.add_argument("--crash-at", type=int)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=str(a.out / "ckpt"), max_steps=a.steps,
                             save_steps=a.ckpt_every, per_device_train_batch_size=4,
                             use_cpu=True, disable_tqdm=True)
    tw = TrainwatchCallback()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64),
                      callbacks=[tw, Drill(a.out, a, tw)])
    trainer.train(resume_from_checkpoint=resume_from())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
