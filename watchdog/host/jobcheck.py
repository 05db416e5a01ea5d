"""Can a job start at all: its workdir, user and program, checked before anything
is launched (in the daemon, before any other job), so that a mistake in the
config is one clear line rather than a job that fails at every relaunch."""

from __future__ import annotations

import os
import shutil

from trainwatch.actions import jobenv
from trainwatch.config import ConfigError, Job
from trainwatch.privsep import credentials
from trainwatch.privsep.credentials import Identity


def check_command(job: Job, foreground: bool = True) -> None:
    """A missing program, workdir or user is the user's mistake: say so before
    anything starts (in the daemon, before any other job is launched)."""
    if job.workdir is not None and not os.path.isdir(job.workdir):
        raise ConfigError(f"jobs.{job.name}.workdir: {job.workdir}: no such directory")
    try:
        credentials.resolve(job.user, job.group)
    except KeyError:
        raise ConfigError(f"jobs.{job.name}.user: no such user {job.user!r}") from None
    except OSError as e:
        where = "group" if job.group is not None else "user"
        raise ConfigError(f"jobs.{job.name}.{where}: {e.strerror or e}") from None
    except (OverflowError, ValueError) as e:  # resolve's checks missed a way: still one line
        where, said = ("user", job.user) if job.user is not None else ("group", job.group)
        raise ConfigError(f"jobs.{job.name}.{where}: cannot resolve {said!r}: {e}") from None
    prog = job.command[0]
    env_path = jobenv.path(job, foreground)  # the PATH the job gets
    if "/" in prog:
        found = os.path.join(job.workdir or os.getcwd(), prog)
        ok = os.path.isfile(found) and os.access(found, os.X_OK)
    else:
        ok = shutil.which(prog, path=env_path) is not None
    if not ok:
        raise ConfigError(f"jobs.{job.name}.command: {prog}: cannot start: "
                          "No such file or directory (or not executable)"
                          + ("" if "/" in prog else f" in the job's PATH {env_path}"))


def _lookup(prog: str, path: str, cwd: str) -> str | None:
    f = os.path.join(cwd, prog) if "/" in prog else shutil.which(prog, path=path)
    return f if f is not None and os.path.isfile(f) and os.access(f, os.X_OK) else None


def _found(prog: str, path: str, cwd: str, ident: Identity | None) -> str | None:
    """Where ``prog`` resolves as exec would find it, looked up as ``ident``: in a
    child with that user's ids when this is root (root may execute what the user
    may not); None when it does not."""
    if ident is None or os.geteuid() != 0 or ident.uid == 0:
        return _lookup(prog, path, cwd)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the user's ids, the lookup, its answer, gone
        try:
            os.close(r)
            os.setgroups(list(ident.groups))
            os.setgid(ident.gid)
            os.setuid(ident.uid)
            os.write(w, (_lookup(prog, path, cwd) or "").encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read(65536).decode(errors="replace")
    os.waitpid(pid, 0)
    return out or None


def program_problems(job: Job) -> tuple[str | None, list[str]]:
    """For check-config: why the job's program cannot start under the daemon, looked
    up in its PATH as its user (None: it resolves), and what this host cannot tell.
    A job's user or workdir that this host lacks is a warning (the config may be
    for another host): the program is then looked up as the caller, and one not
    found is a warning too."""
    warn: list[str] = []
    ident = None
    try:
        ident = credentials.resolve(job.user, job.group)
    except (KeyError, OSError, OverflowError, ValueError):
        who = job.user if job.user is not None else job.group
        warn.append(f"jobs.{job.name}: no user or group {who!r} here: its program is "
                    "looked up as you")
    cwd = job.workdir or os.getcwd()
    if not os.path.isdir(cwd):
        warn.append(f"jobs.{job.name}.workdir: {cwd} is not a folder here")
        if "/" in job.command[0] and not job.command[0].startswith("/"):
            return None, warn  # relative to a folder this host lacks: not to be told here
    prog, path = job.command[0], jobenv.path(job, foreground=False)
    if _found(prog, path, cwd, ident) is not None:
        return None, warn
    who = f" as {ident.name or ident.uid}" if ident is not None else ""
    if "/" in prog:
        return f"jobs.{job.name}.command: {prog}: cannot start{who}: no such executable " \
               f"file (relative to {cwd})", warn
    mine = os.environ.get("PATH", os.defpath)
    if "PATH" not in job.env and (elsewhere := shutil.which(prog, path=mine)) is not None:
        warn.append(f"jobs.{job.name}.command: {prog} is found in your PATH ({elsewhere}), "
                    f"not in a daemon job's ({path}): `trainwatch run` starts it, the daemon "
                    "does not; give the job env: {PATH: ...} or an absolute path")
        return None, warn
    problem = f"jobs.{job.name}.command: {prog}: cannot start{who}: not found (or not " \
              f"executable) in the job's PATH {path}"
    if warn:  # this host lacks the job's user or workdir: the config may be another's
        return None, [*warn, f"{problem} (on this host)"]
    return problem, warn
