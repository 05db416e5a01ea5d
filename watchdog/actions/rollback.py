"""Rollback: relaunch a job from a good checkpoint before a point, with every
newer checkpoint quarantined (kept on disk, listed, never chosen), so that no
later relaunch goes past it: to a step the operator names, or to before the
onset of a loss anomaly, with the anomalous steps' data skipped: plan() the
window (one anomaly widens it, and is charged to the restart budget once),
apply() it, and record what was done (window, widening, quarantined
checkpoints, whether the skip is exact) with the incident."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainwatch.actions import launch as launching
from trainwatch.actions import pull
from trainwatch.config import Rollback
from trainwatch.lifecycle.policy import RestartHistory
from trainwatch.snapshot.format import folder_name
from trainwatch.state.catalog import QUARANTINED
from trainwatch.types import DataOrder, Fault, JobState

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")

MAX_LISTED = 64  # quarantined steps named in an incident; the rest are counted


def listing(r: Runner, step: int) -> Callable[[], list[int]] | None:
    """The work that lists the remote store's steps, when ``to_step`` needs it
    (``step`` not in the catalog, ``checkpoints.remote`` set): a hand as the
    job's user, its start up to ``pull.START_MAX``, then up to ``pull.LIST_MAX``,
    so the caller runs it off the loop and hands its result to ``to_step``. None
    when the catalog is enough."""
    remote, root = r.job.checkpoints.remote, r.catalog.spec.dir
    if remote is None or root is None or any(e.step == step for e in r.catalog.entries()):
        return None
    ident = pull.job_ident(r)
    env = pull.environment(r, ident)
    return lambda: pull.steps(remote, env=env, ident=ident)


def to_step(r: Runner, step: int, reason: str, held: list[int] | None = None) -> str:
    """Roll ``r`` back to its good checkpoint of ``step``; its path. None on local
    disk but a remote store set (``checkpoints.remote``) that holds it (``held``:
    its steps, as ``listing`` lists them): pulled from there first, the relaunch
    waiting for it. A ValueError when there is none (the one line the operator
    sees), the job left as it was."""
    entries = r.catalog.entries()
    entry = next((e for e in entries if e.step == step), None)
    remote, root = r.job.checkpoints.remote, r.catalog.spec.dir
    if entry is None and remote is not None and root is not None:
        if pull.pending(r):
            raise ValueError(f"a pull from {remote} is under way: try again once it is done")
        if held is None:  # it was on local disk when asked, and is gone since
            raise ValueError(f"step {step} is no longer on local disk: ask again")
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


@dataclass(frozen=True)
class Plan:
    """A rollback past a loss anomaly, decided before anything is touched (the
    policy charges the restart budget by it: once per anomaly)."""

    kind: str
    onset: int
    window: tuple[int, int]  # the steps whose data the relaunch skips, both inclusive
    widening: int  # 0: the anomaly's first rollback; n: the n-th time it came back
    previous: tuple[int, int] | None  # the window this one widens
    gave_up: str | None  # why the job stops instead: max_widenings spent


def plan(rb: Rollback, old: tuple[int, int, int] | None, fault: Fault,
         last_step: int | None) -> Plan:
    """The skip window for a loss anomaly, given the window skipped so far
    (``old``: start, end, rollbacks into it): the first from ``skip_before``
    steps before its onset to ``skip_after`` steps after the last anomalous step
    seen; an anomaly back in (or right beside) the window skipped last time is
    the same one, and the window doubles, at most ``max_widenings`` times."""
    onset = fault.onset_step if fault.onset_step is not None else last_step or 0
    noticed = fault.evidence.get("noticed_step")
    last = max(onset, noticed if isinstance(noticed, int) else onset)
    start, end, widening, previous = max(0, onset - rb.skip_before), last + rb.skip_after, 0, None
    width = old[1] - old[0] + 1 if old is not None else 0
    if old is not None and old[0] - width <= onset <= old[1] + width:
        previous, widening = (old[0], old[1]), old[2]
        start, end = max(0, min(old[0], onset) - width), max(old[1], last) + width
    gave_up = None
    if widening > rb.max_widenings:
        gave_up = (f"{fault.kind.value} came back after {rb.max_widenings} widenings of the "
                   f"skip window (now steps {previous[0] if previous else start}-"
                   f"{previous[1] if previous else end}; policy rollback.max_widenings)")
    return Plan(fault.kind.value, onset, (start, end), widening, previous, gave_up)


def exactness(order: DataOrder | None, resumed: int | None) -> tuple[str, str]:
    """Whether relaunching from step ``resumed`` (None: from scratch) and skipping
    a window's steps skips exactly the data those steps trained on, by what the
    job said of its data order: ("exact" | "approximate" | "unverified", why)."""
    if order is None:
        return "unverified", ("the job did not say whether its data order is a function of "
                              "the step (trainwatch.integrations say it; a loop of its own: "
                              "client.Heartbeat.data_order)")
    if order.order == "step":
        return "exact", order.why
    if order.order == "epoch-seeded":
        step, per = resumed or 0, order.epoch_steps
        if per and step % per == 0:
            return "exact", f"{order.why}; resumed at step {step}, an epoch's end"
        where = (f"{step % per} steps into an epoch of {per}" if per
                 else "where the epoch's length is not known")
        return "approximate", (f"{order.why}; resumed at step {step}, {where}: the epoch "
                               "starts over, so later steps draw other batches")
    return "approximate", (f"{order.why}: a resumed run draws other batches than the steps "
                           "the window names")


def apply(r: Runner, p: Plan, incident: int | None) -> dict[str, object]:
    """Carry a rollback out: quarantine every checkpoint from ``before`` steps
    before the skip window on (the relaunch then resumes from the newest good
    one before it, or from scratch) and hand the window to the next attempts
    (TRAINWATCH_SKIP_STEPS). What it did goes into the incident, the log and
    the metrics; returned as the incident records it."""
    rb = r.policy.rollback
    before = p.window[0] - rb.before
    target = r.catalog.last_good(before_step=before)
    fence = target.step if target is not None else -1
    r.catalog.quarantine_after(fence, f"{p.kind} from step {p.onset}")
    quarantined = sorted(s for s, why in r.catalog.bad.items()
                         if s > fence and why.startswith(QUARANTINED))
    r.skip = (p.window[0], p.window[1], p.widening + 1)
    r.save()
    verdict, why = exactness(r.intake.data_order, target.step if target else None)
    d = r.intake.data_order
    record: dict[str, object] = {
        "window": list(p.window), "widening": p.widening, "max_widenings": rb.max_widenings,
        "previous_window": list(p.previous) if p.previous else None,
        "resume_before": before, "resume_step": target.step if target else None,
        "quarantined": quarantined[:MAX_LISTED], "quarantined_count": len(quarantined),
        "skip": verdict, "skip_why": why,
        "data_order": None if d is None else {"order": d.order, "why": d.why, "rank": d.rank,
                                              "epoch_steps": d.epoch_steps},
        "budget": "charged" if p.widening == 0 else "not charged: a widening",
    }
    if incident is not None and incident >= 0:
        r.ledger.amend(incident, {"rollback": record}, None)
    width = p.window[1] - p.window[0] + 1
    added = width - (p.previous[1] - p.previous[0] + 1 if p.previous else 0)
    r.events.rollbacks.labels(r.job.name, verdict).inc()
    r.events.skipped_steps.labels(r.job.name).inc(max(0, added))
    shown = ", ".join(map(str, quarantined[:8])) + (", ..." if len(quarantined) > 8 else "")
    how = (f"widening {p.widening} of {rb.max_widenings}, was {p.previous[0]}-{p.previous[1]}"
           if p.previous else "first rollback of this anomaly")
    log.warning("job %s: rollback for %s from step %d: skip window %d-%d (%s); resuming from "
                "%s; %d checkpoint(s) quarantined%s; skip %s: %s", r.job.name, p.kind, p.onset,
                p.window[0], p.window[1], how,
                f"step {target.step}" if target else "scratch", len(quarantined),
                f" (steps {shown})" if quarantined else "", verdict, why)
    return record


def sealed(r: Runner, incident: int | None, fenced: list[int] | None) -> None:
    """The attempt a rollback stopped may save checkpoints while it stops: the
    fence quarantined them as they appeared, and the incident lists them too."""
    if not fenced or incident is None or incident < 0:
        return
    record = r.ledger.evidence(incident).get("rollback")
    if not isinstance(record, dict) or record.get("quarantined_count") == len(fenced):
        return
    listed = set(record.get("quarantined") or ())
    late = [s for s in fenced if s not in listed]
    record.update(quarantined=fenced[:MAX_LISTED], quarantined_count=len(fenced))
    r.ledger.amend(incident, {"rollback": record}, None)
    log.warning("job %s: %d checkpoint(s) the stopped attempt saved after the rollback "
                "was decided were quarantined too (steps %s)", r.job.name, len(late),
                ", ".join(map(str, late[:8])) + (", ..." if len(late) > 8 else ""))
