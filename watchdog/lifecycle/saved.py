"""What a restarted daemon needs of a runner now, as the job's runtime state
(state/runtime.py) keeps it: monotonic times turned into wall-clock ones."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from trainwatch.state.runtime import Runtime
from trainwatch.types import JobState

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner


def of(r: Runner) -> Runtime:
    """What a restarted daemon needs of the runner ``r`` now (monotonic times
    turned into wall-clock ones)."""
    now, wall = r.clock(), time.time()
    a, s = r.attempt, r.stopping
    live = a is not None and not a.closed
    return Runtime(
        job=r.job.name,
        state=r.state.value if r.state else None,
        attempt=r.number,
        launched=a.launched() if live and a is not None else None,
        resume_from=a.resume_from if a else None,
        resumed_step=a.resumed_step if a else None,
        gpus=a.gpus if a else None,
        started_at=a.started_wall if a else None,
        restarts=r.history.to_json(now, wall),
        relaunch_at=wall + (r.relaunch_at - now) if r.state is JobState.BACKOFF else None,
        pending_incident=r.pending_incident,
        stop={"outcome": s.outcome.value, "reason": s.reason, "delay": s.delay}
        if s is not None else None,
        last_step=r.last_step,
        ever_beaten=r.ever_beaten,
        xids=[(g, wall - (now - t)) for g, t in r.xids_seen],
        paused=r.paused,
        restart_count=r.restarts,
        skip=list(r.skip) if r.skip else None,
        last_incident=r.last_incident,
    )
