"""One launch of a job: its argv and environment, its process, its output.

The job gets its own session (so its process group id is its pid), the
environment of DESIGN.md, and pipes for stdout and stderr that the supervisor
copies into a per-attempt log file in ``state_dir`` (and through to our own
stdout and stderr in ``trainwatch run``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

from trainwatch.config import Job
from trainwatch.tree import JobTree

_CHUNK = 65536
log = logging.getLogger("trainwatch")


def job_env(
    job: Job, socket: str, attempt: int, resume_from: str | None, base: Mapping[str, str],
    gpus: list[int] | None = None,
) -> dict[str, str]:
    env = dict(base)
    env.update(job.env)
    env["TRAINWATCH_SOCKET"] = socket
    env["TRAINWATCH_JOB"] = job.name
    env["TRAINWATCH_ATTEMPT"] = str(attempt)
    # A value inherited from our own environment must not leak into a fresh start.
    env.pop("TRAINWATCH_RESUME_FROM", None)
    env.pop("TRAINWATCH_SKIP_STEPS", None)
    if resume_from is not None:
        env["TRAINWATCH_RESUME_FROM"] = resume_from
    if gpus is not None:
        # NVML numbers GPUs in PCI bus order; make CUDA number them the same way.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        env["TRAINWATCH_NUM_GPUS"] = str(len(gpus))
    return env


def job_argv(job: Job, resume_from: str | None, gpus: list[int] | None = None) -> list[str]:
    """The command; {num_gpus} in it becomes the number of GPUs the attempt gets
    (e.g. torchrun --nproc-per-node={num_gpus}), so that the job learns its new
    world size after a GPU is excluded."""
    argv = list(job.command)
    if gpus is not None:
        argv = [a.replace("{num_gpus}", str(len(gpus))) for a in argv]
    if resume_from is not None:
        argv += [a.replace("{checkpoint}", resume_from) for a in job.resume_args]
    return argv


class Attempt:
    """A running (or finished) attempt. Owns the Popen, the pidfd and the log."""

    def __init__(
        self,
        job: Job,
        number: int,
        socket: str,
        resume_from: str | None,
        resumed_step: int | None,
        log_dir: Path,
        passthrough: bool,
        gpus: list[int] | None = None,
    ) -> None:
        self.job = job
        self.number = number
        self.resume_from = resume_from
        self.resumed_step = resumed_step
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"attempt-{number}-{int(time.time())}.log"
        self.log: BinaryIO = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        self.passthrough = passthrough
        self.dropped = 0  # bytes of output that could not be written
        self.gpus = gpus
        self.proc = subprocess.Popen(
            job_argv(job, resume_from, gpus),
            env=job_env(job, socket, number, resume_from, os.environ, gpus),
            cwd=job.workdir,
            user=job.user,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
        self.started = time.monotonic()
        self._alive_at = self.started
        self.started_wall = time.time()
        self.pid = self.proc.pid
        self.tree = JobTree(job.name, self.pid)
        self.pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            self.pidfd = os.pidfd_open(self.pid)
        self.returncode: int | None = None
        self.exited_at: float | None = None
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.pipes: dict[int, int] = {self.proc.stdout.fileno(): 1, self.proc.stderr.fileno(): 2}
        for fd in self.pipes:
            os.set_blocking(fd, False)

    def pump(self, fd: int) -> bool:
        """Copy what is waiting on one output pipe; False at end of file."""
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            return False
        self._copy(fd, data)
        return True

    def _copy(self, fd: int, data: bytes) -> None:
        """To the log, and through to our own stdout/stderr. Neither may stop the
        loop: a write error (disk full) or a reader that stopped reading (a paused
        terminal, `| less`) drops the output and counts it."""
        try:
            self.log.write(data)
            self.log.flush()
        except OSError as e:
            if not self.dropped:
                log.error("job %s: cannot write %s: %s", self.job.name, self.log_path,
                          e.strerror or e)
            self.dropped += len(data)
        if self.passthrough:
            out = self.pipes[fd]
            while data and select.select([], [out], [], 0)[1]:
                try:
                    data = data[os.write(out, data):]
                except OSError:
                    break
            self.dropped += len(data)

    def _drain(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, _CHUNK)
            except OSError:
                return
            if not data:
                return
            self._copy(fd, data)

    def poll_exit(self) -> int | None:
        """Reap the leader if it has exited; its returncode (negative: signal)."""
        if self.returncode is not None:
            return self.returncode
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 0  # reaped elsewhere: nothing more to learn
        now = time.monotonic()
        if pid == 0:
            self._alive_at = now
            return None
        self.returncode = os.waitstatus_to_exitcode(status)
        # With a pidfd we are woken at the exit itself; when polling, the exit
        # happened after the last poll that saw it alive: take that, so the
        # ledger's detection latency includes the polling delay.
        self.exited_at = now if self.pidfd is not None else self._alive_at
        self.proc.returncode = self.returncode  # keep Popen consistent; we reaped it
        return self.returncode

    def close(self) -> None:
        for fd in list(self.pipes):
            self._drain(fd)  # whatever is still buffered goes to the log first
        if self.proc.stdout:
            self.proc.stdout.close()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.pipes.clear()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self.log.close()
