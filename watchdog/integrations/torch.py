"""Plain PyTorch: each optimizer step's loss and grad norm, finished
checkpoints, resume, and the rollback's skip window.

    from trainwatch.integrations.torch import Watch
    w = Watch()
    start = load(w.resume_from()) if w.resume_from() else 0   # the step it holds
    w.data_order("step", "batch k drawn from a sampler seeded by k")  # the skip is exact
    for step, batch in w.steps(batches_from(start + 1), first=start + 1):
        loss = model(batch).mean()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # pre-clip norm
        opt.step(); opt.zero_grad()
        w.step(step, loss, gn)              # tensors as they are: no .item() needed
        if step % 100 == 0:
            save(path); w.checkpoint(step, path)   # after the file is complete

No extra GPU sync per step: a value may be a float or a 0-d tensor. A CPU
tensor is read at once. A CUDA tensor is copied to pinned host memory with
``non_blocking=True`` behind a CUDA event, and the beat goes out at a later
``step()`` once the event has completed (``Event.query()`` never blocks), so
beats may trail the loop by a step or two. Only when more than
``_MAX_PENDING`` steps are still in flight, and at ``checkpoint()``/
``close()`` (where the save syncs anyway), does it wait. Other devices
(MPS, XLA) are read with ``.item()``, one sync per value.

torch itself is imported only when a device tensor arrives.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from trainwatch import client

__all__ = ["Reporter", "Watch", "agreed_resume", "in_window", "sampler_order", "skip_window"]

T = TypeVar("T")
Sender = client.Heartbeat | client.NullHeartbeat

# Steps whose values may still be on the device before step() waits for the oldest.
_MAX_PENDING = 8


def skip_window() -> tuple[int, int] | None:
    """TRAINWATCH_SKIP_STEPS as (start, end), end inclusive; None when unset,
    malformed or empty (end < start)."""
    w = client.skip_steps()
    return w if w is not None and w[0] <= w[1] else None


def agreed_resume() -> tuple[str | None, tuple[int, int] | None]:
    """``client.resume_from()`` and ``skip_window()``, the same on every rank of the
    default process group (call it after ``init_process_group``): every rank's
    answer is gathered, and where they differ (in a job across hosts, a group
    restart's decision read by some ranks before it was written) every rank
    raises: never trained through; the launcher restarts them and the next round
    reads one decision. Without a process group: this rank's own."""
    mine = (client.resume_from(), skip_window())
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return mine
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    odd = [i for i, g in enumerate(got) if g != got[0]]
    if odd:
        raise RuntimeError(f"trainwatch: the ranks disagree on where to resume: rank 0 "
                           f"{got[0]!r}, rank {odd[0]} {got[odd[0]]!r} ({len(odd)} differ)")
    return mine


def in_window(step: int, window: tuple[int, int] | None) -> bool:
    return window is not None and window[0] <= step <= window[1]


def sampler_order(loader: Any) -> tuple[str, str]:
    """How a torch ``DataLoader``'s sampler orders an epoch, for
    ``client.data_order``: ("epoch-seeded", why) when every epoch's order is
    fixed by the epoch (sequential, or a seeded sampler told its epoch with
    ``set_epoch``), else ("unknown", why). Whether a resume then lands on the
    right batch is the caller's to judge (a stateful loader, the framework's
    fast-forward). Duck-typed: torch is not imported."""
    dataset = getattr(loader, "dataset", None)
    if dataset is not None and not hasattr(dataset, "__len__") and hasattr(dataset, "__iter__"):
        return "unknown", f"an iterable dataset ({type(dataset).__name__}): its order is its own"
    batches = getattr(loader, "batch_sampler", None)
    sampler: Any = getattr(batches, "sampler", None) or getattr(loader, "sampler", None)
    kind = type(sampler).__name__
    if kind == "SequentialSampler":
        return "epoch-seeded", "a SequentialSampler (shuffle=False): the same order every epoch"
    if callable(getattr(sampler, "set_epoch", None)) and hasattr(sampler, "seed"):
        return "epoch-seeded", f"a {kind} seeded with {sampler.seed} and told its epoch"
    if kind == "RandomSampler" and getattr(sampler, "generator", None) is None:
        return "unknown", ("a RandomSampler without a generator (shuffle=True): every run "
                           "draws its own order")
    if kind == "RandomSampler":
        return "unknown", ("a RandomSampler with a generator: its state is not restored on "
                           "resume, so a resumed epoch is ordered differently")
    return "unknown", f"a {kind or 'loader'} that trainwatch cannot tell is seeded by epoch"


def _is_tensor(x: object) -> bool:
    return hasattr(x, "device") and hasattr(x, "detach")


def _host_value(x: Any) -> float | None:
    """A float now, for None, a number or a CPU tensor; never syncs a device."""
    if x is None:
        return None
    if _is_tensor(x):
        return float(x.detach().reshape(()).item())
    return float(x)


class _InFlight:
    __slots__ = ("buf", "event", "fields", "step")

    def __init__(self, step: int, fields: list[float | None], buf: Any, event: Any) -> None:
        self.step, self.fields, self.buf, self.event = step, fields, buf, event

    def values(self) -> tuple[float | None, float | None]:
        got = self.buf.tolist()  # host memory, already copied
        out = [got.pop(0) if v is _DEVICE else v for v in self.fields]
        return out[0], out[1]


_DEVICE: Any = object()  # a field whose value is in the in-flight copy


class Reporter:
    """Beats (step, loss, grad_norm) with values that may be device tensors,
    without syncing the device for them (see the module docstring)."""

    def __init__(self, hb: Sender) -> None:
        self.hb = hb
        self._inflight: deque[_InFlight] = deque()

    def put(self, step: int, loss: Any = None, grad_norm: Any = None) -> None:
        """Report that ``step`` finished with these values. Never raises."""
        try:
            self._put(step, loss, grad_norm)
        except Exception:
            # A value we cannot read must not stop training: beat without it.
            self.hb.beat(step)

    def _put(self, step: int, loss: Any, grad_norm: Any) -> None:
        on_device = [v for v in (loss, grad_norm) if _is_tensor(v) and v.device.type != "cpu"]
        if not on_device:
            self.poll()
            self.hb.beat(step, loss=_host_value(loss), grad_norm=_host_value(grad_norm))
            return
        if on_device[0].device.type != "cuda":
            self.poll()  # no events to wait on: .item() it is
            self.hb.beat(step, loss=_read(loss), grad_norm=_read(grad_norm))
            return
        torch: Any = sys.modules["torch"]  # a CUDA tensor exists, so torch is imported
        fields = [_DEVICE if v is not None and any(v is d for d in on_device) else _host_value(v)
                  for v in (loss, grad_norm)]
        vals = torch.stack([d.detach().reshape(()).to(torch.float64) for d in on_device])
        buf = torch.empty(len(on_device), dtype=torch.float64, pin_memory=True)
        buf.copy_(vals, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._inflight.append(_InFlight(step, fields, buf, event))
        self.poll()

    def poll(self) -> None:
        """Send the beats whose values have reached the host; wait only for
        those beyond _MAX_PENDING."""
        q = self._inflight
        while q and (len(q) > _MAX_PENDING or q[0].event.query()):
            f = q.popleft()
            f.event.synchronize()
            loss, gn = f.values()
            self.hb.beat(f.step, loss=loss, grad_norm=gn)

    def flush(self) -> None:
        """Send every beat still in flight (waits for the device)."""
        try:
            while self._inflight:
                f = self._inflight.popleft()
                f.event.synchronize()
                loss, gn = f.values()
                self.hb.beat(f.step, loss=loss, grad_norm=gn)
        except Exception:
            self._inflight.clear()


def _read(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.detach().reshape(()).item()) if _is_tensor(x) else float(x)


class Watch:
    """One training loop's link to trainwatch: beats, checkpoints, resume, skip window."""

    def __init__(self, hb: Sender | None = None) -> None:
        self.hb: Sender = hb if hb is not None else client.connect()
        self.reporter = Reporter(self.hb)
        self.window = skip_window()
        self.skipped: list[int] = []  # steps passed through by steps() in this process
        self.order_said = False

    def data_order(self, order: str, why: str = "", epoch_steps: int | None = None,
                   step: int = 0) -> bool:
        """Say whether the batch of step k is a function of k ("step" when the
        loop draws batch k from a sampler seeded by k or from a loader whose state
        it saves and restores with the checkpoint), so that a rollback's skip is
        recorded as exact or approximate (client.Heartbeat.data_order)."""
        self.order_said = True
        return self.hb.data_order(order, why, epoch_steps, step)

    def step(self, step: int, loss: Any = None, grad_norm: Any = None) -> None:
        """``step`` finished (after optimizer.step()); loss and grad norm as
        floats or 0-d tensors (grad norm: clip_grad_norm_'s return)."""
        self.reporter.put(step, loss, grad_norm)

    def checkpoint(self, step: int, path: str | os.PathLike[str]) -> bool:
        """The checkpoint at ``path`` (state after ``step``) is complete: call it
        after the file is closed (and renamed into place)."""
        self.reporter.flush()  # the daemon sees step's values before its checkpoint
        return self.hb.checkpoint(step, path)

    def resume_from(self) -> str | None:
        """TRAINWATCH_RESUME_FROM, or None on a fresh start."""
        return client.resume_from()

    def skips(self, step: int) -> bool:
        return in_window(step, self.window)

    def steps(self, batches: Iterable[T], first: int = 1, per_step: int = 1
              ) -> Iterator[tuple[int, T]]:
        """Number ``batches`` as steps from ``first`` (``per_step`` micro-batches
        each) and yield (step, batch) for the steps to train. A step in the
        skip window has its batches drawn and dropped and is beaten without
        values; the loop never sees it. A DataLoader that shuffles without a
        seed per epoch is reported as such (data_order "unknown") unless the
        loop said otherwise with data_order()."""
        if not self.order_said and hasattr(batches, "sampler"):
            order, why = sampler_order(batches)
            if order == "unknown":
                self.data_order(order, why, step=first - 1)
        for i, batch in enumerate(batches):
            step = first + i // per_step
            if not self.skips(step):
                yield step, batch
            elif (i + 1) % per_step == 0:
                self.skipped.append(step)
                self.hb.beat(step)

    def close(self) -> None:
        self.reporter.flush()
        self.hb.close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
