"""A job's folder, ``state_dir/jobs/<job>``: its status, logs, catalog state and
lock. It is 0750, or 02750 and group-owned by the job's group when one is
given: files created in it then take that group, so the job's user can read its
own status and logs while other users read nothing. ``state_dir/jobs`` is 0711:
it can be passed through to a job's folder but not listed."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from trainwatch.state import atomic, statewrites
from trainwatch.state.ownership import set_mode

JOBS_MODE = 0o711
JOB_DIR_MODE = 0o750
JOB_DIR_MODE_GROUP = 0o2750  # setgid: what is created inside takes the job's group


def job_dir(state_dir: str | os.PathLike[str], job: str) -> Path:
    return Path(state_dir) / "jobs" / job


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
