"""The processes of a Slurm job step's tasks on this node: a job trainwatch
attached to, did not launch, and never signals.

srun's tasks are slurmstepd's children; Slurm started them and Slurm kills
them (on a requeue, a cancel, the end of the step). trainwatch watches them
and acts only through scontrol. So a ``StepTree`` is a ``JobTree`` in what it
tells (who is a member, whose datagram to believe) and nothing in what it
does: ``signal`` and ``signal_each`` send nothing, ``reap`` reaps nothing.

Membership. The members are the step's proven tasks on this node (each a pid
and its start time, as ``proof.prove`` found them) and every live process that
descends from one, by /proc parent links. Never by session or process group:
those are slurmstepd's, and other steps' processes may share them. A task
whose pid no longer holds its recorded start time has exited (or a stranger
holds the pid now) and is forgotten, so pid reuse never makes a stranger a
member. Nothing is remembered beyond the tasks: a process that left the
tasks' tree (orphaned to a subreaper or init) is not a member any more.

Stopping. ``alive()`` is what a stop waits for. Slurm, not trainwatch, ends
these processes, so it is empty unless ``awaiting`` is set (a requeue is in
flight and the runner waits for the old tasks to go): a stop of the runner
otherwise ends at once, leaving the step to Slurm.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable

from trainwatch.actions.tree import JobTree
from trainwatch.slurm.proof import Stat, lineage, read_stat
from trainwatch.sources.procstat import proc_stat

log = logging.getLogger("trainwatch")

_ENDED = frozenset("ZXx")  # /proc/<pid>/stat states of a process that has exited


def _live_processes(proc: str = "/proc") -> dict[int, Stat]:
    """pid -> Stat of every live process now (zombies left out)."""
    out: dict[int, Stat] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            s = read_stat(int(name), proc)
            if s is not None:
                out[s.pid] = s
    return out


class StepTree(JobTree):
    """The tasks of one Slurm job step on this node and their descendants;
    watched, never signalled."""

    def __init__(self, job: str, tasks: Iterable[tuple[int, int]]) -> None:
        """``tasks``: (pid, start time in clock ticks after boot, as
        ``tree.start_time`` gives it) of each proven task, at least one; the
        first is the leader. One whose pid no longer has that start time is
        not taken in."""
        given = list(tasks)
        if not given:
            raise ValueError(f"a step of job {job} needs at least one task")
        leader, start = given[0]
        super().__init__(job, leader, None, leader_start=start)
        # The leader's session and process group are slurmstepd's, never ours: the
        # inherited checks that use them must never pass.
        self.leader_reaped = True
        self.known.clear()
        self._tasks: dict[int, int] = {}  # pid -> start time of each task not known gone
        # Set (await_end) while a requeue is in flight: alive() then lists the
        # members, so a stop waits for Slurm to end them, until a deadline.
        self.awaiting = False
        self.await_until = math.inf
        for pid, started in given:
            self.add(pid, started)
        if not self._tasks:
            raise ValueError(f"no task of job {job}'s step is still the process proven")
        self.leader = next(iter(self._tasks))  # a task taken in, never a refused pid

    # --- the tasks ----------------------------------------------------------------

    def add(self, pid: int, start: int) -> bool:
        """Take in a later task of the step (a node's later ranks register one by
        one). False (and not taken in) once closed, or when pid no longer has
        ``start``: it exited, or a stranger holds the pid."""
        if self.closed or pid <= 1:
            return False
        st = proc_stat(pid)
        if st is None or st[2] != start or st[0] in _ENDED:
            return False  # gone, a stranger's, or exited (a zombie not yet reaped)
        self._tasks[pid] = start
        return True

    @property
    def tasks(self) -> dict[int, int]:
        """pid -> start time of each task not yet known to have exited (a copy)."""
        return dict(self._tasks)

    def _live_tasks(self) -> dict[int, int]:
        """The tasks still running. One whose pid lost its start time is forgotten;
        a zombie is kept (its exit status is still readable) but is not live."""
        live: dict[int, int] = {}
        for pid, start in list(self._tasks.items()):
            st = proc_stat(pid)
            if st is None or st[2] != start:
                del self._tasks[pid]  # gone, or a stranger holds the pid now
            elif st[0] not in _ENDED:
                live[pid] = start
        return live

    def tasks_gone(self) -> bool:
        """Has every task exited (pid gone, a zombie, or another start time)?"""
        return not self._live_tasks()

    # --- who is ours ----------------------------------------------------------------

    def scan(self) -> set[int]:
        """The live tasks and every live process descending from one, by /proc
        parent links; remembers them (with their start times) in ``known``."""
        if self.closed:
            return set()
        tasks = self._live_tasks()
        if not tasks:
            self.known.clear()
            return set()
        procs = _live_processes()
        children: dict[int, list[int]] = {}
        for s in procs.values():
            children.setdefault(s.ppid, []).append(s.pid)
        # A task counts only as the process it was proven as (same start time, in
        # this very read of /proc).
        stack = [pid for pid, start in tasks.items()
                 if pid in procs and procs[pid].start == start]
        members: dict[int, int] = {}
        while stack:
            pid = stack.pop()
            if pid in members or pid == self._me:
                continue
            members[pid] = procs[pid].start
            stack.extend(children.get(pid, ()))
        self.known = members
        return set(members)

    def owns(self, pid: int, uid: int) -> bool:
        """Is a datagram from (pid, uid) one of this step's? Root is believed; else
        pid must be a live task or descend from one (start times checked)."""
        if uid == 0:
            return True
        if self.closed:
            return False
        # Walked each time, no verdict kept here (the heartbeat socket keeps its own
        # for a second): a process orphaned when its task ended is no member, and
        # a job forking many short-lived processes grows nothing. Each ancestor is
        # judged by the start time read in this same walk: a task's pid taken by a
        # stranger meanwhile does not match.
        chain = lineage(pid, read_stat)
        return bool(chain) and any(self._tasks.get(s.pid) == s.start for s in chain)

    # --- acting on it: never ------------------------------------------------------

    def signal_each(self, sig: int, pids: Iterable[int]) -> None:
        """Does nothing: Slurm owns and kills a step's tasks; trainwatch acts on an
        attached job only through scontrol (requeue, drain)."""

    def signal(self, sig: int, pids: Iterable[int]) -> None:
        """Does nothing: Slurm owns and kills a step's tasks; trainwatch acts on an
        attached job only through scontrol (requeue, drain)."""

    def reap(self) -> dict[int, int]:
        """Nothing to reap: the tasks are slurmstepd's children, not ours."""
        return {}

    def await_end(self, within: float) -> None:
        """A requeue is in flight: a stop waits up to ``within`` seconds for Slurm
        to end the members."""
        self.awaiting, self.await_until = True, time.monotonic() + within

    def alive(self) -> set[int]:
        """The live members while ``awaiting`` (a requeue is in flight), else none:
        a stop of the runner does not wait for processes Slurm ends, nor, past
        the deadline, for those Slurm did not end (one line says so)."""
        if not self.awaiting:
            return set()
        live = self.scan()
        if live and time.monotonic() >= self.await_until:
            self.awaiting = False
            log.error("job %s: Slurm took the requeue, yet %d of its processes on this node "
                      "still run: the stop waits for them no longer (Slurm's to end; the "
                      "next run's ranks attach as ever)", self.job, len(live))
            return set()
        return live

    def close(self) -> bool:
        """Forget every task and member. Always True: there is no cgroup to remove."""
        self.closed = True
        self._tasks.clear()
        self.known.clear()
        self._believed.clear()
        return True
