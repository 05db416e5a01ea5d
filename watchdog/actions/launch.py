"""Launching an attempt: the last good checkpoint, the GPUs that are healthy,
the attempt's processes; and the accounting of the relaunch after a fault
(time to relaunch, steps lost) in the ledger and the metrics."""

from __future__ import annotations

import logging
import os
import selectors
import signal
import statistics
from typing import TYPE_CHECKING

from trainwatch.actions import attemptfiles, evidence, fresh, hook, pull, rollback, settle, verify
from trainwatch.actions.attempt import Attempt
from trainwatch.sources.ranks import Ranks
from trainwatch.state.entry import Entry
from trainwatch.state.ledger import Relaunch, steps_lost
from trainwatch.types import TERMINAL, JobState
from trainwatch.watch.state import LossFeed, follow_log

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")

_VERIFY_POLL = 0.05  # while a relaunch waits for its checkpoint's verification
_JUDGE_POLL = 1.0  # while it waits for its checkpoints to be judged (a hand that did not answer)


def launch(r: Runner, reason: str) -> None:
    """Start the next attempt from the last good checkpoint, on the healthy GPUs;
    FATAL when it cannot start."""
    if r.engine.started_elsewhere(r):  # not by trainwatch (a Slurm job's next run)
        return
    ready, cp = verify.checkpoint_to_use(r, wait=r.state is not JobState.BACKOFF)
    if not ready:  # its check still runs (in a thread), or its folder is unjudged: it waits
        r.relaunch_at = r.clock() + (_JUDGE_POLL if r.catalog.unjudged else _VERIFY_POLL)
        return
    if r.state is JobState.BACKOFF and settle.waiting(r, cp):
        r.relaunch_at = r.clock() + _JUDGE_POLL  # the pending ones are judged once a second
        return
    if cp is None:  # none here: the newest on the job's remote store, if it has one
        pull.newest(r, reason)
    if pull.pending(r):  # pulling (in a thread): the launch waits in BACKOFF
        after = pull.wait(r, reason)
        if after is None:
            return
        reason = after
        ready, cp = verify.checkpoint_to_use(r, wait=r.state is not JobState.BACKOFF)
        if not ready:
            r.relaunch_at = r.clock() + _VERIFY_POLL
            return
    if cp is None:
        fresh.said(r)  # never a silent start from scratch
    gpus = r.gpus()
    if gpus is None and any("{num_gpus}" in x for x in r.job.command):
        why = ("the command uses {num_gpus}, but trainwatch sees no GPUs here (NVML is "
               "absent or gpu.backend is off): write the number itself")
        log.error("job %s: %s", r.job.name, why)
        r.to(JobState.FATAL, why)
        return
    if gpus is not None and len(gpus) < r.job.gpus.min:
        if r.engine.stay_out(r):
            return
        why = f"{len(gpus)} healthy GPUs, the job needs at least {r.job.gpus.min}"
        if r.state in TERMINAL:  # an operator's start: refused; the job stays as it was
            raise ValueError(f"job {r.job.name}: {why}")
        hook.run(r.policy.exec, r.job.name, "insufficient_gpus", None, r.umask)
        r.to(JobState.FATAL, why)
        return
    r.number += 1
    spanning = r.engine.prepare(r, evidence.job_for_attempt(r, r.number))
    if spanning is None:
        return
    job, env_defaults = spanning
    try:
        a = Attempt(
            job,
            r.number,
            r.socket_path,
            cp.path if cp else None,
            cp.step if cp else None,
            r.dir / "logs",
            r.passthrough,
            gpus,
            die_with_parent=r.die_with_parent,
            umask=r.umask,
            skip=r.skip[:2] if r.skip else None,
            # trainwatch run (the job dies with it): its user's environment (jobenv.py)
            foreground=r.die_with_parent,
            env_defaults=env_defaults,
        )
    except (OSError, KeyError) as e:  # KeyError: no such user
        why = f"no such user {r.job.user!r}"
        if isinstance(e, OSError):
            why = e.strerror or str(e)
        where = getattr(e, "filename", None) or r.job.command[0]
        what = f"{where}: cannot start: {why}"
        log.error("job %s: %s", r.job.name, what)
        r.to(JobState.FATAL, what)
        return
    try:
        begin_attempt(r, a, cp, reason)
    except BaseException:
        # Never an attempt left running unwatched: the next relaunch would start
        # a second copy of the job beside it (a loaded run did, writing the same
        # checkpoints twice).
        log.error("job %s: attempt %d could not be watched: killed", r.job.name, a.number)
        a.tree.signal(signal.SIGKILL, a.tree.scan())
        if a.pidfd is not None and a.pidfd in r.sel.get_map():
            r.sel.unregister(a.pidfd)
        a.close()
        raise


def begin_attempt(r: Runner, a: Attempt, cp: Entry | None, reason: str,
                  group_reached: int | None = None) -> None:
    """Make ``a``, started from ``cp`` (None: fresh), the runner's attempt: its
    ranks, beats and exits watched from now, STARTING, and the relaunch after a
    fault (time to relaunch, steps lost: from ``group_reached`` where the other
    nodes' ranks got further) in the ledger and the metrics."""
    if a.pidfd is not None:  # first: should it fail, the runner has not changed
        r.sel.register(a.pidfd, selectors.EVENT_READ, r.on_exit_ready)
    if r.attempt is not None:
        r.output_dropped_before += r.attempt.dropped
    r.attempt = a  # from here its exit is watched, whatever fails below
    if cp is not None:
        r.catalog.used_by(cp.step, r.number)
    r.restarts += 1 if r.number > 0 else 0
    r.outages.started(a.started)
    intervals = r.ranks.intervals  # the faulted attempt's seconds per step
    step_s = statistics.median(intervals) if intervals else 0.0
    r.over_cap_before += r.ranks.over_cap  # counters that outlive an attempt
    r.ranks = Ranks(started=a.started, max_ranks=r.job.heartbeat.max_ranks)
    r.intake.new_attempt(a.ring_dir)
    r.first_failure.new_attempt(a.started)
    rollback.sealed(r, r.pending_incident, r.catalog.seal_quarantine())
    r.anomalies = LossFeed(r.job.anomalies.detect)
    r.logwatch = follow_log(r.logwatch, str(a.log_path), r.job.logs, from_end=False)
    r.stall.new_attempt(r.job.stall)
    r.hang_latched = False
    r.drill = None  # a notice for the attempt before is not this one's
    reached, r.last_step = r.last_step, cp.step if cp else None
    where = f"from {a.resume_from} (step {a.resumed_step})" if a.resume_from else "fresh"
    if a.gpus is not None:
        where += f", GPUs {','.join(map(str, a.gpus))}"
    if r.pending_incident is not None:
        # The faulted attempt reached `reached`; this one starts over at cp. A job
        # that has never beaten has told nothing of its steps: unknown, not 0.
        lost = steps_lost(a.resumed_step, reached if r.ever_beaten else None, group_reached)
        o = r.outages.outage
        if o is not None:
            name = r.job.name
            r.events.restarts.labels(name, o.kind).inc()
            r.events.relaunch.labels(name).observe(max(0.0, a.started - o.detected))
            r.events.steps_lost.labels(name).inc(lost or 0)
            r.outages.relaunched(lost or 0, step_s)
        r.ledger.relaunched(
            r.pending_incident,
            Relaunch(a.started_wall, a.resume_from, a.resumed_step, lost),
        )
        r.pending_incident = None
    # Published last: whoever sees the new attempt in the status finds its incident
    # already says where it resumed (a test read it in between, under load).
    r.to(JobState.STARTING, f"{reason}: attempt {a.number}, pid {a.pid}, {where}")
    attemptfiles.sweep(os.path.dirname(r.socket_path), a.log_path, r.job.name, a.number)
