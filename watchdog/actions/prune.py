"""Retention carried out (``checkpoints.keep``, state/retention.py): after a
catalog refresh that found a new last good checkpoint, or while free space is
below ``min_free_bytes``, the plan is made from the catalog's verdicts and its
deletions done one by one, each a ledger row and a count. Never while the job
is observed only or paused by the operator, never without a rule."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from trainwatch.state import retention
from trainwatch.state.retention import Plan
from trainwatch.types import JobState

if TYPE_CHECKING:
    from trainwatch.job import JobRunner

log = logging.getLogger("trainwatch")


def plan(r: JobRunner, listed: bool = True) -> Plan:
    """What retention would delete now, and why each other checkpoint stays."""
    keep, root = r.job.checkpoints.keep, r.catalog.spec.dir
    entries = r.catalog.entries() if listed else r.catalog.known()
    free = retention.free_bytes(root) if root else None
    sized = keep.min_free_bytes is not None and free is not None and free < keep.min_free_bytes
    cands = [retention.candidate(e, retention.size_of(e.path) if sized else 0) for e in entries]
    a = r.attempt
    live = a is not None and r.state in (JobState.STARTING, JobState.RUNNING, JobState.STOPPING)
    return retention.plan(cands, keep, resumed_from=a.resumed_step if live and a else None,
                          free_bytes=free)


def after_refresh(r: JobRunner) -> None:
    """Delete what the plan says, when something changed that could free one."""
    keep, root = r.job.checkpoints.keep, r.catalog.spec.dir
    if not keep.deletes or root is None or r.observing:
        return
    good = r.checkpoints.last_good
    low = keep.min_free_bytes is not None and (
        (free := retention.free_bytes(root)) is not None and free < keep.min_free_bytes)
    step = good.step if good is not None else None
    if step == r.catalog.pruned_at and not low:
        return
    r.catalog.pruned_at = step
    p = plan(r, listed=False)
    for c in p.delete:
        why = retention.delete(c, root=root)
        r.ledger.deletion(r.job.name, max(r.number, 0), c.step, c.path, c.size or None, why)
        r.events.deletions.labels(r.job.name, "deleted" if why is None else "failed").inc()
        if why is None:
            r.catalog.forget(c.step)
            log.info("job %s: retention deleted checkpoint step %d (%s)", r.job.name, c.step,
                     c.path)
        else:
            log.warning("job %s: retention could not delete checkpoint step %d: %s",
                        r.job.name, c.step, why)
