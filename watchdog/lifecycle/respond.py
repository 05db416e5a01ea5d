"""A fault becomes an action: the policy chooses it (policy.py), and this
carries it out: record the incident, count it, exclude a GPU, run the exec
hook, and stop the job for a relaunch, for good, or not at all."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from trainwatch.actions import evidence, hook, rollback
from trainwatch.actions import stop as stopping
from trainwatch.evidence import series
from trainwatch.evidence.show import CATALOG, folder
from trainwatch.lifecycle.policy import choose, decide
from trainwatch.multihost import group, leave
from trainwatch.slurm import requeue
from trainwatch.types import Action, Fault, FaultKind, JobState
from trainwatch.watch import firstfailure

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")


def on_gpu_fault(r: Runner, fault: Fault) -> None:
    """A fault of one of this job's GPUs (routed here by the supervisor)."""
    fault = dataclasses.replace(fault, job=r.job.name, onset_step=r.last_step,
                                evidence=dict(fault.evidence))
    r.stall.gpu_fault(fault)  # a stall in its window is classed as this fault
    action = choose(r.policy, fault, r.xids_seen)
    pid = fault.evidence.get("pid")
    a = r.attempt
    # An application-level Xid names the process it hit: one of an earlier attempt
    # (e.g. Xid 45 as we killed it) or of another program is not this attempt's fault.
    foreign = (action is Action.RESTART and isinstance(pid, int) and pid > 0
               and a is not None and not a.tree.owns(pid, uid=-1))
    if r.state in (JobState.STARTING, JobState.RUNNING) and not foreign:
        handle(r, fault, action)
        return
    # Nothing of ours runs on it now: record it, and keep the GPU out of the next launch.
    reason = f"job {r.state.value if r.state else '-'}: recorded only"
    if foreign:
        reason = f"pid {pid} is not this attempt's: recorded only"
    if (action is Action.RESTART_EXCLUDE_GPU and fault.gpu is not None
            and not r.observing):
        exclude(r, fault)
        reason += f"; GPU {fault.gpu} excluded"
    r.events.faults.labels(r.job.name, fault.kind.value).inc()
    latency = max(0.0, r.clock() - fault.onset) if fault.onset_known else None
    r.ledger.incident(fault, action.value, reason, max(r.number, 0), latency,
                         observe_only=r.observing,
                         injected=fault.evidence.get("source") == "drill")
    log.warning("job %s: %s on GPU %s -> %s", r.job.name, fault.kind.value, fault.gpu,
                reason)


def exclude(r: Runner, fault: Fault) -> None:
    if r.gpuwatch is not None and fault.gpu is not None:
        r.gpuwatch.exclude(fault.gpu, f"{fault.kind.value} {fault.evidence.get('xid', '')}"
                              f" (job {r.job.name})".replace("  ", " "))


def run_exec_hook(r: Runner, kind: str, gpu: int | None) -> None:
    hook.run(r.policy.exec, r.job.name, kind, gpu, r.umask)


def keep_series(r: Runner, fault: Fault, incident: int) -> None:
    """The lead rank's loss and grad norm around the onset, beside the incident."""
    feed = r.anomalies
    onset = fault.onset_step if fault.onset_step is not None else r.last_step
    if onset is None or feed.lead is None:
        return
    try:
        where = folder(r.config.state_dir, r.job.name, incident)
        series.keep(where, feed.lead, onset, fault.evidence.get("noticed_step"), feed.series)
    except (OSError, ValueError) as e:  # a full state_dir costs the series, not the job
        log.warning("job %s: incident %d: loss series not kept: %s", r.job.name, incident, e)


def keep_catalog(r: Runner, incident: int) -> None:
    """The job's checkpoints as the catalog judged them at the incident, beside it
    (the incident page's table; the job's catalog.json moves on)."""
    try:
        r.catalog.keep(folder(r.config.state_dir, r.job.name, incident) / CATALOG)
    except (OSError, ValueError, TypeError) as e:  # a full state_dir costs the table only
        log.warning("job %s: incident %d: checkpoints not kept: %s", r.job.name, incident, e)


def progressed(r: Runner) -> bool:
    """Has the attempt saved a good checkpoint past the one it resumed from? (A
    rollback quarantines every later one, so a good one past it is this attempt's.)"""
    a = r.attempt
    if a is None:
        return False
    newest, resumed = r.catalog.last_good(fresh=False), group.resumed_step(r)
    return newest is not None and newest.step > (resumed if resumed is not None else -1)


def handle(r: Runner, fault: Fault, action: Action | None = None) -> None:
    a = r.attempt
    assert a is not None
    fault = firstfailure.explain(r, fault)  # a crash: the rank that failed first
    now = r.clock()
    exited = a.returncode is not None
    resumed = group.resumed_step(r)
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
    if fault.kind in series.LOSS_KINDS and incident is not None and incident >= 0:
        keep_series(r, fault, incident)
    if incident is not None and incident >= 0:
        keep_catalog(r, incident)
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
        if left is not None and len(left) < r.job.gpus.min and r.job.slurm is None:
            waits = None if fatal else leave.leave(r, fault, incident)
            if waits is not None:  # a multi-host job: this host leaves its group
                stop(JobState.BACKOFF, f"{fault.kind.value}: {waits}",
                     r.job.gpus.preflight_every)
                return
            run_exec_hook(r, fault.kind.value, fault.gpu)
            stop(JobState.FATAL, f"{fault.kind.value}: only {len(left)} healthy "
                                 f"GPUs left, the job needs {r.job.gpus.min}")
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
    charged = plan is None or plan.widening == 0
    if requeue.act(r, fault, incident, reason, capture,  # a Slurm job: through Slurm
                   drain=action is Action.RESTART_EXCLUDE_GPU):
        return
    # A job across hosts (or one host's torchrun under nodes:): its agent restarts
    # the workers, unless they must leave a GPU: its environment is the agent's.
    if group.act(r, fault, incident, reason, charged, capture,
                 keep_agent=action is not Action.RESTART_EXCLUDE_GPU):
        return
    r.pending_incident = incident
    stop(JobState.BACKOFF, f"{fault.kind.value}: {reason}", delay or 0.0)
