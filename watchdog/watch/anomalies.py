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
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainwatch.detectors.loss import Anomaly, LossSettings, LossWatch
from trainwatch.evidence import series
from trainwatch.lifecycle import respond
from trainwatch.types import Action, Beat, Fault, FaultKind, JobState

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


class LossFeed:
    """The detectors' state for one attempt, and which rank feeds them."""

    def __init__(self, settings: LossSettings) -> None:
        self.settings = settings
        self.watch = LossWatch(settings)
        self.lead: int | None = None
        self.last: tuple[float | None, float | None] = (None, None)  # the lead's values
        # The lead's recent values, for an incident's series (evidence/series.py).
        self.series: deque[series.Point] = deque(maxlen=series.KEPT)
        self._in_nan: set[int] = set()  # other ranks inside a run of non-finite values

    def observe(self, beats: Sequence[Beat]) -> list[tuple[Anomaly, Beat]]:
        found: list[tuple[Anomaly, Beat]] = []
        for b in beats:
            loss, grad = b.loss, b.grad_norm
            if loss is None and grad is None:
                continue
            if self.lead is None:
                self.lead = b.rank
            if b.rank == self.lead:
                self.last = (loss, grad)
                self.series.append((b.step, loss, grad))
                found += [(an, b) for an in self.watch.observe(b.step, loss, grad)]
            elif (loss is None or loss - loss == 0) and (grad is None or grad - grad == 0):
                # Both finite or not given (_finite, inline: x - x is NaN for NaN and inf).
                if self._in_nan:
                    self._in_nan.discard(b.rank)
            elif self.settings.nan_loss and b.rank not in self._in_nan:
                self._in_nan.add(b.rank)  # one nan_loss per run of them, as for the lead
                bad = b.loss if not _finite(b.loss) else b.grad_norm
                assert bad is not None
                what = "loss" if not _finite(b.loss) else "grad_norm"
                found.append((Anomaly("nan_loss", "act", b.step, b.step, bad,
                                      {"series": what, "rank": b.rank}), b))
        return found


    def health(self) -> dict[str, float | int | None]:
        """The lead's last values and the detectors' statistics (for the catalog);
        ``loss_z``: the last loss's distance from the recent median, in its noise."""
        h = self.watch.health()
        loss, grad = self.last
        med, noise = h.get("loss_median"), h.get("loss_noise")
        z = None
        if loss is not None and loss > 0 and math.isfinite(loss) and med and noise:
            z = (math.log(loss) - math.log(med)) / noise
        return {"loss": loss if loss is None or math.isfinite(loss) else None,
                "grad_norm": grad if grad is None or math.isfinite(grad) else None,
                "loss_z": z, **h}


def check(r: Runner, beats: Sequence[Beat], drill: bool = False) -> list[str]:
    """Feed a batch of beats; act on the first sustained anomaly (the job is
    then being stopped: the rest of the batch is its own past). What was found,
    as "kind level". An attempt that has exited is judged by its exit, not by
    the last values drained after it."""
    found: list[str] = []
    a = r.attempt
    for an, b in r.anomalies.observe(beats):
        if r.state not in (JobState.STARTING, JobState.RUNNING) or (
                a is not None and a.returncode is not None):
            break
        found.append(f"{an.kind} {an.level}")
        evidence: dict[str, object] = {**an.evidence, "value": an.value, "noticed_step": an.step,
                                       "level": an.level}
        if drill:
            evidence["source"] = "drill"
        fault = Fault(FaultKind(an.kind), r.job.name, onset=b.at, evidence=evidence,
                      rank=b.rank, onset_step=an.onset)
        respond.handle(r, fault, Action.ALERT if an.level != "act" else None)
    return found


def inject(r: Runner, kind: object, scale: object = None, steps: object = None
           ) -> dict[str, object]:
    """A drill (``faultinject nan | grad-spike``): observations marked injected
    (evidence ``source: drill``) enter the job's loss feed as the lead rank's,
    and what the detectors decide is handled as a real fault: ``nan``, one
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
    beats = [Beat(rank, first + i, now, 0, loss, grad) for i, (loss, grad) in enumerate(values)]
    found = check(r, beats, drill=True)
    return {"job": name, "kind": kind, "steps": [first, first + len(values) - 1],
            "found": found}
