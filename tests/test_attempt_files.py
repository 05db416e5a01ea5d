"""What attempts leave behind (issue 21, item C19): a job that died while no daemon
ran is charged the steps its ring says it reached, and the exit files and logs
of earlier attempts are bounded."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Workspace, finish, pid_gone, wait_for
from test_daemon import Host, exited_at, sigkill, started
from trainwatch.actions import attemptfiles


@pytest.fixture
def host() -> Iterator[Host]:
    h = Host(Path(tempfile.mkdtemp(prefix="twf", dir="/tmp")))
    try:
        yield h
    finally:
        h.cleanup()


def test_a_job_that_died_while_the_daemon_was_down_is_charged_the_steps_its_ring_holds(
        host: Host) -> None:
    """The daemon is SIGKILLed at about step 5 (its state file says step 1), the job runs on
    past step 40 and exits 3; the next daemon's incident says the step it died at, and the
    relaunch (fresh: no checkpoint) counts all of them lost."""
    host.config([host.job_doc("a", "--interval", "0.02", "--ckpt-every", "100000")])
    d1 = host.daemon()
    s = started(host, d1, "a", min_step=5)
    sigkill(d1)
    log = Path(s["log"])
    wait_for(lambda: "step 40\n" in log.read_text(), timeout=30, what="the job past step 40")
    host.trigger("a", "exit_code", "3")
    wait_for(lambda: pid_gone(s["pid"]), timeout=20, what="the job to exit")
    died = exited_at(log, 3)

    d2 = host.daemon()
    started(host, d2, "a", min_step=0, attempt=s["attempt"] + 1)
    [inc] = host.incidents()
    assert json.loads(inc["evidence"]).get("last_step") == died, inc
    assert inc["onset_step"] == died and inc["steps_lost"] == died, inc
    # Its exit was recorded: the dead attempt's exit files are gone, the new one's are there.
    left = sorted(p.name for p in (host.run_dir / "jobs").glob("a.attempt-*.exit*"))
    assert left and all(n.startswith(f"a.attempt-{s['attempt'] + 1}.") for n in left), left


def test_a_job_relaunched_15_times_keeps_one_attempts_exit_files_and_10_logs(
        ws: Workspace) -> None:
    """15 attempts that crash at once: run_dir keeps only the last attempt's exit files (an
    earlier run's stale ones go too, another job's stay), state_dir the newest 10 logs."""
    run_jobs = ws.root / "run" / "jobs"
    run_jobs.mkdir(parents=True)
    for name in ("job.attempt-99.exit", "jobx.attempt-1.exit", "other.attempt-1.exit.start"):
        (run_jobs / name).write_text("{}")
    cfg = ws.config({"command": ["sh", "-c", "echo attempt $TRAINWATCH_ATTEMPT; exit 1"]},
                    {"max_restarts": 14, "backoff": {"initial": "0.01s", "max": "0.01s",
                                                     "jitter": 0}})
    rc, out = finish(ws.run(cfg), timeout=120)
    assert rc == 1, out
    assert len(ws.incidents()) == 15
    names = sorted(p.name for p in run_jobs.iterdir())
    exits = [n for n in names if ".exit" in n]
    assert exits == ["job.attempt-14.exit", "job.attempt-14.exit.start",
                     "jobx.attempt-1.exit", "other.attempt-1.exit.start"], names
    logs = sorted((ws.state / "jobs" / "job" / "logs").iterdir())
    numbers = sorted(int(p.name.split("-")[1]) for p in logs)
    assert numbers == list(range(5, 15)), [p.name for p in logs]
    assert (ws.state / "jobs" / "job" / "logs" / logs[-1].name).read_text().startswith(
        "attempt ")


def test_log_retention_keeps_the_newest_by_time_and_never_the_current(tmp_path: Path) -> None:
    """A new run numbers attempts from 0 again: its attempt-0 log is newer than an old run's
    attempt-9 and is kept; a link of that shape goes as a name (its target untouched), files
    of other shapes stay."""
    for n, t in [(7, 100), (8, 101), (9, 102), (0, 200)]:
        (tmp_path / f"attempt-{n}-{t}.log").write_text("")
    (tmp_path / "notes.txt").write_text("")
    target = tmp_path / "notes.txt"
    os.symlink(target, tmp_path / "attempt-1-50.log")
    removed = attemptfiles.logs(tmp_path, "attempt-0-200.log", keep=2)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert removed == 3 and left == ["attempt-0-200.log", "attempt-9-102.log", "notes.txt"]
    assert target.exists()
