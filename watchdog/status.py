"""A job's published status: ``state_dir/jobs/<job>/status.json``, rewritten
atomically on every state change and whenever a rank's pid becomes known.
``faultinject`` and the CLI find the job's processes through it. A runtime
snapshot, so it is not fsynced."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from trainwatch import atomic

log = logging.getLogger("trainwatch")


def job_dir(state_dir: str | os.PathLike[str], job: str) -> Path:
    return Path(state_dir) / "jobs" / job


def status_path(state_dir: str | os.PathLike[str], job: str) -> Path:
    return job_dir(state_dir, job) / "status.json"


def publish(state_dir: str | os.PathLike[str], job: str, status: dict[str, Any]) -> bool:
    """False when it could not be written (disk full): survived, the next one may."""
    try:
        atomic.write_json(status_path(state_dir, job), status, durable=False)
    except OSError as e:
        log.error("cannot publish the status of job %s: %s", job, e.strerror or e)
        return False
    return True


def read(state_dir: str | os.PathLike[str], job: str) -> dict[str, Any] | None:
    s = atomic.read_json(status_path(state_dir, job))
    return s if isinstance(s, dict) else None
