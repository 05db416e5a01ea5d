"""The drills themselves, as functions (the CLI and the demo call these).

A job's processes are found through its published status in ``state_dir``
(``jobs/<job>/status.json``): the leader's pid, its process group, and the pid
of every rank that has beaten.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from trainwatch import status as jobstatus


class DrillError(Exception):
    """The drill cannot be carried out: one line for the user."""


def job_status(state_dir: str, job: str) -> dict[str, Any]:
    s = jobstatus.read(state_dir, job)
    if s is None:
        raise DrillError(f"{jobstatus.status_path(state_dir, job)}: no status for job {job!r}"
                         " (is trainwatch supervising it, with this --state-dir?)")
    if s.get("state") not in ("starting", "running") or not s.get("pid"):
        raise DrillError(f"job {job!r} is {s.get('state')}, not running")
    return s


def _rank_pid(s: dict[str, Any], rank: int) -> int:
    pid = s.get("ranks", {}).get(str(rank))
    if pid is None:
        known = ", ".join(sorted(s.get("ranks", {}))) or "none yet"
        raise DrillError(f"job {s['job']!r} has no rank {rank} (ranks seen: {known})")
    return int(pid)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise DrillError(f"process {pid} is gone") from None
    except PermissionError:
        raise DrillError(f"process {pid}: not permitted (run as the job's user or root)") from None


def crash(state_dir: str, job: str, rank: int | None = None) -> int:
    """SIGKILL the job's leader (or one rank's process). Returns the pid killed."""
    s = job_status(state_dir, job)
    pid = int(s["pid"]) if rank is None else _rank_pid(s, rank)
    _kill(pid, signal.SIGKILL)
    return pid


def hang(state_dir: str, job: str, rank: int | None = None, seconds: float | None = None) -> str:
    """SIGSTOP one rank's process, or the job's whole process group; with
    ``seconds``, SIGCONT it again after that long. Returns what was stopped."""
    s = job_status(state_dir, job)
    if rank is None:
        pgid = int(s["pgid"])
        try:
            os.killpg(pgid, signal.SIGSTOP)
        except ProcessLookupError:
            raise DrillError(f"process group {pgid} is gone") from None

        def resume() -> None:
            os.killpg(pgid, signal.SIGCONT)

        what = f"process group {pgid}"
    else:
        pid = _rank_pid(s, rank)
        _kill(pid, signal.SIGSTOP)

        def resume() -> None:
            os.kill(pid, signal.SIGCONT)

        what = f"rank {rank} (pid {pid})"
    if seconds is not None:
        time.sleep(seconds)
        with contextlib.suppress(ProcessLookupError):
            resume()  # unless trainwatch already killed and relaunched it
    return what
