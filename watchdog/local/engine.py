"""The job's own process tree on this host (`trainwatch run`, the daemon's jobs):
trainwatch ends every process of the attempt and launches the next itself."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from trainwatch.actions import hook
from trainwatch.actions import stop as stopping
from trainwatch.types import JobState

if TYPE_CHECKING:
    from trainwatch.actions.attempt import Attempt
    from trainwatch.config import Job
    from trainwatch.evidence.capture import Capture
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.types import Fault


def _incident(incident: int | None) -> int:
    return incident if incident is not None else -1


class Local:
    """Satisfies lifecycle.engine.Engine; the other engines fall back on it."""

    def resumed_step(self, r: Runner) -> int | None:
        a = r.attempt
        return a.resumed_step if a is not None else None

    def of_rounds_before(self, r: Runner, pid: int) -> bool:
        return False

    def check(self, r: Runner, a: Attempt, now: float) -> bool:
        return False

    def held(self, r: Runner, fault: Fault, now: float) -> bool:
        return False

    def wake(self, r: Runner, now: float) -> float | None:
        return None

    def reported(self, r: Runner) -> None:
        return None

    def probed(self, r: Runner, ranks: Mapping[int, bool]) -> Mapping[int, bool]:
        return {}

    def short_of_gpus(self, r: Runner, fault: Fault, incident: int | None, fatal: bool,
                      capture: Capture | None) -> bool:
        left = r.gpus() or []
        hook.run(r.policy.exec, r.job.name, fault.kind.value, fault.gpu, r.umask)
        stopping.start(r, JobState.FATAL, f"{fault.kind.value}: only {len(left)} healthy GPUs "
                       f"left, the job needs {r.job.gpus.min}", 0.0, capture,
                       _incident(incident))
        return True

    def restart(self, r: Runner, fault: Fault, incident: int | None, reason: str,
                delay: float, charged: bool, capture: Capture | None,
                exclude_gpu: bool) -> None:
        r.pending_incident = incident
        stopping.start(r, JobState.BACKOFF, f"{fault.kind.value}: {reason}", delay, capture,
                       _incident(incident))

    def started_elsewhere(self, r: Runner) -> bool:
        return False

    def stay_out(self, r: Runner) -> bool:
        return False

    def prepare(self, r: Runner, job: Job) -> tuple[Job, Mapping[str, str]] | None:
        return job, {}

    def waiting(self, r: Runner) -> str | None:
        return None

    def relaunch_due(self, r: Runner, now: float) -> bool:
        return now >= r.relaunch_at
