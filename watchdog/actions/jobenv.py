"""A job's environment and command line, as an attempt is started.

Whose environment a job starts from:

- ``trainwatch run`` in the foreground, the job running as the user who typed
  it: that user's own environment (their shell set up CUDA, conda, NCCL_* for
  the job), as any command they start would have.
- Every job of the daemon, and a job that ``trainwatch run`` starts as another
  user: a clean one, the way systemd starts a ``User=`` service: ``PATH`` (a
  sane default), the locale (``LANG``, ``LANGUAGE``, ``LC_*``) of the daemon,
  the job's user's ``HOME``, ``USER``, ``LOGNAME`` and ``SHELL``, then the
  variables the job's ``env_passthrough`` names (from the daemon's
  environment), its ``env``, and trainwatch's own. Never the rest of the
  daemon's: that is where its own credentials live (``AWS_SECRET_ACCESS_KEY``
  for remote snapshots), and a job's environment must follow from its config
  alone, not from the shell or unit that started the daemon. A root job of the
  daemon is no exception: systemd's services do not inherit the invoking shell
  either.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping

from trainwatch.config import Job
from trainwatch.privsep.credentials import Identity
from trainwatch.sources import ring

# systemd's variables for the main process only. A job launched by the daemon
# inherits them unless they are dropped: a job that speaks sd_notify itself
# would then write to the daemon's socket (and be refused by NotifyAccess=main).
SERVICE_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID",
               "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")

# systemd's PATH for the services it starts (the split-/usr variant).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_LOCALE = ("LANG", "LANGUAGE")  # and every LC_*
_OURS = ("TRAINWATCH_RESUME_FROM", "TRAINWATCH_SKIP_STEPS", ring.ENV)


def inherits(ident: Identity | None, foreground: bool) -> bool:
    """Does the job start from our own environment? Only in the foreground
    (``trainwatch run``), running as ourselves."""
    return foreground and (ident is None or ident.uid == os.geteuid())


def _account(ident: Identity | None) -> dict[str, str]:
    """HOME, USER, LOGNAME and SHELL of whom the job runs as (ourselves without a user)."""
    name, home, shell = None, None, None
    if ident is not None and ident.name is not None:
        name, home = ident.name, ident.home
    uid = ident.uid if ident is not None else os.geteuid()
    try:
        pw = pwd.getpwuid(uid)
        name, home, shell = name or pw.pw_name, home or pw.pw_dir, pw.pw_shell
    except KeyError:  # a uid without a passwd entry: what we know
        pass
    out = {"HOME": home, "USER": name, "LOGNAME": name, "SHELL": shell}
    return {k: v for k, v in out.items() if v}


def base(job: Job, ident: Identity | None, foreground: bool,
         ours: Mapping[str, str]) -> dict[str, str]:
    """The environment before the job's ``env`` and trainwatch's variables."""
    if inherits(ident, foreground):
        env = {k: v for k, v in ours.items() if k not in SERVICE_ENV}  # systemd's, not the job's
        if ident is not None and ident.name is not None:  # a user named: their account
            env.update(_account(ident))
        return env
    env = {"PATH": DEFAULT_PATH}
    env.update({k: v for k, v in ours.items() if k in _LOCALE or k.startswith("LC_")})
    env.update(_account(ident))
    env.update({k: ours[k] for k in job.env_passthrough if k in ours})
    return env


def path(job: Job, foreground: bool) -> str:
    """The PATH the job's program is looked up in (as exec will)."""
    if "PATH" in job.env:
        return job.env["PATH"]
    if foreground or "PATH" in job.env_passthrough:
        return os.environ.get("PATH", os.defpath)
    return DEFAULT_PATH


def job_env(
    job: Job, socket: str, attempt: int, resume_from: str | None, ours: Mapping[str, str],
    gpus: list[int] | None = None, ident: Identity | None = None,
    ring_dir: str | None = None, skip: tuple[int, int] | None = None,
    foreground: bool = True, defaults: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """``defaults``: set unless the job's environment has them (the job's own value
    wins: a job across hosts, config/torchrun.py)."""
    env = base(job, ident, foreground, ours)
    env.update(job.env)
    for k, v in (defaults or {}).items():
        env.setdefault(k, v)
    env["TRAINWATCH_SOCKET"] = socket
    env["TRAINWATCH_JOB"] = job.name
    env["TRAINWATCH_ATTEMPT"] = str(attempt)
    for k in _OURS:  # a value inherited from our own environment must not leak into a start
        env.pop(k, None)
    if ring_dir is not None:
        env[ring.ENV] = ring_dir
    if skip is not None:  # after a rollback past a loss anomaly: its steps' data
        env["TRAINWATCH_SKIP_STEPS"] = f"{skip[0]}:{skip[1]}"
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
