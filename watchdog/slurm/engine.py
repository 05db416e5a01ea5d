"""Slurm, for an attached job: a restart is a requeue (requeue.py), after
draining this node where a GPU must be left out, and Slurm starts the next run,
which attaches (attach.py). A run trainwatch launched itself is relaunched as a
local one is."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainwatch.local.engine import Local
from trainwatch.multihost import known
from trainwatch.slurm import requeue
from trainwatch.types import TERMINAL

if TYPE_CHECKING:
    from trainwatch.evidence.capture import Capture
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.types import Fault

_ATTACH_POLL = 1.0  # while the requeued job's next run has not attached


class Slurm(Local):
    def reported(self, r: Runner) -> None:
        if r.job.slurm is not None:
            known.share(r, requeue.scope(r))

    def short_of_gpus(self, r: Runner, fault: Fault, incident: int | None, fatal: bool,
                      capture: Capture | None) -> bool:
        return False  # the requeue drains this node: the job runs on others

    def restart(self, r: Runner, fault: Fault, incident: int | None, reason: str,
                delay: float, charged: bool, capture: Capture | None,
                exclude_gpu: bool) -> None:
        if not requeue.act(r, fault, incident, reason, capture, drain=exclude_gpu):
            super().restart(r, fault, incident, reason, delay, charged, capture, exclude_gpu)

    def started_elsewhere(self, r: Runner) -> bool:
        if r.state in TERMINAL:
            raise ValueError(f"job {r.job.name}: Slurm starts it, not trainwatch "
                             f"(scontrol requeue {r.job.slurm})")
        r.relaunch_at = r.clock() + _ATTACH_POLL
        requeue.waits(r)
        return True
