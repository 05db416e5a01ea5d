"""What each attempt leaves in trainwatch's own folders, bounded.

Every attempt's keeper writes ``run_dir/jobs/<job>.attempt-N.exit`` (and
``.exit.start``), and its output goes to ``state_dir/jobs/<job>/logs/
attempt-N-<time>.log``. Left alone they grow with every relaunch (1,007 exit
files after 503 attempts). Once attempt N has started, what an earlier
attempt's exit files said is recorded (its exit was acted on, and the state
file a restarted daemon adopts from now names attempt N), so they go, as do
those of an earlier run; of the logs the newest ``KEEP_LOGS`` attempts' stay
(an incident keeps the lines that made it: a log rule's, a stall's evidence).

Both folders are root's own (``run_dir/jobs`` and the 0750 log folder, which
the job's user cannot write), and only names of this job's shape are removed,
relative to the opened folder; nothing in a folder a job's user may write
(its ring and flight-recorder folders) is ever touched here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

log = logging.getLogger("trainwatch")

KEEP_LOGS = 10  # the newest attempts whose output logs are kept, per job
_LOG = re.compile(r"attempt-(\d+)-(\d+)\.log")
_EXIT = re.compile(r"(\d+)\.exit(?:\.start)?")


def _names(folder: str | Path) -> tuple[int, list[str]] | None:
    """An fd of the folder (not followed if a link) and its names; None if absent."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return fd, os.listdir(fd)
    except OSError:
        os.close(fd)
        return None


def _remove(fd: int, names: list[str]) -> int:
    n = 0
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            try:
                os.unlink(name, dir_fd=fd)
                n += 1
            except OSError as e:
                log.warning("cannot remove %s: %s", name, e.strerror or e)
    return n


def exit_files(run_jobs: str, job: str, current: int) -> int:
    """Remove the exit files of the job's attempts other than ``current`` (an
    earlier run's, in the same run_dir, may have had higher numbers); how many."""
    found = _names(run_jobs)
    if found is None:
        return 0
    fd, names = found
    prefix = f"{job}.attempt-"
    try:
        old = [n for n in names if n.startswith(prefix)
               and (m := _EXIT.fullmatch(n[len(prefix):])) and int(m.group(1)) != current]
        return _remove(fd, old)
    finally:
        os.close(fd)


def logs(log_dir: Path, current: str, keep: int = KEEP_LOGS) -> int:
    """Remove all but the newest ``keep`` attempts' logs, newest by the time in
    the name (a new ``trainwatch run`` numbers its attempts from 0 again), never
    ``current``; how many."""
    found = _names(log_dir)
    if found is None:
        return 0
    fd, names = found
    try:
        dated = sorted(((int(m.group(2)), int(m.group(1)), n) for n in names
                        if (m := _LOG.fullmatch(n)) and n != current), reverse=True)
        return _remove(fd, [n for _t, _a, n in dated[max(0, keep - 1):]])
    finally:
        os.close(fd)


def sweep(run_jobs: str, log_path: Path, job: str, current: int) -> None:
    """After attempt ``current`` (its log ``log_path``) has started, and the
    state file names it."""
    gone = exit_files(run_jobs, job, current), \
        logs(log_path.parent, log_path.name) if str(log_path) != os.devnull else 0
    if any(gone):
        log.debug("job %s: removed %d exit files and %d logs of earlier attempts", job, *gone)
