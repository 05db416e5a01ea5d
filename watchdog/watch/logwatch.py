"""A job's output against its log rules (detectors/logrules.py): the attempt's
log file is followed (the job writes it itself), its new lines are matched at
each tick and once more at the job's exit, and a rule that fires is a fault
found for respond.py: the rule's own action, or the policy's for its kind (an
out-of-memory error stops the job: relaunched, it would run into the same OOM).
The matched line and the lines before it are the incident's evidence."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from trainwatch.types import Action, Fault, FaultKind, Finding, JobState

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner


def check(r: Runner, now: float) -> Iterator[Finding]:
    """Match the job's new output, up to the first rule that fires with an action
    other than alert (acted on, the job is then being stopped)."""
    w = r.logwatch
    if w is None:
        return
    exited = r.attempt is not None and r.attempt.returncode is not None
    for m in w.poll(now):
        if r.state not in (JobState.STARTING, JobState.RUNNING):
            return
        kind = FaultKind(m.kind)
        action = Action(m.action) if m.action else r.policy.action_for(kind)
        if exited and action is Action.ALERT:
            continue  # the exit decides what happens to an attempt that has ended
        evidence = {"rule": m.rule, "line": m.line, "before": list(m.before),
                    "after": list(m.after)}
        if r.take_drill("log_line") is not None:
            evidence["source"] = "drill"  # faultinject log-line wrote it
        fault = Fault(kind, r.job.name, onset=now, evidence=evidence,
                      onset_step=r.last_step, onset_known=False)
        yield Finding(fault, action)
