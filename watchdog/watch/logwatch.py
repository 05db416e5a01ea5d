"""A job's output against its log rules (detectors/logrules.py): the attempt's
log file is followed (the job writes it itself), its new lines are matched at
each tick and once more at the job's exit, and a rule that fires is a fault
for respond.py: the rule's own action, or the policy's for its kind (an
out-of-memory error stops the job: relaunched, it would run into the same OOM).
The matched line and the lines before it are the incident's evidence."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from trainwatch.actions.logfollow import LogFollower
from trainwatch.detectors.logrules import BUILTIN, LogMatch, Matcher, compile_rules
from trainwatch.lifecycle import respond
from trainwatch.types import Action, Fault, FaultKind, JobState

if TYPE_CHECKING:
    from trainwatch.actions.attempt import Attempt
    from trainwatch.lifecycle.runner import Runner

_MAX_LINE = 4096  # a longer line is cut for matching (one with no newline for a long time, too)


class LogWatch:
    def __init__(self, path: str, matcher: Matcher, from_end: bool = False) -> None:
        """``from_end``: an adopted attempt's log; what was in it before is not news."""
        offset = 0
        if from_end:
            try:
                offset = os.stat(path).st_size
            except OSError:
                offset = 0
        self.matcher = matcher
        self.partial = b""
        self.lines: list[str] = []
        self.follower = LogFollower(path, self._take, offset)

    def _take(self, data: bytes) -> None:
        chunks = (self.partial + data).split(b"\n")
        self.partial = chunks.pop()
        if len(self.partial) > _MAX_LINE:
            chunks.append(self.partial[:_MAX_LINE])
            self.partial = b""
        self.lines += [c[:_MAX_LINE].decode(errors="replace") for c in chunks]

    def poll(self, now: float) -> list[LogMatch]:
        self.follower.poll()
        lines, self.lines = self.lines, []
        return self.matcher.feed(lines, now) if lines else []

    def close(self) -> None:
        self.follower.close()


def follow(r: Runner, a: Attempt, from_end: bool) -> None:
    """The new attempt's log, against the job's rules (none: not followed)."""
    if r.logwatch is not None:
        r.logwatch.close()
    spec = r.job.logs
    rules = (*(BUILTIN if spec.builtin else ()), *spec.rules)
    r.logwatch = LogWatch(str(a.log_path), compile_rules(rules), from_end) if rules else None


def check(r: Runner, now: float) -> None:
    """Match the job's new output; act on the first rule that fires with an action
    other than alert (the job is then being stopped)."""
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
        respond.handle(r, fault, action)
