"""Detectors: small pure functions from observations to a Fault (or None). No I/O.

Each one plugs into a job's loop through ``Detector``: a name, the event that
feeds it (``exit``: the leader ended; ``tick``: time passed; ``beat``: a
heartbeat arrived) and a pure function of a ``JobView``. A new detector is a
new module and one entry in ``JOB_DETECTORS``; the job runner does not change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from trainwatch.types import Beat, Fault, HeartbeatSnapshot, ProcessExit

if TYPE_CHECKING:  # the config's reader imports detectors.xid: no cycle at run time
    from trainwatch.config import Job

Event = Literal["exit", "tick", "beat"]


@dataclass(frozen=True)
class JobView:
    """What a job's detectors may read at one instant."""

    job: Job
    now: float
    last_step: int | None
    heartbeats: HeartbeatSnapshot
    exit: ProcessExit | None = None  # for "exit"
    beat: Beat | None = None  # for "beat"


@dataclass(frozen=True)
class Detector:
    name: str
    on: Event
    detect: Callable[[JobView], Fault | None]
    # When it could next fire without a new event (for the loop's sleep); None: only on events.
    deadline: Callable[[JobView], float | None] | None = None


def _crash(v: JobView) -> Fault | None:
    from trainwatch.detectors.crash import detect_crash

    return None if v.exit is None else detect_crash(v.job.name, v.exit, v.last_step)


def _hang(v: JobView) -> Fault | None:
    from trainwatch.detectors.hang import detect_hang

    return detect_hang(v.job.name, v.heartbeats, v.job.heartbeat)


def _hang_deadline(v: JobView) -> float | None:
    from trainwatch.detectors.hang import next_deadline

    return next_deadline(v.heartbeats, v.job.heartbeat)


JOB_DETECTORS: tuple[Detector, ...] = (
    Detector("crash", "exit", _crash),
    Detector("hang", "tick", _hang, _hang_deadline),
)


def run(on: Event, view: JobView) -> list[Fault]:
    """Every detector fed by ``on``, in order; the faults they found."""
    return [f for d in JOB_DETECTORS if d.on == on and (f := d.detect(view)) is not None]


def next_deadline(view: JobView) -> float | None:
    times = [t for d in JOB_DETECTORS if d.deadline is not None
             and (t := d.deadline(view)) is not None]
    return min(times) if times else None
