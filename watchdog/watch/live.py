"""A live attempt's watchers, in their order at each tick of the loop: the rank
processes (first failure), the job's output (log rules), the stall watch, and
the tick detectors (a hang). What they find is yielded, in order, for the
lifecycle to act on (respond.act_on); the first acted on that stops the job ends
the round: the job is no longer live."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

from trainwatch.actions.attempt import Attempt
from trainwatch.actions.tree import stopped_ranks
from trainwatch.detectors import run as run_detectors
from trainwatch.types import Finding, JobState
from trainwatch.watch import firstfailure, logwatch, stallwatch

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

# A job that never uses the client counts as running once it has been up this
# long; one that does counts as running at its first beat.
RUNNING_WITHOUT_BEATS = 10.0

_LIVE = (JobState.STARTING, JobState.RUNNING)


def check(r: Runner, a: Attempt, now: float) -> Iterator[Finding]:
    # Since the attempt's start, or its group round's (r.ranks begin with either).
    if r.state is JobState.STARTING and not r.ranks.beaten \
            and now - r.ranks.started >= RUNNING_WITHOUT_BEATS:
        r.to(JobState.RUNNING, f"up {RUNNING_WITHOUT_BEATS:g}s without heartbeats")
    firstfailure.tick(r, now)  # the rank processes, watched
    # A multi-host job: a rank's own end, a peer's restart, evidence before a restart.
    if r.engine.check(r, a, now) or r.state not in _LIVE:
        return
    yield from logwatch.check(r, now)
    yield from stallwatch.check(r, now)
    if r.state not in _LIVE or r.hang_latched:
        return  # a log rule or the stall detector acted; a hang already reported
    faults = run_detectors("tick", r.view(now))
    if faults:
        # A beat may be queued while we poll: read it before judging; and which
        # ranks' processes are stopped names the hung one among ranks that went
        # quiet together (DDP's wait in the collective).
        r.intake.drain()
        stopped = stopped_ranks(r.ranks.pids())
        faults = run_detectors("tick", r.view(now, stopped=stopped))
    fault = faults[0] if faults else None
    if fault is not None:
        if r.engine.held(r, fault, now):
            return  # a multi-host job: the host with the stopped rank names it
        if r.take_drill("hang", "nccl_stall") is not None:
            fault = dataclasses.replace(fault, evidence={**fault.evidence, "source": "drill"})
        yield Finding(fault)
