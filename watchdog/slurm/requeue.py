"""Recovery of an attached job through Slurm (issue 23, part 2): where the
policy restarts or rolls back a job trainwatch launched, an attached job is
requeued (``scontrol requeue``, then started at once rather than after its
BeginTime: slurm/actions.py), on whichever node saw the fault first. Its
processes are Slurm's: the stop that follows signals nothing and waits for
Slurm to end them; its next run attaches again (slurm/attach.py), with the
restart count up by one, and resumes from the last good checkpoint.

A run that has ended already (a crashed rank: Slurm's own handling) or that
another node (or Slurm) requeued is recorded, not requeued again. The restart
budget is the policy's ``max_restarts`` counted in Slurm's ``Restarts=`` (the
attempt's number), which every node agrees on: past it the job is left to
Slurm, FATAL here. A requeue
Slurm refuses (``--no-requeue``, not a batch job) is said in the incident, in
one ERROR line and in ``trainwatch_slurm_requeues_total{outcome="refused"}``,
and the job is left to Slurm (FATAL here): never a retry loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainwatch.actions import background
from trainwatch.actions import stop as stopping
from trainwatch.evidence.capture import Capture
from trainwatch.multihost import known, records
from trainwatch.slurm import actions, command, node
from trainwatch.slurm.command import Outcome, Result
from trainwatch.slurm.stepattempt import StepAttempt
from trainwatch.types import Fault, JobState

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")

SETTLE_WAIT = 5.0  # seconds the next run's ranks wait for the requeue's outcome
# Seconds past kill_grace a stop waits for Slurm to end the tasks it requeued:
# Slurm signals them at once and SIGKILLs them KillWait (30 s by default) later.
AWAIT = 60.0


@dataclass
class Asked:
    """A requeue in flight (in a thread) and, once done, what Slurm said."""

    incident: int
    result: Result[int] | None = None
    drain: Result[None] | None = None
    waited_since: float | None = None  # the next run's first rank, waiting for the outcome
    told: bool = False


def act(r: Runner, fault: Fault, incident: int | None, reason: str,
        capture: Capture | None, drain: bool = False) -> bool:
    """For an attached job: requeue it (or record that it ended or was requeued
    already) and stop watching this run; first, with ``drain`` (a GPU to leave
    out), drain this node. False for a job trainwatch launched."""
    a = r.attempt
    if r.job.slurm is None or not isinstance(a, StepAttempt):
        return False
    settings = r.config.slurm
    job, run, n = r.job.slurm, a.number, incident if incident is not None else -1
    r.pending_incident = incident
    budget = r.policy.max_restarts
    if a.returncode is not None:  # ended: Slurm's own handling, recorded here
        why = f"{fault.kind.value}: {reason}; Slurm ended run {run}: its next run attaches"
        claim(r, run + 1, fault)  # the steps this node's ranks reached, for every node
    elif run >= budget:  # Slurm's restart count, the one every node agrees on
        why = (f"{fault.kind.value}: not requeued: Slurm requeued job {job} {run} times "
               f"already (max_restarts {budget})")
        log.error("job %s: %s", r.job.name, why)
        if incident is not None and incident >= 0:
            r.ledger.amend(incident, {"slurm": why, "slurm_outcome": "budget"}, None)
        r.pending_incident = None
        stopping.start(r, JobState.FATAL, why, 0.0, capture, n)
        return True
    elif settings is None:
        why = f"{fault.kind.value}: {reason}; no slurm: settings: not requeued"
    else:
        decide(r, run + 1, fault)
        if incident is not None and incident >= 0:
            r.ledger.backoff_applied(incident, 0.0)  # Slurm starts the next run at once
        slurm = command.for_settings(settings)
        asked = Asked(n)
        a.requeue = asked
        a.tasks.await_end(r.policy.kill_grace + AWAIT)  # the stop waits for Slurm

        gpu = fault.gpu if drain else None
        drained_for = " ".join(f"{fault.kind.value} {fault.evidence.get('xid', '')} on GPU "
                               f"{gpu} (job {job})".split())

        def work() -> None:
            if gpu is not None:
                asked.drain = d = actions.drain(settings.node, drained_for, slurm=slurm)
                health = node.this()
                if "drain" in d.done and health is not None:
                    health.drained([gpu])
            result = actions.requeue(job, slurm=slurm, expect=run)
            if result.outcome is not Outcome.OK:
                a.tasks.awaiting = False  # nothing will end them: the stop ends now
            asked.result = result

        background.start(r, work, "slurm-requeue")
        why = f"{fault.kind.value}: {reason}; requeue of Slurm job {job} asked"
    stopping.start(r, JobState.BACKOFF, why, 0.0, capture, n)
    return True


def scope(r: Runner) -> str:
    """The job's records in its checkpoint folder (multihost/records.py)."""
    return f"slurm-{r.job.slurm}"


def decide(r: Runner, run: int, fault: Fault) -> None:
    """Where run ``run`` resumes, on every node: the last good checkpoint as this
    node judged it (quarantine applied, verified), with what the other nodes were
    told (multihost/known.py), in the job's checkpoint
    folder, where each node's daemon reads it when that run's ranks attach. The
    first node to decide wins; a later one's decision is not written."""
    ck = r.job.checkpoints.dir
    if ck is None:
        log.warning("job %s: no checkpoints folder known (TRAINWATCH_CHECKPOINT_DIR, or "
                    "slurm.job.checkpoints.dir): each node resumes from what it judged",
                    r.job.name)
        return
    known.gather(r, scope(r))  # the node whose rank reports checkpoints may be another
    cp = r.catalog.last_good()
    records.call(r, records.begin_in_hand, ck, run, r.config.host,
                 {"resume_path": cp.path if cp else None, "resume_step": cp.step if cp else None,
                  "kind": fault.kind.value}, _claim(r, fault), scope(r))


def _claim(r: Runner, fault: Fault) -> dict[str, object]:
    return {"kind": fault.kind.value, "rank": fault.rank, "at": time.time(),
            "reached": r.last_step}


def claim(r: Runner, run: int, fault: Fault) -> None:
    """This node's part of run ``run``'s decision, which another node made: the
    step its ranks reached, from which every node counts the steps lost."""
    if (ck := r.job.checkpoints.dir) is not None and run > 0:
        records.call(r, records.claim_in_hand, ck, run, r.config.host,
                     {**_claim(r, fault), "victim": True}, scope(r))


def decided(r: Runner, run: int) -> records.Restart | None:
    """Run ``run``'s decision, where a node made one (see decide)."""
    ck = r.job.checkpoints.dir
    if ck is None or run <= 0:
        return None
    rec = records.parse(records.call(r, records.newest_in_hand, ck, run - 1, scope(r)))
    return rec if rec is not None and rec.gen == run else None


def settled(r: Runner) -> bool:
    """Before the next run begins: the requeue's outcome is in its incident. The
    next run may attach before the requeue's thread has returned (it started the
    job at once): its ranks wait (asked again) up to SETTLE_WAIT seconds."""
    a = r.attempt
    asked = a.requeue if isinstance(a, StepAttempt) else None
    if asked is None or asked.told:
        return True
    if asked.result is None:
        if asked.waited_since is None:
            asked.waited_since = r.clock()
        # Past it, the thread is stuck in Slurm: the run begins, the outcome comes later.
        return bool(r.clock() - asked.waited_since >= SETTLE_WAIT)
    waits(r)
    return True


def waits(r: Runner) -> None:
    """In BACKOFF, each second until the next run attaches: the requeue's outcome
    into the incident (once), FATAL where Slurm did not requeue it."""
    a = r.attempt
    asked = a.requeue if isinstance(a, StepAttempt) else None
    if asked is None or asked.result is None or asked.told:
        return
    asked.told = True
    res, job = asked.result, r.job.slurm
    ok = res.outcome is Outcome.OK
    r.events.slurm_requeues.labels(r.job.name, res.outcome.value).inc()
    if asked.incident >= 0:
        said = {"slurm": res.message, "slurm_outcome": res.outcome.value}
        if asked.drain is not None:
            said["slurm_drain"] = asked.drain.message
        r.ledger.amend(asked.incident, said, None)
    if asked.drain is not None:
        (log.warning if asked.drain.ok else log.error)("job %s: %s", r.job.name,
                                                       asked.drain.message)
    if ok:
        log.warning("job %s: %s", r.job.name, res.message)
        return
    log.error("job %s: Slurm job %s was not requeued (%s): left to Slurm", r.job.name, job,
              res.message)
    if r.state is JobState.BACKOFF:
        r.pending_incident = None
        r.to(JobState.FATAL, f"not requeued: {res.message}")
