"""What restarts a job: one interface, one implementation per engine, chosen
once per job from its config (job.py): the job's own process tree on this host
(local/), torchrun's agent for a job across hosts (multihost/), Slurm for an
attached job (slurm/). A Kubernetes engine would be a fourth folder beside them.

The lifecycle (respond.py, actions/launch.py, the watchers) asks its engine and
never names one: whether a rank's exit or a peer's restart is the engine's to
follow, whether a hang is for another host to name, how a decided restart is
carried out (end the workers and relaunch here, leave them to the agent, or
requeue), what a host short of GPUs does (end, leave the group, drain the node),
and how an attempt is started. As torch elastic's RendezvousHandler is to its
c10d, etcd and static back ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from trainwatch.actions.attempt import Attempt
    from trainwatch.config import Job
    from trainwatch.evidence.capture import Capture
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.types import Fault


class Engine(Protocol):
    """How one job is restarted. Each method takes the job's runner."""

    # --- while an attempt runs -------------------------------------------------
    def resumed_step(self, r: Runner) -> int | None:
        """The step the ranks running now resumed from (None: from scratch)."""

    def of_rounds_before(self, r: Runner, pid: int) -> bool:
        """``pid`` was a worker of a round before this one: its beats are not this
        round's."""

    def check(self, r: Runner, a: Attempt, now: float) -> bool:
        """A live attempt's tick, before the watchers: True while the engine's own
        part of a restart is under way (nothing else is judged meanwhile)."""

    def held(self, r: Runner, fault: Fault, now: float) -> bool:
        """A hang or stall another host is to name: not acted on here (yet)."""

    def wake(self, r: Runner, now: float) -> float | None:
        """When the loop must look at the engine's part again, if it has one."""

    def reported(self, r: Runner) -> None:
        """The job reported a checkpoint new to this host: the engine's other hosts
        are told (multihost/known.py), if it has any."""

    def probed(self, r: Runner, ranks: Mapping[int, bool]) -> Mapping[int, bool]:
        """This host read its silent ranks' stacks (rank -> inside a collective): the
        other hosts are told, and their ranks' last read comes back (probeshare.py)."""

    # --- a decided fault -------------------------------------------------------
    def short_of_gpus(self, r: Runner, fault: Fault, incident: int | None, fatal: bool,
                      capture: Capture | None) -> bool:
        """Fewer healthy GPUs are left than the job needs: True when the engine has
        stopped the job for it (ended it, or left the group to wait for a
        pre-flight); False to restart it all the same (the restart drains the node)."""

    def restart(self, r: Runner, fault: Fault, incident: int | None, reason: str,
                delay: float, charged: bool, capture: Capture | None,
                exclude_gpu: bool) -> None:
        """Carry out a decided restart (``charged``: it spent one of the budget;
        ``exclude_gpu``: the workers must leave a GPU)."""

    # --- launching ---------------------------------------------------------------
    def started_elsewhere(self, r: Runner) -> bool:
        """True when the engine, not trainwatch, starts the next attempt (the relaunch
        is looked at again later)."""

    def stay_out(self, r: Runner) -> bool:
        """A launch short of GPUs that waits in BACKOFF rather than ending the job."""

    def prepare(self, r: Runner, job: Job) -> tuple[Job, Mapping[str, str]] | None:
        """The job as this attempt starts it, and the variables it gets unless its
        environment has them; None when it cannot start (the job is FATAL)."""

    def waiting(self, r: Runner) -> str | None:
        """The BACKOFF reason while the engine holds the relaunch, if it does."""

    def relaunch_due(self, r: Runner, now: float) -> bool:
        """In BACKOFF: the relaunch is due."""
