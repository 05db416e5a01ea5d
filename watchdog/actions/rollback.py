"""Rollback: relaunch a job from the good checkpoint of a given step, with
every newer checkpoint quarantined (kept on disk, listed, never chosen), so
that no later relaunch goes past it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainwatch.actions.launch import launch
from trainwatch.policy import RestartHistory
from trainwatch.types import JobState

if TYPE_CHECKING:
    from trainwatch.job import JobRunner


def to_step(r: JobRunner, step: int, reason: str) -> str:
    """Roll ``r`` back to its good checkpoint of ``step``; its path. A ValueError
    when there is none (the one line the operator sees)."""
    entries = r.catalog.entries()
    entry = next((e for e in entries if e.step == step), None)
    if entry is None or not entry.good:
        have = [e.step for e in entries if e.good]
        raise ValueError(f"no good checkpoint at step {step} (good: {have or 'none'})")
    r.catalog.quarantine_after(step, reason)
    if r.state in (JobState.STARTING, JobState.RUNNING):
        r.begin_stop(JobState.BACKOFF, reason)
    elif r.state is JobState.BACKOFF:
        r.relaunch_at = r.clock()
    elif r.state is JobState.STOPPING and r.stopping is not None:
        r.stopping.outcome, r.stopping.delay = JobState.BACKOFF, 0.0
    else:
        r.history = RestartHistory()
        launch(r, reason)
    return entry.path
