"""Adversarial cases of the supervisor itself (issue items 3, 6 and 15): a
run_dir another user prepared is refused, one job's failure in handling does
not end the loop that supervises the others, and a job named ``control`` does
not take the control socket's place. The other items have files of their own:
test_hardening_heartbeat.py (1, 6, 7), test_hardening_process.py (2, 4, 5, 9,
10, 11, 13), test_hardening_io.py (4, 12, 13, 14), test_config_hardening.py (8)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import UserPython, Workspace, local_user, missing, run_name, wait_for
from trainwatch.config import from_mapping
from trainwatch.host.supervisor import Supervisor
from trainwatch.lifecycle.job import JobRunner
from trainwatch.types import JobState

VICTIM = run_name("victim")  # this run's own user (conftest)


def _user(name: str) -> pwd.struct_passwd:
    return local_user(name)


def _as(uid: int, gid: int, *argv: str, env: dict[str, str] | None = None,
        ) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        missing("acting as another user needs root and setpriv")
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                           *argv], capture_output=True, text=True, timeout=60, env=env,
                          check=False)


def test_default_run_dir_prepared_by_another_user_is_refused(
        open_tmp: Path, user_python: UserPython) -> None:
    """Item 3: uid 65534 pre-creates the victim's /tmp/trainwatch-<uid>/trainwatch; the victim's
    trainwatch refuses it in one line, exit 2, and binds nothing there."""
    victim = _user(VICTIM)
    base = Path(f"/tmp/trainwatch-{victim.pw_uid}")
    shutil.rmtree(base, ignore_errors=True)
    try:
        r = _as(65534, 65534, "mkdir", "-m", "0777", "-p", str(base / "trainwatch"))
        assert r.returncode == 0, r.stderr
        state = open_tmp / "state"
        state.mkdir()
        os.chown(state, victim.pw_uid, victim.pw_gid)
        env = user_python.env(HOME=str(open_tmp))
        r = _as(victim.pw_uid, victim.pw_gid, user_python.python, "-m", "trainwatch.cli", "run",
                "--name", "j", "--state-dir", str(state), "--metrics-port", "0", "--",
                "/bin/true", env=env)
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert str(base) in r.stderr and "Traceback" not in r.stderr
        assert not list((base / "trainwatch").iterdir())  # nothing bound in their folder
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_own_default_run_dir_is_created_private(
        open_tmp: Path, user_python: UserPython) -> None:
    """Item 3: a run_dir trainwatch creates for a user is 0700, owned by that user."""
    victim = _user(VICTIM)
    base = Path(f"/tmp/trainwatch-{victim.pw_uid}")
    shutil.rmtree(base, ignore_errors=True)
    try:
        state = open_tmp / "state"
        env = user_python.env(HOME=str(open_tmp))
        os.chown(open_tmp, victim.pw_uid, victim.pw_gid)
        r = _as(victim.pw_uid, victim.pw_gid, user_python.python, "-m", "trainwatch.cli", "run",
                "--name", "j", "--state-dir", str(state), "--metrics-port", "0", "-q", "--",
                "/bin/true", env=env)
        assert r.returncode == 0, r.stderr
        for d in (base / "trainwatch", state):
            st = d.stat()
            assert (st.st_uid, st.st_mode & 0o777) == (victim.pw_uid, 0o700), d
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_state_dir_writable_by_others_is_refused(ws: Workspace) -> None:
    """Item 3: a world-writable state_dir (without the sticky bit) is refused in one line."""
    ws.state.mkdir()
    ws.state.chmod(0o777)
    rc = subprocess.run([sys.executable, "-m", "trainwatch.cli", "run", "--config",
                         str(ws.config({"command": ["/bin/true"]}))],
                        capture_output=True, text=True, timeout=30, check=False)
    assert rc.returncode == 2
    assert "writable by every user" in rc.stderr and len(rc.stderr.splitlines()) == 1


@pytest.mark.parametrize("which", ["state_dir", "run_dir"])
def test_a_users_link_above_state_dir_or_run_dir_is_refused_whatever_the_sysctl_says(
        ws: Workspace, tmp_path: Path, which: str) -> None:
    """Another user's symlink in sticky /tmp, above the configured folder, pointing at a
    folder of root's: refused in one line, exit 2, nothing written where it points (root
    followed it and made ledger.db, jobs/ and control.sock there: the path was resolved
    first and judged after, and fs.protected_symlinks=0 let root follow a user's link)."""
    if os.geteuid() != 0:
        missing("a link of another user's needs root to make")
    target = tmp_path / "roots"
    target.mkdir()
    link = Path(f"/tmp/tw-{run_name('link')}-{which}")
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    os.lchown(link, 65534, 65534)
    try:
        cfg = ws.config({"command": ["/bin/true"]}, **{which: str(link / "tw")})
        r = subprocess.run([sys.executable, "-m", "trainwatch.cli", "run", "--config", str(cfg)],
                           capture_output=True, text=True, timeout=30, check=False)
        assert r.returncode == 2, r.stderr
        assert f"{link}: a symlink owned by uid 65534" in r.stderr, r.stderr
        assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
        assert list(target.iterdir()) == []
    finally:
        link.unlink(missing_ok=True)


def test_one_jobs_failing_handling_does_not_stop_the_others(
        ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 6: an exception in one job's handling is logged and counted; the loop goes on
    supervising the other job to its end, and then the failing one too."""
    doc = {"state_dir": str(ws.state), "run_dir": str(ws.root / "run"), "metrics": {"port": 0},
           "gpu": {"backend": "off"},
           "jobs": [{"name": "bad", "command": ws.worker("--steps", "200")},
                    {"name": "good", "command": ws.worker("--steps", "30")}]}
    sup = Supervisor(from_mapping(doc))
    real_tick = JobRunner.tick
    failures = {"n": 0}

    def tick(self: JobRunner, now: float) -> None:
        if self.job.name == "bad" and failures["n"] < 5:
            failures["n"] += 1
            raise RuntimeError("a bug in one job's handling")
        real_tick(self, now)

    monkeypatch.setattr(JobRunner, "tick", tick)
    assert sup.run(install_signals=False) == 0
    assert {r.job.name: r.state for r in sup.runners} == {"bad": JobState.EXITED,
                                                          "good": JobState.EXITED}
    assert sup.loop_errors == 5


def test_job_named_control_leaves_the_control_socket_to_trainwatch(ws: Workspace) -> None:
    """Item 15: a job named `control` beats on its own socket and GPU drills still reach
    trainwatch over control.sock."""
    cfg = ws.config({"name": "control", "command": ws.worker("--steps", "100000",
                                                             "--interval", "0.05")},
                    gpu={"backend": "sim", "count": 2})
    p = ws.run(cfg)
    wait_for(lambda: (ws.state / "jobs" / "control" / "status.json").exists()
             and '"running"' in (ws.state / "jobs" / "control" / "status.json").read_text(),
             what="job control running")
    r = subprocess.run([sys.executable, "-m", "faultinject.cli", "gpu-xid", "--gpu", "1",
                        "--xid", "63", "--run-dir", str(ws.root / "run")],
                       capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: any(i["kind"] == "gpu_xid" for i in ws.incidents()), what="the Xid")
    assert p.poll() is None


def test_reader_that_stops_reading_our_stderr_does_not_stall_the_loop(ws: Workspace) -> None:
    """Item 11, `trainwatch run ... 2>&1 | sleep`: trainwatch's own log lines share the stalled
    pipe with the job's output, and still the job's exit is handled and run ends."""
    r, w = os.pipe()
    reader = subprocess.Popen(["sleep", "300"], stdin=r)
    os.close(r)
    cmd = ["bash", "-c", "echo hi; head -c 300000 /dev/zero >&2; exit 3"]
    tw = subprocess.Popen(
        [sys.executable, "-m", "trainwatch.cli", "run", "--name", "job", "--state-dir",
         str(ws.state), "--run-dir", str(ws.root / "run"), "--metrics-port", "0",
         "--max-restarts", "0", "--", *cmd],
        stdout=w, stderr=w)
    os.close(w)
    ws.procs.append(tw)
    try:
        tw.wait(timeout=30)
        assert tw.returncode == 1
        assert ws.status().get("state") == "fatal"
        assert reader.poll() is None  # the reader never read a byte, and still does not
    finally:
        reader.kill()
        reader.wait()


def test_a_flood_of_checkpoint_reports_does_not_stall_the_loop(ws: Workspace) -> None:
    """A job sending 4,000 distinct checkpoint reports (long paths, most refused, the rest
    bounded, each there: each is looked for, at a bounded rate): the catalog state stays
    small and Ctrl-C is acted on at once."""
    script = ws.root / "reports.py"
    script.write_text(
        "import os, sys, time\nfrom trainwatch import client\nhb = client.connect()\n"
        "hb.beat(1)\nd = sys.argv[1]\nos.makedirs(d, exist_ok=True)\n"
        "for i in range(4000):\n"
        "    inside = i % 2 == 0\n"
        "    path = os.path.join(d, 'step_%d' % i) if inside else '/tmp/step_%d' % i + 'x' * 3000\n"
        "    if inside:\n"
        "        open(path, 'w').close()\n"
        "    hb.checkpoint(i, path)\n"
        "open(os.path.join(d, '..', 'sent'), 'w').close()\n"
        "time.sleep(600)\n")
    p = ws.run(ws.config({"command": [sys.executable, str(script), str(ws.ckpt)]}))
    wait_for(lambda: (ws.root / "sent").exists(), timeout=60, what="the reports sent")
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    p.wait(timeout=15)
    assert time.monotonic() - t0 < 10
    assert p.returncode == 130
    assert (ws.state / "jobs" / "job" / "catalog.json").stat().st_size < 2_000_000


def test_state_dir_writable_by_another_group_is_refused(ws: Workspace) -> None:
    """Item 3: a root-owned state_dir its group may write (root:staff 0775), in which a member
    planted jobs/job -> elsewhere, is refused in one line; nothing is written through it."""
    if os.geteuid() != 0:
        missing("handing a folder to another group needs root")
    elsewhere = ws.root / "elsewhere"
    elsewhere.mkdir()
    ws.state.mkdir()
    os.chown(ws.state, 0, 50)
    ws.state.chmod(0o775)
    (ws.state / "jobs").mkdir()
    (ws.state / "jobs" / "job").symlink_to(elsewhere)
    r = subprocess.run([sys.executable, "-m", "trainwatch.cli", "run", "--config",
                        str(ws.config({"command": ["/bin/true"]}))],
                       capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 2, r.stderr
    assert "writable by group 50" in r.stderr and len(r.stderr.splitlines()) == 1
    assert list(elsewhere.iterdir()) == []


def test_an_exit_whose_handling_failed_is_handled_again(
        ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 6: if acting on the leader's exit raises once, the exit is not forgotten (the job
    does not stay `running` around a zombie): the next round handles it and the job ends."""
    import trainwatch.watch.exits as exitmod  # where the exit is judged

    doc = {"state_dir": str(ws.state), "run_dir": str(ws.root / "run"), "metrics": {"port": 0},
           "gpu": {"backend": "off"}, "jobs": [{"name": "j", "command": ws.worker("--steps", "5")}]}
    sup = Supervisor(from_mapping(doc))
    real = exitmod.run_detectors
    calls = {"n": 0}

    def flaky(on: str, *args: object) -> object:
        if on == "exit":
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("a bug while judging the exit")
        return real(on, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(exitmod, "run_detectors", flaky)
    done = threading.Event()
    timer = threading.Timer(30, lambda: done.is_set() or sup.request_stop())
    timer.start()
    try:
        rc = sup.run(install_signals=False)
    finally:
        done.set()
        timer.cancel()
    assert calls["n"] == 2 and sup.loop_errors == 1
    assert rc == 0 and sup.runners[0].state is JobState.EXITED
