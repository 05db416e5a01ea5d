"""A small model that really trains: a two-layer MLP (numpy) learning a fixed
random teacher network by SGD with momentum.

Each step's batch is drawn from a generator seeded by (seed, step), so a run
that is interrupted and resumed from its checkpoints ends with exactly the
parameters of an uninterrupted run; the demo checks that bit for bit. The
trainer beats every step, checkpoints every K steps (write to a temp file,
fsync, rename, then report it), resumes from TRAINWATCH_RESUME_FROM and skips
the data of the steps in TRAINWATCH_SKIP_STEPS (after a rollback). On SIGUSR1
it puts a NaN in its weights, on SIGUSR2 it scales its gradient (the drills).

    python -m trainwatch.demo.trainer --steps 600 --ckpt-dir ckpt --journal j.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import numpy.typing as npt
from trainwatch import client

Params = dict[str, npt.NDArray[np.float64]]
IN, HIDDEN, OUT, BATCH = 16, 32, 1, 64
LR, MOMENTUM = 0.01, 0.9


def init(seed: int) -> tuple[Params, Params, Params]:
    """(teacher, params, velocity)."""
    rng = np.random.default_rng(seed)
    teacher = {"w": rng.normal(0, 1, (IN, OUT)), "v": rng.normal(0, 1, (IN, IN))}
    params = {
        "w1": rng.normal(0, 1 / np.sqrt(IN), (IN, HIDDEN)),
        "b1": np.zeros(HIDDEN),
        "w2": rng.normal(0, 1 / np.sqrt(HIDDEN), (HIDDEN, OUT)),
        "b2": np.zeros(OUT),
    }
    velocity = {k: np.zeros_like(v) for k, v in params.items()}
    return teacher, params, velocity


def batch(seed: int, step: int, teacher: Params) -> tuple[npt.NDArray[np.float64], ...]:
    rng = np.random.default_rng([seed, step])
    x = rng.normal(0, 1, (BATCH, IN))
    y = np.tanh(x @ teacher["v"]) @ teacher["w"]
    return x, y


def train_step(
    params: Params, velocity: Params, x: npt.NDArray[np.float64], y: npt.NDArray[np.float64],
    grad_scale: float = 1.0,
) -> tuple[float, float]:
    """One SGD-with-momentum step in place; returns (loss, grad_norm).
    ``grad_scale``: the spike drill's factor on the gradient."""
    h = np.tanh(x @ params["w1"] + params["b1"])
    pred = h @ params["w2"] + params["b2"]
    err = pred - y
    loss = float(np.mean(err**2))
    d_pred = 2 * err / len(x)
    grads = {"w2": h.T @ d_pred, "b2": d_pred.sum(0)}
    d_h = (d_pred @ params["w2"].T) * (1 - h**2)
    grads["w1"] = x.T @ d_h
    grads["b1"] = d_h.sum(0)
    if grad_scale != 1.0:
        grads = {k: g * grad_scale for k, g in grads.items()}
    grad_norm = float(np.sqrt(sum(float(np.sum(g**2)) for g in grads.values())))
    for k, g in grads.items():
        velocity[k] = MOMENTUM * velocity[k] - LR * g
        params[k] += velocity[k]
    return loss, grad_norm


def digest(params: Params, velocity: Params) -> str:
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(params[k].tobytes())
        h.update(velocity[k].tobytes())
    return h.hexdigest()[:16]


def save(path: Path, step: int, loss: float, params: Params, velocity: Params) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    arrays: dict[str, Any] = {"step": step, "loss": loss}
    arrays.update({f"p_{k}": v for k, v in params.items()})
    arrays.update({f"v_{k}": v for k, v in velocity.items()})
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str) -> tuple[int, Params, Params]:
    with np.load(path) as z:
        step = int(z["step"])
        params = {k[2:]: z[k].copy() for k in z.files if k.startswith("p_")}
        velocity = {k[2:]: z[k].copy() for k in z.files if k.startswith("v_")}
    return step, params, velocity


def skipped(step: int, skip: tuple[int, int] | None) -> bool:
    """Whether this step's data is skipped (TRAINWATCH_SKIP_STEPS, both ends inclusive)."""
    return skip is not None and skip[0] <= step <= skip[1]


def reference(seed: int, steps: int, skip: tuple[int, int] | None = None) -> tuple[float, str]:
    """An uninterrupted, fault-free run in-process that skips the data of the
    steps ``skip`` covers: (final loss, digest)."""
    teacher, params, velocity = init(seed)
    loss = float("nan")
    for step in range(1, steps + 1):
        x, y = batch(seed, step, teacher)
        if not skipped(step, skip):
            loss, _ = train_step(params, velocity, x, y)
    return loss, digest(params, velocity)


class Breakage:
    """The drills, for real (``faultinject.drills.in_trainer``): SIGUSR1 puts a
    NaN into the weights, SIGUSR2 scales the gradient for the next few steps.
    Signals, not a file polled each step: they cost nothing until sent, and
    reach the trainer through the same proven-the-job's pidfd as the crash and
    hang drills. The handler only records them; the loop applies them between
    steps."""

    def __init__(self, scale: float, steps: int) -> None:
        self.scale, self.steps = scale, steps
        self.nan = False
        self.spike_left = 0
        signal.signal(signal.SIGUSR1, self._on_nan)
        signal.signal(signal.SIGUSR2, self._on_spike)

    def _on_nan(self, _sig: int, _frame: FrameType | None) -> None:
        self.nan = True

    def _on_spike(self, _sig: int, _frame: FrameType | None) -> None:
        self.spike_left = self.steps

    def apply(self, params: Params) -> float:
        """Before a step: corrupt the weights if asked; the gradient's factor."""
        if self.nan:
            self.nan = False
            params["w1"][0, 0] = np.nan
        if self.spike_left:
            self.spike_left -= 1
            return self.scale
        return 1.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainer")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--step-time", type=float, default=0.015, help="simulated compute per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--journal", help="append JSON lines: start, checkpoint, resume, done")
    p.add_argument("--spike-scale", type=float, default=100.0,
                   help="SIGUSR2: the gradient's factor")
    p.add_argument("--spike-steps", type=int, default=10, help="SIGUSR2: for this many steps")
    args = p.parse_args(argv)
    breakage = Breakage(args.spike_scale, args.spike_steps)

    def note(**event: Any) -> None:
        if args.journal:
            event["attempt"] = int(os.environ.get("TRAINWATCH_ATTEMPT", "0"))
            event["gpus"] = os.environ.get("CUDA_VISIBLE_DEVICES")
            with open(args.journal, "a") as f:
                f.write(json.dumps(event) + "\n")

    hb = client.connect()
    teacher, params, velocity = init(args.seed)
    start = 0
    resume = client.resume_from()
    skip = client.skip_steps()
    if resume:
        start, params, velocity = load(resume)
        note(event="resume", step=start, path=resume, digest=digest(params, velocity), skip=skip)
        print(f"resumed from {resume} at step {start}", flush=True)
    else:
        note(event="start", step=0, skip=skip)
    # batch() draws step k's data from (seed, k): a rollback's skip is exact.
    hb.data_order("step", "each batch is drawn from a generator seeded by (seed, step)",
                  step=start)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    loss = float("nan")
    for step in range(start + 1, args.steps + 1):
        x, y = batch(args.seed, step, teacher)  # drawn even when skipped, as a loader would
        if skipped(step, skip):
            hb.beat(step)  # alive, nothing learnt: no loss to report
        else:
            loss, grad_norm = train_step(params, velocity, x, y, breakage.apply(params))
            time.sleep(args.step_time)
            hb.beat(step, loss=loss, grad_norm=grad_norm)
        if step % args.ckpt_every == 0:
            path = ckpt_dir / f"step_{step}.npz"
            save(path, step, loss, params, velocity)
            hb.checkpoint(step, path)
            note(event="checkpoint", step=step, path=str(path), digest=digest(params, velocity),
                 loss=loss)
        if step % 100 == 0:
            print(f"step {step} loss {loss:.5f}", flush=True)
    note(event="done", step=args.steps, loss=loss, digest=digest(params, velocity))
    print(f"done: {args.steps} steps, loss {loss:.5f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
