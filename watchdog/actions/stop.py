"""The stop protocol: SIGTERM (and SIGCONT, so that a stopped process can act
on it) to every process of the attempt, ``kill_grace`` to exit, SIGKILL to
what is left, and done only once every process is gone."""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

from trainwatch.actions import evidence, ringfolder, verify
from trainwatch.actions.attempt import Attempt
from trainwatch.evidence.capture import Capture
from trainwatch.lifecycle.runner import Stop
from trainwatch.types import JobState
from trainwatch.watch import firstfailure

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")


def request(r: Runner, reason: str) -> None:
    """The operator asked: stop the job, do not relaunch."""
    if r.state in (JobState.STARTING, JobState.RUNNING):
        start(r, JobState.PAUSED, reason)
    elif r.state is JobState.BACKOFF:
        r.to(JobState.PAUSED, reason)
    elif r.stopping is not None and r.stopping.outcome is JobState.BACKOFF:
        r.stopping.outcome, r.stopping.reason = JobState.PAUSED, reason


def start(r: Runner, outcome: JobState, reason: str, delay: float = 0.0,
          capture: Capture | None = None, incident: int = -1) -> None:
    """STOPPING now; ``outcome`` (after ``delay``, for BACKOFF) once the tree is gone.
    With a ``capture`` in flight, the signals wait for it (at most its timeout)."""
    now = r.clock()
    wait = capture.timeout if capture is not None else 0.0
    r.stopping = Stop(outcome, reason, now + wait + r.policy.kill_grace, delay, capture=capture,
                      incident=incident)
    r.to(JobState.STOPPING, reason)
    if capture is None:
        begin(r.attempt, r.config.observe_only)
    advance(r, now)


def advance(r: Runner, now: float) -> None:
    s, a = r.stopping, r.attempt
    assert s is not None
    if s.capture is not None:
        if not s.capture.done and now < s.deadline - r.policy.kill_grace:
            return  # the evidence first: the processes as they were at the fault
        evidence.finish(r, s.capture, s.incident)
        s.capture, s.deadline = None, now + r.policy.kill_grace
        begin(a, r.config.observe_only)
    if not progress(s, a, now, r.policy.kill_grace, r.config.observe_only, r.job.name):
        return
    firstfailure.after_stop(r, a, s.incident)  # its output is complete now
    if a is not None:
        if a.pidfd is not None and a.pidfd in r.sel.get_map():
            r.sel.unregister(a.pidfd)
        a.close()
    r.intake.end_attempt()
    if a is not None and a.ring_dir is not None:
        ringfolder.remove(r, a.ring_dir)  # as the job's user, off the loop
    if a is not None and r.job.evidence.flight_recorder:
        ringfolder.remove(r, str(evidence.fr_dir(r, a.number)))  # copied by its incidents
    r.stopping = None
    if s.outcome is JobState.BACKOFF:
        r.relaunch_at = now + s.delay
        r.to(JobState.BACKOFF, r.engine.waiting(r) or f"relaunch in {s.delay:.2f}s")
        verify.prefetch(r)  # the checkpoint the relaunch will use, checked meanwhile
    else:
        r.to(s.outcome, s.reason)


def begin(a: Attempt | None, observe_only: bool) -> None:
    """Ask every process of the attempt to exit. observe_only never signals."""
    if a is None or observe_only:
        return
    members = a.tree.scan()
    a.tree.signal(signal.SIGTERM, members)
    a.tree.signal(signal.SIGCONT, members)


def progress(s: Stop, a: Attempt | None, now: float, grace: float, observe_only: bool,
             job: str) -> bool:
    """True once nothing of the attempt is left (and its exit is collected);
    SIGKILL once past the deadline. observe_only cannot wait for the tree."""
    if a is None:
        return True
    a.poll_exit()
    a.tree.reap()
    alive = set() if observe_only else a.tree.alive()
    if not alive:
        return True
    if now >= s.deadline and not s.killed:
        log.warning("job %s: %d processes outlived kill_grace %gs: SIGKILL", job, len(alive),
                    grace)
        cg = a.tree.cgroup
        if cg is None or not cg.kill():  # cgroup.kill: every member at once, forks included
            a.tree.signal(signal.SIGKILL, alive)
        s.killed = True
    return False
