"""An attempt trainwatch attached to rather than launched: one run of a Slurm
job (its number is Slurm's restart count, which every node agrees on) as the
proven tasks of its step on this node (step.py). Nothing is started, signalled
or reaped: Slurm does all three.

Its end. The tasks are slurmstepd's children, so no exit status reaches us.
Once every task on this node is gone the verdict is Slurm's: the job's state
and ExitCode (``scontrol show job``, in a thread: the loop never waits for
Slurm). COMPLETED with 0:0 is a clean end; a job that failed, was cancelled,
timed out or was requeued is a crash, with its code where Slurm gives one and
1 where it does not (a missing code is never a success). While the job still
runs after this node's tasks ended, there is no verdict yet: the heartbeat
timeout is what notices a node whose ranks are gone while others wait.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from trainwatch.actions.attempt import Attempt
from trainwatch.config import Job
from trainwatch.slurm import actions
from trainwatch.slurm.command import Outcome, Slurm
from trainwatch.slurm.parse import JobInfo
from trainwatch.slurm.proof import Proven
from trainwatch.slurm.step import StepTree
from trainwatch.sources.procstat import proc_stat

log = logging.getLogger("trainwatch")

NO_LOG = Path(os.devnull)  # an attached job's output is Slurm's (its --output file)
_ASK_EVERY = 1.0  # seconds between two questions to Slurm once the tasks are gone
_ENDED_OK = "COMPLETED"
_STILL = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED"})


def verdict(info: JobInfo, run: int) -> int | None:
    """The returncode run ``run`` of the job stands for once it has ended; None
    while it still runs. A run requeued since (by another node, or Slurm) was
    ended by Slurm's SIGTERM."""
    if info.restarts > run:
        return -int(signal.SIGTERM)
    if info.state in _STILL:
        return None
    code = info.exit_code
    if info.state == _ENDED_OK and code is not None and code == (0, 0):
        return 0
    if code is not None and code.returncode:
        return code.returncode
    return 1  # failed, cancelled, requeued, or no code given: never a success


class StepAttempt(Attempt):
    """Run ``number`` (Slurm's restart count) of an attached job on this node."""

    slurm_job: int
    slurm_step: int
    tasks: StepTree  # also ``tree``, as a JobTree
    _asked_at: float
    _asking: threading.Thread | None
    _info: JobInfo | None
    _slurm: Slurm
    requeue: Any  # slurm/requeue.py's Asked, once a requeue of this run was asked

    @classmethod
    def attach(cls, job: Job, proven: Proven, resume_from: str | None,
               resumed_step: int | None, ring_dir: str | None, slurm: Slurm) -> StepAttempt:
        self = cls.__new__(cls)
        self._common(job, proven.restarts, resume_from, resumed_step, None)
        self.slurm_job, self.slurm_step = proven.job, proven.step
        self.tree = self.tasks = StepTree(job.name, [(proven.task_pid, proven.task_start)])
        self.pid = self.tasks.leader
        self.keeper_fd = None
        # Readable when the first task exits (a pidfd needs no parent); then polled.
        self.pidfd = _pidfd(proven.task_pid, proven.task_start)
        self.cgroup = None
        self.follower = None
        self.log_path = NO_LOG
        self.ring_dir = ring_dir
        self.started = time.monotonic()
        self.started_wall = time.time()
        self._alive_at = self.started
        self._watcher = None
        self._asked_at = 0.0
        self._asking = None
        self._info = None
        self._slurm = slurm
        self.requeue = None
        return self

    def add(self, proven: Proven) -> bool:
        """A later rank of this run on this node."""
        return self.tasks.add(proven.task_pid, proven.task_start)

    def launched(self) -> dict[str, Any]:
        return {"slurm_job": self.slurm_job, "slurm_step": self.slurm_step,
                "tasks": {str(p): s for p, s in self.tasks.tasks.items()}}

    def poll_exit(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        now = time.monotonic()
        if not self.tasks.tasks_gone():
            self._alive_at = now
            return None
        info = self._info
        code = verdict(info, self.number) if info is not None else None
        if code is not None:
            self.returncode, self.exited_at = code, self._alive_at
            log.info("job %s: its tasks on this node are gone; Slurm says %s (exit %s): "
                     "returncode %d", self.job.name, info.state if info else "?",
                     info.exit_code if info else "?", code)
            return code
        if (self._asking is None or not self._asking.is_alive()) \
                and now - self._asked_at >= _ASK_EVERY:
            self._asked_at = now
            self._asking = threading.Thread(target=self._ask, name="trainwatch-slurm-exit",
                                            daemon=True)
            self._asking.start()
        return None

    def ended(self, code: int) -> None:
        """A later run or step of the job attached here, so this one has ended:
        ``code`` 0 for a step followed by the next, 1 for a run Slurm requeued."""
        if self.returncode is None:
            self.returncode, self.exited_at = code, self._alive_at

    def _ask(self) -> None:
        r = actions.job_info(self.slurm_job, slurm=self._slurm)
        if r.outcome is Outcome.OK and r.value is not None:
            self._info = r.value

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._close_fds()
            self.tree.close()

    def release(self) -> None:
        self._close_fds()
        self.closed = True

    def exit_seen(self) -> None:
        """The first task exited: the others, and Slurm's verdict, are polled."""
        if self.returncode is None and self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _pidfd(pid: int, start: int) -> int | None:
    """A pidfd of the task, if pid is still the process proven (its start time)."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
    st = proc_stat(pid)
    if st is None or st[2] != start:  # checked after opening: the fd holds that process
        os.close(fd)
        return None
    return fd


__all__ = ["NO_LOG", "StepAttempt", "verdict"]
