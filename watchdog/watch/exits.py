"""An attempt's end, noticed by its pidfd (or a poll): judged once its last
beats and output lines are read (an OOM or NCCL line says why it died better
than its exit status), by the exit detectors; a clean exit finishes the job."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from trainwatch.detectors import run as run_detectors
from trainwatch.lifecycle import respond
from trainwatch.types import JobState, ProcessExit
from trainwatch.watch import logwatch

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner


def check(r: Runner) -> None:
    """Act on the attempt's exit, once, if it has exited."""
    a = r.attempt
    if a is None or r.exit_handled == a.number:
        return
    rc = a.returncode if a.returncode is not None else a.poll_exit()
    if rc is None:
        return
    if r.state is not JobState.STARTING and r.state is not JobState.RUNNING:
        return  # we are stopping it; actions/stop.py finishes the job
    r.intake.drain()  # its last beats, still queued, count towards the steps it reached
    logwatch.check(r, r.clock())  # its last lines say why it died (an OOM, NCCL)
    if r.state is not JobState.STARTING and r.state is not JobState.RUNNING:
        r.exit_handled = a.number
        return
    at = a.exited_at if a.exited_at is not None else r.clock()
    faults = run_detectors("exit", r.view(r.clock(), exit=ProcessExit(a.pid, rc, at)))
    fault = faults[0] if faults else None
    drill = r.take_drill("crash")
    if fault is not None and drill is not None:
        fault = dataclasses.replace(fault, onset=drill.at, onset_known=True,
                                    evidence={**fault.evidence, "source": "drill"})
    if fault is None:
        r.begin_stop(JobState.EXITED, "the job finished (exit 0)")
    else:
        respond.handle(r, fault)
    r.exit_handled = a.number  # not before: a handling that raised is tried again
