"""End to end through `trainwatch run`: real processes, real signals, the real
socket and ledger. The job is tests/jobs/worker.py, driven by flags."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import Workspace, finish, pid_gone, wait_for


def test_crashing_job_resumes_from_newest_complete_checkpoint(ws: Workspace) -> None:
    """A crash at step 25 relaunches from step_20 and the steps continue from 21 to the end."""
    cfg = ws.config({"command": ws.worker("--steps", "40", "--crash-at", "25")})
    rc, out = finish(ws.run(cfg))
    assert rc == 0, out
    starts = [e for e in ws.events() if e["event"] == "start"]
    assert [(e["attempt"], e["step"]) for e in starts] == [(0, 0), (1, 20)]
    assert starts[1]["resume"] == str(ws.ckpt / "step_20")
    [inc] = ws.incidents()
    assert inc["kind"] == "crash" and inc["action"] == "restart"
    assert json.loads(inc["evidence"])["exit_code"] == 3
    assert inc["resumed_step"] == 20 and inc["steps_lost"] == 5
    assert inc["time_to_relaunch_s"] is not None
    assert [e["step"] for e in ws.events() if e["event"] == "done"] == [40]
    assert ws.transitions()[-1] == "exited"


def test_stopped_job_is_detected_as_hang_and_relaunched(ws: Workspace) -> None:
    """SIGSTOP from `faultinject hang` silences the beats: a hang, and a relaunch. (A 1 s
    timeout fired before the drill in a loaded run, the job starved on 2 busy cores.)"""
    cfg = ws.config({"command": ws.worker("--steps", "400"), "heartbeat": {"timeout": "4s"}})
    p = ws.run(cfg)
    wait_for(
        lambda: (ws.status().get("step") or 0) >= 15 and ws.status().get("ranks"),
        timeout=60, what="the job to beat",
    )
    fi = ws.faultinject("hang", "--rank", "0")
    assert fi.returncode == 0, fi.stderr
    rc, out = finish(p)
    assert rc == 0, out
    [inc] = ws.incidents()
    assert inc["kind"] == "hang" and inc["rank"] == 0
    assert json.loads(inc["evidence"])["timeout_s"] == 4.0
    assert inc["resumed_step"] is not None and inc["resumed_step"] >= 10
    attempts = {e["attempt"] for e in ws.events() if e["event"] == "start"}
    assert attempts == {0, 1}


def test_double_forked_descendant_is_killed_before_relaunch(ws: Workspace) -> None:
    """A process that double-forked into its own session and ignores SIGTERM is SIGKILLed."""
    pidfile = ws.root / "escapee.pid"
    cfg = ws.config(
        {"command": ws.worker("--steps", "30", "--crash-at", "15", "--escapee", str(pidfile))},
        {"kill_grace": "0.5s"},
    )
    p = ws.run(cfg)
    escapee = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), what="the escapee"))
    assert os.getsid(escapee) != os.getsid(os.getpid())
    wait_for(lambda: ws.incidents(), what="the crash")
    # It must be gone before the relaunch (which escapes again: a new pid).
    wait_for(lambda: pid_gone(escapee), timeout=10, what="the escapee to die")
    rc, out = finish(p)
    assert rc == 0, out
    assert "SIGKILL" in out  # it outlived kill_grace
    last = int(pidfile.read_text())
    assert last != escapee and pid_gone(last)


def test_job_that_dies_at_once_spends_budget_with_backoff_and_ends_fatal(ws: Workspace) -> None:
    """Exit 1 at once: 3 restarts with doubling backoff, then fatal and exit code 1."""
    cfg = ws.config(
        {"command": ["sh", "-c", "exit 1"]},
        {"max_restarts": 3, "backoff": {"initial": "0.1s", "factor": 2, "jitter": 0}},
    )
    rc, out = finish(ws.run(cfg))
    assert rc == 1, out
    incs = ws.incidents()
    assert [i["kind"] for i in incs] == ["crash"] * 4
    assert [i["backoff_s"] for i in incs[:3]] == [0.1, 0.2, 0.4]
    assert "budget spent" in incs[3]["decision"]
    assert ws.transitions()[-1] == "fatal"
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(incs)]
    assert all(g >= d for g, d in zip(gaps, [0.1, 0.2, 0.4], strict=True)), gaps


def test_half_written_newest_checkpoint_is_skipped(ws: Workspace) -> None:
    """With a marker configured, an unmarked newer checkpoint is passed over for a marked one."""
    (ws.ckpt / "step_10").write_text("10")
    (ws.ckpt / "step_10.done").write_text("")
    (ws.ckpt / "step_20").write_text("2")  # still being written: no marker
    cfg = ws.config(
        {
            "command": ws.worker("--steps", "12", "--no-report"),
            "checkpoints": {"dir": str(ws.ckpt), "marker": ".done"},
        }
    )
    rc, out = finish(ws.run(cfg))
    assert rc == 0, out
    [start] = [e for e in ws.events() if e["event"] == "start"]
    assert start["resume"] == str(ws.ckpt / "step_10") and start["step"] == 10


def test_checkpoint_that_crashes_the_job_on_load_is_marked_bad(ws: Workspace) -> None:
    """Dying before the first beat twice from step_20 marks it bad (kept on disk); step_10 next."""
    cfg = ws.config(
        {
            "command": ws.worker("--steps", "30", "--crash-at", "25", "--fail-on-load", "20"),
            "checkpoints": {"dir": str(ws.ckpt), "bad_after": 2},
        }
    )
    rc, out = finish(ws.run(cfg))
    assert rc == 0, out
    loads = [e for e in ws.events() if e["event"] in ("start", "load_failed")]
    assert [(e["event"], e["step"]) for e in loads] == [
        ("start", 0),
        ("load_failed", 20),
        ("load_failed", 20),
        ("start", 10),
    ]
    catalog = json.loads((ws.state / "jobs" / "job" / "catalog.json").read_text())
    assert list(catalog["bad"]) == ["20"]
    # reached 25 -> back to 20; failed at 20 -> 20 again; failed at 20 -> back to 10
    assert [i["steps_lost"] for i in ws.incidents()] == [5, 0, 10]
    assert (ws.ckpt / "step_20").read_text() == "20"  # marked bad, never deleted
    assert "marked bad" in out


def test_observe_only_never_signals_the_job(ws: Workspace) -> None:
    """observe_only records the hang but sends nothing: no SIGTERM, no SIGSTOP, no relaunch."""
    trapped = ws.root / "sigterm"
    cfg = ws.config(
        {
            "command": ws.worker(
                "--steps",
                "20",
                "--silent-at",
                "10",
                "--silent-for",
                "2.5",
                "--trap-term",
                str(trapped),
            ),
            "heartbeat": {"timeout": "0.5s"},
        },
        observe_only=True,
    )
    rc, out = finish(ws.run(cfg))
    assert rc == 0, out
    [inc] = ws.incidents()
    assert inc["kind"] == "hang" and inc["observe_only"] == 1
    assert inc["decision"] == "observe_only: would restart"
    assert not trapped.exists()
    assert {e["attempt"] for e in ws.events()} == {0}
    assert [e["step"] for e in ws.events() if e["event"] == "done"] == [20]


def test_ctrl_c_stops_the_whole_tree_and_exits_130(ws: Workspace) -> None:
    """SIGINT to trainwatch stops every rank of the job, ends paused, and exits 130."""
    cfg = ws.config({"command": ws.worker("--steps", "100000", "--ranks", "3")})
    p = ws.run(cfg)
    ranks = wait_for(
        lambda: len(ws.status().get("ranks", {})) == 3 and ws.status()["ranks"], what="three ranks"
    )
    p.send_signal(signal.SIGINT)
    rc, out = finish(p)
    assert rc == 130, out
    assert all(pid_gone(int(pid)) for pid in ranks.values())
    assert ws.transitions()[-1] == "paused"


def test_faultinject_hang_on_one_rank_names_that_rank(ws: Workspace) -> None:
    """Stopping rank 2 of 3 gives a hang incident for rank 2 (pids come from SO_PASSCRED)."""
    cfg = ws.config(
        {"command": ws.worker("--steps", "200", "--ranks", "3"), "heartbeat": {"timeout": "1s"}},
        {"max_restarts": 0},
    )
    p = ws.run(cfg)
    wait_for(lambda: len(ws.status().get("ranks", {})) == 3, what="three ranks")
    fi = ws.faultinject("hang", "--rank", "2")
    assert fi.returncode == 0, fi.stderr
    rc, out = finish(p)
    assert rc == 1, out  # max_restarts 0: the hang is fatal
    [inc] = ws.incidents()
    assert inc["kind"] == "hang" and inc["rank"] == 2
    assert json.loads(inc["evidence"])["ranks_stale"] == [2]


def test_job_without_client_is_never_killed_for_not_beating(ws: Workspace) -> None:
    """A job that never beats runs to completion past the heartbeat timeout."""
    cfg = ws.config({"command": ["sh", "-c", "sleep 1.5"], "heartbeat": {"timeout": "0.3s"}})
    rc, out = finish(ws.run(cfg))
    assert rc == 0, out
    assert ws.incidents() == []


def test_startup_timeout_catches_a_job_that_never_beats(ws: Workspace) -> None:
    """With startup_timeout set, an attempt that never beats is a hang."""
    cfg = ws.config(
        {"command": ["sleep", "30"],
         "heartbeat": {"required": True, "startup_timeout": "0.5s"}}, {"max_restarts": 0}
    )
    rc, out = finish(ws.run(cfg))
    assert rc == 1, out
    [inc] = ws.incidents()
    assert inc["kind"] == "hang" and json.loads(inc["evidence"])["startup_timeout_s"] == 0.5


def test_job_output_goes_to_a_per_attempt_log_and_through(ws: Workspace) -> None:
    """stdout and stderr land together in state_dir/jobs/<job>/logs (the job writes the file
    itself, no pipe to us) and, by default, are copied through to our stdout."""
    cfg = ws.config({"command": ["sh", "-c", "echo to-out; echo to-err >&2"]})
    p = subprocess.run(
        [sys.executable, "-m", "trainwatch.cli", "run", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert "to-out" in p.stdout and "to-err" in p.stdout
    [log] = (ws.state / "jobs" / "job" / "logs").iterdir()
    assert set(log.read_text().split()) == {"to-out", "to-err"}


def test_run_with_flags_alone(ws: Workspace) -> None:
    """`trainwatch run` without a config takes the DESIGN flags and the command after --."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainwatch.cli",
            "run",
            "--name",
            "flags",
            "--state-dir",
            str(ws.state),
            "--run-dir",
            str(ws.root / "run"),
            "--checkpoint-dir",
            str(ws.ckpt),
            "--heartbeat-timeout",
            "30s",
            "--max-restarts",
            "2",
            "--metrics-port",  # the default port may be held by another run on this host
            "0",
            "--",
            *ws.worker("--steps", "20", "--crash-at", "15"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert [e["step"] for e in ws.events() if e["event"] == "start"] == [0, 10]


def _one_line_error(args: list[str], expect: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "trainwatch.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert expect in p.stderr and "Traceback" not in p.stderr


def test_run_usage_errors_are_one_line_and_exit_2(ws: Workspace) -> None:
    """No command, a bad flag value, a missing program, a missing config: one line, exit 2."""
    base = ["run", "--state-dir", str(ws.state), "--run-dir", str(ws.root / "run")]
    _one_line_error(base, "expected a command after --")
    _one_line_error([*base, "--heartbeat-timeout", "soon", "--", "true"], "expected a duration")
    _one_line_error([*base, "--max-restarts", "-1", "--", "true"], "expected an integer >= 0")
    _one_line_error([*base, "--", "/nonexistent/train"], "/nonexistent/train: cannot start")
    _one_line_error(
        ["run", "--config", str(ws.root / "missing.yaml"), "--", "true"],
        "missing.yaml: cannot read",
    )
    _one_line_error(["incidents", "--state-dir", str(ws.root / "nowhere")], "no ledger here")


def test_incidents_lists_the_ledger(ws: Workspace) -> None:
    """`trainwatch incidents` prints a table, and --json the full rows."""
    cfg = ws.config({"command": ws.worker("--steps", "30", "--crash-at", "25")})
    assert finish(ws.run(cfg))[0] == 0
    table = subprocess.run(
        [sys.executable, "-m", "trainwatch.cli", "incidents", "--state-dir", str(ws.state)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "crash" in table and "restart" in table
    rows = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "trainwatch.cli",
                "incidents",
                "--state-dir",
                str(ws.state),
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert rows[0]["kind"] == "crash" and rows[0]["resumed_step"] == 20


def test_faultinject_on_an_unknown_job_is_one_line(ws: Workspace) -> None:
    """faultinject against a job trainwatch does not know: one line, exit 2."""
    p = ws.faultinject("crash", job="nope")
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1
    assert "no status for job 'nope'" in p.stderr


def test_every_package_folder_is_listed_in_pyproject() -> None:
    """Every folder under watchdog/ with an __init__.py is a listed subpackage."""
    import tomllib

    root = Path(__file__).parent.parent
    listed = set(
        tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        "trainwatch"
        + (
            "." + ".".join(p.parent.relative_to(root / "watchdog").parts)
            if p.parent != root / "watchdog"
            else ""
        )
        for p in (root / "watchdog").rglob("__init__.py")
    }
    assert found <= listed, found - listed


def test_a_second_trainwatch_for_the_same_job_is_refused(ws: Workspace) -> None:
    """While one trainwatch supervises a job, another on the same run_dir exits 2 in one line."""
    cfg = ws.config({"command": ["sleep", "30"]})
    first = ws.run(cfg)
    wait_for(lambda: ws.status().get("state") == "starting", what="the first to start")
    _one_line_error(["run", "--config", str(cfg)], "already supervised")
    assert first.poll() is None  # the first one is untouched


def test_demo_recovers_from_a_crash_a_hang_an_xid_and_a_spike() -> None:
    """`trainwatch demo` injects its faults, recovers, and proves continuity (exit 0):
    the gradient spike is rolled back to before its onset, the checkpoint after it
    quarantined, its window skipped, and the final weights equal a fault-free run's
    that skips the same window."""
    p = subprocess.run(
        [sys.executable, "-m", "trainwatch.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "incident 1: crash (SIGKILL)" in p.stdout
    assert "incident 2: hang (rank 0 silent" in p.stdout
    assert "incident 3: Xid 79 on GPU 1" in p.stdout
    assert "relaunched on  GPUs 0,2,3 (GPU 1 excluded)" in p.stdout
    assert "incident 4: grad_norm_outlier (grad_norm " in p.stdout
    assert "acted          rollback at step" in p.stdout
    assert "rolled back to step_600.npz (step 600)" in p.stdout
    assert "quarantined    step_650.npz (kept on disk)" in p.stdout
    assert "attempt 4 was given TRAINWATCH_SKIP_STEPS=" in p.stdout
    assert "== an uninterrupted, fault-free run's, skipping steps" in p.stdout
    assert "demo passed" in p.stdout


def test_daemon_supervises_every_job_of_its_config(ws: Workspace) -> None:
    """`trainwatch daemon` runs each configured job under the same loop; one crash, both finish,
    and the daemon stays up (listing them) until SIGTERM."""
    import yaml

    cfg = ws.config({"command": ws.worker("--steps", "20", "--crash-at", "15")})
    doc = yaml.safe_load(cfg.read_text())
    doc["jobs"].append({"name": "other", "command": ["sh", "-c", "sleep 0.5"]})
    cfg.write_text(yaml.safe_dump(doc))
    p = subprocess.Popen([sys.executable, "-m", "trainwatch.cli", "daemon", "--config", str(cfg)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: ws.status().get("state") == "exited"
                 and ws.status("other").get("state") == "exited", 60, "both jobs to finish")
        assert p.poll() is None  # the daemon does not exit when its jobs end
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert [i["job"] for i in ws.incidents()] == ["job"]
    assert "job other: stopping -> exited" in err


def test_dropped_datagrams_are_counted_in_the_published_status(ws: Workspace) -> None:
    """Garbage and oversized datagrams to a live job's socket are dropped, counted, survived."""
    import socket

    cfg = ws.config({"command": ws.worker("--steps", "100000")})
    p = ws.run(cfg)
    sock_path = wait_for(lambda: ws.status().get("state") == "running" and ws.status()["socket"],
                         what="the job to run")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"not json", sock_path)
        s.sendto(b'{"v":1,"k":"beat","step":"x"}', sock_path)
        s.sendto(b"x" * 5000, sock_path)
    counts = wait_for(lambda: (ws.status().get("datagrams") or {}).get("oversized") == 1
                      and ws.status()["datagrams"], what="the counters to be published")
    assert counts["malformed"] == 2
    assert p.poll() is None  # survived
    rc, out = finish_interrupted(p)
    assert rc == 130 and "dropped a malformed datagram" in out


def finish_interrupted(p: subprocess.Popen[bytes]) -> tuple[int, str]:
    p.send_signal(signal.SIGINT)
    return finish(p)


def test_many_ranks_in_lock_step_are_not_taken_for_hung(ws: Workspace) -> None:
    """16 ranks beating together overflow the kernel's 10-datagram queue; none looks hung."""
    cfg = ws.config({"command": ws.worker("--steps", "120", "--interval", "0.05", "--ranks", "16"),
                     "heartbeat": {"timeout": "1s"}}, {"max_restarts": 0})
    rc, out = finish(ws.run(cfg), timeout=60)
    assert rc == 0, out
    assert ws.incidents() == []
    assert len(ws.status()["ranks"]) == 16


def test_a_stalled_reader_of_our_output_does_not_stall_supervision(ws: Workspace) -> None:
    """With trainwatch's stdout a pipe nobody reads, a chatty job's crash is still handled."""
    cfg = ws.config({"command": [sys.executable, "-c",
                                 "import sys; sys.stdout.write('x' * 300000); sys.exit(3)"]},
                    {"max_restarts": 0})
    p = subprocess.Popen([sys.executable, "-m", "trainwatch.cli", "run", "--config", str(cfg)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    ws.procs.append(p)
    wait_for(lambda: ws.incidents(), timeout=20, what="the crash to be recorded")
    assert p.wait(timeout=20) == 1  # fatal, though nobody ever read its stdout


def test_orphans_that_leave_the_session_are_reaped(ws: Workspace) -> None:
    """An orphan in its own session that exits is reaped by trainwatch, not left a zombie."""
    import psutil

    # sh starts `setsid sleep` and exits at once: the sleep is orphaned into its own
    # session and re-parented to trainwatch, the subreaper.
    cfg = ws.config({"command": [sys.executable, "-c",
                                 "import subprocess, time; "
                                 "subprocess.run(['sh', '-c', 'setsid sleep 0.3 & exit 0']); "
                                 "time.sleep(30)"]})
    p = ws.run(cfg)
    wait_for(lambda: ws.status().get("state") == "starting", what="the job to start")
    time.sleep(1.0)  # the orphan has exited by now and re-parented to trainwatch

    def zombies() -> list[int]:
        found = []
        for c in psutil.Process(p.pid).children():
            try:  # reaped between the listing and this look: gone, as it should be
                if c.status() == psutil.STATUS_ZOMBIE:
                    found.append(c.pid)
            except psutil.NoSuchProcess:
                pass
        return found

    wait_for(lambda: not zombies(), timeout=15, what="the zombie to be reaped")


_SAVES_THEN_CRASHES = """
import sys, time
from trainwatch import client
ckpt = sys.argv[1]
resume = client.resume_from()
start = int(open(resume).read()) if resume else 0
hb = client.connect()
for step in range(start + 1, start + 7):
    hb.beat(step)
    time.sleep(0.02)
    if step % 5 == 0:
        path = f"{ckpt}/step_{step}"
        with open(path + ".tmp", "w") as f:
            f.write(str(step))
        import os; os.replace(path + ".tmp", path)
        hb.checkpoint(step, path)
    if step >= 24:
        sys.exit(0)
sys.exit(3)
"""


def test_an_attempt_that_saved_progress_starts_the_backoff_over(ws: Workspace) -> None:
    """Each attempt saves a checkpoint past the one it resumed from, then crashes:
    progress kept, so every relaunch waits the initial backoff, not a doubling one
    (the restart budget is still spent, one crash each)."""
    script = ws.root / "saves.py"
    script.write_text(_SAVES_THEN_CRASHES)
    cfg = ws.config(
        {"command": [sys.executable, str(script), str(ws.ckpt)], "resume_args": []},
        {"max_restarts": 6, "backoff": {"initial": "0.1s", "factor": 4, "jitter": 0}},
    )
    rc, out = finish(ws.run(cfg))
    assert rc == 0, out
    incs = ws.incidents()
    assert [i["kind"] for i in incs] == ["crash"] * 4, incs
    assert [i["backoff_s"] for i in incs] == [0.1] * 4, incs
    assert [i["resumed_step"] for i in incs] == [5, 10, 15, 20], incs
