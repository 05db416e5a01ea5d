"""One launch of a job: its argv and environment, its processes, its log.

The job is started by its keeper (keeper.py, kept.py), a small parent of its
own, in a session of its own, in its own cgroup where we may create one
(tree.py, cgroup.py), with the credentials of its user and group
(privsep/credentials.py) and the environment of DESIGN.md (jobenv.py). Its stdout and stderr go
straight to a per-attempt log file in ``state_dir``, never through a pipe to
trainwatch: the job outlives trainwatch, and its output keeps flowing while
trainwatch is down. ``trainwatch run`` follows the file to its own stdout
(logfollow.py, passthrough.py). The keeper records the leader's exit status
in a file; a restarted trainwatch adopts the attempt from what it recorded
(``Attempt.adopt``) and still learns how it ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainwatch.actions import kept, passthrough, watcher
from trainwatch.actions.cgroup import AttemptCgroup
from trainwatch.actions.jobenv import job_argv, job_env
from trainwatch.actions.logfollow import LogFollower
from trainwatch.actions.tree import JobTree
from trainwatch.config import Job
from trainwatch.privsep import credentials
from trainwatch.privsep.credentials import Identity
from trainwatch.state import statewrites
from trainwatch.state.ownership import set_mode

log = logging.getLogger("trainwatch")
def ring_dir(socket: str, job: str, number: int) -> str:
    """Beside the heartbeat socket and the exit file, in run_dir."""
    return os.path.join(os.path.dirname(socket), f"{job}.attempt-{number}.rings")


class Attempt:
    """A running (or finished) attempt: its keeper's record, the tree, the cgroup, the log."""

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
        die_with_parent: bool = False,
        umask: int = -1,
        skip: tuple[int, int] | None = None,
        foreground: bool = False,
        env_defaults: Mapping[str, str] | None = None,
    ) -> None:
        self._common(job, number, resume_from, resumed_step, gpus)
        ident = credentials.resolve(job.user, job.group)
        self.log_path = log_dir / f"attempt-{number}-{int(time.time())}.log"
        log_fd = self._open_log(log_dir, ident)
        cgroup = AttemptCgroup.create(job.name, number)
        if umask < 0:  # ours; os.umask() reads it only by setting it
            umask = os.umask(0o077)
            os.umask(umask)
        self.ring_dir: str | None = ring_dir(socket, job.name, number)
        if not self._make_ring_dir(ident):
            self.ring_dir = None
        env = job_env(job, socket, number, resume_from, os.environ, gpus, ident, self.ring_dir,
                      skip, foreground, env_defaults)
        drop = ident is not None and os.geteuid() == 0  # as credentials.child_setup decides
        spec = {
            "argv": job_argv(job, resume_from, gpus), "env": env, "cwd": job.workdir,
            "uid": ident.uid if drop and ident else None,
            "gid": ident.gid if drop and ident else None,
            "groups": list(ident.groups) if drop and ident else None,
            "umask": umask,
            "cgroup_procs": os.path.join(cgroup.path, "cgroup.procs") if cgroup else None,
            # In run_dir (tmpfs, kept across restarts): a full or read-only state_dir
            # must not cost the exit status.
            "pdeathsig": die_with_parent,
            "exit": os.path.join(os.path.dirname(socket), f"{job.name}.attempt-{number}.exit"),
            "job": job.name, "attempt": number,
        }
        try:
            self.rec, self.keeper_fd = kept.launch(spec, log_fd)
        except BaseException:
            if cgroup is not None:
                cgroup.close()
            raise
        finally:
            if log_fd is not None:
                os.close(log_fd)  # the keeper and the job hold it now
        if cgroup is not None and not self.rec.cgroup:
            log.warning("job %s: cannot join cgroup %s: membership falls back to the "
                        "process tree", job.name, cgroup.path)
            cgroup.close()
            cgroup = None
        self.started = time.monotonic()
        self.started_wall = time.time()
        self._attach(cgroup, passthrough)
        self._watcher: tuple[int, int, int | None] | None = None
        if die_with_parent:
            self._watcher = (watcher.start(watcher.CGROUP, cgroup.path) if cgroup is not None
                             else watcher.start(watcher.SESSION, str(self.pid)))

    @classmethod
    def adopt(cls, job: Job, number: int, rec: kept.Launched, pidfd: int | None,
              cgroup_path: str | None, log_path: str | None, resume_from: str | None,
              resumed_step: int | None, gpus: list[int] | None, started_wall: float) -> Attempt:
        """The attempt a trainwatch before us launched, found running (or ended) again."""
        self = cls.__new__(cls)
        self._common(job, number, resume_from, resumed_step, gpus)
        self.rec, self.keeper_fd = rec, pidfd
        self.log_path = Path(log_path) if log_path else Path(os.devnull)
        self.started_wall = started_wall
        self.started = time.monotonic() - max(0.0, time.time() - started_wall)
        cgroup = AttemptCgroup.existing(cgroup_path) if cgroup_path and rec.cgroup else None
        self._attach(cgroup, False)
        self._watcher = None
        d = ring_dir(rec.exit_path, job.name, number)
        self.ring_dir = d if os.path.isdir(d) else None
        return self

    def _common(self, job: Job, number: int, resume_from: str | None,
                resumed_step: int | None, gpus: list[int] | None) -> None:
        self.job = job
        self.number = number
        self.resume_from = resume_from
        self.resumed_step = resumed_step
        self.dropped = 0  # bytes of output lost (passthrough full)
        self.log_errors = 0  # failed opens and mode changes of the log
        self._warned: set[str] = set()
        self.gpus = gpus
        self.closed = False
        self.returncode: int | None = None
        self.exited_at: float | None = None
        self.status_lost = False  # the keeper died without recording the exit

    def _attach(self, cgroup: AttemptCgroup | None, passthrough: bool) -> None:
        self.pid = self.rec.pid
        # What wakes us at the exit: the keeper's pidfd where it exits right after
        # recording it (with a cgroup); without one the keeper holds the leader's
        # zombie (keeper.py) and the leader's own pidfd is readable at its exit.
        self.pidfd: int | None = self.keeper_fd if self.rec.cgroup else kept.leader_pidfd(self.rec)
        self.cgroup = cgroup
        self.tree = JobTree(self.job.name, self.pid, cgroup,
                            leader_start=kept.ticks(self.rec.leader_start))
        self._alive_at = time.monotonic()
        self.follower: LogFollower | None = None
        if passthrough:
            self.follower = LogFollower(str(self.log_path), self._through)

    def launched(self) -> dict[str, Any]:
        """What runtime.json records of the attempt's processes (state/runtime.py)."""
        return {**dataclasses.asdict(self.rec), "log": str(self.log_path),
                "cgroup_path": self.cgroup.path if self.cgroup else None}

    def _through(self, data: bytes) -> None:
        self.dropped += passthrough.to(1).write(data)

    def follow(self) -> None:
        """Copy the log's new output through to our stdout (trainwatch run)."""
        if self.follower is not None:
            self.follower.poll()

    def _make_ring_dir(self, ident: Identity | None) -> bool:
        """The attempt's folder for its ranks' beat rings (sources/ring.py): the
        job's user's alone. False (logged once, counted) when it cannot be made:
        the job's client then sends every beat as a datagram."""
        d = self.ring_dir
        assert d is not None
        try:
            shutil.rmtree(d, ignore_errors=True)  # a stale one (a state_dir reset)
            os.mkdir(d, 0o700)
            drop = ident is not None and os.geteuid() == 0
            set_mode(d, 0o700, ident.uid if drop and ident else -1,
                     ident.gid if drop and ident else -1)
        except OSError as e:
            log.warning("job %s: cannot create %s (%s): beats come as datagrams",
                        self.job.name, d, e.strerror or e)
            statewrites.count("rings")
            return False
        return True

    def _open_log(self, log_dir: Path, ident: Identity | None) -> int | None:
        """The attempt's log, 0640 in a 0750 folder, group-owned by the job's group
        so that its user may read it and others may not. None (logged, counted)
        when it cannot be opened: the job runs anyway."""
        gid = ident.gid if ident is not None and os.geteuid() == 0 else -1
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._log_failed("create the folder of", e)
            return None
        try:
            set_mode(log_dir, 0o750, -1, gid)
        except OSError as e:
            self._log_failed("set the mode of the folder of", e)
        try:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o640)
        except OSError as e:
            self._log_failed("open", e)
            return None
        try:
            if gid != -1:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, 0o640)  # the umask may have taken more
        except OSError as e:
            self._log_failed("set the mode of", e)
        return fd

    def _log_failed(self, what: str, e: OSError) -> None:
        """Each kind of failure is logged once per attempt; every one is counted."""
        if what not in self._warned:
            self._warned.add(what)
            log.error("job %s: cannot %s %s: %s (its output is dropped and counted)",
                      self.job.name, what, self.log_path, e.strerror or e)
        self.log_errors += 1
        statewrites.count("log")

    def poll_exit(self) -> int | None:
        """The leader's returncode (negative: signal) once its keeper recorded it."""
        if self.returncode is not None:
            return self.returncode
        d = kept.read_exit(self.rec)
        now = time.monotonic()
        if d is not None:
            self.returncode = int(d["returncode"])
            at = d.get("exited_at")
            self.exited_at = now - max(0.0, time.time() - at) if isinstance(at, (int, float)) \
                else now
            return self.returncode
        if kept.adopt(self.rec) != "gone":
            self._alive_at = now
            return None
        if kept.read_exit(self.rec) is None:  # it may have written it just before exiting
            # The keeper was killed: how the job ended is not known. Its leader
            # cannot outlive it unnoticed (it is gone too, or in the tree we stop).
            log.error("job %s: the keeper of attempt %d (pid %d) is gone without recording "
                      "the exit status", self.job.name, self.number, self.rec.keeper)
            self.status_lost = True
            self.returncode = -int(signal.SIGKILL)
            self.exited_at = self._alive_at
            return self.returncode
        return self.poll_exit()

    @property
    def watcher_pid(self) -> int | None:
        """The pid of the watcher that ends the attempt with us (None: none, or stood down)."""
        return None if self._watcher is None else self._watcher[0]

    def close(self) -> None:
        """After the tree is gone: the last output through, the keeper reaped, the
        cgroup removed (the ring folder is the caller's to remove: ringfolder.py)."""
        if self.closed:
            return
        if self.follower is not None:
            self.follower.close()
        kept.reap(self.rec, self.keeper_fd)
        self._close_fds()
        self.closed = True
        if not self.tree.close() and self.cgroup is not None:
            log.warning("job %s: cgroup %s still holds processes; left in place",
                        self.job.name, self.cgroup.path)
        if self._watcher is not None:
            watcher.stand_down(*self._watcher)
            self._watcher = None
        # The ring folder is removed by the caller, as the job's user (ringfolder.py).

    def release(self) -> None:
        """Leave the attempt running without us (the daemon stops; the next adopts it)."""
        if self.follower is not None:
            self.follower.close()
        self._close_fds()
        self.closed = True

    def _close_fds(self) -> None:
        for fd in {self.pidfd, self.keeper_fd} - {None}:
            with contextlib.suppress(OSError):
                os.close(fd)  # type: ignore[arg-type]
        self.pidfd = self.keeper_fd = None

    def exit_seen(self) -> None:
        """The pidfd was readable but the keeper's record is not there yet: poll
        for it from now on (the tick does, while pidfd is None)."""
        if self.returncode is None and self.pidfd is not None:
            if self.pidfd != self.keeper_fd:
                os.close(self.pidfd)
            self.pidfd = None
