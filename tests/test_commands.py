"""The operator commands (`trainwatch status`, `incidents`, `checkpoints`,
`rollback`, `pause`/`resume`/`stop`/`start`, `reload`) run as real processes
against a real control socket.

The daemon's server side of these ops is written separately: here a real
`trainwatch.host.control.ControlSocket`, served by a thread of the test, answers
with canned replies in the agreed schema and records what it was asked. Tests
against the live daemon belong with the daemon. Also here: no daemon (no
socket, a stale one), a real unprivileged user kept out by a closed run_dir,
reaching the daemon as itself (SO_PASSCRED) and refused by it, the daemon's
refusals, and `incidents` falling back to
the ledger without a daemon."""

from __future__ import annotations

import grp
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import ServedControl, UserPython, Workspace, local_user, run_name
from trainwatch.cli.commands import render_incidents
from trainwatch.host.control import ControlSocket, Peer, Refused, control_path
from trainwatch.state.ledger import Ledger
from trainwatch.types import Fault, FaultKind

NO_GROUP = "tw-no-such-group"  # an admin group nobody is in: root and the daemon only
OTHER = run_name("test1")  # a user of this run's own (conftest)
Reply = dict[str, Any] | Exception


class Daemon(ServedControl):
    """A ControlSocket answered by a selector loop in a thread, with canned
    replies per op (an Exception is raised, as a daemon's refusal is)."""

    def __init__(self, run_dir: str, replies: dict[str, Reply], group: str = NO_GROUP) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.peers: list[Peer] = []
        self.replies = replies
        super().__init__(ControlSocket(run_dir, self._handle, group=group))

    def _handle(self, op: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        self.calls.append((op, args))
        self.peers.append(peer)
        reply = self.replies[op]
        if isinstance(reply, Exception):
            raise reply
        return reply



@pytest.fixture
def run_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="tw", dir="/tmp")  # short: AF_UNIX paths are <= 107 bytes
    os.chmod(d, 0o755)  # other users may reach the socket; its own mode decides
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(run_dir: str) -> Iterator[Daemon]:
    d = Daemon(run_dir, {**REPLIES, "status": _status()})
    yield d
    d.stop()


def _tw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainwatch.cli", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def _ok(p: subprocess.CompletedProcess[str]) -> list[str]:
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert p.stderr == ""
    return p.stdout.splitlines()


def _one_line(p: subprocess.CompletedProcess[str], rc: int = 1) -> str:
    assert p.returncode == rc, (p.stdout, p.stderr)
    assert p.stdout == "" or (rc == 1 and p.stdout.startswith("{"))  # reload --json
    assert p.stderr.count("\n") == 1, p.stderr
    assert "Traceback" not in p.stderr
    return p.stderr.strip()


def _incident_row(i: int, job: str, kind: str, **kw: Any) -> dict[str, Any]:
    row = {"id": i, "time": time.time() - 3600, "job": job, "kind": kind, "rank": None,
           "action": "restart", "attempt": 1, "detection_latency_s": 0.25,
           "time_to_relaunch_s": 3.5, "resumed_step": 20, "steps_lost": 5,
           "observe_only": False}
    return {**row, **kw}


def _status() -> dict[str, Any]:
    """A status reply whose last incident was 250 s ago (4m, however slow the CLI starts)."""
    return {"jobs": [
        {"job": "llama", "state": "running", "paused": True, "attempt": 2, "pid": 4242,
         "step": 1234, "steps_per_second": 12.345, "last_beat_age": 3.21, "restarts": 2,
         "gpus": [0, 1], "last_incident": {"id": 7, "kind": "crash", "action": "restart",
                                           "time": time.time() - 250}},
        {"job": "bert", "state": "backoff", "paused": False, "attempt": 0, "pid": None,
         "step": None, "steps_per_second": None, "last_beat_age": None, "restarts": 0,
         "gpus": None, "last_incident": None},
        {"job": "t5", "state": None, "paused": True, "attempt": 0, "pid": None, "step": None,
         "steps_per_second": 1500.0, "last_beat_age": 7300.0, "restarts": 11, "gpus": [],
         "last_incident": None},
    ],
    "daemon": DAEMON}


DAEMON = {"pid": 99, "version": "0.1.0", "uptime": 7300.0,
          "config": "/etc/trainwatch/trainwatch.yaml"}
INCIDENTS = [_incident_row(3, "llama", "crash"),
             _incident_row(4, "llama", "hang", rank=1, action="alert", observe_only=True,
                           detection_latency_s=None, steps_lost=None)]
CHECKPOINTS = {"job": "llama", "checkpoints": [
    {"step": 10, "path": "/ck/step_10", "verdict": "good", "why": None, "last_good": False},
    {"step": 20, "path": "/ck/step_20", "verdict": "good", "why": None, "last_good": True,
     "health": {"loss": 2.3456789, "loss_z": -0.42}, "size": 3 << 20, "time": 1.8e9,
     "attempts": [1, 2]},
    {"step": 30, "path": "/ck/step_30", "verdict": "quarantined",
     "why": "after a nan_loss at step 27", "last_good": False},
    {"step": 40, "path": "/ck/step_40", "verdict": "bad", "why": "missing model.pt",
     "last_good": False},
]}
REPLIES: dict[str, Reply] = {
    "incidents": {"incidents": INCIDENTS},
    "checkpoints": CHECKPOINTS,
    "rollback": {"job": "llama", "checkpoint": "/ck/step_20", "step": 20},
    "pause": {"job": "llama", "state": "running", "paused": True},
    "resume": {"job": "llama", "state": "running", "paused": False},
    "stop": {"job": "llama", "state": "stopping", "paused": False},
    "start": {"job": "llama", "state": "starting", "paused": False},
    "reload": {"reloaded": True, "error": None, "added": ["gpt"], "changed": ["llama"],
               "removed": [], "unchanged": ["bert", "t5"]},
}


# --- status ------------------------------------------------------------------


def test_status_prints_the_daemon_and_one_line_per_job(daemon: Daemon, run_dir: str) -> None:
    """status: the daemon's line, a header, and per job its state, step, rate, beat age,
    restarts, GPUs and last incident, with - for what is unknown."""
    lines = _ok(_tw("status", "--run-dir", run_dir))
    assert daemon.calls == [("status", {})]
    assert lines[0] == "trainwatch 0.1.0: pid 99, up 2h, config /etc/trainwatch/trainwatch.yaml"
    assert lines[1].split() == ["JOB", "STATE", "STEP", "STEPS/S", "BEAT", "RESTARTS", "GPUS",
                                "LAST", "INCIDENT"]
    assert lines[2].split() == ["llama", "running", "(paused)", "1234", "12.3", "3.2s", "2",
                                "0,1", "#7", "crash", "restart", "4m", "ago"]
    assert lines[3].split() == ["bert", "backoff", "-", "-", "-", "0", "-", "-"]
    assert lines[4].split() == ["t5", "-", "(paused)", "-", "1500", "2h", "11", "none", "-"]
    assert len(lines) == 5
    # Columns line up: each job's step starts under STEP.
    assert lines[2].index("1234") == lines[1].index("STEP ")


def test_status_json_is_the_reply_payload(daemon: Daemon, run_dir: str) -> None:
    """status --json prints the daemon's reply without "ok"."""
    assert json.loads(_tw("status", "--run-dir", run_dir, "--json").stdout) \
        == daemon.replies["status"]


def test_status_without_jobs_says_so(run_dir: str) -> None:
    """A daemon with no jobs: "no jobs" after its line."""
    d = Daemon(run_dir, {"status": {"jobs": [], "daemon": DAEMON}})
    try:
        assert _ok(_tw("status", "--run-dir", run_dir))[1:] == ["no jobs"]
    finally:
        d.stop()


def test_status_finds_the_run_dir_in_the_config(ws: Workspace) -> None:
    """--config F: the request goes to the run_dir F names."""
    config = ws.config({"command": ["true"]})
    d = Daemon(str(ws.root / "run"), {"status": _status()})
    try:
        assert _ok(_tw("status", "--config", str(config)))[2].startswith("llama")
        assert d.calls == [("status", {})]
    finally:
        d.stop()


# --- incidents ---------------------------------------------------------------


def test_incidents_from_the_daemon(daemon: Daemon, run_dir: str) -> None:
    """incidents asks with the job and limit, prints the ledger's table, --json its rows."""
    p = _tw("incidents", "--run-dir", run_dir, "--job", "llama", "--limit", "5")
    lines = _ok(p)
    assert daemon.calls == [("incidents", {"job": "llama", "limit": 5})]
    assert p.stdout == render_incidents(INCIDENTS) + "\n"
    assert lines[0].split() == ["id", "time", "job", "kind", "rank", "action", "attempt",
                                "detect", "relaunch", "resumed", "lost"]
    assert lines[1].split()[3:] == ["llama", "crash", "-", "restart", "1", "0.250s", "3.500s",
                                    "20", "5"]
    assert lines[2].split()[3:] == ["llama", "hang", "1", "alert", "(observed)", "1", "-",
                                    "3.500s", "20", "-"]
    rows = json.loads(_tw("incidents", "--run-dir", run_dir, "--json").stdout)
    assert rows == INCIDENTS
    assert daemon.calls[-1] == ("incidents", {"job": None, "limit": 50})


def _ledger_with(ws: Workspace, *kinds: FaultKind) -> None:
    ledger = Ledger(ws.state)
    try:
        for k in kinds:
            ledger.incident(Fault(k, "job", time.monotonic()), "restart", "within budget", 1,
                            0.5)
    finally:
        ledger.close()


def test_incidents_without_a_daemon_read_the_ledger(ws: Workspace) -> None:
    """No daemon behind the config's run_dir: incidents reads its state_dir's ledger."""
    config = ws.config({"command": ["true"]})
    _ledger_with(ws, FaultKind.CRASH, FaultKind.HANG, FaultKind.NAN_LOSS)
    lines = _ok(_tw("incidents", "--config", str(config)))
    assert [line.split()[4] for line in lines[1:]] == ["crash", "hang", "nan_loss"]
    rows = json.loads(_tw("incidents", "--config", str(config), "--json", "--limit", "2").stdout)
    assert [r["kind"] for r in rows] == ["hang", "nan_loss"]  # the newest 2, oldest first


def test_incidents_with_a_state_dir_reads_that_ledger(ws: Workspace) -> None:
    """--state-dir D names the ledger: read directly, the newest --limit N; a D without
    one is exit 2, one line."""
    _ledger_with(ws, FaultKind.CRASH, FaultKind.HANG)
    lines = _ok(_tw("incidents", "--state-dir", str(ws.state), "--limit", "1"))
    assert [line.split()[4] for line in lines[1:]] == ["hang"]
    rows = json.loads(_tw("incidents", "--state-dir", str(ws.state), "--json").stdout)
    assert [(r["kind"], r["job"]) for r in rows] == [("crash", "job"), ("hang", "job")]
    line = _one_line(_tw("incidents", "--state-dir", str(ws.root / "nowhere")), rc=2)
    assert line == (f"trainwatch: {ws.root}/nowhere: no ledger here (expected"
                    f" {ws.root}/nowhere/ledger.db)")


def test_incidents_without_a_daemon_or_a_ledger_is_one_line(ws: Workspace) -> None:
    """Neither a daemon nor a ledger: one line naming both, exit 1."""
    config = ws.config({"command": ["true"]})
    line = _one_line(_tw("incidents", "--config", str(config)))
    assert f"no trainwatch daemon at {ws.root}/run/control.sock" in line
    assert f"no ledger at {ws.state}/ledger.db" in line


def test_incidents_with_a_bare_run_dir_does_not_guess_a_ledger(run_dir: str) -> None:
    """--run-dir alone with no daemon there: the no-daemon line, not another ledger."""
    line = _one_line(_tw("incidents", "--run-dir", run_dir))
    assert line == (f"trainwatch: no trainwatch daemon at {run_dir}/control.sock (is it"
                    " running? --run-dir/--config)")


# --- checkpoints, rollback, job commands, reload -----------------------------


def test_checkpoints_table_marks_the_last_good(daemon: Daemon, run_dir: str) -> None:
    """checkpoints JOB: STEP VERDICT LOSS SIZE WRITTEN RESUMED-BY PATH (WHY), the last good
    one's verdict "last good", the loss when it was reported (and its distance from the
    recent mean), and the attempts that resumed from it."""
    lines = _ok(_tw("checkpoints", "llama", "--run-dir", run_dir))
    assert daemon.calls == [("checkpoints", {"job": "llama", "plan": False})]
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1.8e9))
    assert [" ".join(line.split()) for line in lines] == [
        "STEP VERDICT LOSS SIZE WRITTEN RESUMED BY PATH",
        "10 good - - - - /ck/step_10",
        f"20 last good 2.346 (-0.4 sd) 3.0M {written} 1,2 /ck/step_20",
        "30 quarantined - - - - /ck/step_30 (after a nan_loss at step 27)",
        "40 bad - - - - /ck/step_40 (missing model.pt)",
    ]
    assert json.loads(_tw("checkpoints", "llama", "--run-dir", run_dir, "--json").stdout) \
        == CHECKPOINTS


def test_rollback_prints_where_it_relaunches_from(daemon: Daemon, run_dir: str) -> None:
    """rollback JOB --to-step N sends job and step and prints one line."""
    lines = _ok(_tw("rollback", "llama", "--to-step", "20", "--run-dir", run_dir))
    assert daemon.calls == [("rollback", {"job": "llama", "step": 20})]
    assert lines == ["llama: relaunching from step 20 (/ck/step_20)"]
    p = _tw("rollback", "llama", "--to-step", "20", "--run-dir", run_dir, "--json")
    assert json.loads(p.stdout) == REPLIES["rollback"]


@pytest.mark.parametrize(("op", "says"), [
    ("pause", "llama: running (paused)"),
    ("resume", "llama: running"),
    ("stop", "llama: stopping"),
    ("start", "llama: starting"),
])
def test_job_commands_send_their_op_and_print_the_state(
    daemon: Daemon, run_dir: str, op: str, says: str
) -> None:
    """pause/resume/stop/start JOB: the op with the job, one line with its new state."""
    assert _ok(_tw(op, "llama", "--run-dir", run_dir)) == [says]
    assert daemon.calls == [(op, {"job": "llama"})]
    assert json.loads(_tw(op, "llama", "--run-dir", run_dir, "--json").stdout) == REPLIES[op]


def test_reload_prints_a_summary(daemon: Daemon, run_dir: str) -> None:
    """reload: one line naming what was added, changed and removed."""
    assert _ok(_tw("reload", "--run-dir", run_dir)) == [
        "reloaded: added gpt; changed llama; 2 unchanged"]
    assert daemon.calls == [("reload", {})]


def test_reload_refused_is_the_error_line_and_exit_1(run_dir: str) -> None:
    """A reload the daemon did not apply: its error on one line, exit 1 (with --json too)."""
    error = "/etc/trainwatch/trainwatch.yaml: jobs[0].name: expected a name, got ''"
    d = Daemon(run_dir, {"reload": {"reloaded": False, "error": error, "added": [],
                                    "changed": [], "removed": [], "unchanged": ["a"]}})
    try:
        assert _one_line(_tw("reload", "--run-dir", run_dir)) == f"trainwatch reload: {error}"
        p = _tw("reload", "--run-dir", run_dir, "--json")
        assert _one_line(p) == f"trainwatch reload: {error}"
        assert json.loads(p.stdout)["reloaded"] is False
    finally:
        d.stop()


# --- failures ----------------------------------------------------------------

COMMANDS = [["status"], ["incidents"], ["checkpoints", "j"], ["rollback", "j", "--to-step", "1"],
            ["pause", "j"], ["resume", "j"], ["stop", "j"], ["start", "j"], ["reload"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_no_daemon_is_one_line_and_exit_1(run_dir: str, argv: list[str]) -> None:
    """No control socket in run_dir: one line saying where it looked and what to check."""
    line = _one_line(_tw(*argv, "--run-dir", run_dir))
    assert line == (f"trainwatch: no trainwatch daemon at {run_dir}/control.sock (is it"
                    " running? --run-dir/--config)")


def test_stale_socket_is_no_daemon(run_dir: str) -> None:
    """A socket file nobody is bound to (a daemon that died): the same no-daemon line."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(control_path(run_dir))
    s.close()
    assert "no trainwatch daemon at" in _one_line(_tw("status", "--run-dir", run_dir))


def test_daemon_refusal_is_one_line_and_exit_1(run_dir: str) -> None:
    """ok=false from the daemon: "trainwatch OP: why", exit 1."""
    d = Daemon(run_dir, {"pause": LookupError("no job named 'nope'")})
    try:
        line = _one_line(_tw("pause", "nope", "--run-dir", run_dir))
        assert line == "trainwatch pause: no job named 'nope'"
    finally:
        d.stop()


def test_reply_of_another_shape_is_one_line(run_dir: str) -> None:
    """A reply without the expected fields (another version): one line, exit 1."""
    d = Daemon(run_dir, {"status": {"jobs": [{"job": "a"}]}, "checkpoints": {"job": "a"}})
    try:
        assert "unexpected reply" in _one_line(_tw("status", "--run-dir", run_dir))
        assert "unexpected reply" in _one_line(_tw("checkpoints", "a", "--run-dir", run_dir))
    finally:
        d.stop()


@pytest.mark.parametrize(("argv", "says"), [
    (["rollback", "j"], "the following arguments are required: --to-step"),
    (["rollback", "j", "--to-step", "-1"], "--to-step: expected an integer >= 0, got '-1'"),
    (["incidents", "--limit", "0"], "--limit: expected an integer >= 1, got '0'"),
    (["pause"], "the following arguments are required: job"),
], ids=["no-step", "negative-step", "zero-limit", "no-job"])
def test_usage_mistakes_are_one_line_and_exit_2(
    run_dir: str, argv: list[str], says: str
) -> None:
    """A missing or bad argument: one line saying what was expected, exit 2."""
    assert says in _one_line(_tw(*argv, "--run-dir", run_dir), rc=2)


# --- another user ------------------------------------------------------------


def _as_user(up: UserPython, user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    u = local_user(user)
    return subprocess.run(
        ["setpriv", f"--reuid={u.pw_uid}", f"--regid={u.pw_gid}", "--clear-groups",
         up.python, "-m", "trainwatch.cli", *argv],
        env=up.env(), capture_output=True, text=True, timeout=60, check=False)


def test_other_user_is_kept_out_by_a_closed_run_dir(
    user_python: UserPython, run_dir: str
) -> None:
    """A run_dir of mode 0o700 (a non-root trainwatch's): the permission line, exit 1."""
    d = Daemon(run_dir, {"status": _status()})
    try:
        os.chmod(run_dir, 0o700)
        assert _one_line(_as_user(user_python, OTHER, "status", "--run-dir", run_dir)) \
            == (f"trainwatch: permission denied: {run_dir}/control.sock: its folder (run_dir)"
                " is not open to this user")
        assert d.calls == []
    finally:
        d.stop()


def test_other_user_is_refused_by_the_daemon(user_python: UserPython, run_dir: str) -> None:
    """The daemon's refusal of a job not the sender's: its line after the op, exit 1."""
    u = local_user(OTHER)
    who = f"uid {u.pw_uid} ({OTHER})"
    d = Daemon(run_dir, {"stop": Refused(f"job llama runs as alice; {who} may act only on "
                                         "its own jobs")})
    try:
        line = _one_line(_as_user(user_python, OTHER, "stop", "llama", "--run-dir",
                                  run_dir))
        assert line == f"trainwatch stop: job llama runs as alice; {who} may act only on " \
                       "its own jobs"
        assert [(p.uid, p.admin) for p in d.peers] == [(u.pw_uid, False)]
        assert d.sock.counters.refused == 1
    finally:
        d.stop()


def test_member_of_the_group_is_answered(user_python: UserPython, run_dir: str) -> None:
    """A real non-root user in the admin group reaches the daemon as an admin."""
    # The user's own group, made the socket's group here.
    group = grp.getgrgid(local_user(OTHER).pw_gid).gr_name
    d = Daemon(run_dir, {"status": _status()}, group=group)
    try:
        p = _as_user(user_python, OTHER, "status", "--run-dir", run_dir)
        assert _ok(p)[2].startswith("llama")
        assert d.calls == [("status", {})]
        assert [p.admin for p in d.peers] == [True]
    finally:
        d.stop()
