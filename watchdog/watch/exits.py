"""An attempt's end, noticed by its pidfd (or a poll): judged once its last
beats and output lines are read (an OOM or NCCL line says why it died better
than its exit status), by the exit detectors; a clean exit finishes the job.
What it finds it yields, in order, for the lifecycle to act on (respond.act_on);
it goes on only once that is done."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from trainwatch.detectors import run as run_detectors
from trainwatch.types import Finding, Finished, JobState, ProcessExit
from trainwatch.watch import logwatch

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner


def check(r: Runner) -> Iterator[Finding | Finished]:
    """The attempt's exit, judged once, if it has exited."""
    a = r.attempt
    if a is None or r.exit_handled == a.number:
        return
    rc = a.returncode if a.returncode is not None else a.poll_exit()
    if rc is None:
        return
    if r.state is not JobState.STARTING and r.state is not JobState.RUNNING:
        return  # we are stopping it; actions/stop.py finishes the job
    r.intake.drain()  # its last beats, still queued, count towards the steps it reached
    yield from logwatch.check(r, r.clock())  # its last lines say why it died (an OOM, NCCL)
    if r.state is not JobState.STARTING and r.state is not JobState.RUNNING:
        r.exit_handled = a.number
        return
    at = a.exited_at if a.exited_at is not None else r.clock()
    faults = run_detectors("exit", r.view(r.clock(), exit=ProcessExit(a.pid, rc, at)))
    fault = faults[0] if faults else None
    drill = r.take_drill("crash")
    fault = drill.mark(fault) if fault is not None and drill is not None else fault
    yield Finished("the job finished (exit 0)") if fault is None else Finding(fault)
    r.exit_handled = a.number  # not before: a handling that raised is tried again
