"""torchrun's agent, for a job across hosts (``nodes:``): the agent restarts the
workers from the group's decision (group.py), a host short of GPUs leaves the
group and waits for a pre-flight (leave.py), and every launch runs the job's
torchrun command as torchrun.py settles it. Where the agent is gone, or must go
(its workers change GPUs), the job is relaunched as a local one is."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from trainwatch.actions import stop as stopping
from trainwatch.config import torchrun
from trainwatch.local.engine import Local
from trainwatch.multihost import group, known, leave, probeshare
from trainwatch.types import JobState

if TYPE_CHECKING:
    from trainwatch.actions.attempt import Attempt
    from trainwatch.config import Job
    from trainwatch.evidence.capture import Capture
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.types import Fault

log = logging.getLogger("trainwatch")


class Torchrun(Local):
    def resumed_step(self, r: Runner) -> int | None:
        return group.resumed_step(r)

    def of_rounds_before(self, r: Runner, pid: int) -> bool:
        return group.of_rounds_before(r, pid)

    def check(self, r: Runner, a: Attempt, now: float) -> bool:
        return group.check(r, a, now)

    def held(self, r: Runner, fault: Fault, now: float) -> bool:
        return group.held(r, fault, now)

    def wake(self, r: Runner, now: float) -> float | None:
        return group.wake(r, now)

    def reported(self, r: Runner) -> None:
        if r.group is not None:
            known.share(r, None)

    def probed(self, r: Runner, ranks: Mapping[int, bool]) -> Mapping[int, bool]:
        return probeshare.exchange(r, ranks)

    def short_of_gpus(self, r: Runner, fault: Fault, incident: int | None, fatal: bool,
                      capture: Capture | None) -> bool:
        waits = None if fatal else leave.leave(r, fault, incident)
        if waits is None:
            return super().short_of_gpus(r, fault, incident, fatal, capture)
        stopping.start(r, JobState.BACKOFF, f"{fault.kind.value}: {waits}",
                       r.job.gpus.preflight_every, capture,
                       incident if incident is not None else -1)
        return True

    def restart(self, r: Runner, fault: Fault, incident: int | None, reason: str,
                delay: float, charged: bool, capture: Capture | None,
                exclude_gpu: bool) -> None:
        # The agent restarts the workers, unless they must leave a GPU: its
        # environment is the agent's.
        if not group.act(r, fault, incident, reason, charged, capture,
                         keep_agent=not exclude_gpu):
            super().restart(r, fault, incident, reason, delay, charged, capture, exclude_gpu)

    def stay_out(self, r: Runner) -> bool:
        return leave.stay_out(r)

    def prepare(self, r: Runner, job: Job) -> tuple[Job, Mapping[str, str]] | None:
        """The job's torchrun command as torchrun.py settles it, said once per launch,
        with the group's variables; None (FATAL) when that cannot be done."""
        job = group.job_for_attempt(r, job)
        if job.nodes is None:
            return job, {}
        try:
            p = torchrun.plan(job.command, job.nodes, r.config.host, job.env)
        except torchrun.SpanError as e:  # refused at load; a command from elsewhere is not
            what = f"jobs.{job.name}.command: {e}"
            log.error("job %s: %s", job.name, what)
            r.to(JobState.FATAL, what)
            return None
        log.info("%s", torchrun.said(job.name, job.nodes, p))
        for w in p.warnings:
            log.warning("job %s: %s", job.name, w)
        return replace(job, command=p.argv, env={**job.env, **p.env}), p.env_defaults

    def waiting(self, r: Runner) -> str | None:
        return leave.waiting(r)

    def relaunch_due(self, r: Runner, now: float) -> bool:
        return leave.relaunch_due(r, now)
