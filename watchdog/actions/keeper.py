"""The keeper: one small parent per attempt, so that the job outlives trainwatch
and its exit status is still known afterwards (conmon's idea).

Only a parent can wait for a process. The daemon starts the keeper (kept.py)
in its own session; the keeper starts the job's leader in another one and
waits for it. When the daemon dies (SIGKILL, upgrade, restart) the keeper is
re-parented to init and carries on; when the leader exits the keeper writes
the exit file (temp, fsync, rename) and exits, which wakes whoever holds a
pidfd of it.

Run as ``python -I -S /path/to/keeper.py JOB ATTEMPT`` (what kept.launch
does: no site, about 20 ms faster) or ``python -I -m
trainwatch.actions.keeper``. Its stdin carries one JSON spec (see _check),
its stdout and stderr are the job's log, and fd 3, when open, is a pipe back
to the daemon with two lines (text):

    pid <leader> <leader start ticks> <keeper start ticks>   right after fork
    ok <1|0: joined the cgroup>   once the leader has exec'd, or
    err <stage> <errno>           when it could not (nothing was exec'd)

Start times are ``starttime`` of /proc/<pid>/stat, clock ticks since boot:
unlike an epoch time they never move with the wall clock.

It imports only os, modules built into the interpreter, and keeperwire.py
(its JSON and files, with the same rule) beside it: ``signal``,
``json``, ``subprocess`` and this package's modules would cost 8 to 130 ms
each (enum, re, yaml); ctypes (7 ms) only for pdeathsig.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # not `signal`, which imports enum (8 ms)
import errno
import os
import sys
import time

if __package__:  # python -m trainwatch.actions.keeper
    from trainwatch.actions.keeperwire import dumps, loads, start_ticks, write_file
else:  # by path, isolated (-I): its own folder, for its one sibling
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: never shadows
    from keeperwire import (  # type: ignore[import-not-found,no-redef]
        dumps,
        loads,
        start_ticks,
        write_file,
    )

_PR_SET_PDEATHSIG = 1
_IGNORED = (_signal.SIGINT, _signal.SIGHUP, _signal.SIGTERM, _signal.SIGPIPE)
_REPORT = 3  # fd of the pipe back to the daemon
_NOT_FOUND = 127  # the shell's codes: no such program; found but not runnable
_NOT_RUN = 126
_EXIT_TRIES = 5  # attempts at the exit file, a second apart (a full disk may clear)


def _quietly(f: object, *args: object) -> None:
    """f(*args), an OSError ignored (contextlib would cost 3 ms of startup)."""
    try:
        f(*args)  # type: ignore[operator]
    except OSError:
        return


def _say(line: str) -> None:
    """A line to the log (our stderr): only for what nobody else will learn."""
    _quietly(os.write, 2, f"trainwatch-keeper: {line}\n".encode(errors="replace"))


def _report(line: str) -> None:
    """To the daemon; run by hand (no fd 3) or with the daemon gone, the files say it all."""
    _quietly(os.write, _REPORT, line.encode())


def _check(spec: object) -> str | None:
    """What is wrong with the spec, in one line; None when it is fine."""
    if not isinstance(spec, dict):
        return "the spec is not a JSON object"
    want: dict[str, tuple[type, ...]] = {
        "argv": (list,), "env": (dict,), "cwd": (str, type(None)),
        "uid": (int, type(None)), "gid": (int, type(None)), "groups": (list, type(None)),
        "umask": (int,), "cgroup_procs": (str, type(None)), "pdeathsig": (bool,),
        "exit": (str,), "job": (str,), "attempt": (int,), "parent": (int, type(None)),
        "cwd_inherited": (bool, type(None)),
    }
    for key, types in want.items():
        if key not in spec and type(None) in types:
            continue
        v = spec.get(key)
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            return f"{key!r} is missing or not a {' or '.join(t.__name__ for t in types)}"
    if not spec["argv"] or not all(isinstance(a, str) for a in spec["argv"]):
        return "'argv' must be a non-empty list of strings"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in spec["env"].items()):
        return "'env' must map strings to strings"
    if spec.get("groups") is not None and not all(
            isinstance(g, int) and not isinstance(g, bool) for g in spec["groups"]):
        return "'groups' must be a list of integers"
    if not os.path.isabs(spec["exit"]):
        return "'exit' must be an absolute path"
    return None


def _pdeathsig() -> object:
    """libc's prctl, to ask for SIGKILL when our parent dies."""
    import ctypes  # 7 ms: only in the foreground mode that needs it

    return ctypes.CDLL(None, use_errno=True).prctl


class _Plan:
    """What the leader does between fork and exec (from a checked spec)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None, uid: int | None,
                 gid: int | None, groups: list[int] | None, umask: int, procs: int | None,
                 keeper: int, prctl: object) -> None:
        self.argv, self.env, self.cwd, self.umask = argv, env, cwd, umask
        self.uid, self.gid, self.groups = uid, gid, groups
        self.procs, self.keeper, self.prctl = procs, keeper, prctl
        # No workdir: the job keeps the folder it inherits from us at fork (the
        # daemon's), never entered as the job's user (who may not be able to).
        self.cwd_inherited = False
        # Where to look for the program: the job's PATH, as subprocess and
        # os.execvpe do, computed here because the child may import nothing
        # (execvpe does: the job's user may not even be able to read our stdlib).
        if "/" in argv[0]:
            self.paths = [argv[0]]
        else:
            dirs = env.get("PATH", os.defpath).split(os.pathsep)
            self.paths = [os.path.join(d, argv[0]) for d in dirs]

    def execute(self) -> None:
        """exec the first program found; else raise the first error that is not
        "no such file" (e.g. EACCES), or the last one."""
        first: OSError | None = None
        last: OSError = OSError(errno.ENOENT, "no PATH")
        for path in self.paths:
            try:
                os.execve(path, self.argv, self.env)
            except OSError as e:
                last = e
                if first is None and e.errno not in (errno.ENOENT, errno.ENOTDIR):
                    first = e
        raise first or last


def _child(plan: _Plan, w: int) -> None:
    """Between fork and exec, in the leader. Never returns: execs or _exits.
    Imports nothing: once it is the job's user it may not read our stdlib.
    Order: cgroup (only root may write there), groups, gid, uid, then pdeathsig
    (a credential change clears it), umask, and the working folder as the job's
    user (as systemd's WorkingDirectory= does)."""
    stage = "setsid"
    try:
        os.setsid()
        if plan.procs is not None:
            try:
                os.write(plan.procs, b"0")  # "0": the writing process itself
            except OSError as e:
                os.write(w, b"cgroup %d\n" % (e.errno or 0))  # not fatal: runs without
        stage = "setgroups"
        if plan.groups is not None:
            os.setgroups(plan.groups)
        stage = "setgid"
        if plan.gid is not None:
            os.setresgid(plan.gid, plan.gid, plan.gid)
        stage = "setuid"
        if plan.uid is not None:
            os.setresuid(plan.uid, plan.uid, plan.uid)
        stage = "pdeathsig"
        if plan.prctl is not None:
            plan.prctl(_PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)  # type: ignore[operator]
            if os.getppid() != plan.keeper:
                os._exit(1)  # the keeper died before we asked to die with it
        if plan.umask >= 0:
            os.umask(plan.umask)
        stage = "cwd"
        if plan.cwd is not None and not plan.cwd_inherited:
            os.chdir(plan.cwd)
        for sig in (*_IGNORED, _signal.SIGXFSZ):  # an ignored signal stays ignored across exec
            _signal.signal(sig, _signal.SIG_DFL)
        stage = "exec"
        plan.execute()
    except OSError as e:
        os.write(w, f"err {stage} {e.errno or errno.EINVAL}\n".encode())
    except BaseException:  # e.g. ValueError: too many groups
        os.write(w, f"err {stage} {errno.EINVAL}\n".encode())
    finally:
        os._exit(_NOT_RUN)


def _error(stage: str, err: int, plan: _Plan) -> tuple[int, str]:
    """The exit file's returncode and one-line reason for a job that never ran."""
    what = os.strerror(err)
    if stage == "exec":
        code = _NOT_FOUND if err in (errno.ENOENT, errno.ENOTDIR) else _NOT_RUN
        return code, f"cannot run {plan.argv[0]}: {what}"
    if stage in ("setgroups", "setgid", "setuid"):
        return _NOT_RUN, (f"cannot take the job's credentials (uid {plan.uid} gid "
                          f"{plan.gid}): {stage}: {what}")
    return _NOT_RUN, f"cannot start the job: {stage}: {what}"


def _exit_file(spec: dict[str, object], record: dict[str, object]) -> int:
    """Write the exit file, retrying a few times; 0 once written, else 1."""
    path = str(spec["exit"])
    text = dumps({**record, "job": spec["job"], "attempt": spec["attempt"]})
    for i in range(_EXIT_TRIES):
        try:
            write_file(path, text)
            return 0
        except OSError as e:
            if i == _EXIT_TRIES - 1:
                _say(f"cannot write the exit file {path}: {e.strerror or e} "
                     f"(job's returncode {record.get('returncode')})")
            else:
                time.sleep(1.0)
    return 1


def main() -> int:
    # Outlive the daemon and its terminal. launch() spawns us with these
    # blocked, so none can arrive before they are ignored.
    for sig in _IGNORED:
        _signal.signal(sig, _signal.SIG_IGN)
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, _IGNORED)
    _quietly(os.set_inheritable, _REPORT, False)  # the job must not hold the daemon's pipe
    os.closerange(_REPORT + 1, 1 << 20)  # anything the daemon leaked (close_range(2))
    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    problem: str | None
    try:
        spec = loads(b"".join(chunks).decode())
    except (ValueError, UnicodeDecodeError) as e:
        spec, problem = None, f"the spec is not JSON: {e}"
    else:
        problem = _check(spec)
    if problem is not None or not isinstance(spec, dict):
        _say(f"bad spec: {problem}")
        _report("err spec 22\n")
        return 2
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # the job's stdin
    os.close(null)
    me = os.getpid()
    prctl = _pdeathsig() if spec["pdeathsig"] else None
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)  # type: ignore[operator]
        if spec.get("parent") is not None and os.getppid() != spec["parent"]:
            _report("err parent 0\n")
            return 1  # trainwatch run died before we asked to die with it
    procs = None
    cgroup = spec.get("cgroup_procs") is not None
    if cgroup:
        try:
            procs = os.open(spec["cgroup_procs"], os.O_WRONLY | os.O_CLOEXEC)
        except OSError as e:
            cgroup = False
            _say(f"cannot join cgroup {spec['cgroup_procs']}: {e.strerror}; running without")
    plan = _Plan(spec["argv"], spec["env"], spec.get("cwd"), spec.get("uid"), spec.get("gid"),
                 spec.get("groups"), spec["umask"], procs, me, prctl)
    plan.cwd_inherited = bool(spec.get("cwd_inherited"))
    r, w = os.pipe()  # close-on-exec: end of file without a line means exec'd
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(plan, w)
    os.close(w)
    if procs is not None:
        os.close(procs)
    os.chdir("/")  # never pin a mount for the job's lifetime
    leader_ticks, my_ticks = start_ticks(pid), start_ticks("self")
    _report(f"pid {pid} {leader_ticks} {my_ticks}\n")
    said = b""
    while chunk := os.read(r, 4096):
        said += chunk
    os.close(r)
    failed = None
    for line in said.decode(errors="replace").splitlines():
        word = line.split()
        if word[:1] == ["cgroup"]:
            cgroup = False
            _say(f"cannot join cgroup {spec['cgroup_procs']}: "
                 f"{os.strerror(int(word[1]))}; running without")
        elif word[:1] == ["err"] and len(word) == 3:
            failed = word[1], int(word[2])
    if failed is not None:
        os.waitpid(pid, 0)
        _report(f"err {failed[0]} {failed[1]}\n")
        _quietly(os.close, _REPORT)
        code, why = _error(*failed, plan)
        _say(why)
        return _exit_file(spec, {"pid": pid, "keeper": me, "returncode": code,
                                 "exited_at": time.time(), "error": why})
    _report(f"ok {int(cgroup)}\n")
    _quietly(os.close, _REPORT)
    hz = os.sysconf("SC_CLK_TCK")
    try:
        write_file(spec["exit"] + ".start", dumps({
            "keeper": me, "keeper_start": my_ticks / hz, "pid": pid,
            "leader_start": leader_ticks / hz, "cgroup": cgroup, "at": time.time(),
            "boot_id": boot_id(), "job": spec["job"], "attempt": spec["attempt"]}))
    except OSError as e:
        _say(f"cannot write the start file: {e.strerror or e}")
    # WNOWAIT: the status is recorded at once, but without a cgroup the zombie is
    # held until no process of its session or group is left, so that their id (its
    # pid) stays the job's and the daemon can still prove who is a member.
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    assert info is not None  # without WNOHANG it waits
    code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    rc = _exit_file(spec, {"pid": pid, "keeper": me, "returncode": code,
                           "exited_at": time.time()})
    if not cgroup:
        _hold(pid)
    os.waitpid(pid, 0)
    return rc


def _hold(leader: int) -> None:
    """Until no live process has the leader's pid as its session or group id."""
    while True:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                fd = os.open(f"/proc/{name}/stat", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    stat = os.read(fd, 1024)
                finally:
                    os.close(fd)
            except OSError:
                continue
            f = stat[stat.rfind(b")") + 2:].split()
            if len(f) > 3 and f[0] not in (b"Z", b"X") and leader in (int(f[2]), int(f[3])):
                break
        else:
            return
        time.sleep(0.5)


def boot_id() -> str:
    """This boot's id: a start time from another boot names nobody."""
    try:
        fd = os.open("/proc/sys/kernel/random/boot_id", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return os.read(fd, 64).decode().strip()
    finally:
        os.close(fd)


def run() -> int:
    """main(), with a failure of our own (no fork: EAGAIN) said in one line."""
    try:
        return main()
    except OSError as e:
        _say(f"cannot start the job: {e.strerror or e}")
        _report(f"err keeper {e.errno or errno.EIO}\n")
        return 1


if __name__ == "__main__":
    sys.exit(run())
