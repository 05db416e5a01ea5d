"""One supervisor per job and state_dir: an exclusive ``flock`` on
``state_dir/jobs/<job>/lock``, held for the supervisor's life.

The heartbeat socket cannot be the lock: two ``trainwatch run`` with other
run dirs but one state_dir both ran and wrote two attempt-0 rows into one
ledger. The lock belongs with what they would share. The kernel drops it
when its holder dies, however it dies, so a stale lock cannot outlive a
crash. The holder's pid is written inside, for the refusal's message only.
The file is 0600: a job's user may read its job's folder, and could
otherwise hold the lock (flock needs only a read descriptor).

A state_dir where the lock file cannot be created (read-only) degrades:
the job is supervised unlocked, with a warning, never refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path

from trainwatch.config import ConfigError
from trainwatch.state.jobdir import job_dir, make_job_dir

log = logging.getLogger("trainwatch")

LOCK_NAME = "lock"
LOCK_MODE = 0o600


class JobLocked(ConfigError):
    """Another trainwatch supervises this job with this state_dir: one line, exit 2."""


class JobLock:
    """The lock of one job, held from ``acquire`` until ``release`` (or exit)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> JobLock:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


def lock_path(state_dir: str | os.PathLike[str], job: str) -> Path:
    return job_dir(state_dir, job) / LOCK_NAME


def _open(path: Path) -> int:
    """Read-write (created 0600), or read-only where it exists but the
    filesystem is read-only; flock works on either."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, LOCK_MODE)
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.ENOSPC, errno.EDQUOT):
            raise
        return os.open(path, os.O_RDONLY | flags)
    with contextlib.suppress(OSError):
        os.fchmod(fd, LOCK_MODE)
    return fd


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        text = os.pread(fd, 32, 0).decode("ascii").strip()
        if text.isdigit():
            return f"pid {int(text)}"
    return "another process (pid not yet written)"


def acquire(state_dir: str | os.PathLike[str], job: str, gid: int = -1) -> JobLock:
    """Take the job's lock (creating its folder, see ``jobdir.make_job_dir``).
    Raises JobLocked, naming the holder's pid, when another process holds it."""
    make_job_dir(state_dir, job, gid)
    path = lock_path(state_dir, job)
    try:
        fd = _open(path)
    except OSError as e:
        log.warning("job %s: cannot lock %s (%s): a second trainwatch for this job and "
                    "state_dir would not be refused", job, path, e.strerror or e)
        return JobLock(path, None)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise JobLocked(f"job {job!r} is already supervised by {holder} with state_dir "
                            f"{state_dir} (lock {path}); stop it first, or use another "
                            "state_dir") from None
        log.warning("job %s: cannot lock %s (%s)", job, path, e.strerror or e)
        return JobLock(path, None)
    # Best effort: on a full or read-only state_dir the lock holds without it.
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return JobLock(path, fd)
