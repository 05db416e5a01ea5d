"""A Slurm step's tasks as trainwatch sees them (StepTree), with real processes:
members by (pid, start time) and /proc parent links only, never a stranger,
and never a signal sent (Slurm owns and kills a step's tasks)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
import pytest
from conftest import wait_for
from trainwatch.actions.tree import JobTree, start_time
from trainwatch.slurm.step import StepTree
from trainwatch.sources.procstat import proc_stat

USER = 4321  # a datagram's uid that is not root's: root is believed whatever its pid


@dataclass
class Task:
    """A stand-in for an srun task: sh -> sh -> sleep (a child and a grandchild)."""

    proc: subprocess.Popen[bytes]
    start: int
    child: int
    grandchild: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def members(self) -> set[int]:
        return {self.pid, self.child, self.grandchild}


@pytest.fixture
def spawn() -> Iterator[Callable[[], Task]]:
    """Starts tasks; kills each and its descendants afterwards."""
    made: list[Task] = []
    kin: list[psutil.Process] = []

    def start() -> Task:
        # Neither sh execs its last command ("& wait", "; :"): three processes.
        p = subprocess.Popen(["sh", "-c", 'sh -c "sleep 300; :" & wait'])
        pp = psutil.Process(p.pid)
        kids = wait_for(lambda: len(pp.children(recursive=True)) >= 2 and
                        pp.children(recursive=True), what="the task's child and grandchild")
        kin.extend(kids)
        child = next(k.pid for k in kids if k.ppid() == p.pid)
        grandchild = next(k.pid for k in kids if k.ppid() == child)
        task = Task(p, start_time(p.pid) or 0, child, grandchild)
        made.append(task)
        return task

    try:
        yield start
    finally:
        for k in kin:
            with contextlib.suppress(psutil.Error):
                k.kill()  # psutil refuses a pid that another process holds now
        for t in made:
            if t.proc.poll() is None:
                t.proc.kill()
            t.proc.wait()


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A process outside every task: the tasks' sibling (also the test's child)."""
    p = subprocess.Popen(["sleep", "300"])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def _reap(t: Task) -> None:
    t.proc.kill()
    t.proc.wait()


def test_scan_finds_the_tasks_and_their_descendants_but_not_a_sibling(
        spawn: Callable[[], Task], stranger: subprocess.Popen[bytes]) -> None:
    """scan() is the live tasks and everything below them, nothing beside them."""
    a, b = spawn(), spawn()
    tree = StepTree("slurm-7", [(a.pid, a.start), (b.pid, b.start)])
    assert isinstance(tree, JobTree)
    assert tree.leader == a.pid
    members = tree.scan()
    assert members == a.members | b.members
    assert stranger.pid not in members and os.getpid() not in members
    assert tree.known == {pid: start_time(pid) for pid in members}


def test_owns_a_tasks_grandchild_but_not_a_stranger_nor_the_test_itself(
        spawn: Callable[[], Task], stranger: subprocess.Popen[bytes]) -> None:
    """owns() believes a task and its descendants, root, and nobody else."""
    a = spawn()
    tree = StepTree("slurm-7", [(a.pid, a.start)])
    assert tree.owns(a.grandchild, USER)
    assert tree.owns(a.grandchild, USER)  # again, from what it believed
    assert tree.owns(a.pid, USER) and tree.owns(a.child, USER)
    assert not tree.owns(stranger.pid, USER)
    assert not tree.owns(os.getpid(), USER)
    assert not tree.owns(1, USER)
    assert tree.owns(stranger.pid, 0)  # root is believed, as a JobTree does


def test_signals_are_never_sent(spawn: Callable[[], Task]) -> None:
    """signal(), signal_each() and reap() leave every member running and unstopped."""
    a = spawn()
    tree = StepTree("slurm-7", [(a.pid, a.start)])
    members = tree.scan()
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        tree.signal(sig, members)
        tree.signal_each(sig, members)
    assert tree.reap() == {}
    time.sleep(0.5)  # what a signal would have done, it would have done by now
    for pid in a.members:
        st = proc_stat(pid)
        assert st is not None and st[0] not in ("T", "t", "Z", "X"), (pid, st)
    assert a.proc.poll() is None
    assert tree.unproven == 0


def test_a_pid_with_another_start_time_is_no_member(
        spawn: Callable[[], Task]) -> None:
    """A task recorded with a start time its pid does not have (pid reuse) is never
    taken in, nor made the leader; a step with no task left is refused."""
    a, b = spawn(), spawn()
    tree = StepTree("slurm-7", [(a.pid, a.start + 1), (b.pid, b.start)])
    assert tree.tasks == {b.pid: b.start} and tree.leader == b.pid
    assert tree.scan() == b.members
    assert not tree.owns(a.pid, USER) and not tree.owns(a.grandchild, USER)
    assert not tree.add(a.pid, a.start - 1)
    assert tree.tasks == {b.pid: b.start}
    with pytest.raises(ValueError, match="no task"):
        StepTree("slurm-7", [(a.pid, a.start + 1)])


def test_an_exited_task_is_not_taken_in(spawn: Callable[[], Task]) -> None:
    """A task that has exited (a zombie not yet reaped, its start time still right)
    is not added."""
    a, b = spawn(), spawn()
    tree = StepTree("slurm-7", [(a.pid, a.start)])
    b.proc.kill()
    wait_for(lambda: (proc_stat(b.pid) or ("Z",))[0] == "Z", what="the task's zombie")
    assert not tree.add(b.pid, b.start)
    assert b.pid not in tree.tasks


def test_a_process_orphaned_when_its_task_ended_is_no_longer_believed(
        spawn: Callable[[], Task]) -> None:
    """Its grandchild is believed while the task runs; once the task and its child
    are killed (the grandchild goes to a subreaper or init), it is not."""
    a = spawn()
    tree = StepTree("slurm-7", [(a.pid, a.start)])
    assert tree.owns(a.grandchild, USER)
    os.kill(a.child, signal.SIGKILL)
    a.proc.kill()
    a.proc.wait()
    wait_for(lambda: (proc_stat(a.grandchild) or ("", 0))[1] != a.child,
             what="the grandchild to be reparented")
    assert proc_stat(a.grandchild) is not None  # still running
    assert not tree.owns(a.grandchild, USER)


def test_add_takes_in_a_later_task(spawn: Callable[[], Task]) -> None:
    """add() of a node's later rank makes it and its descendants members."""
    a, b = spawn(), spawn()
    tree = StepTree("slurm-7", [(a.pid, a.start)])
    assert not tree.owns(b.grandchild, USER)
    assert tree.scan() == a.members
    assert tree.add(b.pid, b.start)
    assert tree.tasks == {a.pid: a.start, b.pid: b.start}
    assert tree.owns(b.grandchild, USER)
    assert tree.scan() == a.members | b.members
    assert tree.leader == a.pid


def test_tasks_gone_once_every_task_has_exited(spawn: Callable[[], Task]) -> None:
    """tasks_gone() is false while a task runs, true once each is a zombie or gone."""
    a, b = spawn(), spawn()
    tree = StepTree("slurm-7", [(a.pid, a.start), (b.pid, b.start)])
    assert not tree.tasks_gone()
    _reap(a)
    assert not tree.tasks_gone()
    assert tree.tasks == {b.pid: b.start}  # a's pid lost its start time: forgotten
    b.proc.kill()
    wait_for(lambda: (proc_stat(b.pid) or ("Z",))[0] == "Z", what="the task's zombie")
    assert tree.tasks_gone()  # a zombie has exited
    assert tree.scan() == set()
    b.proc.wait()
    assert tree.tasks_gone()


def test_alive_is_empty_unless_awaiting_a_requeue(spawn: Callable[[], Task]) -> None:
    """alive() lists the members only while awaiting is set, so a stop ends at once."""
    a = spawn()
    tree = StepTree("slurm-7", [(a.pid, a.start)])
    assert tree.awaiting is False
    assert tree.alive() == set()
    tree.awaiting = True
    assert tree.alive() == a.members
    _reap(a)
    assert tree.alive() == set()


def test_a_requeue_is_awaited_only_until_its_deadline(
        spawn: Callable[[], Task], caplog: pytest.LogCaptureFixture) -> None:
    """await_end(s): alive() lists the members for s seconds; past them, members
    Slurm did not end are not waited for (one ERROR line), so a stop ends."""
    a = spawn()
    tree = StepTree("slurm-7", [(a.pid, a.start)])
    tree.await_end(60.0)
    assert tree.alive() == a.members
    tree.await_end(0.0)
    with caplog.at_level(logging.ERROR, logger="trainwatch"):
        assert tree.alive() == set()
        assert tree.alive() == set()
    said = [r.getMessage() for r in caplog.records if "waits for them no longer" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("job slurm-7: Slurm took the requeue"), said
    assert tree.scan() == a.members  # still there: Slurm's to end
    _reap(a)


def test_close_forgets_everything(spawn: Callable[[], Task]) -> None:
    """close() returns True; after it nothing is a member and nothing is added."""
    a, b = spawn(), spawn()
    tree = StepTree("slurm-7", [(a.pid, a.start)])
    tree.awaiting = True
    assert tree.owns(a.child, USER)
    assert tree.close() is True
    assert tree.scan() == set() and tree.alive() == set()
    assert not tree.owns(a.child, USER)
    assert not tree.add(b.pid, b.start)
    assert tree.tasks == {}


def test_a_step_needs_a_task() -> None:
    """A StepTree of no task is refused."""
    with pytest.raises(ValueError, match="at least one task"):
        StepTree("slurm-7", [])
