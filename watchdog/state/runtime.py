"""A job's runtime state: one typed object, written atomically (temp file,
fsync, rename) on every change of state, and read back by a restarted daemon
to adopt the job: which attempt runs under which processes (identified by pid
and start time), the restart history, the backoff deadline, the incident in
flight, the step reached. Times are wall-clock seconds here: they outlive
the process (and the monotonic clock readings) that took them."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwatch.state import atomic, statewrites

VERSION = 1


@dataclass
class Runtime:
    job: str
    state: str | None = None  # a JobState's value
    attempt: int = -1  # -1 before the first launch
    # The attempt's processes, as actions.kept records them (pids, start times,
    # cgroup, exit file); None while nothing runs.
    launched: dict[str, Any] | None = None
    resume_from: str | None = None
    resumed_step: int | None = None
    gpus: list[int] | None = None
    started_at: float | None = None  # the attempt's launch
    restarts: dict[str, Any] = field(default_factory=dict)  # policy.RestartHistory.to_json
    relaunch_at: float | None = None  # in BACKOFF: when
    pending_incident: int | None = None  # the incident whose relaunch is not recorded yet
    stop: dict[str, Any] | None = None  # in STOPPING: outcome, reason, delay
    last_step: int | None = None
    ever_beaten: bool = False
    xids: list[tuple[int | None, float]] = field(default_factory=list)
    paused: bool = False  # the operator: keep watching, stop acting
    restart_count: int = 0
    skip: list[int] | None = None  # after a rollback: start, end, rollbacks into it
    last_incident: int = 0  # the newest stopping incident whose grant ``restarts`` holds
    saved_at: float = 0.0
    v: int = VERSION


def path(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / "runtime.json"


def save(job_dir: str | os.PathLike[str], rt: Runtime, wall: float) -> bool:
    """False when it could not be written (counted and logged by statewrites)."""
    rt.saved_at = wall
    p = path(job_dir)
    try:
        atomic.write_json(p, dataclasses.asdict(rt))
    except (OSError, ValueError, TypeError) as e:
        statewrites.failed("runtime", p, e)
        return False
    return True


def load(job_dir: str | os.PathLike[str], job: str) -> Runtime | None:
    """The saved state, or None when absent, unreadable, another version or
    another job's: a restarted daemon then starts the job afresh."""
    d = atomic.read_json(path(job_dir))
    if not isinstance(d, dict) or d.get("v") != VERSION or d.get("job") != job:
        return None
    names = {f.name for f in dataclasses.fields(Runtime)}
    try:
        rt = Runtime(**{k: v for k, v in d.items() if k in names})
    except TypeError:
        return None
    rt.xids = [(g if isinstance(g, int) else None, float(t)) for g, t in rt.xids
               if isinstance(t, (int, float))] if isinstance(rt.xids, list) else []
    return rt
