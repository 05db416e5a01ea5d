"""A job's process tree with real processes: cgroup membership that a process
cannot leave or forge, (pid, start time) identity, and no stranger ever
signalled, also when it is handed a pid the job used (PID namespace)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import missing, wait_for
from trainwatch.actions import cgroup
from trainwatch.actions import watcher as watchers
from trainwatch.actions.attempt import Attempt
from trainwatch.actions.tree import is_gone
from trainwatch.config import Job
from trainwatch.sources.procstat import proc_stat

NOBODY = 65534


def _need_root() -> None:
    if os.geteuid() != 0:
        missing("needs root (cgroups, other uids, PID namespaces)")


def _need_cgroup() -> None:
    _need_root()
    if cgroup.base() is None:
        missing("needs a writable cgroup v2 hierarchy")


@pytest.fixture
def logs() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="twtree", dir="/tmp"))
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _attempt(logs: Path, *cmd: str, name: str = "treejob") -> Attempt:
    return Attempt(Job(name=name, command=cmd), 0, str(logs / "x.sock"), None, None,
                   logs / "logs", passthrough=False)


def _end(a: Attempt) -> None:
    """Kill what is left of the attempt and close it (test cleanup)."""
    if not a.closed:
        a.tree.signal(signal.SIGKILL, a.tree.scan())
        wait_for(lambda: not a.tree.alive(), what="the tree to die")
        a.close()


def _read_pid(path: Path) -> int:
    return int(wait_for(lambda: path.exists() and path.read_text().strip(),
                        what=f"a pid in {path}"))


def test_process_that_leaves_the_session_by_setsid_and_double_fork_is_still_killed(
        logs: Path) -> None:
    """A grandchild that setsid()s, double-forks, drops TRAINWATCH_JOB: still a member, killed."""
    _need_cgroup()
    pidfile = logs / "escaped"
    a = _attempt(logs, "sh", "-c", "setsid env -u TRAINWATCH_JOB sh -c 'sleep 300 & echo $! > "
                 f"{pidfile}' & exec sleep 300")
    try:
        escaped = _read_pid(pidfile)
        assert os.getsid(escaped) != a.pid  # it did leave the job's session
        wait_for(lambda: (proc_stat(escaped) or ("", 0, 0))[1] != a.pid, what="the orphaning")
        assert escaped in a.tree.scan()
        assert a.tree.owns(escaped, NOBODY)
        a.tree.signal(signal.SIGKILL, a.tree.alive())
        wait_for(lambda: is_gone(escaped), what="the escaped process to die")
    finally:
        _end(a)


def test_process_claiming_the_job_in_its_environment_is_not_a_member(logs: Path) -> None:
    """A process whose environment says TRAINWATCH_JOB=<job> is neither believed nor signalled."""
    _need_root()
    a = _attempt(logs, "sleep", "300", name="victim")
    env = dict(os.environ, TRAINWATCH_JOB="victim", TRAINWATCH_SOCKET=str(logs / "x.sock"))
    spoof = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                              "--clear-groups", "sleep", "300"], env=env)
    try:
        comm = Path(f"/proc/{spoof.pid}/comm")
        wait_for(lambda: comm.read_text().strip() == "sleep", what="the spoofer to run")
        assert not a.tree.owns(spoof.pid, NOBODY)
        assert spoof.pid not in a.tree.scan()
        a.tree.signal(signal.SIGKILL, a.tree.scan())
        wait_for(lambda: not a.tree.alive(), what="the job to die")
        assert spoof.poll() is None  # never signalled
    finally:
        spoof.kill()
        spoof.wait()
        _end(a)


def test_exited_leader_status_is_recorded_and_close_removes_the_cgroup(logs: Path) -> None:
    """The leader's exit status comes from its keeper's record; close() removes the cgroup.
    (The zombie is held only without a cgroup: test_stranger_given_a_pid_... below.)"""
    _need_root()
    a = _attempt(logs, "sh", "-c", "exit 7")
    path = a.cgroup.path if a.cgroup is not None else None
    wait_for(lambda: a.poll_exit() is not None, what="the leader's exit")
    assert a.returncode == 7
    a.close()
    wait_for(lambda: proc_stat(a.pid) is None, what="the leader reaped")
    if path is not None:
        assert not os.path.exists(path)


def test_signal_after_close_reaches_nobody(logs: Path) -> None:
    """Once an attempt is closed its tree signals nothing: the pids it knew may be reused."""
    a = _attempt(logs, "sh", "-c", "exit 0")
    wait_for(lambda: a.poll_exit() is not None, what="the leader's exit")
    a.close()
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        a.tree.known[stranger.pid] = (proc_stat(stranger.pid) or ("", 0, 0))[2]
        a.tree.signal(signal.SIGKILL, [stranger.pid])
        time.sleep(0.2)  # a signal would have landed by now; nothing must
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


_SUPERVISOR = textwrap.dedent(
    """
    import shlex, sys, time
    from pathlib import Path
    import trainwatch.actions.cgroup
    mode, tmp = sys.argv[1], Path(sys.argv[2])
    if mode == "fallback":
        trainwatch.actions.cgroup.base = lambda *a, **k: None
    from trainwatch.actions.attempt import Attempt
    from trainwatch.config import Job
    py = sys.executable
    if mode == "cgroup":  # a descendant that left the session and whose parent is gone
        cmd = f"setsid sh -c 'sleep 300 & echo $! > {tmp}/escaped' & exec sleep 300"
    else:  # a member in another process group, whose child left the session
        child = ("import os, subprocess, time; os.setpgid(0, 0); "
                 "p = subprocess.Popen(['setsid', 'sleep', '300']); "
                 f"open('{tmp}/escaped', 'w').write(str(p.pid)); time.sleep(300)")
        cmd = f"{py} -c {shlex.quote(child)} & exec sleep 300"
    a = Attempt(Job(name="orphanjob", command=("sh", "-c", cmd)), 0, str(tmp / "x.sock"),
                None, None, tmp / "logs", passthrough=False, die_with_parent=True)
    assert (a.cgroup is None) == (mode == "fallback"), a.cgroup
    print(a.pid, flush=True)
    time.sleep(300)
    """
)


@pytest.mark.parametrize("mode", ["cgroup", "fallback"])
def test_attempt_started_to_die_with_its_parent_does_not_outlive_a_sigkill(
        logs: Path, mode: str) -> None:
    """die_with_parent: SIGKILL of the supervising process takes the leader and an escaped
    descendant: with a cgroup, any; without, one whose parent was still in the session."""
    _need_cgroup() if mode == "cgroup" else _need_root()
    sup = subprocess.Popen([sys.executable, "-c", _SUPERVISOR, mode, str(logs)],
                           stdout=subprocess.PIPE, text=True)
    assert sup.stdout is not None
    leader = int(sup.stdout.readline())
    escaped = _read_pid(logs / "escaped")
    try:
        # Fallback: `setsid sleep` calls setsid() once it runs; its pid is written before.
        wait_for(lambda: os.getsid(escaped) != leader, what="the escapee's own session")
        sup.kill()
        sup.wait()
        sup.stdout.close()
        wait_for(lambda: is_gone(leader), timeout=10, what="the leader to die with its parent")
        wait_for(lambda: is_gone(escaped), timeout=10, what="the escaped process to die too")
    finally:
        if sup.poll() is None:  # the wait above failed: its watcher ends the job
            sup.kill()
            sup.wait()
            sup.stdout.close()
        for pid in (leader, escaped):
            if not is_gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("mode", ["cgroup", "fallback"])
def test_watcher_is_stood_down_at_close_and_reaped_by_us(
        logs: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher of an attempt that dies with us exits at close(), killing nothing, and is
    reaped by the attempts (no supervisor here), never left a zombie."""
    if mode == "fallback":
        monkeypatch.setattr(cgroup, "base", lambda *a, **k: None)
    else:
        _need_cgroup()
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    a = Attempt(Job(name="watched", command=("sleep", "300")), 0, str(logs / "x.sock"), None,
                None, logs / "logs", passthrough=False, die_with_parent=True)
    try:
        assert (a.cgroup is None) == (mode == "fallback")
        watcher = a.watcher_pid
        assert watcher is not None and not is_gone(watcher)
        _end(a)
        assert a.watcher_pid is None
        wait_for(lambda: (watchers.reap(), proc_stat(watcher) is None)[1], timeout=10,
                 what="the watcher to exit and be reaped")
        assert bystander.poll() is None
    finally:
        _end(a)
        bystander.kill()
        bystander.wait()


_IN_NAMESPACE = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    from pathlib import Path
    import trainwatch.actions.cgroup
    mode, scenario, tmp = sys.argv[1:4]
    if mode == "fallback":
        trainwatch.actions.cgroup.base = lambda *a, **k: None
    from trainwatch.actions.attempt import Attempt
    from trainwatch.config import Job

    def wait(cond, what):
        end = time.monotonic() + 20
        while time.monotonic() < end:
            v = cond()
            if v:
                return v
            time.sleep(0.02)
        sys.exit(f"timed out waiting for {what}")

    def spawn_stranger_at(pid):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        return subprocess.Popen(["sleep", "300"], start_new_session=True)

    F = Path(tmp) / "member"
    cmd = {
        # the leader exits; a member that ignores SIGTERM lives on through kill_grace
        "leader": "trap '' TERM; sleep 300 & exit 3",
        # a member dies of the SIGTERM and is reaped; the stop goes on
        "member": f"sleep 300 & echo $! > {F}; trap '' TERM; sleep 300 & wait",
    }[scenario]
    a = Attempt(Job(name="nsjob", command=("sh", "-c", cmd)), 0, tmp + "/x.sock", None, None,
                Path(tmp) / "logs", passthrough=False)
    assert (a.cgroup is None) == (mode == "fallback"), a.cgroup
    if scenario == "leader":
        wait(lambda: a.poll_exit() is not None, "the leader to exit")
        wait(lambda: len(a.tree.alive()) == 1, "the member")
        a.tree.signal(signal.SIGTERM, a.tree.scan())
        reused = a.pid
    else:
        reused = int(wait(lambda: F.exists() and F.read_text().strip(), "the member's pid"))
        wait(lambda: reused in a.tree.scan(), "the member to be seen")
        a.tree.signal(signal.SIGTERM, a.tree.scan())
        wait(lambda: not os.path.exists(f"/proc/{reused}"), "the member to be reaped")
    # A process is told from one that reuses its pid by its start time, in clock ticks
    # (10 ms): a stranger started in the member's own tick (seen once under load, all
    # of this within 10 ms) is beyond what it can tell; pid reuse that fast needs a pid
    # namespace and ns_last_pid set by hand, as here.
    time.sleep(0.05)
    stranger = spawn_stranger_at(reused)
    a.tree.signal(signal.SIGKILL, a.tree.alive())  # kill_grace is over
    wait(lambda: not a.tree.alive(), "the tree to die")
    a.poll_exit()
    a.close()
    time.sleep(0.2)
    print(json.dumps({"reused": reused, "stranger": stranger.pid,
                      "stranger_alive": stranger.poll() is None}))
    stranger.kill()
    """
)


@pytest.mark.parametrize("mode", ["cgroup", "fallback"])
@pytest.mark.parametrize("scenario", ["leader", "member"])
def test_stranger_given_a_pid_the_job_used_is_never_signalled(
        logs: Path, mode: str, scenario: str) -> None:
    """In a PID namespace, a stranger handed the leader's or a member's pid mid-stop survives."""
    _need_cgroup() if mode == "cgroup" else _need_root()
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                        _IN_NAMESPACE, mode, scenario, str(logs)],
                       capture_output=True, text=True, timeout=90, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["stranger_alive"], out
    if scenario == "member":
        assert out["stranger"] == out["reused"]  # the stranger really holds the member's old pid
    else:
        assert out["stranger"] != out["reused"]  # the zombie leader keeps its pid reserved
