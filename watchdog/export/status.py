"""A job's published status: ``state_dir/jobs/<job>/status.json``, rewritten
atomically on every state change and whenever a rank's pid becomes known.
``faultinject`` and the CLI find the job's processes through it. A runtime
snapshot, so it is not fsynced.

The job's folder holds its status, logs, catalog state and lock. It is 0750,
or 02750 and group-owned by the job's group when one is given: files created
in it then take that group, so the job's user can read its own status and
logs while other users read nothing. ``state_dir/jobs`` is 0711: it can be
passed through to a job's folder but not listed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwatch.state import atomic, statewrites
from trainwatch.state.ownership import set_mode

if TYPE_CHECKING:
    from trainwatch.lifecycle.runner import Runner

log = logging.getLogger("trainwatch")

JOBS_MODE = 0o711
JOB_DIR_MODE = 0o750
JOB_DIR_MODE_GROUP = 0o2750  # setgid: what is created inside takes the job's group


def job_dir(state_dir: str | os.PathLike[str], job: str) -> Path:
    return Path(state_dir) / "jobs" / job


def status_path(state_dir: str | os.PathLike[str], job: str) -> Path:
    return job_dir(state_dir, job) / "status.json"


def make_job_dir(state_dir: str | os.PathLike[str], job: str, gid: int = -1) -> Path:
    """Create (or bring to its modes) the job's folder; ``gid``: the job's group
    (-1: ours). Never raises: a read-only or full state_dir is counted as a
    failed status write and supervision goes on without the folder."""
    d = job_dir(state_dir, job)
    try:
        atomic.makedirs(d.parent, JOBS_MODE)
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, JOB_DIR_MODE)
        _ensure_mode(d.parent, JOBS_MODE)
        _ensure_mode(d, JOB_DIR_MODE if gid == -1 else JOB_DIR_MODE_GROUP, gid)
    except OSError as e:
        statewrites.failed("status", d, e)
    return d


def _ensure_mode(path: Path, mode: int, gid: int = -1) -> None:
    """Only when it differs: a read-only state_dir already right is no failure."""
    st = os.lstat(path)
    if stat.S_IMODE(st.st_mode) != mode or gid not in (-1, st.st_gid):
        set_mode(path, mode, gid=gid)


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
