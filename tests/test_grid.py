"""The loop's steady grid (lifecycle/job.py): a job that beats ticks, and has its
rings read, every second under trainwatch run and every two seconds under the
daemon (many jobs share its host); what must not wait for the grid (a hang's
deadline, the first look for ranks) still comes when it is due."""

from __future__ import annotations

import math
import os
import selectors
import sys

import pytest
from conftest import Workspace
from trainwatch.config import load
from trainwatch.host.daemon import Daemon
from trainwatch.host.supervisor import Supervisor
from trainwatch.lifecycle.job import JobRunner
from trainwatch.state.ledger import Ledger
from trainwatch.types import Beat, JobState


def _runner(ws: Workspace, clock: list[float], grid: float,
            heartbeat: dict[str, object] | None = None) -> JobRunner:
    job: dict[str, object] = {"command": [sys.executable, "-c", "pass"]}
    if heartbeat:
        job["heartbeat"] = heartbeat
    cfg = load(ws.config(job))
    r = JobRunner(cfg, cfg.jobs[0], Ledger(ws.state), selectors.DefaultSelector(),
                  clock=lambda: clock[0], grid=grid)
    r.state = JobState.RUNNING
    return r


def test_the_daemon_ticks_its_jobs_every_two_seconds_and_trainwatch_run_every_second() -> None:
    assert (Supervisor.grid, Daemon.grid) == (1.0, 2.0)


@pytest.mark.parametrize(("grid", "tick"), [(2.0, 102.0), (1.0, 101.0)])
def test_a_beating_job_ticks_and_has_its_rings_read_on_its_supervisors_grid(
        ws: Workspace, grid: float, tick: float) -> None:
    clock = [100.5]
    r = _runner(ws, clock, grid)
    try:
        r.ranks.observe(Beat(0, 1, 100.4, os.getpid(), None, None))
        assert r.next_wake(100.5) == tick  # the grid, shared by every job
        rings = ws.root / "rings"
        rings.mkdir()
        r.intake.ring_dir = str(rings)
        r.intake.tick(100.5)
        assert r.intake.next_wake() == tick  # the rings on the same grid
        assert r.next_wake(100.5) == tick
    finally:
        r.intake.close()


def test_a_hang_deadline_between_two_grid_ticks_wakes_the_job_at_the_deadline(
        ws: Workspace) -> None:
    clock = [100.5]
    r = _runner(ws, clock, 2.0, {"timeout": "1s"})
    try:
        r.ranks.observe(Beat(0, 1, 100.0, os.getpid(), None, None))
        wake = r.next_wake(100.5)
        assert math.isclose(wake, 101.0), wake  # the beat + 1 s, before the grid's 102
    finally:
        r.intake.close()


def test_ranks_are_looked_for_every_second_in_an_attempts_first_minute_until_one_is_found(
        ws: Workspace) -> None:
    """The first failure's rank processes (watch/firstfailure.py): not on the 2 s grid."""
    clock = [100.5]
    r = _runner(ws, clock, 2.0)
    try:
        r.ranks.observe(Beat(0, 1, 100.4, os.getpid(), None, None))
        r.first_failure.new_attempt(100.0)
        assert r.next_wake(100.5) == 101.0  # the attempt's start + 1 s, not the grid's 102
        r.first_failure.new_attempt(0.0)  # a minute and more into the attempt
        r.first_failure.scan_at = 100.9
        assert r.next_wake(100.5) == 102.0
    finally:
        r.intake.close()
