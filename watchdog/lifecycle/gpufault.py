"""A fault of one of this job's GPUs, routed here by the supervisor: acted on as
any fault while the job runs there (respond.py), else recorded, the GPU kept out
of the next launch where the policy excludes it."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from trainwatch.lifecycle.policy import choose
from trainwatch.lifecycle.respond import exclude, handle
from trainwatch.types import Action, Fault, JobState

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
