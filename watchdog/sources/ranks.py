"""The heartbeat state of one attempt: per rank, its last beat, step, pid and
how many beats it sent, and a bounded sample of step intervals from which a
hang timeout is learned.

Ranks are capped (``max_ranks``, the job's world size or 1,024): a beat whose
rank is at or beyond the cap is dropped and counted (``over_cap``), so a job
cannot grow trainwatch's memory or the exported ``rank`` series without bound.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from trainwatch.types import Beat, HeartbeatSnapshot, RankView

_SAMPLE = 512  # recent step intervals kept per attempt (all ranks together)
_P99_AFTER = 4  # recompute the p99 once a quarter of the sample is new
MAX_RANKS = 1024  # the default cap when the job declares no world size


@dataclass
class _Rank:
    last_beat: float
    step: int
    pid: int
    loss: float | None = None
    grad_norm: float | None = None
    beats: int = 1
    # The step of the last beat that carried each value: a beat without one keeps
    # the last (a client may send the loss every k steps only).
    loss_step: int | None = None
    grad_norm_step: int | None = None
    advanced_at: float = 0.0  # when its step last went up

    def values(self, b: Beat) -> None:
        if b.loss is not None:
            self.loss, self.loss_step = b.loss, b.step
        if b.grad_norm is not None:
            self.grad_norm, self.grad_norm_step = b.grad_norm, b.step


@dataclass
class Ranks:
    started: float  # monotonic start of the attempt
    max_ranks: int = MAX_RANKS  # ranks 0 .. max_ranks-1 are kept
    ranks: dict[int, _Rank] = field(default_factory=dict)
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=_SAMPLE))
    p99: float | None = None
    over_cap: int = 0  # beats dropped: their rank was at or beyond max_ranks
    _since_p99: int = 0

    def observe(self, b: Beat) -> bool | None:
        """Record a beat; returns True when the rank or its pid is new, False
        otherwise, and None when the beat was dropped (rank over the cap)."""
        r = self.ranks.get(b.rank)
        if r is None:
            if not 0 <= b.rank < self.max_ranks:
                self.over_cap += 1
                return None
            self.ranks[b.rank] = r = _Rank(b.at, b.step, b.pid, advanced_at=b.at)
            r.values(b)
            return True
        step, at = b.step, b.at
        if step > r.step:
            # Seconds per step, so that a client beating every k steps still
            # teaches a comparable interval.
            self.intervals.append((at - r.last_beat) / (step - r.step))
            self._since_p99 += 1
            r.advanced_at = at
        new_pid = r.pid != b.pid
        r.last_beat, r.step, r.pid = at, step, b.pid
        if b.loss is not None:  # _Rank.values, inline: every beat of every rank comes here
            r.loss, r.loss_step = b.loss, step
        if b.grad_norm is not None:
            r.grad_norm, r.grad_norm_step = b.grad_norm, step
        r.beats += 1
        return new_pid

    @property
    def beaten(self) -> bool:
        return bool(self.ranks)

    @property
    def step(self) -> int | None:
        """The step every rank has reached (the slowest rank's)."""
        return min(r.step for r in self.ranks.values()) if self.ranks else None

    @property
    def max_step(self) -> int | None:
        return max(r.step for r in self.ranks.values()) if self.ranks else None

    def learned_p99(self, min_samples: int) -> float | None:
        if len(self.intervals) < min_samples:
            return None
        if self.p99 is None or self._since_p99 * _P99_AFTER >= len(self.intervals):
            ordered = sorted(self.intervals)
            self.p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
            self._since_p99 = 0
        return self.p99

    def snapshot(self, now: float, min_samples: int) -> HeartbeatSnapshot:
        views = tuple(
            RankView(rank, r.last_beat, r.step, r.beats, r.advanced_at)
            for rank, r in self.ranks.items()
        )
        return HeartbeatSnapshot(now, self.started, views, self.learned_p99(min_samples))

    def pids(self) -> dict[int, int]:
        return {rank: r.pid for rank, r in self.ranks.items()}

    def beat_from(self, pid: int) -> bool:
        """Has a beat of this attempt come from ``pid`` (one believed then)?"""
        return any(r.pid == pid for r in self.ranks.values())
