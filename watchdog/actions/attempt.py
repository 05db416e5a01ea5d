"""One launch of a job: its argv and environment, its processes, its log.

The job is started by its keeper (keeper.py, kept.py), a small parent of its
own, in a session of its own, in its own cgroup where we may create one
(tree.py, cgroup.py), with the credentials of its user and group
(credentials.py) and the environment of DESIGN.md (jobenv.py). Its stdout and stderr go
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

from trainwatch.actions import credentials, kept, passthrough
from trainwatch.actions.cgroup import AttemptCgroup
from trainwatch.actions.credentials import Identity
from trainwatch.actions.jobenv import job_argv, job_env
from trainwatch.actions.logfollow import LogFollower
from trainwatch.actions.tree import JobTree
from trainwatch.config import Job
from trainwatch.state import statewrites
from trainwatch.state.ownership import set_mode

log = logging.getLogger("trainwatch")
# The watcher that takes the attempt down if `trainwatch run` is SIGKILLed
# (see _watch): it reads its stdin, a pipe only we hold; a line from us stands
# it down, end of file without one means we are gone.
# With a cgroup ($0): kill every process in it and remove it once empty.
_WATCH_CGROUP = ('read -r x || { echo 1 > "$0/cgroup.kill"; for i in 1 2 3 4 5 6 7 8 9 10; do '
                 'rmdir "$0" 2>/dev/null && break; sleep 1; done; }')
# Without one ($0: the leader's pid, its process group and session id): one
# snapshot of /proc ("pid ppid pgrp sid" of each live process), the members are
# those in that session or group and, to a fixed point, the children of a
# member; then SIGKILL to the group and to each member. Again (up to 5 passes)
# for what was forked meanwhile.
_WATCH_SESSION = r"""read -r x && exit 0
n=$0
case $n in ''|*[!0-9]*|0|1) exit 2;; esac
for i in 1 2 3 4 5; do
  s=
  for d in /proc/[0-9]*; do
    { read -r l < "$d/stat"; } 2>/dev/null || continue
    set -f; set -- ${l##*") "}; set +f
    [ "$1" = Z ] || s="$s${d#/proc/} $2 $3 $4
"
  done
  m=" "
  while read -r p pp g sid; do
    [ "$g" = "$n" ] || [ "$sid" = "$n" ] && m="$m$p "
  done <<E
$s
E
  k=
  while [ "$k" != "$m" ]; do
    k=$m
    while read -r p pp g sid; do
      case $m in *" $p "*) ;; *" $pp "*) m="$m$p ";; esac
    done <<E
$s
E
  done
  [ "$i" = 1 ] && kill -s KILL -- "-$n" 2>/dev/null
  [ "$m" = " " ] && exit 0
  kill -s KILL $m 2>/dev/null
  [ "$i" = 1 ] || sleep 1
done
"""
# pidfds of watchers stood down but not yet reaped (see reap_watchers).
_stood_down: list[int] = []


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
            self._watcher = (_watch(_WATCH_CGROUP, cgroup.path) if cgroup is not None
                             else _watch(_WATCH_SESSION, str(self.pid)))

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
            _stand_down(*self._watcher)
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


def _watch(script: str, target: str) -> tuple[int, int, int | None] | None:
    """Start the watcher that ends the attempt if we die without closing it
    (SIGKILL): ``target`` is its cgroup, else the leader's pid. Returns (pid,
    fd to stand it down, pidfd to reap it by) or None when it cannot start.

    Without a cgroup it reaches the leader's process group and session and
    what descends from a member still alive then: a process that left both
    session and group (setsid) and whose parent is gone too (the leader dies
    with us: PR_SET_PDEATHSIG) is out of reach, as is what was forked between
    its last pass and its kill. Strangers: a process group or session id is
    the leader's pid, and a pid is not reused while any process still has it as
    its group or session id, so the group and session it kills are the job's.
    The residual risk: the leader is reaped by init and every member is gone
    before the watcher runs, and the pid counter wraps round to the leader's
    pid for a new group or session leader in that moment. A member's pid read
    from /proc may likewise be freed and reused before the kill (the usual
    race of kill(2), milliseconds wide, after pid_max forks)."""
    reap_watchers()  # those stood down by earlier attempts
    try:
        r, w = os.pipe2(os.O_CLOEXEC)
    except OSError:
        return None
    try:
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            # posix_spawn, not Popen: no Popen bookkeeping may ever wait on this
            # pid after it was reaped (by us, or the supervisor's stray reaper).
            pid = os.posix_spawn("/bin/sh", ["/bin/sh", "-c", script, target], {},
                                 file_actions=[(os.POSIX_SPAWN_DUP2, r, 0),
                                               (os.POSIX_SPAWN_DUP2, null, 1),
                                               (os.POSIX_SPAWN_DUP2, null, 2)],
                                 setsid=True)
        finally:
            os.close(null)
    except OSError as e:
        os.close(w)
        log.warning("cannot start the watcher that ends the job with trainwatch: %s",
                    e.strerror or e)
        return None
    finally:
        os.close(r)
    pidfd: int | None = None
    # Our unreaped child: the pid is its own. Reaping through the pidfd can never
    # take the status of another child (a new leader) given the pid after it.
    with contextlib.suppress(OSError, AttributeError):
        pidfd = os.pidfd_open(pid)
    return pid, w, pidfd


def _stand_down(pid: int, w: int, pidfd: int | None) -> None:
    """Tell the watcher we closed the attempt: it exits at once, killing nothing."""
    with contextlib.suppress(OSError):
        os.write(w, b"exit\n")
    os.close(w)
    if pidfd is not None:
        _stood_down.append(pidfd)
    reap_watchers()


def reap_watchers() -> None:
    """Reap the stood-down watchers that have exited (WNOHANG); one still
    exiting is tried again at the next close() or start. Without a pidfd (an
    old kernel) the supervisor's stray reaper reaps it."""
    for fd in list(_stood_down):
        try:
            if os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG) is None:
                continue  # not yet exited
        except ChildProcessError:
            pass  # reaped already (the supervisor's stray reaper)
        except OSError:
            pass  # cannot wait on it: leave it to the stray reaper
        _stood_down.remove(fd)
        os.close(fd)
