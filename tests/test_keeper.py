"""The keeper (trainwatch.actions.keeper) and the daemon's handle on it (kept):
a job outlives the process that launched it, and its exit status is still
learnt; identity checks never adopt or signal a stranger. Real processes."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import local_user, missing, need_root, pid_gone, run_name, wait_for
from trainwatch.actions import cgroup as cgroups
from trainwatch.actions import kept
from trainwatch.actions.keeper import boot_id
from trainwatch.actions.tree import start_time

HZ = os.sysconf("SC_CLK_TCK")
# Launches one job through kept.launch, prints the record, then waits to be killed.
PARENT = r"""
import dataclasses, json, os, sys, time
from trainwatch.actions import kept
spec = json.loads(sys.argv[1])
log = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
rec, _ = kept.launch(spec, log)
print(json.dumps(dataclasses.asdict(rec)), flush=True)
time.sleep(600)
"""
# Ticks every 50 ms until the file STOP appears in its folder, then exits 3.
TICKER = ["sh", "-c", 'i=0; while [ ! -e STOP ]; do echo "tick $i"; i=$((i+1)); sleep 0.05; '
                      'done; exit "${1:-3}"', "ticker"]


def spec(tmp: Path, argv: list[str], **kw: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "argv": argv, "env": {"PATH": os.environ.get("PATH", os.defpath)}, "cwd": str(tmp),
        "uid": None, "gid": None, "groups": None, "umask": 0o022, "cgroup_procs": None,
        "pdeathsig": False, "exit": str(tmp / "exit"), "job": "job", "attempt": 0}
    s.update(kw)
    return s


@pytest.fixture
def launched() -> Iterator[list[kept.Launched]]:
    """Launches to clean up: each leader still running is SIGKILLed, each keeper reaped."""
    recs: list[kept.Launched] = []
    yield recs
    for rec in recs:
        fd = kept.leader_pidfd(rec)
        if fd is not None:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        keeper = kept.adopt(rec)
        if isinstance(keeper, int):
            select.select([keeper], [], [], 10)
            kept.reap(rec, keeper)
            os.close(keeper)


def launch(s: dict[str, Any], log: Path | None, recs: list[kept.Launched]
           ) -> tuple[kept.Launched, int]:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640) if log else None
    try:
        rec, pidfd = kept.launch(s, fd)
    finally:
        if fd is not None:
            os.close(fd)
    recs.append(rec)
    assert pidfd is not None, "this kernel has pidfds"
    return rec, pidfd


def wait_exit(rec: kept.Launched, pidfd: int, timeout: float = 20.0) -> int:
    """The keeper's pidfd turns readable when it exits; the exit file is written by then."""
    assert select.select([pidfd], [], [], timeout)[0], "the keeper did not exit"
    kept.reap(rec, pidfd)
    os.close(pidfd)
    code = kept.exit_status(rec)
    assert code is not None, "the keeper exited without writing the exit file"
    return code


def parent_launch(s: dict[str, Any], log: Path) -> tuple[subprocess.Popen[bytes], kept.Launched]:
    """A throwaway Python process that launches the job and waits to be killed."""
    p = subprocess.Popen([sys.executable, "-c", PARENT, json.dumps(s), str(log)],
                         stdout=subprocess.PIPE)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line, "the launching parent died"
    return p, kept.Launched.from_dict(json.loads(line))


def proc_ids(pid: int) -> dict[str, list[int]]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            out[key] = [int(x) for x in rest.split()]
    return out


def test_job_outlives_the_sigkilled_launcher_and_its_exit_code_is_still_learnt(
        tmp_path: Path, launched: list[kept.Launched]) -> None:
    """SIGKILL of the launching process: output keeps growing; exit 3 lands in the exit file."""
    log = tmp_path / "log"
    p, rec = parent_launch(spec(tmp_path, TICKER), log)
    launched.append(rec)
    wait_for(lambda: log.exists() and b"tick" in log.read_bytes(), what="the job's first tick")
    p.kill()
    p.wait()
    assert p.stdout is not None
    p.stdout.close()
    size = log.stat().st_size
    wait_for(lambda: log.stat().st_size > size + 20, what="output after the launcher died")
    pidfd = kept.adopt(rec)
    assert isinstance(pidfd, int), "the keeper is alive and adoptable"
    assert kept.read_start(rec.exit_path) == rec
    assert kept.exit_status(rec) is None
    (tmp_path / "STOP").touch()
    assert wait_exit(rec, pidfd) == 3


def test_job_killed_by_sigkill_is_recorded_as_minus_9(
        tmp_path: Path, launched: list[kept.Launched]) -> None:
    """A leader killed by a signal: returncode is minus the signal, as subprocess gives."""
    rec, pidfd = launch(spec(tmp_path, ["sleep", "60"]), None, launched)
    leader = kept.leader_pidfd(rec)
    assert leader is not None
    signal.pidfd_send_signal(leader, signal.SIGKILL)
    os.close(leader)
    assert wait_exit(rec, pidfd) == -signal.SIGKILL


def test_missing_program_raises_file_not_found_and_the_exit_file_says_127(
        tmp_path: Path) -> None:
    """exec of a missing program: launch raises ENOENT naming it; exit file: 127 + error."""
    with pytest.raises(FileNotFoundError) as e:
        kept.launch(spec(tmp_path, ["no-such-program-tw"]), None)
    assert e.value.filename == "no-such-program-tw"
    d = json.loads((tmp_path / "exit").read_text())
    assert d["returncode"] == 127
    assert "no-such-program-tw" in d["error"]
    assert not (tmp_path / "exit.start").exists()


def test_adopt_refuses_a_live_process_whose_start_time_differs_and_never_signals_it(
        tmp_path: Path) -> None:
    """A record whose pid now names a stranger (other start time, other boot) is "gone"."""
    with subprocess.Popen(["sleep", "60"]) as stranger:
        try:
            real = start_time(stranger.pid)
            assert real is not None
            rec = kept.Launched(stranger.pid, real / HZ + 1.0, stranger.pid, real / HZ + 1.0,
                                False, str(tmp_path / "exit"), boot_id())
            assert kept.adopt(rec) == "gone"
            assert kept.leader_pidfd(rec) is None
            kept.reap(rec, None)
            other_boot = dataclasses.replace(rec, keeper_start=real / HZ,
                                             boot_id="00000000-0000-0000-0000-000000000000")
            assert kept.adopt(other_boot) == "gone"
            right = kept.adopt(dataclasses.replace(rec, keeper_start=real / HZ))
            assert isinstance(right, int)  # the same record with the true start is adopted
            os.close(right)
            assert stranger.poll() is None, "the stranger was signalled or reaped"
            assert "SigPnd:\t0000000000000000" in Path(
                f"/proc/{stranger.pid}/status").read_text()
        finally:
            stranger.kill()


def _attempt_cgroup() -> cgroups.AttemptCgroup:
    need_root("cgroups")
    cg = cgroups.AttemptCgroup.create("kepttest", 0)
    if cg is None:
        missing("cgroup v2 is not mounted or not ours to write")
        raise AssertionError("unreachable")
    return cg


def test_leader_joins_the_attempt_cgroup_and_the_keeper_survives_cgroup_kill(
        tmp_path: Path, launched: list[kept.Launched]) -> None:
    """The leader is in the attempt's cgroup, the keeper is not, and records the kill."""
    cg = _attempt_cgroup()
    try:
        procs = os.path.join(cg.path, "cgroup.procs")
        rec, pidfd = launch(spec(tmp_path, ["sleep", "60"], cgroup_procs=procs), None, launched)
        assert rec.cgroup
        assert cgroups.of(rec.pid) == cg.rel
        assert cgroups.of(rec.keeper) != cg.rel
        assert cg.kill()
        assert wait_exit(rec, pidfd) == -signal.SIGKILL
        wait_for(lambda: not cg.populated(), what="the cgroup to empty")
    finally:
        assert cg.close()


def test_cgroup_that_cannot_be_joined_falls_back_and_says_so(
        tmp_path: Path, launched: list[kept.Launched]) -> None:
    """No such cgroup: the job runs anyway and the start record says cgroup false."""
    s = spec(tmp_path, ["sh", "-c", "exit 7"], cgroup_procs=str(tmp_path / "nope/cgroup.procs"))
    rec, pidfd = launch(s, tmp_path / "log", launched)
    assert rec.cgroup is False
    assert wait_exit(rec, pidfd) == 7
    assert "cannot join cgroup" in (tmp_path / "log").read_text()


def test_keeper_ignores_sigterm_sighup_and_sigint(
        tmp_path: Path, launched: list[kept.Launched]) -> None:
    """Signals that end a daemon or a terminal do not end the keeper: it still records exit 4."""
    rec, pidfd = launch(spec(tmp_path, [*TICKER, "4"]), None, launched)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGPIPE):
        signal.pidfd_send_signal(pidfd, sig)
    (tmp_path / "STOP").touch()
    assert wait_exit(rec, pidfd) == 4


def test_leader_runs_as_the_job_user_while_the_keeper_stays_root(
        tmp_path: Path, launched: list[kept.Launched]) -> None:
    """uid, gid and groups are the user's in the leader; the keeper keeps root's."""
    need_root("run a job as another user")
    pw = local_user(run_name("test1"))
    s = spec(tmp_path, ["sleep", "60"], cwd="/", uid=pw.pw_uid, gid=pw.pw_gid,
             groups=[pw.pw_gid])
    rec, pidfd = launch(s, None, launched)
    leader = proc_ids(rec.pid)
    assert leader["Uid"] == [pw.pw_uid] * 4
    assert leader["Gid"] == [pw.pw_gid] * 4
    assert leader["Groups"] == [pw.pw_gid]
    assert proc_ids(rec.keeper)["Uid"] == [0] * 4
    fd = kept.leader_pidfd(rec)
    assert fd is not None
    signal.pidfd_send_signal(fd, signal.SIGKILL)
    os.close(fd)
    assert wait_exit(rec, pidfd) == -signal.SIGKILL


def test_failed_credential_drop_runs_nothing_and_the_exit_file_says_why(tmp_path: Path) -> None:
    """setgroups refused (an invalid gid): no exec, launch raises, the exit file says 126."""
    need_root("set groups")
    s = spec(tmp_path, ["touch", "RAN"], groups=[(1 << 32) - 1])
    with pytest.raises(OSError) as e:
        kept.launch(s, None)
    assert "setgroups" in str(e.value)
    assert not (tmp_path / "RAN").exists()
    d = json.loads((tmp_path / "exit").read_text())
    assert d["returncode"] == 126
    assert "setgroups" in d["error"]


def test_with_pdeathsig_keeper_and_leader_die_with_the_launcher(tmp_path: Path) -> None:
    """Foreground mode: SIGKILL of the launcher takes the keeper and then the leader down."""
    p, rec = parent_launch(spec(tmp_path, ["sleep", "60"], pdeathsig=True), tmp_path / "log")
    assert not pid_gone(rec.keeper) and not pid_gone(rec.pid)
    p.kill()
    p.wait()
    assert p.stdout is not None
    p.stdout.close()
    wait_for(lambda: pid_gone(rec.keeper) and pid_gone(rec.pid),
             what="the keeper and the leader to die with the launcher")


def test_spec_larger_than_a_pipe_buffer_reaches_the_job(
        tmp_path: Path, launched: list[kept.Launched]) -> None:
    """A 200 kB environment (beyond the 64 kB pipe buffer) arrives whole."""
    s = spec(tmp_path, ["sh", "-c", 'echo "len ${#BIG0}${#BIG1}${#BIG2}${#BIG3}"'])
    for i in range(4):  # Linux takes at most 128 kB in one variable (MAX_ARG_STRLEN)
        s["env"][f"BIG{i}"] = "x" * 50_000
    rec, pidfd = launch(s, tmp_path / "log", launched)
    assert wait_exit(rec, pidfd) == 0
    assert "len 50000500005000050000" in (tmp_path / "log").read_text()


def test_exit_file_of_another_launch_is_not_taken_for_ours(
        tmp_path: Path, launched: list[kept.Launched]) -> None:
    """An exit file left by an earlier leader (other pid) does not answer for this one."""
    rec, pidfd = launch(spec(tmp_path, ["sh", "-c", "exit 9"]), None, launched)
    assert wait_exit(rec, pidfd) == 9
    assert kept.exit_status(dataclasses.replace(rec, pid=rec.pid + 1)) is None


def test_launch_record_from_bad_state_is_one_clear_error() -> None:
    """A damaged record in a state file: a ValueError naming the field, no traceback inside."""
    good = dataclasses.asdict(kept.Launched(1, 2.0, 3, 4.0, True, "/x", "b"))
    assert kept.Launched.from_dict(good) == kept.Launched(1, 2.0, 3, 4.0, True, "/x", "b")
    with pytest.raises(ValueError, match="'pid'"):
        kept.Launched.from_dict({**good, "pid": "3"})
    with pytest.raises(ValueError, match="JSON object"):
        kept.Launched.from_dict([1])
