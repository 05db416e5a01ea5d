"""A fault becomes an action: the policy chooses it (policy.py), and this
carries it out: record the incident, count it, exclude a GPU, run the exec
hook, and stop the job for a relaunch, for good, or not at all."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from trainwatch.actions import evidence, hook, rollback
from trainwatch.actions import stop as stopping
from trainwatch.lifecycle.policy import decide
from trainwatch.types import Action, Fault, FaultKind, Finding, Finished, JobState
from trainwatch.watch import firstfailure

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")


def exclude(r: Runner, fault: Fault) -> None:
    if r.gpuwatch is not None and fault.gpu is not None:
        r.gpuwatch.exclude(fault.gpu, f"{fault.kind.value} {fault.evidence.get('xid', '')}"
                              f" (job {r.job.name})".replace("  ", " "))


def run_exec_hook(r: Runner, kind: str, gpu: int | None) -> None:
    hook.run(r.policy.exec, r.job.name, kind, gpu, r.umask)


def progressed(r: Runner) -> bool:
    """Has the attempt saved a good checkpoint past the one it resumed from? (A
    rollback quarantines every later one, so a good one past it is this attempt's.)"""
    a = r.attempt
    if a is None:
        return False
    newest, resumed = r.catalog.last_good(fresh=False), r.engine.resumed_step(r)
    return newest is not None and newest.step > (resumed if resumed is not None else -1)


def act_on(r: Runner, found: Iterable[Finding | Finished]) -> list[Finding]:
    """Act on what a watcher finds, each before the watcher looks further (it
    stops once the job is no longer live). The faults acted on."""
    acted = []
    for f in found:
        if isinstance(f, Finished):
            r.begin_stop(JobState.EXITED, f.why)
        else:
            handle(r, f.fault, f.action)
            acted.append(f)
    return acted


def handle(r: Runner, fault: Fault, action: Action | None = None) -> None:
    a = r.attempt
    assert a is not None
    fault = firstfailure.explain(r, fault)  # a crash: the rank that failed first
    now = r.clock()
    exited = a.returncode is not None
    resumed = r.engine.resumed_step(r)
    # Dying (or hanging) before the first beat after loading a checkpoint
    # counts against that checkpoint (a group's round's too: else a corrupt one
    # is every round's decision, and the group crash-loops on it).
    failed_start = not r.ranks.beaten and resumed is not None and r.ever_beaten
    if failed_start and resumed is not None and r.catalog.start_failed(resumed):
        log.warning("job %s: checkpoint step %d marked bad: %s", r.job.name, resumed,
                    r.catalog.bad[resumed])
    if action is None:
        action = r.policy.action_for(fault.kind)
    plan = None
    if r.observing:
        why = "observe_only" if r.config.observe_only else "paused"
        reason, delay, fatal = f"{why}: would {action.value}", None, False
    else:
        if action is Action.ROLLBACK:
            # The same anomaly again is not charged again.
            plan = rollback.plan(r.policy.rollback, r.skip, fault, r.last_step)
        if plan is not None and plan.gave_up is not None:
            reason, delay, fatal = plan.gave_up, None, True
            log.error("job %s: %s: stopped", r.job.name, plan.gave_up)
        else:
            d = decide(r.policy, fault, r.history, now, now - a.started, r.rng, action,
                       charged=plan is None or plan.widening == 0, progressed=progressed(r))
            reason, delay, fatal = d.reason, d.delay, d.fatal
    r.events.faults.labels(r.job.name, fault.kind.value).inc()
    latency = max(0.0, now - fault.onset) if fault.onset_known else None
    if latency is not None:
        r.events.detection.labels(r.job.name).observe(latency)
    incident = r.ledger.incident(
        fault, action.value, reason, a.number, latency,
        observe_only=r.observing, backoff=delay,
        injected=fault.evidence.get("source") == "drill",
    )
    if incident is not None and not r.observing and action is not Action.ALERT:
        r.last_incident = incident  # its grant is in the history saved from now on
    if incident is not None and incident >= 0:
        evidence.keep_beside(r, fault, incident)
    ev = ", ".join(f"{k}={v}" for k, v in fault.evidence.items())
    log.warning("job %s: %s (%s) -> %s: %s", r.job.name, fault.kind.value, ev,
                action.value, reason)

    if not r.observing and (action is not Action.ALERT or exited):
        # The job stops working from the fault's onset (the first fault's, if the
        # relaunch after it faulted too) until a relaunch beats again.
        r.outages.fault(fault.kind.value, fault.onset, now)
    if r.observing or action is Action.ALERT:
        if exited:
            r.begin_stop(JobState.FATAL, f"{fault.kind.value}: not relaunched ({reason})")
        elif fault.kind is FaultKind.HANG:
            r.hang_latched = True  # reported; again only after a new beat
        return
    # The job is stopped from here on: what its processes show now, first.
    capture = evidence.start(r, fault, incident)

    def stop(outcome: JobState, why: str, delay: float = 0.0) -> None:
        stopping.start(r, outcome, why, delay, capture,
                       incident if incident is not None else -1)

    if action is Action.RESTART_EXCLUDE_GPU:
        exclude(r, fault)
        left = r.gpus()
        if left is not None and len(left) < r.job.gpus.min \
                and r.engine.short_of_gpus(r, fault, incident, fatal, capture):
            return
    if action is Action.EXEC:
        run_exec_hook(r, fault.kind.value, fault.gpu)
        stop(JobState.FATAL, f"{fault.kind.value}: handed to the exec hook")
        return
    if plan is not None and not fatal:
        rollback.apply(r, plan, incident)
    if action is Action.STOP or fatal:
        stop(JobState.FATAL, f"{fault.kind.value}: {reason}")
        return
    r.engine.restart(r, fault, incident, reason, delay or 0.0,
                     charged=plan is None or plan.widening == 0, capture=capture,
                     exclude_gpu=action is Action.RESTART_EXCLUDE_GPU)
