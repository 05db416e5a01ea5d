"""The daemon's side of an attempt's keeper (keeper.py): start it, find it again
after a restart of ours, and read the exit status it leaves behind.

What the daemon records of a launch is a ``Launched`` (JSON-serialisable:
``dataclasses.asdict`` and ``Launched.from_dict``). A pid alone names whoever
holds it now: a keeper or leader is identified by (pid, start time), the start
time being /proc/<pid>/stat's ``starttime`` in seconds since boot, plus the
boot's id. Unlike psutil's ``create_time()`` (boot time + that, an epoch time
that moves when the clock is stepped, e.g. by the first NTP sync) it is exact
and never moves, so it is compared exactly.

A pidfd of the keeper becomes readable when the keeper exits, which it does
right after writing the exit file; this holds for a keeper that is no longer
our child, too (pidfd_open(2)).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import select
import signal
import sys
import time
from dataclasses import dataclass, fields
from typing import Any, Literal

from trainwatch.actions.keeper import boot_id
from trainwatch.sources.procstat import proc_stat

KEEPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keeper.py")
_HZ = os.sysconf("SC_CLK_TCK")
_BLOCKED = {signal.SIGINT, signal.SIGHUP, signal.SIGTERM}  # until the keeper ignores them
_REPORT = 3


@dataclass(frozen=True)
class Launched:
    """One attempt's keeper and leader, as the daemon records them."""

    keeper: int
    keeper_start: float  # seconds since boot (/proc/<pid>/stat starttime / CLK_TCK)
    pid: int  # the job's leader
    leader_start: float
    cgroup: bool  # the leader joined the attempt's cgroup
    exit_path: str
    boot_id: str = ""  # "": unknown (then a start time alone identifies)

    @classmethod
    def from_dict(cls, d: object) -> Launched:
        """From what ``dataclasses.asdict`` gave (a state file); ValueError in one
        line when it is not that."""
        if not isinstance(d, dict):
            raise ValueError("a launch record must be a JSON object")
        kw: dict[str, Any] = {}
        for f in fields(cls):
            v = d.get(f.name, "" if f.name == "boot_id" else None)
            want = _FIELD_TYPES[str(f.type)]
            if not isinstance(v, want) or (isinstance(v, bool) and f.type != "bool"):
                raise ValueError(f"launch record: {f.name!r} is missing or not a {f.type}")
            kw[f.name] = v
        kw["keeper_start"] = float(kw["keeper_start"])
        kw["leader_start"] = float(kw["leader_start"])
        return cls(**kw)


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int, "float": (int, float), "bool": bool, "str": str}


def ticks(seconds: float) -> int:
    return round(seconds * _HZ)


def launch(spec: dict[str, Any], log_fd: int | None,
           timeout: float = 10.0) -> tuple[Launched, int | None]:
    """Start the keeper of one attempt and return once the job's leader has
    exec'd, with a pidfd of the keeper (None without pidfd support).

    ``spec`` is keeper.py's (argv, env, cwd, uid, gid, groups, umask,
    cgroup_procs, pdeathsig, exit, job, attempt); a relative ``exit`` and a
    ``cwd`` of None are made ours. ``log_fd`` becomes the keeper's and the job's
    stdout and stderr (None: /dev/null); the caller keeps and closes its own.

    Raises OSError when the job did not start: exec failed (errno, strerror,
    filename = argv[0]: FileNotFoundError for a missing program), the
    credentials could not be taken, or the keeper itself failed. The exit file
    says so too (returncode 127 or 126, "error"). When the exec has not
    finished within ``timeout`` seconds (a hung file system), the launch is
    returned anyway with ``cgroup`` as asked; the start file, written once it
    is known, and the exit file say what happened."""
    spec = dict(spec)
    spec["exit"] = os.path.abspath(spec["exit"])
    if spec.get("cwd") is None:
        spec["cwd"] = os.getcwd()  # the keeper itself moves to /
        spec["cwd_inherited"] = True
    if spec.get("pdeathsig"):
        spec["parent"] = os.getpid()
    data = json.dumps(spec).encode()
    argv = [sys.executable, "-I", "-S", KEEPER, str(spec["job"]), str(spec["attempt"])]
    fds: list[int] = []  # ours to close, whatever happens
    try:
        for _ in range(2):
            fds.extend(os.pipe())
        # The keeper's 0 to 3 are set from these by dup2, in order: no source
        # may be one of the targets (where our own 0 to 2 were closed).
        for i, fd in enumerate(fds):
            if fd < 4:
                fds[i] = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 4)
                os.close(fd)
        r0, w0, r3, w3 = fds
        out = log_fd
        if out is None or out < 4:
            src = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC) if out is None else out
            try:
                out = fcntl.fcntl(src, fcntl.F_DUPFD_CLOEXEC, 4)
            finally:
                if log_fd is None:
                    os.close(src)
            fds.append(out)
        # posix_spawn, not Popen: no Popen bookkeeping may ever wait on this pid.
        keeper = os.posix_spawn(
            sys.executable, argv, {},
            file_actions=[(os.POSIX_SPAWN_DUP2, r0, 0), (os.POSIX_SPAWN_DUP2, out, 1),
                          (os.POSIX_SPAWN_DUP2, out, 2), (os.POSIX_SPAWN_DUP2, w3, _REPORT)],
            setsid=True, setsigmask=_BLOCKED)
        pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            pidfd = os.pidfd_open(keeper)  # our unreaped child: surely the keeper
        for fd in (r0, w3):
            os.close(fd)
            fds.remove(fd)
        with contextlib.suppress(BrokenPipeError):  # it died: its report says why
            view = memoryview(data)
            while view:
                view = view[os.write(w0, view):]
        os.close(w0)
        fds.remove(w0)
        lines = _read_report(r3, time.monotonic() + timeout)
    finally:
        for fd in fds:
            os.close(fd)
    return _launched(spec, keeper, pidfd, lines), pidfd


def _read_report(fd: int, deadline: float) -> list[list[str]]:
    """The keeper's lines on fd 3, until it closes it or the deadline passes."""
    buf = b""
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    while (left := deadline - time.monotonic()) > 0:
        if not poll.poll(left * 1000):
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return [line.split() for line in buf.decode(errors="replace").splitlines()]


def _launched(spec: dict[str, Any], keeper: int, pidfd: int | None,
              lines: list[list[str]]) -> Launched:
    started = next((w for w in lines if w[:1] == ["pid"] and len(w) == 4), None)
    result = next((w for w in lines if w[:1] in (["ok"], ["err"])), None)
    if started is None or (result is not None and result[0] == "err"):
        _settle(keeper, pidfd)
        if pidfd is not None:
            os.close(pidfd)
        if result is None or len(result) != 3:
            raise OSError(errno.EIO, "the keeper failed before starting the job (see the "
                          "attempt's log)")
        stage, err = result[1], int(result[2])
        if stage == "exec":
            raise OSError(err, os.strerror(err), spec["argv"][0])
        if stage in ("setgroups", "setgid", "setuid"):
            raise OSError(err, f"the job's process could not take uid {spec.get('uid')} gid "
                          f"{spec.get('gid')}: {stage}: {os.strerror(err)}")
        raise OSError(err, f"the job could not start: {stage}: {os.strerror(err)}")
    cgroup = result[1] == "1" if result is not None else spec.get("cgroup_procs") is not None
    return Launched(keeper=keeper, keeper_start=int(started[3]) / _HZ, pid=int(started[1]),
                    leader_start=int(started[2]) / _HZ, cgroup=cgroup,
                    exit_path=spec["exit"], boot_id=boot_id())


def _settle(keeper: int, pidfd: int | None, wait: float = 5.0) -> None:
    """A keeper that failed writes its exit file and exits: reap it, so it leaves
    no zombie. SIGKILL when it has not within ``wait`` seconds."""
    if pidfd is None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(keeper, 0)
        return
    if not select.select([pidfd], [], [], wait)[0]:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED)


def _open_checked(pid: int, start: float, boot: str) -> int | Literal["gone"] | None:
    """A pidfd of pid if it is still the process that started at ``start``
    (opened first, then checked: a pid recycled in between fails the check)."""
    if boot and boot != boot_id():
        return "gone"
    fd: int | None = None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return "gone"
    except (OSError, AttributeError):
        pass  # no pidfd support: checked by start time alone
    st = proc_stat(pid)
    if st is None or st[2] != ticks(start):
        if fd is not None:
            os.close(fd)
        return "gone"
    return fd


def adopt(rec: Launched) -> int | Literal["gone"] | None:
    """After a restart of ours: a pidfd of the keeper when it still runs (or is
    an unreaped zombie), None when it runs but pidfds are unsupported, "gone"
    when it is gone or its pid is now another process's. Sends no signal."""
    return _open_checked(rec.keeper, rec.keeper_start, rec.boot_id)


def leader_pidfd(rec: Launched) -> int | None:
    """A pidfd of the job's leader, to signal it with (pidfd_send_signal); None
    when it is gone (or its pid another's) or pidfds are unsupported."""
    fd = _open_checked(rec.pid, rec.leader_start, rec.boot_id)
    return fd if isinstance(fd, int) else None


def read_exit(rec: Launched) -> dict[str, Any] | None:
    """The exit file of this launch (its "pid" is our leader), or None: not yet
    written, or unreadable. Has "returncode" (negative: killed by that signal),
    "exited_at", and "error" when the job never ran."""
    try:
        with open(rec.exit_path, "rb") as f:
            d = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("pid") != rec.pid:
        return None  # a leftover of another launch
    code = d.get("returncode")
    return d if isinstance(code, int) and not isinstance(code, bool) else None


def exit_status(rec: Launched) -> int | None:
    """The job's recorded returncode once the exit file exists, else None."""
    d = read_exit(rec)
    return None if d is None else int(d["returncode"])


def read_start(exit_path: str) -> Launched | None:
    """What the keeper wrote beside the exit file once the job had started: for a
    daemon that died before it recorded the launch. None when absent or bad."""
    try:
        with open(exit_path + ".start", "rb") as f:
            d = json.loads(f.read())
        return Launched.from_dict({**d, "exit_path": exit_path})
    except (OSError, ValueError, TypeError):
        return None


def reap(rec: Launched, pidfd: int | None) -> None:
    """Reap the keeper if it is our child and has exited (no zombie left);
    harmless when it is not our child, still runs, or was reaped already.
    Does not close ``pidfd``."""
    try:
        if pidfd is not None:
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
            return
        st = proc_stat(rec.keeper)
        if st is not None and st[2] == ticks(rec.keeper_start):  # still its pid: unreaped
            os.waitpid(rec.keeper, os.WNOHANG)
    except ChildProcessError:
        pass  # not ours to reap (a restart of ours), or reaped by someone else
