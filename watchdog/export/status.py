"""A job's published status: ``state_dir/jobs/<job>/status.json``, rewritten
atomically on every state change and whenever a rank's pid becomes known.
``faultinject`` and the CLI find the job's processes through it. A runtime
snapshot, so it is not fsynced. It lies in the job's folder (state/jobdir.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwatch.state import atomic, statewrites
from trainwatch.state.jobdir import job_dir

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")

def status_path(state_dir: str | os.PathLike[str], job: str) -> Path:
    return job_dir(state_dir, job) / "status.json"


def publish(state_dir: str | os.PathLike[str], job: str, status: dict[str, Any]) -> bool:
    """False when it could not be written (disk full, read-only): counted and
    survived, the next one may succeed."""
    path = status_path(state_dir, job)
    try:
        atomic.write_json(path, status, durable=False)
    except (OSError, ValueError, TypeError) as e:
        statewrites.failed("status", path, e)
        return False
    return True


def read(state_dir: str | os.PathLike[str], job: str) -> dict[str, Any] | None:
    s = atomic.read_json(status_path(state_dir, job))
    return s if isinstance(s, dict) else None


def of(r: Runner) -> dict[str, Any]:
    """What ``trainwatch status`` and faultinject read of a job."""
    a = r.attempt
    return {
        "job": r.job.name,
        "state": r.state.value if r.state else None,
        "attempt": r.number,
        "pid": a.pid if a else None,
        "pgid": a.pid if a else None,
        "ranks": {str(r): p for r, p in r.ranks.pids().items()},
        "step": r.last_step,
        "socket": r.socket_path,
        "run_dir": r.config.run_dir,  # where faultinject finds the control socket
        "cgroup": a.tree.cgroup.path if a and a.tree.cgroup else None,
        "log": str(a.log_path) if a else None,
        "resumed_from": a.resume_from if a else None,
        "observe_only": r.config.observe_only,
        "datagrams": dataclasses.asdict(r.socket.counters),
        "rings": {"dir": r.intake.ring_dir, "read": r.intake.rings_opened,
                  "values": r.intake.ring_values, "lapped": r.intake.rings_lapped,
                  "refused": r.intake.rings_refused},
        "ranks_over_cap": r.ranks_over_cap,
    }
