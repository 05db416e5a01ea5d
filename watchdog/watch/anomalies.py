"""A job's loss and gradient-norm watch: the values its beats carry go to the
detectors (detectors/loss.py), and what they find becomes a fault for
respond.py. A transient anomaly is an alert whatever the policy says; a
sustained one (level ``act``) gets the policy's action, a rollback by default
(actions/rollback.py).

Which values: the statistics follow one rank (the first to report values,
rank 0 under torchrun: ranks of a data-parallel job log the same reduced
loss), while a non-finite value from any rank is a ``nan_loss`` at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from trainwatch.types import Action, Beat, Fault, FaultKind, Finding, JobState

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner


def check(r: Runner, beats: Sequence[Beat], drill: bool = False) -> Iterator[Finding]:
    """Feed a batch of beats, up to the first sustained anomaly (acted on, the job
    is then being stopped: the rest of the batch is its own past). An attempt that
    has exited is judged by its exit, not by the last values drained after it."""
    a = r.attempt
    for an, b in r.anomalies.observe(beats):
        if r.state not in (JobState.STARTING, JobState.RUNNING) or (
                a is not None and a.returncode is not None):
            break
        evidence: dict[str, object] = {**an.evidence, "value": an.value, "noticed_step": an.step,
                                       "level": an.level}
        if drill:
            evidence["source"] = "drill"
        fault = Fault(FaultKind(an.kind), r.job.name, onset=b.at, evidence=evidence,
                      rank=b.rank, onset_step=an.onset)
        yield Finding(fault, Action.ALERT if an.level != "act" else None)


def said(found: Sequence[Finding]) -> list[str]:
    """What was found, as "kind level"."""
    return [f"{f.fault.kind.value} {f.fault.evidence['level']}" for f in found]


def drill(r: Runner, kind: object, scale: object = None, steps: object = None
          ) -> list[Beat]:
    """A drill's beats (``faultinject nan | grad-spike``), for check(drill=True):
    observations marked injected (evidence ``source: drill``) that enter the
    job's loss feed as the lead rank's, and what the detectors decide is handled
    as a real fault: ``nan``, one
    non-finite loss; ``grad-spike``, the lead's grad norm x ``scale`` (100) for
    ``steps`` steps (the job's ``act_run``: enough to act). They take the steps
    from the one being trained now (the last beaten + 1; the watch ignores
    repeats, so the job's own beats of those steps are not seen). A ValueError
    says why not, in one line."""
    name = r.job.name
    if r.state not in (JobState.STARTING, JobState.RUNNING):
        raise ValueError(f"job {name} is {r.state.value if r.state else 'not started'}, "
                         "not running")
    feed, s = r.anomalies, r.anomalies.settings
    first = max(feed.watch.last_step or 0, r.last_step or 0) + 1
    values: list[tuple[float | None, float | None]]
    if kind == "nan":
        if not s.nan_loss:
            raise ValueError(f"job {name}: nan_loss detection is off")
        values = [(math.nan, None)]
    elif kind == "grad-spike":
        x = 100.0 if scale is None else scale
        n = s.act_run if steps is None else steps
        if isinstance(x, bool) or not isinstance(x, int | float) or not 0 < x < math.inf:
            raise ValueError(f"expected a positive scale, got {x!r}")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 100_000:
            raise ValueError(f"expected steps from 1 to 100000, got {n!r}")
        if not s.grad_norm_outlier:
            raise ValueError(f"job {name}: grad_norm_outlier detection is off")
        h = feed.watch.health()
        seen, base = h["grad_norm_n"] or 0, h["grad_norm_median"]
        if base is None or seen <= s.warmup_steps:
            raise ValueError(f"job {name} has no grad-norm statistics yet (warm-up: {seen} of "
                             f"{s.warmup_steps} observations); try again later")
        last = feed.last[1]
        g = (last if last is not None and math.isfinite(last) and last > 0 else base) * x
        values = [(None, g)] * n
    else:
        raise ValueError(f"expected kind nan or grad-spike, got {kind!r}")
    rank, now = feed.lead if feed.lead is not None else 0, r.clock()
    return [Beat(rank, first + i, now, 0, loss, grad) for i, (loss, grad) in enumerate(values)]
