"""`faultinject crash|hang` against real processes: a status whose trainwatch is
gone is refused, and a pid in a status that is not the job's (a stranger now) is
never signalled, with a cgroup and without one; the job's own pids still are."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, missing, wait_for
from trainwatch.actions import cgroup
from trainwatch.actions.cgroup import AttemptCgroup
from trainwatch.actions.tree import is_gone
from trainwatch.export import status as jobstatus
from trainwatch.sources.procstat import proc_stat
from trainwatch.state import jobdir, joblock


def _faultinject(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultinject.cli", args[0], "--job", "job",
                           "--state-dir", str(state), *args[1:]],
                          capture_output=True, text=True, timeout=30, check=False)


class Procs:
    """Processes the test starts; every one is killed at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *argv: str, session: bool = True) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(list(argv), start_new_session=session)
        self.procs.append(p)
        wait_for(lambda: (proc_stat(p.pid) or ("",))[0] in ("S", "R"), what="it to run")
        return p

    def alive(self, p: subprocess.Popen[bytes]) -> bool:
        st = proc_stat(p.pid)
        return p.poll() is None and st is not None and st[0] != "T"  # neither dead nor stopped


@pytest.fixture
def procs() -> Iterator[Procs]:
    ps = Procs()
    yield ps
    for p in ps.procs:
        p.kill()
        p.wait()


def _publish(ws: Workspace, pid: int, ranks: dict[str, int] | None = None,
             cgroup_path: str | None = None) -> None:
    s: dict[str, Any] = {"job": "job", "state": "running", "attempt": 0, "pid": pid,
                         "pgid": pid, "ranks": {k: v for k, v in (ranks or {}).items()},
                         "cgroup": cgroup_path}
    jobdir.make_job_dir(ws.state, "job")
    assert jobstatus.publish(ws.state, "job", s)


def _refused(r: subprocess.CompletedProcess[str], says: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == "" and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr


@pytest.mark.parametrize("drill", [("crash",), ("hang",), ("hang", "--rank", "0")])
def test_status_nobody_supervises_is_refused_and_its_pid_never_signalled(
        ws: Workspace, procs: Procs, drill: tuple[str, ...]) -> None:
    """A status left by a trainwatch that is gone (its lock free) names a pid a stranger has now:
    refused in one line, exit 2, the stranger untouched."""
    stranger = procs.start("sleep", "300")
    _publish(ws, stranger.pid, {"0": stranger.pid})
    joblock.acquire(ws.state, "job").release()  # the lock file is there, nobody holds it
    r = _faultinject(ws.state, *drill)
    _refused(r, "job job is not supervised (no trainwatch holds its lock)")
    assert procs.alive(stranger)


def test_status_of_a_sigkilled_trainwatch_is_refused(ws: Workspace) -> None:
    """After `trainwatch run` is SIGKILLed its status still says the job runs: the drill is
    refused as unsupervised, not sent to the pid it names."""
    p = ws.run(ws.config({"command": ["sleep", "300"]}))
    leader = int(wait_for(lambda: ws.status().get("pid"), timeout=30, what="the job to start"))
    p.kill()
    p.wait()
    wait_for(lambda: is_gone(leader), timeout=10, what="the job to die with trainwatch")
    assert ws.status()["state"] in ("starting", "running")  # stale: nobody rewrote it
    _refused(_faultinject(ws.state, "crash"), "job job is not supervised")


@pytest.fixture
def held(ws: Workspace) -> Iterator[None]:
    """The job's lock, held by the test as a running trainwatch holds it."""
    lock = joblock.acquire(ws.state, "job")
    assert lock.held
    yield
    lock.release()


def test_rank_pid_outside_the_leaders_session_is_never_signalled(
        ws: Workspace, procs: Procs, held: None) -> None:
    """Without a cgroup, a rank pid in neither the leader's session nor group nor below it (a
    stranger now) is refused; a rank pid in the leader's session is the job's and is killed."""
    leader = procs.start("sh", "-c", "sleep 300 & exec sleep 301")
    member = int(wait_for(lambda: _children(leader.pid), what="the member")[0])
    stranger = procs.start("sleep", "300")
    _publish(ws, leader.pid, {"0": stranger.pid, "1": member})
    for drill in (("crash", "--rank", "0"), ("hang", "--rank", "0")):
        _refused(_faultinject(ws.state, *drill),
                 f"process {stranger.pid} does not belong to job 'job'")
    assert procs.alive(stranger)
    r = _faultinject(ws.state, "crash", "--rank", "1")
    assert r.returncode == 0, r.stderr
    assert f"pids {member}" in r.stdout
    wait_for(lambda: is_gone(member), what="the member to die")
    assert procs.alive(stranger) and procs.alive(leader)


def test_leader_that_leads_no_session_is_never_signalled(
        ws: Workspace, procs: Procs, held: None) -> None:
    """A status naming as leader a pid that leads no session of its own (a reused pid) is
    refused, for the leader and for the pids of its 'session', which is then not the job's."""
    stranger = procs.start("sleep", "300", session=False)
    _publish(ws, stranger.pid, {"0": stranger.pid})
    _refused(_faultinject(ws.state, "crash"), "leads no session of its own")
    _refused(_faultinject(ws.state, "hang"), "leads no session of its own")
    assert procs.alive(stranger)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


@pytest.fixture
def job_cgroup() -> Iterator[AttemptCgroup]:
    if os.geteuid() != 0 or cgroup.base() is None:
        missing("needs root and a writable cgroup v2 hierarchy")
    cg = AttemptCgroup.create("fitest", 0)
    assert cg is not None
    yield cg
    cg.kill()
    wait_for(lambda: not cg.populated(), what="the test cgroup to empty")
    cg.close()


def test_pid_outside_the_statuss_cgroup_is_never_signalled(
        ws: Workspace, procs: Procs, held: None, job_cgroup: AttemptCgroup) -> None:
    """With a cgroup, a pid not in it (even one leading its own session) is refused by crash and
    left out by hang; a member of the cgroup is the job's and is stopped and killed."""
    member = procs.start("sleep", "300")
    assert job_cgroup.procs_fd is not None
    os.write(job_cgroup.procs_fd, str(member.pid).encode())
    assert job_cgroup.holds(member.pid)
    stranger = procs.start("sleep", "300")
    _publish(ws, member.pid, {"0": stranger.pid}, cgroup_path=job_cgroup.path)
    _refused(_faultinject(ws.state, "crash", "--rank", "0"),
             f"not in the job's cgroup {job_cgroup.path}")
    r = _faultinject(ws.state, "hang")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("pids ", 1)[1].split() == [str(member.pid)]
    assert (proc_stat(member.pid) or ("",))[0] == "T"
    _publish(ws, stranger.pid, {}, cgroup_path=job_cgroup.path)  # the leader: a stranger now
    _refused(_faultinject(ws.state, "crash"), "not in the job's cgroup")
    assert procs.alive(stranger)
    _publish(ws, member.pid, {}, cgroup_path=job_cgroup.path)
    r = _faultinject(ws.state, "crash")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: member.poll() is not None, what="the member to die")
    assert member.returncode == -signal.SIGKILL
    assert procs.alive(stranger)
