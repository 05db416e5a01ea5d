"""Can a job start at all: its workdir, user and program, checked before anything
is launched (in the daemon, before any other job), so that a mistake in the
config is one clear line rather than a job that fails at every relaunch."""

from __future__ import annotations

import os
import shutil

from trainwatch.actions import jobenv
from trainwatch.config import ConfigError, Job
from trainwatch.privsep import credentials


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
