"""What each of a job's watchers keeps between ticks: the loss feed, the log being
followed, the checkpoint reports refused, the stall watch's samples, the rank
exits watched. State only: the watchers that act on it (anomalies.py,
logwatch.py, reports.py, stallwatch.py, firstfailure.py) take the job's runner;
this does not, so that the runner's protocol (lifecycle/runner.py) names these
without an import circle."""

from __future__ import annotations

import math
import os
import selectors
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trainwatch.actions.logfollow import LogFollower
from trainwatch.config.schema import Logs
from trainwatch.detectors import stall
from trainwatch.detectors.logrules import BUILTIN, LogMatch, Matcher, compile_rules
from trainwatch.detectors.loss import Anomaly, LossWatch
from trainwatch.detectors.losssettings import LossSettings
from trainwatch.detectors.stall import Proc, StallSettings
from trainwatch.evidence import series
from trainwatch.sources.procs import Sampler
from trainwatch.sources.rankexits import RankExits
from trainwatch.types import Beat, Fault
from trainwatch.watch.stackprobe import Prober


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


_MAX_LINE = 4096  # a longer line is cut for matching (one with no newline for a long time, too)


class LogWatch:
    def __init__(self, path: str, matcher: Matcher, from_end: bool = False) -> None:
        """``from_end``: an adopted attempt's log; what was in it before is not news."""
        offset = 0
        if from_end:
            try:
                offset = os.stat(path).st_size
            except OSError:
                offset = 0
        self.matcher = matcher
        self.partial = b""
        self.lines: list[str] = []
        self.follower = LogFollower(path, self._take, offset)

    def _take(self, data: bytes) -> None:
        chunks = (self.partial + data).split(b"\n")
        self.partial = chunks.pop()
        if len(self.partial) > _MAX_LINE:
            chunks.append(self.partial[:_MAX_LINE])
            self.partial = b""
        self.lines += [c[:_MAX_LINE].decode(errors="replace") for c in chunks]

    def poll(self, now: float) -> list[LogMatch]:
        self.follower.poll()
        lines, self.lines = self.lines, []
        return self.matcher.feed(lines, now) if lines else []

    def close(self) -> None:
        self.follower.close()


def follow_log(current: LogWatch | None, path: str, spec: Logs,
               from_end: bool) -> LogWatch | None:
    """A new attempt's log (``path``), against the job's rules (none: not followed);
    the one followed before is let go."""
    if current is not None:
        current.close()
    rules = (*(BUILTIN if spec.builtin else ()), *spec.rules)
    return LogWatch(path, compile_rules(rules), from_end) if rules else None


@dataclass
class Refusals:
    """A job's refused reports, every attempt."""

    count: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    last: tuple[int, str] | None = None  # the newest refused (step, path)

    def said(self) -> str:
        """``3 refused (outside_dir: 3), the newest step 6: /x/step_6.pt``."""
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_reason.items()))
        newest = f", the newest step {self.last[0]}: {self.last[1]:.200}" if self.last else ""
        return f"{self.count} refused ({reasons}){newest}"


class StallWatch:
    def __init__(self, settings: StallSettings) -> None:
        self.settings = settings
        self.sampler = Sampler()
        self.gpu_faults: deque[Fault] = deque(maxlen=8)
        self.sampled = False  # the processes were sampled at the last tick
        # Without the client: since when every process was idle or stopped at each
        # sample (None: one was busy, or the output spoke), and the last sample.
        self.quiet_since: float | None = None
        self.sampled_at: float | None = None
        self.stopped_since: dict[int, float] = {}  # rank -> stopped (T) at each sample since
        self.prober = Prober()  # the ranks' stacks in a quiet stretch

    def new_attempt(self, settings: StallSettings) -> None:
        self.settings, self.sampler, self.sampled = settings, Sampler(), False
        self.gpu_faults.clear()
        self.loud()

    def loud(self) -> None:
        """The job spoke (or a new attempt began): no quiet stretch yet."""
        self.quiet_since = self.sampled_at = None
        self.stopped_since = {}
        self.prober.reset()

    def quiet_for(self, now: float, procs: dict[int, Proc]) -> float:
        """Seconds every process has been idle or stopped, as of this sample. A
        stretch begins where the rates that show it begin: at the sample before."""
        q = stall.quiet(procs, self.settings.idle_cpu)
        if q is False:
            self.quiet_since = None
        elif self.quiet_since is None:  # quiet, or not known yet: not broken
            self.quiet_since = self.sampled_at if q and self.sampled_at is not None else now
        self.sampled_at = now
        return 0.0 if self.quiet_since is None else now - self.quiet_since

    def stopped_for(self, now: float, procs: dict[int, Proc]) -> dict[int, float]:
        """Seconds each rank's process has been stopped (T) at every sample, as of
        this one (call after quiet_for: it moves sampled_at on)."""
        stopped = {r for r, p in procs.items() if r >= 0 and p.state == "T"}
        self.stopped_since = {r: self.stopped_since.get(r, now) for r in stopped}
        return {r: now - t for r, t in self.stopped_since.items()}

    def gpu_fault(self, fault: Fault) -> None:
        """A fault of one of the job's GPUs: it wins over a stall in its window."""
        self.gpu_faults.append(fault)


_FIRST_SCAN = 1.0


_MAX_SCAN = 30.0


_EAGER_FOR = 60.0  # seconds into an attempt that ranks are looked for every second


class FirstFailure:
    """One job's: the current attempt's rank exits and when to look for ranks next."""

    def __init__(self, sel: selectors.BaseSelector, clock: Callable[[], float],
                 max_ranks: int) -> None:
        self.exits = RankExits(sel, clock, max_watched=max_ranks)
        self.scan_at = self.eager_until = 0.0
        self.scan_every = _FIRST_SCAN
        self.pending = False  # torchrun's summary not read yet for the incident

    def new_attempt(self, started: float) -> None:
        self.exits.close()
        self.scan_every, self.scan_at, self.pending = _FIRST_SCAN, started + _FIRST_SCAN, False
        self.eager_until = started + _EAGER_FOR

    def next_scan(self) -> float | None:
        """The next look, while it must not wait for the loop's grid: every second in
        the attempt's first minute until a rank is found."""
        if self.exits.watched or self.scan_at >= self.eager_until:
            return None
        return self.scan_at

    def scan_due(self, now: float) -> bool:
        """Whether to look for the attempt's rank processes now (and when next)."""
        if now < self.scan_at:
            return False
        self.scan_at = now + self.scan_every
        if self.exits.watched or now >= self.eager_until:
            self.scan_every = min(_MAX_SCAN, 2 * self.scan_every)
        return True
