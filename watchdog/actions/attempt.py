"""One launch of a job: its argv and environment, its process, its output.

The job gets its own session (so its process group id is its pid), its own
cgroup where we may create one (tree.py, cgroup.py), the credentials of its
user and group (credentials.py), the environment of DESIGN.md, and pipes for
stdout and stderr that the supervisor copies into a per-attempt log file in
``state_dir`` (and through to our own stdout and stderr in ``trainwatch run``,
passthrough.py). Neither a log that cannot be written nor a reader that
stopped reading ever stops the launch or the loop: the output is dropped and
counted.

The leader is not reaped when it exits: its exit status is read with
``WNOWAIT`` and the zombie keeps its pid (and so the process group and
session id) reserved until close(), after the rest of the tree is gone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from trainwatch.actions import credentials, passthrough
from trainwatch.actions.cgroup import AttemptCgroup
from trainwatch.actions.credentials import Identity
from trainwatch.actions.tree import JobTree
from trainwatch.config import Job
from trainwatch.state import statewrites
from trainwatch.state.ownership import set_mode

_CHUNK = 65536
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


def job_env(
    job: Job, socket: str, attempt: int, resume_from: str | None, base: Mapping[str, str],
    gpus: list[int] | None = None, ident: Identity | None = None,
) -> dict[str, str]:
    env = dict(base)
    credentials.env_for(ident, env, job.env)
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
    """A running (or finished) attempt. Owns the Popen, the pidfd, the cgroup and the log."""

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
    ) -> None:
        self.job = job
        self.number = number
        self.resume_from = resume_from
        self.resumed_step = resumed_step
        self.passthrough = passthrough
        self.dropped = 0  # bytes of output lost (log not written, or passthrough full)
        self.log_errors = 0  # failed opens, writes and closes of the log
        self._warned: set[str] = set()
        self.gpus = gpus
        self.closed = False
        ident = credentials.resolve(job.user, job.group)
        self.log_path = log_dir / f"attempt-{number}-{int(time.time())}.log"
        self.log_fd = self._open_log(log_dir, ident)
        argv = job_argv(job, resume_from, gpus)
        env = job_env(job, socket, number, resume_from, os.environ, gpus, ident)
        cgroup = AttemptCgroup.create(job.name, number)
        try:
            self.proc = self._spawn(argv, env, cgroup, ident, die_with_parent, umask)
        except BaseException:
            if cgroup is not None:
                cgroup.close()
            if self.log_fd is not None:
                os.close(self.log_fd)
            raise
        if cgroup is not None and cgroup.procs_fd is None:
            cgroup = None  # _spawn fell back: the cgroup could not be joined
        self.started = time.monotonic()
        self._alive_at = self.started
        self.started_wall = time.time()
        self.pid = self.proc.pid
        self.tree = JobTree(job.name, self.pid, cgroup)
        self.cgroup = cgroup
        self.pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            self.pidfd = os.pidfd_open(self.pid)
        self.returncode: int | None = None
        self.exited_at: float | None = None
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.pipes: dict[int, int] = {self.proc.stdout.fileno(): 1, self.proc.stderr.fileno(): 2}
        for fd in self.pipes:
            os.set_blocking(fd, False)
        # (pid, write end of its stdin, pidfd): see _watch.
        self._watcher: tuple[int, int, int | None] | None = None
        if die_with_parent:
            self._watcher = (_watch(_WATCH_CGROUP, cgroup.path) if cgroup is not None
                             else _watch(_WATCH_SESSION, str(self.pid)))

    def _spawn(self, argv: list[str], env: dict[str, str], cgroup: AttemptCgroup | None,
               ident: Identity | None, die_with_parent: bool,
               umask: int) -> subprocess.Popen[bytes]:
        for cg in (cgroup, None) if cgroup is not None else (None,):
            fd = cg.procs_fd if cg is not None else None
            try:
                return subprocess.Popen(
                    argv, env=env, cwd=self.job.workdir,
                    preexec_fn=credentials.child_setup(fd, ident, die_with_parent),
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True, close_fds=True, umask=umask,
                )
            except subprocess.SubprocessError:
                if cg is None:
                    who = f"uid {ident.uid} gid {ident.gid}" if ident else "its credentials"
                    raise OSError(errno.EPERM, f"the job's process could not take {who}",
                                  argv[0]) from None
                log.warning("job %s: cannot join cgroup %s: membership falls back to the "
                            "process tree", self.job.name, cg.path)
                cg.close()
        raise AssertionError("unreachable")

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
        terminal, `| sleep`) drops the output and counts it."""
        if self.log_fd is None:
            self.dropped += len(data)
        else:
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self.log_fd, view):]
            except OSError as e:
                self._log_failed("write", e)
                self.dropped += len(view)
        if self.passthrough:
            self.dropped += passthrough.to(self.pipes[fd]).write(data)

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
        """The leader's returncode (negative: signal) once it has exited. It is
        left a zombie (see the module's docstring); close() reaps it."""
        if self.returncode is not None:
            return self.returncode
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            # Reaped by someone else: its status is lost, and its pid may be reused.
            self.tree.leader_reaped = True
            info = None
            code = 0
        else:
            if info is None:
                self._alive_at = time.monotonic()
                return None
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        now = time.monotonic()
        self.returncode = code
        # With a pidfd we are woken at the exit itself; when polling, the exit
        # happened after the last poll that saw it alive: take that, so the
        # ledger's detection latency includes the polling delay.
        self.exited_at = now if self.pidfd is not None else self._alive_at
        self.proc.returncode = code  # keep Popen from ever waiting on the pid itself
        return code

    @property
    def watcher_pid(self) -> int | None:
        """The pid of the watcher that ends the attempt with us (None: none, or stood down)."""
        return None if self._watcher is None else self._watcher[0]

    @property
    def holds_pid(self) -> bool:
        """True while the leader's pid is ours (alive, or an unreaped zombie):
        nobody else (the supervisor's stray reaper) may reap it."""
        return not self.closed and not self.tree.leader_reaped

    def close(self) -> None:
        """After the tree is gone: drain the output, reap the leader, remove the cgroup."""
        if self.closed:
            return
        for fd in list(self.pipes):
            self._drain(fd)  # whatever is still buffered goes to the log first
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        self.pipes.clear()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.poll_exit() is not None and not self.tree.leader_reaped:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, os.WNOHANG)
            self.tree.leader_reaped = True
        self.closed = True
        if not self.tree.close() and self.cgroup is not None:
            log.warning("job %s: cgroup %s still holds processes; left in place",
                        self.job.name, self.cgroup.path)
        if self._watcher is not None:
            _stand_down(*self._watcher)
            self._watcher = None
        if self.log_fd is not None:
            try:
                os.close(self.log_fd)
            except OSError as e:  # a network file system may report a lost write here
                self._log_failed("close", e)
            self.log_fd = None


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
