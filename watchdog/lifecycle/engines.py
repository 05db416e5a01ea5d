"""The registry of recovery engines (lifecycle/engine.py): which restarts a job."""

from __future__ import annotations

from trainwatch.config import Job
from trainwatch.lifecycle.engine import Engine
from trainwatch.local.engine import Local
from trainwatch.multihost.engine import Torchrun
from trainwatch.slurm.engine import Slurm


def engine_for(job: Job) -> Engine:
    """What restarts ``job``, chosen once from its config: Slurm for an attached
    job, torchrun's agent for one across hosts, else its own process tree."""
    if job.slurm is not None:
        return Slurm()
    if job.nodes is not None:
        return Torchrun()
    return Local()
