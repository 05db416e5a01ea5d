"""A PyTorch Lightning run with trainwatch's TrainwatchCallback: a tiny MLP on
CPU, deterministic, an epoch of --ckpt-every steps and a checkpoint at the end
of each (OUT/ckpt/step_N.ckpt: Lightning resumes exactly at an epoch end),
resumed with ``ckpt_path=resume_from()``.

    trainwatch run --checkpoint-dir OUT/ckpt --checkpoint-pattern 'step_{step}.ckpt' \
        -- python examples/lightning_train.py --out OUT

Drills, on the first attempt only (TRAINWATCH_ATTEMPT unset or 0):
--nan-at S fills a weight with NaN before step S, so its loss really is NaN;
--crash-at S raises after step S. --shuffle: an ordinary shuffled DataLoader,
whose order a resumed run does not repeat. OUT/progress.jsonl records each attempt's
first step, what it resumed from, the steps it skipped, and its last step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from trainwatch.integrations.lightning import TrainwatchCallback, resume_from


def record(out: Path, **event: Any) -> None:
    event["attempt"] = int(os.environ.get("TRAINWATCH_ATTEMPT", "0"))
    with open(out / "progress.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Drill(pl.Callback):
    def __init__(self, out: Path, a: argparse.Namespace, tw: TrainwatchCallback) -> None:
        self.out, self.a, self.tw = out, a, tw
        self.first_attempt = int(os.environ.get("TRAINWATCH_ATTEMPT", "0")) == 0
        self.started = False

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
        step = trainer.global_step + 1
        if not self.started:
            self.started = True
            record(self.out, event="start", resume_from=resume_from(), first_step=step,
                   skip=list(self.tw.window) if self.tw.window else None)
        if self.first_attempt and step == self.a.nan_at:
            with torch.no_grad():
                module.net[0].weight.fill_(float("nan"))

    def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any,
                           i: int) -> None:
        if self.first_attempt and trainer.global_step == self.a.crash_at:
            raise RuntimeError(f"injected crash after step {trainer.global_step}")
        time.sleep(self.a.step_time)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        record(self.out, event="end", last_step=trainer.global_step, skipped=self.tw.skipped)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of sleep per step")
    p.add_argument("--nan-at", type=int)
    p.add_argument("--crash-at", type=int)
    p.add_argument("--shuffle", action="store_true",
                   help="an ordinary shuffled DataLoader: a rollback's skip is then approximate")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)

    pl.seed_everything(0, verbose=False)
    x = torch.randn(a.ckpt_every * 16, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.5), batch_size=16,
        shuffle=a.shuffle)
    tw = TrainwatchCallback()
    ckpt = ModelCheckpoint(dirpath=a.out / "ckpt", filename="step_{step}",
                           auto_insert_metric_name=False, every_n_epochs=1, save_top_k=-1,
                           save_on_train_epoch_end=True)
    trainer = pl.Trainer(max_steps=a.steps, max_epochs=-1,
                         callbacks=[tw, ckpt, Drill(a.out, a, tw)], accelerator="cpu",
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(Regression(), data, ckpt_path=resume_from())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
