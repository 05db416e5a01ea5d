"""Hugging Face ``transformers``: a ``TrainerCallback`` that beats every
optimizer step with the values the Trainer really computed, reports each
``checkpoint-N/`` once written, and honours the rollback's skip window.

    from trainwatch.integrations.hf import TrainwatchCallback, resume_from
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[TrainwatchCallback()])
    trainer.train(resume_from_checkpoint=resume_from())

Why not ``logs``: with the default ``logging_nan_inf_filter=True`` the Trainer
adds the window's mean in place of a NaN/inf step loss (transformers 5.23
``trainer.py`` lines 1911-1917), so ``on_log`` never shows the NaN, and it logs
only every ``logging_steps``. Instead, at ``on_train_begin`` the callback wraps
two methods of that Trainer instance (found from the call stack if it was not
given one):

- ``training_step`` (trainer.py:2043, "Subclass and override"): it returns the
  micro-batch loss ``loss.detach()`` (trainer.py:2120), the very tensor the
  Trainer adds to ``tr_loss`` (trainer.py:1909, 1923). Their sum over the
  step's micro-batches is the step loss (each is already divided by the
  accumulation steps, trainer.py:2111), summed on the device.
- ``_get_grad_norm`` (trainer.py:2781), called once per optimizer step
  (trainer.py:1932) with ``_clip_grad_norm``'s return, i.e. the pre-clip total
  norm from ``accelerator.clip_grad_norm_`` (trainer.py:2779), or, with
  ``max_grad_norm=0``, a norm computed with max_norm=inf (trainer.py:2788).
  It is what the Trainer logs as ``grad_norm``, unfiltered.

Both stay tensors; ``on_step_end`` (trainer.py:1949, after ``global_step += 1``)
hands them to trainwatch.integrations.torch.Reporter, which reads them without
a device sync. ``on_save`` (trainer.py:2278) comes right after
``_save_checkpoint`` wrote ``trainer_state.json`` last (trainer.py:3409), so
``<output_dir>/checkpoint-N`` is complete on the main process when reported.

Data order (``client.data_order``), said once at ``on_train_begin``: "step"
with the defaults. The Trainer's RandomSampler becomes accelerate's
``SeedableRandomSampler`` (``use_seedable_sampler``, on by default), seeded
with ``data_seed`` or ``seed`` plus the epoch (``set_epoch``, trainer.py:1851),
and a resumed run skips the epoch's trained batches (``skip_first_batches``,
trainer.py:1844). "unknown" when ``ignore_data_skip`` is set, the seedable
sampler is off, the sampling strategy is another (group_by_length,
batch_rebalance: not checked), the dataset has no length (an iterable one
keeps its own order), or a subclass builds its own loader.

Skip window: for a step in it the wrapped ``training_step`` returns a zero loss
without forward or backward. Gradients are then None (``model.zero_grad()``
sets them so after every step), so ``optimizer.step()`` changes no parameter
and no optimizer state, while ``global_step`` and the LR scheduler advance.
Under DDP every rank skips the same steps, so no collective is left waiting.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import FrameType
from typing import Any

from trainwatch import client
from trainwatch.integrations.torch import Reporter, in_window, skip_window

__all__ = ["TrainwatchCallback", "resume_from"]

_transformers: Any = importlib.import_module("transformers")

TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME, written last


def resume_from() -> str | None:
    """For ``trainer.train(resume_from_checkpoint=...)``: TRAINWATCH_RESUME_FROM or None."""
    return client.resume_from()


def data_order(trainer: Any) -> tuple[str, str]:
    """How this Trainer's train data follows its step: (order, why); see the
    module docstring."""
    base, args = _transformers.Trainer, trainer.args
    own = [m for m in ("get_train_dataloader", "_get_train_sampler")
           if getattr(type(trainer), m, None) is not getattr(base, m, None)]
    if own:
        return "unknown", f"{type(trainer).__name__} overrides {own[0]}"
    if getattr(args, "ignore_data_skip", False):
        return "unknown", "ignore_data_skip=True: a resumed run does not skip the trained batches"
    ds = trainer.train_dataset
    if not hasattr(ds, "__len__"):
        return "unknown", (f"an iterable dataset ({type(ds).__name__}): the Trainer skips the "
                           "trained batches on resume, exact only if it yields the same "
                           "sequence every run")
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("random", "sequential"):
        return "unknown", f"train_sampling_strategy={strategy} (not checked)"
    config = getattr(args, "accelerator_config", None)
    if strategy == "random" and not getattr(config, "use_seedable_sampler", True):
        return "unknown", ("accelerator_config.use_seedable_sampler=False: the shuffle is "
                           "not seeded by epoch")
    seed = args.data_seed if getattr(args, "data_seed", None) is not None else args.seed
    return "step", (f"the Trainer orders each epoch by seed {seed} and the epoch, and skips "
                    "the epoch's trained batches on resume")


def _find_trainer() -> Any:
    """The Trainer whose callback handler is calling us (on_train_begin runs
    inside Trainer.train)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        s = f.f_locals.get("self")
        if isinstance(s, _transformers.Trainer):
            return s
        f = f.f_back
    return None


class TrainwatchCallback(_transformers.TrainerCallback):  # type: ignore[misc]
    """Beats each optimizer step (loss and pre-clip grad norm as computed, NaN
    included), reports finished checkpoints, skips TRAINWATCH_SKIP_STEPS."""

    def __init__(self, trainer: Any = None,
                 hb: client.Heartbeat | client.NullHeartbeat | None = None) -> None:
        self.trainer = trainer
        self.hb = hb if hb is not None else client.connect()
        self.reporter = Reporter(self.hb)
        self.window = skip_window()
        self.skipped: list[int] = []  # steps passed through in this process
        self._loss: Any = None  # this step's loss so far (a device tensor)
        self._grad_norm: Any = None
        self._skipping = False

    # --- the Trainer's methods, wrapped ---------------------------------------

    def _instrument(self, trainer: Any) -> None:
        if getattr(trainer, "_trainwatch_callback", None) is self:
            return  # train() called again on the same Trainer
        trainer._trainwatch_callback = self
        step_fn = trainer.training_step

        def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if in_window(trainer.state.global_step + 1, self.window):
                self._skipping = True
                torch = sys.modules["torch"]
                return torch.zeros((), device=trainer.args.device)
            loss = step_fn(model, inputs, *args, **kwargs)
            self._loss = loss if self._loss is None else self._loss + loss
            return loss

        trainer.training_step = training_step
        norm_fn = getattr(trainer, "_get_grad_norm", None)
        if norm_fn is not None:
            def get_grad_norm(*args: Any, **kwargs: Any) -> Any:
                self._grad_norm = norm_fn(*args, **kwargs)
                return self._grad_norm

            trainer._get_grad_norm = get_grad_norm

    # --- callback events --------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer if self.trainer is not None else _find_trainer()
        if trainer is not None:
            self.trainer = trainer
            self._instrument(trainer)
            if state.is_world_process_zero:
                order, why = data_order(trainer)
                self.hb.data_order(order, why, step=int(state.global_step))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = int(state.global_step)
        if self._skipping:
            self.skipped.append(step)
            self.hb.beat(step)
        else:
            self.reporter.put(step, self._loss, self._grad_norm)
        self._loss = self._grad_norm = None
        self._skipping = False

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isfile(os.path.join(path, TRAINER_STATE)):
            self.reporter.flush()  # the step's values before its checkpoint
            self.hb.checkpoint(int(state.global_step), path)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.reporter.flush()
