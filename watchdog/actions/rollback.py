"""Rollback: relaunch a job from a good checkpoint before a point, with every
newer checkpoint quarantined (kept on disk, listed, never chosen), so that no
later relaunch goes past it: to a step the operator names, or to before the
onset of a loss anomaly, with the anomalous steps' data skipped."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from trainwatch.actions import launch as launching
from trainwatch.actions import pull
from trainwatch.policy import RestartHistory
from trainwatch.snapshot.format import folder_name
from trainwatch.types import Fault, JobState

if TYPE_CHECKING:
    from trainwatch.job import JobRunner


def to_step(r: JobRunner, step: int, reason: str) -> str:
    """Roll ``r`` back to its good checkpoint of ``step``; its path. None on local
    disk but a remote store set (``checkpoints.remote``) that holds it: pulled
    from there first, the relaunch waiting for it. A ValueError when there is
    none (the one line the operator sees), the job left as it was."""
    entries = r.catalog.entries()
    entry = next((e for e in entries if e.step == step), None)
    remote, root = r.job.checkpoints.remote, r.catalog.spec.dir
    if entry is None and remote is not None and root is not None:
        if pull.pending(r):
            raise ValueError(f"a pull from {remote} is under way: try again once it is done")
        held = pull.steps(remote)  # before anything is touched: a step it lacks is refused
        if step not in held:
            have = [e.step for e in entries if e.good]
            raise ValueError(f"no snapshot of step {step} on local disk (good: {have or 'none'}) "
                             f"nor on {remote} (it holds: {held[-20:] or 'none'})")
        pull.begin(r, step, reason)
        path = f"{os.path.join(root, folder_name(step))}, being pulled from {remote}"
    elif entry is None or not entry.good:
        have = [e.step for e in entries if e.good]
        raise ValueError(f"no good checkpoint at step {step} (good: {have or 'none'})")
    else:
        path = entry.path
    r.catalog.quarantine_after(step, reason)
    if r.state in (JobState.STARTING, JobState.RUNNING):
        r.begin_stop(JobState.BACKOFF, reason)
    elif r.state is JobState.BACKOFF:
        r.relaunch_at = r.clock()
    elif r.state is JobState.STOPPING and r.stopping is not None:
        r.stopping.outcome, r.stopping.delay = JobState.BACKOFF, 0.0
    else:
        r.history = RestartHistory()
        launching.launch(r, reason)
    return path


def after_anomaly(r: JobRunner, fault: Fault) -> str | None:
    """Prepare the relaunch after a loss anomaly: quarantine every checkpoint from
    ``anomalies.margin`` steps before its onset on (the relaunch then resumes from
    the newest one before that, or from scratch), and skip the anomalous steps'
    data (TRAINWATCH_SKIP_STEPS). An anomaly that comes back in the window just
    skipped widens it; after ``max_rollbacks`` such tries, a reason to stop."""
    spec = r.job.anomalies
    onset = fault.onset_step if fault.onset_step is not None else r.last_step or 0
    noticed = fault.evidence.get("noticed_step")
    end = max(onset, noticed if isinstance(noticed, int) else onset)
    start, tries = onset, 1
    old = r.skip
    width = old[1] - old[0] + 1 if old is not None else 0
    if old is not None and old[0] - width <= onset <= old[1] + width:
        # Back in (or right beside) the window skipped last time: skip twice as much.
        start, end, tries = max(0, min(old[0], onset) - width), max(old[1], end) + width, old[2] + 1
    if tries > spec.max_rollbacks:
        return (f"{fault.kind.value} came back after {spec.max_rollbacks} rollbacks around "
                f"steps {start}-{end}")
    before = onset - spec.margin
    target = r.catalog.last_good(before_step=before)
    r.catalog.quarantine_after(target.step if target else -1,
                               f"{fault.kind.value} from step {onset}")
    r.skip = (start, end, tries)
    r.save()
    return None
