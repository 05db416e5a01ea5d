"""Goodput: the share of supervised time a job spent doing useful work.

A fault costs from its onset (the first fault's, if the relaunch after it
faulted too) until a relaunch beats again, plus the time to redo the steps
it lost (steps lost x the step interval before the fault)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Outage:
    """A fault that stopped the job, until the relaunch's first heartbeat."""

    kind: str
    onset: float  # monotonic
    detected: float
    redo_seconds: float = 0.0


class Goodput:
    def __init__(self) -> None:
        self.outage: Outage | None = None
        self.lost_seconds = 0.0
        self.first_started: float | None = None
        self.ended_at: float | None = None

    def started(self, at: float) -> None:
        if self.first_started is None:
            self.first_started = at

    def fault(self, kind: str, onset: float, now: float) -> None:
        """A fault that stops the job's work."""
        if self.outage is None:
            self.outage = Outage(kind, onset, now)
        else:
            self.outage.kind, self.outage.detected = kind, now

    def relaunched(self, lost_steps: int, step_seconds: float) -> None:
        if self.outage is not None:
            self.outage.redo_seconds += lost_steps * step_seconds

    def back(self, at: float) -> float | None:
        """The relaunch beats: the outage ends; the seconds it cost, or None."""
        o = self.outage
        if o is None:
            return None
        lost = max(0.0, at - o.onset) + o.redo_seconds
        self.lost_seconds += lost
        self.outage = None
        return lost

    def ratio(self, now: float) -> float | None:
        """1 - seconds lost to faults / seconds supervised; None before the first launch."""
        if self.first_started is None:
            return None
        end = self.ended_at if self.ended_at is not None else now
        total = end - self.first_started
        if total <= 0:
            return None
        lost = self.lost_seconds
        if self.outage is not None:  # still down, or ended down: it counts until now
            lost += max(0.0, end - self.outage.onset) + self.outage.redo_seconds
        return max(0.0, min(1.0, 1.0 - lost / total))
