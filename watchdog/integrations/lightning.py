"""PyTorch Lightning (package ``lightning``): a ``Callback`` that beats every
optimizer step, reports checkpoints once their file is complete, and honours
the rollback's skip window.

    from trainwatch.integrations.lightning import TrainwatchCallback, resume_from
    trainer = L.Trainer(callbacks=[TrainwatchCallback(), ModelCheckpoint(...)])
    trainer.fit(model, data, ckpt_path=resume_from())

Where the values come from (lightning 2.6.6, ``lightning/pytorch``):

- loss: ``on_train_batch_end``'s ``outputs["loss"]`` (loops/training_epoch_loop.py
  calls it per batch; loops/optimization/automatic.py ``run`` returns
  ``closure.consume_result().asdict()``), the detached loss divided by
  ``accumulate_grad_batches``; summed over the step's batches, on the device.
  Lightning filters nothing: a NaN loss arrives as NaN.
- grad norm: ``on_before_optimizer_step``, which plugins/precision/precision.py
  ``_after_closure`` (line 87) calls after backward and before
  ``_clip_gradients`` (line 89), so the norm is pre-clip. Lightning keeps no
  norm of its own, so it is computed here: ``torch.nn.utils.get_total_norm``
  over this rank's gradients, on the device (a local norm under FSDP).
- checkpoints: ``Callback.on_save_checkpoint`` runs before anything is
  written. Instead ``setup`` wraps ``trainer.save_checkpoint`` (trainer.py
  line 1439: dump, ``strategy.save_checkpoint``, barrier): when it returns the
  file is complete and every rank is past the barrier; rank 0 reports it. With
  ``AsyncCheckpointIO`` the write is only queued on its one-thread executor,
  so the report is queued behind it on the same executor.

Values are read without a device sync (trainwatch.integrations.torch.Reporter).

Data order (``client.data_order``), said once at ``on_train_start``, after
Lightning restored the checkpoint and set the loaders up: "step" when every
train loader is stateful (``state_dict``/``load_state_dict``, e.g. torchdata's
``StatefulDataLoader``: fit_loop.py saves its state with the checkpoint and
restores it; training_epoch_loop.py ``reset`` calls such loaders resumable);
"epoch-seeded" when each epoch's order is fixed (a SequentialSampler, or a
seeded sampler that fit_loop.py ``_set_sampler_epoch`` tells its epoch): a
resume then starts the epoch over from its first batch, so a skip is exact only
from a checkpoint at an epoch end; otherwise "unknown" (an ordinary shuffled
``DataLoader``: every run draws its own order, and a resumed run trains other
batches than the steps the skip window names).

Skip window: for a step in it the wrapped ``training_step`` returns None;
Lightning then runs no backward and ``optimizer.step()`` finds no gradients,
so nothing changes, while ``global_step`` still advances
(automatic.py ``_optimizer_step`` counts the step either way). Lightning
documents a None ``training_step`` as unsupported for multi-GPU, TPU and
DeepSpeed strategies.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from trainwatch import client
from trainwatch.integrations.torch import Reporter, in_window, sampler_order, skip_window

__all__ = ["TrainwatchCallback", "resume_from"]

_pl: Any = importlib.import_module("lightning.pytorch")


def _stateful(loader: Any) -> bool:
    return all(callable(getattr(loader, m, None)) for m in ("state_dict", "load_state_dict"))


def data_order(trainer: Any) -> tuple[str, str, int | None]:
    """How the trainer's train loaders follow its step: (order, why, optimizer
    steps per epoch or None); see the module docstring."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = list(getattr(combined, "flattened", None) or [])
    if not loaders:
        return "unknown", "no train dataloader found at on_train_start", None
    if all(_stateful(x) for x in loaders):
        return "step", ("every train loader is stateful (state_dict/load_state_dict): "
                        "Lightning restores its position from the checkpoint"), None
    said = [sampler_order(x) for x in loaders]
    odd = next((why for order, why in said if order != "epoch-seeded"), None)
    if odd is not None:
        return "unknown", f"{odd}; the loader is not stateful", None
    batches = trainer.num_training_batches
    if not isinstance(batches, int) or batches <= 0:
        return "unknown", f"{said[0][1]}, but the epoch's length is not known", None
    per = -(-batches // max(1, int(trainer.accumulate_grad_batches)))
    return "epoch-seeded", (f"{said[0][1]}; the loader is not stateful, so a resume starts "
                            "its epoch over"), per


def resume_from() -> str | None:
    """For ``trainer.fit(..., ckpt_path=...)``: TRAINWATCH_RESUME_FROM or None."""
    return client.resume_from()


class TrainwatchCallback(_pl.Callback):  # type: ignore[misc]
    """Beats each optimizer step (loss, pre-clip grad norm), reports complete
    checkpoints from rank 0, skips TRAINWATCH_SKIP_STEPS."""

    def __init__(self, hb: client.Heartbeat | client.NullHeartbeat | None = None) -> None:
        self.hb = hb if hb is not None else client.connect()
        self.reporter = Reporter(self.hb)
        self.window = skip_window()
        self.skipped: list[int] = []  # steps passed through in this process
        self._loss: Any = None
        self._grad_norm: Any = None
        self._last_step: int | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or getattr(trainer, "_trainwatch_callback", None) is self:
            return
        trainer._trainwatch_callback = self
        self._wrap_save(trainer)
        step_fn = pl_module.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            if in_window(trainer.global_step + 1, self.window):
                return None
            return step_fn(*args, **kwargs)

        pl_module.training_step = training_step

    def _wrap_save(self, trainer: Any) -> None:
        save = trainer.save_checkpoint

        def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> None:
            save(filepath, *args, **kwargs)
            if not trainer.is_global_zero:
                return
            step, path = int(trainer.global_step), os.path.abspath(os.fspath(filepath))
            self.reporter.flush()  # the step's values before its checkpoint
            io = getattr(trainer.strategy, "checkpoint_io", None)
            executor = getattr(io, "_executor", None)
            if type(io).__name__ == "AsyncCheckpointIO" and executor is not None:
                executor.submit(self.hb.checkpoint, step, path)  # runs after the write
            else:
                self.hb.checkpoint(step, path)

        trainer.save_checkpoint = save_checkpoint

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._last_step = int(trainer.global_step)
        if trainer.is_global_zero:
            order, why, per = data_order(trainer)
            self.hb.data_order(order, why, per, step=self._last_step)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            torch: Any = sys.modules["torch"]
            self._grad_norm = torch.nn.utils.get_total_norm(grads)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self._loss = loss if self._loss is None else self._loss + loss
        step = int(trainer.global_step)
        if step == self._last_step:
            return  # accumulating: no optimizer step in this batch
        self._last_step = step
        if self._loss is None and self._grad_norm is None and in_window(step, self.window):
            self.skipped.append(step)
            self.hb.beat(step)
        else:
            self.reporter.put(step, self._loss, self._grad_norm)
        self._loss = self._grad_norm = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.reporter.flush()
