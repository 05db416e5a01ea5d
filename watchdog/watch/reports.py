"""A job's checkpoint reports (``hb.checkpoint(step, path)``): taken into the
catalog, or refused (state/catalog.py ``REFUSALS``): each refusal counted by its
reason (``trainwatch_job_checkpoint_reports_refused_total``), the first of each
reason said in one line naming the configured folder, and the newest kept, so
that a launch from scratch can say what the job reported (actions/fresh.py): a
mistyped ``checkpoints.dir`` refuses every report."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from trainwatch.types import CheckpointReport, JobState

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import JobParts, Runner

log = logging.getLogger("trainwatch")

_WHY = {
    "outside_dir": "not in checkpoints.dir {dir}",
    "not_named": "not a name its layout gives that step",
    "quarantined": "a quarantined step, from an attempt being stopped",
    "path_too_long": "a path too long",
    "missing": "nothing there, looked for as the job's user",
    "too_many": "more reports than a job makes: the folder's listing finds its checkpoints",
}


def refused(r: JobParts, obs: CheckpointReport) -> None:
    """The catalog refused ``obs`` (its reason in ``r.catalog.refusal``)."""
    reason = r.catalog.refusal or "not_named"
    rf = r.refused
    rf.count += 1
    rf.by_reason[reason] = rf.by_reason.get(reason, 0) + 1
    rf.last = (obs.step, obs.path)
    r.events.reports_refused.labels(r.job.name, reason).inc()
    if rf.by_reason[reason] == 1:  # the first of each reason; the rest are counted
        why = _WHY.get(reason, reason).format(dir=r.catalog.spec.dir)
        log.warning("job %s: refused a checkpoint report (%s): step %d, %.200s; every "
                    "refused report is counted (trainwatch_job_checkpoint_reports_refused_total)",
                    r.job.name, why, obs.step, obs.path)


def on_report(r: Runner, obs: CheckpointReport) -> None:
    """The job reported a complete checkpoint."""
    # A checkpoint written again at a quarantined step is new, if this attempt
    # (one resumed from before the rollback) wrote it; not one being stopped.
    running = r.state in (JobState.STARTING, JobState.RUNNING)
    health = r.anomalies.health() if running else None
    new = r.catalog.reported.get(obs.step) != obs.path
    if not r.catalog.report(obs.step, obs.path, replaces_quarantined=running,
                            health=health):
        refused(r, obs)  # counted by reason, the first of each said
        return
    r.checkpoints_at = 0.0  # the exporter's summary: refresh at the next tick
    log.info("job %s: checkpoint step %d complete: %s", r.job.name, obs.step, obs.path)
    if new:
        r.engine.reported(r)  # the other hosts are told: any may decide a restart
