"""The stop protocol: SIGTERM (and SIGCONT, so that a stopped process can act
on it) to every process of the attempt, ``kill_grace`` to exit, SIGKILL to
what is left, and done only once every process is gone."""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

from trainwatch.actions.attempt import Attempt
from trainwatch.types import JobState

log = logging.getLogger("trainwatch")


@dataclass
class Stop:
    outcome: JobState  # the state once the tree is gone
    reason: str
    deadline: float  # SIGKILL from then
    delay: float = 0.0  # before a relaunch, when outcome is BACKOFF
    killed: bool = False


def begin(a: Attempt | None, observe_only: bool) -> None:
    """Ask every process of the attempt to exit. observe_only never signals."""
    if a is None or observe_only:
        return
    members = a.tree.scan()
    a.tree.signal(signal.SIGTERM, members)
    a.tree.signal(signal.SIGCONT, members)


def progress(s: Stop, a: Attempt | None, now: float, grace: float, observe_only: bool,
             job: str) -> bool:
    """True once nothing of the attempt is left (and its exit is collected);
    SIGKILL once past the deadline. observe_only cannot wait for the tree."""
    if a is None:
        return True
    a.poll_exit()
    a.tree.reap()
    alive = set() if observe_only else a.tree.alive()
    if not alive:
        return True
    if now >= s.deadline and not s.killed:
        log.warning("job %s: %d processes outlived kill_grace %gs: SIGKILL", job, len(alive),
                    grace)
        cg = a.tree.cgroup
        if cg is None or not cg.kill():  # cgroup.kill: every member at once, forks included
            a.tree.signal(signal.SIGKILL, alive)
        s.killed = True
    return False
