"""A rank's ``attach`` request on the control socket (host/operations.py).

The claim is proven off the loop by the Registry (register.py); the request is
answered "pending" until it is. Once proven, the job's runner is found, or made
from the ``slurm.job`` template (config/slurmwatch.py) as ``slurm-<job id>``
running as the proven owner, and the rank's task is taken into the attempt of
its run: Slurm's restart count, which every node agrees on, is the attempt's
number. Only what the proof established is used (the owner's uid, the task's
pid and start time, the restart count); the claim's other fields are the
user's word: a checkpoints folder is read only in the job's hands, as its user.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import stat
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from trainwatch.actions import attempt
from trainwatch.actions.launch import begin_attempt
from trainwatch.config.schema import Job, SlurmWatch
from trainwatch.lifecycle import respond
from trainwatch.privsep.access import Peer, Refused
from trainwatch.slurm import command, readopt, requeue
from trainwatch.slurm.command import NO_SLURM, Slurm
from trainwatch.slurm.proof import Proven
from trainwatch.slurm.register import RETRY
from trainwatch.slurm.stepattempt import StepAttempt
from trainwatch.types import JobState
from trainwatch.watch import exits

if TYPE_CHECKING:
    from collections.abc import Sequence

    from trainwatch.config import Config
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.slurm.register import Registry

log = logging.getLogger("trainwatch")

_LIVE = (JobState.STARTING, JobState.RUNNING)
_PROVEN = tuple(f.name for f in dataclasses.fields(Proven))


class Hosting(Protocol):
    """What the attach op needs of the daemon that answers it (host/daemon.py)."""

    @property
    def config(self) -> Config: ...
    @property
    def registry(self) -> Registry | None: ...  # None: no slurm: section
    @property
    def runners(self) -> Sequence[Runner]: ...
    def add_runner(self, config: Config, j: Job) -> Runner: ...


def name_of(job: int) -> str:
    return f"slurm-{job}"


def answer(sup: Hosting, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
    """The reply to one attach request (register.py's, plus where to beat once proven)."""
    reg, settings = sup.registry, sup.config.slurm
    if reg is None or settings is None:
        raise ValueError(NO_SLURM)
    reply: dict[str, Any] = reg.answer(args, peer)
    if not reply.get("proven"):
        return reply
    proven = Proven(**{k: reply[k] for k in _PROVEN})
    r = _runner(sup, settings, proven, args)
    a = join(r, proven, command.for_settings(settings))
    if a is None:
        return {"pending": True, "retry": RETRY}
    readopt.remember(r, args, proven)  # for a daemon that starts while the rank runs
    return {**reply, "name": r.job.name, "socket": r.socket_path, "ring_dir": a.ring_dir,
            "attempt": a.number, "resume_from": a.resume_from, "resumed_step": a.resumed_step}


def _runner(sup: Hosting, settings: SlurmWatch, proven: Proven,
            args: dict[str, Any]) -> Runner:
    name = name_of(proven.job)
    for r in sup.runners:
        if r.job.name == name:
            if r.job.user != str(proven.uid):  # a job id reused by another owner
                raise Refused(f"job {proven.job}: watched here as another user's")
            return r
    r = sup.add_runner(sup.config, _job(settings.job, name, proven, args))
    log.info("job %s: attached (Slurm job %d, owner uid %d, node %s)", name, proven.job,
             proven.uid, proven.node)
    return r


def _job(template: Job, name: str, proven: Proven, args: dict[str, Any]) -> Job:
    ckpt = template.checkpoints
    d = args.get("checkpoints_dir")
    if ckpt.dir is None and isinstance(d, str) and os.path.isabs(d) and len(d) <= 4096 \
            and "\0" not in d:
        ckpt = replace(ckpt, dir=os.path.normpath(d))
    argv0 = args.get("argv0")
    shown = (argv0[:256],) if isinstance(argv0, str) and argv0 and "\0" not in argv0 \
        else template.command  # shown only (status); never run
    return replace(template, name=name, command=shown, user=str(proven.uid),
                   checkpoints=ckpt, slurm=proven.job)


def join(r: Runner, proven: Proven, slurm: Slurm) -> StepAttempt | None:
    """The attempt of the proven rank's run, begun here if it is the first of its
    run on this node; the run before it is ended first (Slurm requeued the job,
    or its next srun began). None: the run before is still being stopped (the
    rank asks again)."""
    a = r.attempt
    if isinstance(a, StepAttempt) and not a.closed:
        if a.number > proven.restarts:
            raise Refused(f"job {proven.job}: run {proven.restarts} was requeued already")
        if a.number == proven.restarts and a.slurm_step == proven.step:
            a.add(proven)
            return a
        # Its tasks are gone or going: a requeue (Slurm's SIGTERM ended them), or
        # the job's next step (a clean end of this one).
        a.ended(0 if a.number == proven.restarts else -int(signal.SIGTERM))
        if r.state in _LIVE:
            respond.act_on(r, exits.check(r))
    if r.state is JobState.STOPPING or not requeue.settled(r):
        return None
    r.number = proven.restarts
    cp = r.catalog.last_good()
    path, step = (cp.path, cp.step) if cp is not None else (None, None)
    reached = None
    if (rec := requeue.decided(r, proven.restarts)) is not None:  # every node's choice
        reached = rec.reached
        path, step = rec.resume_path, rec.resume_step
        cp = next((e for e in r.catalog.known() if e.step == step and e.path == path), None)
    rings = ring_folder(r, proven)
    a = StepAttempt.attach(r.job, proven, path, step, rings, slurm)
    begin_attempt(r, a, cp, "attached", reached)
    return a


def ring_folder(r: Runner, proven: Proven) -> str | None:
    """The run's folder for its ranks' beat rings, in run_dir, the owner's alone
    (0700). One a daemon before this one made is kept, rings and all (their
    writers run on); None (beats come as datagrams) when it cannot be made."""
    d = attempt.ring_dir(r.socket_path, r.job.name, proven.restarts)
    try:
        st = os.lstat(d)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == proven.uid \
                and stat.S_IMODE(st.st_mode) == 0o700:
            return d
        shutil.rmtree(d) if stat.S_ISDIR(st.st_mode) else os.unlink(d)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("job %s: cannot reuse %s (%s): beats come as datagrams", r.job.name, d,
                    e.strerror or e)
        return None
    try:
        os.mkdir(d, 0o700)
        if os.geteuid() == 0:
            os.chown(d, proven.uid, -1, follow_symlinks=False)
    except OSError as e:
        log.warning("job %s: cannot create %s (%s): beats come as datagrams", r.job.name, d,
                    e.strerror or e)
        return None
    return d
