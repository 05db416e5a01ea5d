"""`trainwatch daemon` as a host service (issue 10), black box: the real CLI, real
processes and signals, the files it writes. Its jobs outlive it by design (SIGKILL
or SIGTERM), and the next daemon re-adopts them; every test kills what it started
by pid (the daemons, the jobs' processes from their pid files and status.json,
and the keepers runtime.json names)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import missing, pid_gone, wait_for

PRINTER = Path(__file__).parent / "jobs" / "printer.py"
SYSTEMD_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "INVOCATION_ID",
                "JOURNAL_STREAM")


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (/proc/<pid>/stat field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def alive(pid: int) -> bool:
    return not pid_gone(pid)


def proc_state(pid: int) -> str:
    """The State: line of /proc/<pid>/status ("S (sleeping)", "T (stopped)", ...)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split(":", 1)[1].strip()
    return "?"


def cgroup2_mounts() -> list[str]:
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[2:3] == ["cgroup2"]]


def cgroup_empty(cg: str) -> bool:
    return not Path(cg, "cgroup.procs").read_text().strip()


def steps(log: Path) -> list[int]:
    """The "step N" lines a printer job wrote to its log, in order."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [int(m) for m in re.findall(r"^step (\d+)$", text, re.M)]


class Daemon:
    """One `trainwatch daemon --config` process, its output in a file."""

    def __init__(self, root: Path, config: Path, n: int, env: dict[str, str] | None) -> None:
        self.out = root / f"daemon-{n}.out"
        with open(self.out, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainwatch.cli", "daemon", "--config", str(config)],
                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=30)


class Host:
    """A short temp dir with a state dir, a run dir, one folder per job (its
    triggers, pid files and checkpoints), and the daemons started on it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / "state"
        self.run_dir = root / "run"
        self.path = root / "trainwatch.yaml"
        self.daemons: list[Daemon] = []
        self.strangers: list[subprocess.Popen[bytes]] = []
        # (pid, start time) of every job process and keeper seen: killed at the end.
        self.seen: set[tuple[int, int]] = set()
        self.cgroups: set[str] = set()  # every attempt's, removed at the end when empty

    def job_dir(self, job: str) -> Path:
        return self.root / job

    def job_doc(self, job: str, *args: str) -> dict[str, Any]:
        d = self.job_dir(job)
        return {
            "name": job,
            "command": [sys.executable, str(PRINTER), "--dir", str(d), *args],
            "resume_args": ["--resume-from", "{checkpoint}"],
            "checkpoints": {"dir": str(d / "ckpt"), "pattern": "step_{step}"},
            "heartbeat": {"timeout": "60s"},
            "policy": "default",
        }

    def config(self, jobs: list[dict[str, Any]], **top: Any) -> Path:
        """Write the config file (the same path each time: SIGHUP rereads it)."""
        doc: dict[str, Any] = {
            "state_dir": str(self.state), "run_dir": str(self.run_dir),
            "metrics": {"port": 0}, "gpu": {"backend": "off", "kmsg": None},
            "jobs": jobs,
            "policies": {"default": {
                "max_restarts": 5, "kill_grace": "2s",
                "backoff": {"initial": "0.1s", "factor": 2, "max": "1s", "jitter": 0}}},
            **top,
        }
        for j in jobs:
            (self.job_dir(j["name"]) / "ckpt").mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(doc))
        os.replace(tmp, self.path)
        return self.path

    def daemon(self, env: dict[str, str] | None = None) -> Daemon:
        d = Daemon(self.root, self.path, len(self.daemons), env)
        self.daemons.append(d)
        return d

    def stranger(self) -> subprocess.Popen[bytes]:
        """A process that is nobody's job: it writes down every signal it catches."""
        log = self.root / "stranger.signals"
        code = ("import signal, sys, time\n"
                "def h(s, f):\n"
                f"    open({str(log)!r}, 'a').write(f'{{s}}\\n')\n"
                "for s in (1, 2, 3, 10, 12, 14, 15, 18):\n"
                "    signal.signal(s, h)\n"
                "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
                "while True:\n"
                "    time.sleep(1000)\n")
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             start_new_session=True)
        self.strangers.append(p)
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        return p

    # what the daemon wrote

    def _json(self, job: str, name: str) -> dict[str, Any]:
        try:
            d = json.loads((self.state / "jobs" / job / name).read_text())
        except (OSError, ValueError):
            return {}
        return d if isinstance(d, dict) else {}

    def status(self, job: str) -> dict[str, Any]:
        s = self._json(job, "status.json")
        self._remember(s.get("pid"))
        self._cgroup(s.get("cgroup"))
        return s

    def runtime(self, job: str) -> dict[str, Any]:
        rt = self._json(job, "runtime.json")
        launched = rt.get("launched")
        if isinstance(launched, dict):
            self._remember(launched.get("pid"))
            self._remember(launched.get("keeper"))
            self._cgroup(launched.get("cgroup_path"))
        return rt

    def _cgroup(self, path: object) -> None:
        if isinstance(path, str) and os.path.isabs(path):
            self.cgroups.add(path)

    def _remember(self, pid: object) -> None:
        if isinstance(pid, int) and pid > 0 and pid not in {p.pid for p in self.strangers}:
            t = start_time(pid)
            if t is not None:
                self.seen.add((pid, t))

    def running(self, job: str, **want: Any) -> dict[str, Any]:
        """status.json once it says running (and matches `want`), else {}."""
        s = self.status(job)
        ok = s.get("state") == "running" and s.get("pid")
        return s if ok and all(s.get(k) == v for k, v in want.items()) else {}

    def step(self, job: str) -> int:
        return int(self.status(job).get("step") or 0)

    def _db(self, sql: str) -> list[dict[str, Any]]:
        db = self.state / "ledger.db"
        if not db.exists():
            return []
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        con.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in con.execute(sql)]
        except sqlite3.OperationalError:
            return []
        finally:
            con.close()

    def incidents(self) -> list[dict[str, Any]]:
        return self._db("SELECT * FROM incidents ORDER BY id")

    def transitions(self) -> list[dict[str, Any]]:
        return self._db("SELECT * FROM transitions ORDER BY id")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "trainwatch.cli", *args],
                              capture_output=True, text=True, timeout=60, check=False)

    def trigger(self, job: str, name: str, text: str = "") -> None:
        tmp = self.job_dir(job) / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.job_dir(job) / name)

    # cleanup

    def cleanup(self) -> None:
        for d in self.daemons:
            with contextlib.suppress(Exception):
                d.kill()
        jobs = self.state / "jobs"
        if jobs.is_dir():
            for j in jobs.iterdir():
                self.status(j.name)
                self.runtime(j.name)
        ours = str(self.root).encode()
        for f in self.root.glob("*/pids/*"):
            with contextlib.suppress(ValueError, OSError):
                pid = int(f.name)
                # Only a process that is still one of this test's jobs (pid reuse).
                if ours in Path(f"/proc/{pid}/cmdline").read_bytes():
                    self._remember(pid)
        killed = []
        for pid, t in sorted(self.seen):
            if start_time(pid) == t:
                killed.append(pid)
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    with contextlib.suppress(OSError):
                        os.kill(pid, sig)
        for pid in killed:
            with contextlib.suppress(AssertionError):
                wait_for(functools.partial(pid_gone, pid), timeout=10, what=f"{pid} to die")
        for p in self.strangers:
            p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()
        self._remove_cgroups()
        shutil.rmtree(self.root, ignore_errors=True)

    def _remove_cgroups(self) -> None:
        """The attempts' cgroups, empty now, that no daemon is left to remove."""
        for cg in sorted(self.cgroups):
            if not os.path.isdir(cg) or not any(cg.startswith(m + "/") for m in cgroup2_mounts()):
                continue
            with contextlib.suppress(AssertionError, OSError):
                wait_for(functools.partial(cgroup_empty, cg), timeout=5,
                         what="the cgroup to empty")
                os.rmdir(cg)


@pytest.fixture
def host() -> Iterator[Host]:
    h = Host(Path(tempfile.mkdtemp(prefix="twd", dir="/tmp")))
    try:
        yield h
    finally:
        h.cleanup()


def started(h: Host, d: Daemon, job: str, min_step: int = 5, timeout: float = 60.0,
            **want: Any) -> dict[str, Any]:
    """Wait until the job runs and has beaten min_step steps (failing with the daemon's output)."""
    try:
        wait_for(lambda: h.running(job, **want) and h.step(job) >= min_step, timeout=timeout,
                 what=f"job {job} running at step >= {min_step} {want or ''}")
    except AssertionError as e:
        raise AssertionError(f"{e}; status {h.status(job)}; daemon alive {d.alive()}:\n"
                             f"{_story(d.output())}") from None
    return h.status(job)


def _story(output: str, size: int = 6000) -> str:
    """The daemon's output without its stream of checkpoint lines, the end of it."""
    keep = [x for x in output.splitlines() if not re.search(r"checkpoint step \d+ complete", x)]
    return "\n".join(keep)[-size:]


def log_grows(log: Path, timeout: float = 20.0) -> int:
    """Wait until the log shows at least 5 more steps than now; the last step."""
    before = max(steps(log), default=0)
    wait_for(lambda: max(steps(log), default=0) >= before + 5, timeout=timeout,
             what=f"{log.name} to grow past step {before}")
    return max(steps(log))


def exited_at(log: Path, code: int) -> int:
    """The step at which the printer obeyed its exit_code trigger (its last such line)."""
    found = re.findall(rf"^exit {code} at step (\d+)$", log.read_text(errors="replace"), re.M)
    assert found, f"{log.name} does not show the job exiting {code}:\n{log.read_text()[-500:]}"
    return int(found[-1])


def sigkill(d: Daemon) -> None:
    d.kill()
    assert d.proc.returncode == -signal.SIGKILL


def test_a_job_outlives_a_sigkilled_daemon_and_is_adopted_by_the_next(host: Host) -> None:
    """The next daemon adopts the job (same pid and attempt, no incident); a crash resumes it."""
    host.config([host.job_doc("a")])
    d1 = host.daemon()
    s = started(host, d1, "a")
    pid, attempt, log = s["pid"], s["attempt"], Path(s["log"])
    assert log.parent == host.state / "jobs" / "a" / "logs", log
    assert log.name.startswith(f"attempt-{attempt}-"), log
    assert f"stderr too, pid={pid}" in log.read_text()
    sigkill(d1)
    assert alive(pid)
    log_grows(log)  # straight to the file: the daemon is not in the way
    assert alive(pid)

    d2 = host.daemon()
    s = started(host, d2, "a", min_step=host.step("a") + 5)
    assert (s["pid"], s["attempt"], s["log"]) == (pid, attempt, str(log))
    log_grows(log)
    assert host.incidents() == []
    assert any("adopt" in f"{t['to_state']} {t['reason']}".lower() for t in host.transitions()
               if t["job"] == "a"), host.transitions()

    # Crash the adopted job once it has a checkpoint: relaunched from the newest one.
    wait_for(lambda: max(steps(log), default=0) >= 25, timeout=30, what="step 25")
    host.trigger("a", "exit_code", "3")
    s = started(host, d2, "a", min_step=0, attempt=attempt + 1)
    assert s["pid"] != pid
    died = exited_at(log, 3)
    newest = died // 20 * 20
    [inc] = host.incidents()
    assert (inc["kind"], inc["attempt"], inc["action"]) == ("crash", attempt, "restart"), inc
    assert json.loads(inc["evidence"])["exit_code"] == 3, inc
    assert inc["resumed_step"] == newest, (dict(inc), s)
    relaunched = Path(s["log"])
    assert relaunched != log and relaunched.name.startswith(f"attempt-{attempt + 1}-")
    ckpt = host.job_dir("a") / "ckpt" / f"step_{newest}"
    wait_for(lambda: f"--resume-from {ckpt}" in relaunched.read_text(), timeout=10,
             what="the relaunch's resume argument in its log")
    assert f"attempt={attempt + 1} step={newest}" in relaunched.read_text()
    assert s.get("resumed_from") == str(ckpt), s
    assert d2.alive()


def test_an_adopted_job_that_exits_0_is_recorded_finished(host: Host) -> None:
    """An adopted job's exit 0 is `exited`, with no incident, and the daemon goes on running."""
    host.config([host.job_doc("a")])
    d1 = host.daemon()
    pid = started(host, d1, "a")["pid"]
    sigkill(d1)
    d2 = host.daemon()
    started(host, d2, "a", min_step=host.step("a") + 3, pid=pid)
    host.trigger("a", "exit_code", "0")
    wait_for(lambda: host.status("a").get("state") == "exited", timeout=30,
             what="state exited")
    assert pid_gone(pid)
    assert host.incidents() == []
    assert [t["to_state"] for t in host.transitions()][-1] == "exited"
    time.sleep(1)  # the daemon is a service: no job left is no reason to exit
    assert d2.alive(), d2.output()[-2000:]
    assert host.status("a")["state"] == "exited"


def test_a_job_that_dies_while_the_daemon_is_down_is_handled_at_the_next_start(
        host: Host) -> None:
    """An exit while no daemon runs is, at the next start, a crash with its exit code."""
    host.config([host.job_doc("a")])
    d1 = host.daemon()
    s = started(host, d1, "a", min_step=22)
    pid, attempt = s["pid"], s["attempt"]
    sigkill(d1)
    # What the daemon had recorded as reported when it died: the job checkpoints on
    # while no daemon runs (on a busy machine, past the next one), and those reports
    # reach nobody.
    catalog = json.loads((host.state / "jobs" / "a" / "catalog.json").read_text())
    known = {int(k) for k in catalog["reported"]}
    host.trigger("a", "exit_code", "3")
    wait_for(lambda: pid_gone(pid), timeout=20, what="the job to exit")
    died = exited_at(Path(s["log"]), 3)

    d2 = host.daemon()
    s = started(host, d2, "a", min_step=0, attempt=attempt + 1)
    assert s["pid"] != pid
    [inc] = host.incidents()
    assert (inc["kind"], inc["attempt"]) == ("crash", attempt), inc
    evidence = json.loads(inc["evidence"])
    assert evidence.get("exit_code") == 3, evidence
    # The newest checkpoint reported to a daemon: one written at the very step the job
    # exited, or after the daemon died, was reported to none and is not known complete.
    newest = max((k for k in known if k < died), default=None)
    assert newest is not None and inc["resumed_step"] == newest, (inc, sorted(known), died)


def test_a_recycled_pid_is_never_adopted_or_signalled(host: Host) -> None:
    """A saved attempt whose pid is now a stranger's is not adopted; the stranger gets no signal."""
    host.config([host.job_doc("a")])
    d1 = host.daemon()
    s = started(host, d1, "a", min_step=1)
    sigkill(d1)
    rt = host.runtime("a")
    assert isinstance(rt.get("launched"), dict), rt
    # The job and its keeper go; a stranger then takes their pid in runtime.json.
    for pid, t in list(host.seen):
        if start_time(pid) == t:
            os.kill(pid, signal.SIGKILL)
    for pid, _t in list(host.seen):
        wait_for(functools.partial(pid_gone, pid), timeout=20, what=f"{pid} to die")

    stranger = host.stranger()
    st = start_time(stranger.pid)
    assert st is not None
    rt_path = host.state / "jobs" / "a" / "runtime.json"
    rt["state"] = "running"
    launched = rt["launched"]
    launched["pid"] = launched["keeper"] = stranger.pid
    # The start times stay the dead processes' (moved further off): never the stranger's.
    for k in ("leader_start", "keeper_start"):
        launched[k] = launched.get(k, 0) + 1000
    # No exit status either (as after a reboot): nothing says how the attempt ended.
    if isinstance(launched.get("exit_path"), str):
        for suffix in ("", ".start"):
            Path(launched["exit_path"] + suffix).unlink(missing_ok=True)
    rt_path.write_text(json.dumps(rt))

    d2 = host.daemon()
    # status.json still names the dead job's pid until the new daemon writes it.
    wait_for(lambda: host.status("a").get("pid") not in (None, s["pid"]), timeout=60,
             what="the new daemon's status.json")
    s2 = started(host, d2, "a", min_step=1)
    assert s2["pid"] != stranger.pid, (s2, d2.output()[-2000:])
    assert str(PRINTER).encode() in Path(f"/proc/{s2['pid']}/cmdline").read_bytes()
    time.sleep(1)  # anything the daemon would do to the stranger is done by now
    assert stranger.poll() is None
    assert start_time(stranger.pid) == st
    assert not proc_state(stranger.pid).startswith("T"), proc_state(stranger.pid)
    signals = host.root / "stranger.signals"
    assert not signals.exists(), signals.read_text()
    assert not any("adopt" in t["reason"].lower() and str(stranger.pid) in t["reason"]
                   for t in host.transitions()), host.transitions()


def test_the_restart_budget_carries_over_a_daemon_restart(host: Host) -> None:
    """A crash loop spends one budget across two daemons: 3 restarts in all, then fatal."""
    doc = host.job_doc("a")
    doc["command"] = ["sh", "-c", "sleep 0.3; exit 1"]
    host.config([doc])
    raw = yaml.safe_load(host.path.read_text())
    raw["policies"]["default"].update(max_restarts=3, backoff={"initial": "1s", "factor": 1,
                                                                 "jitter": 0})
    host.path.write_text(yaml.safe_dump(raw))
    d1 = host.daemon()
    wait_for(lambda: len(host.incidents()) >= 2, timeout=60, what="two crashes")
    sigkill(d1)
    host.runtime("a")
    d2 = host.daemon()
    wait_for(lambda: host.status("a").get("state") == "fatal", timeout=60,
             what=f"fatal; incidents {host.incidents()}; {d2.output()[-2000:]}")
    incs = host.incidents()
    assert [i["kind"] for i in incs] == ["crash"] * 4, ([(i["attempt"], i["decision"])
                                                        for i in incs], d2.output()[-3000:])
    assert [i["attempt"] for i in incs] == [0, 1, 2, 3], incs
    assert "budget" in incs[-1]["decision"], incs[-1]
    assert d2.alive()


def test_sighup_with_a_bad_config_keeps_the_old_one(host: Host) -> None:
    """A bad config on SIGHUP is one line naming the file; the daemon and job go on."""
    host.config([host.job_doc("a")])
    d = host.daemon()
    pid = started(host, d, "a")["pid"]
    before = d.output()
    good = host.path.read_text()
    host.path.write_text(good.replace("max_restarts: 5", "max_restarts: -1"))
    d.signal(signal.SIGHUP)
    wait_for(lambda: len(d.output()) > len(before), timeout=20, what="a log line on SIGHUP")
    time.sleep(0.5)  # any further lines about it
    new = d.output()[len(before):]
    said = [x for x in new.splitlines() if str(host.path) in x]
    assert len(said) == 1 and "max_restarts" in said[0], new
    assert "Traceback" not in new, new
    assert d.alive()
    s = started(host, d, "a", min_step=host.step("a") + 3)
    assert s["pid"] == pid
    assert "signal" not in Path(s["log"]).read_text()
    # The old config still rules: a crash is restarted under its budget.
    host.trigger("a", "exit_code", "3")
    started(host, d, "a", min_step=0, attempt=s["attempt"] + 1)


def test_sighup_adds_a_new_job_and_leaves_an_unchanged_one_alone(host: Host) -> None:
    """SIGHUP with one job added starts it; the unchanged job keeps its pid and gets no signal."""
    host.config([host.job_doc("a")])
    d = host.daemon()
    s = started(host, d, "a")
    host.config([host.job_doc("a"), host.job_doc("b")])
    d.signal(signal.SIGHUP)
    started(host, d, "b", min_step=1)
    s2 = started(host, d, "a", min_step=host.step("a") + 3)
    assert (s2["pid"], s2["attempt"]) == (s["pid"], s["attempt"])
    time.sleep(0.5)
    assert "signal" not in Path(s["log"]).read_text()
    assert host.incidents() == []
    assert d.alive()


def test_sighup_changes_a_job_at_its_next_launch_and_leaves_a_removed_one_running(
        host: Host) -> None:
    """A changed job keeps running until its next launch takes the change; a removed job runs on."""
    host.config([host.job_doc("a"), host.job_doc("b")])
    d = host.daemon()
    sa = started(host, d, "a")
    sb = started(host, d, "b")
    host.config([host.job_doc("a", "--ckpt-every", "7")])
    d.signal(signal.SIGHUP)
    wait_for(lambda: "reload" in d.output().lower(), timeout=20, what="the reload")
    time.sleep(0.5)
    assert started(host, d, "a", min_step=host.step("a") + 3)["pid"] == sa["pid"]
    assert alive(sb["pid"])
    log_grows(Path(sb["log"]))
    for s in (sa, sb):
        assert "signal" not in Path(s["log"]).read_text()
    host.trigger("a", "exit_code", "3")
    s = started(host, d, "a", min_step=0, attempt=sa["attempt"] + 1)
    wait_for(lambda: "--ckpt-every 7" in Path(s["log"]).read_text(), timeout=10,
             what="the changed command in the relaunch's log")
    # Back in the config, the job still running is taken back, not started twice.
    host.config([host.job_doc("a", "--ckpt-every", "7"), host.job_doc("b")])
    hup = time.time()
    d.signal(signal.SIGHUP)
    wait_for(lambda: [t for t in host.transitions() if t["job"] == "b" and t["time"] >= hup
                      and "adopt" in t["reason"]], timeout=30, what="job b taken back")
    s = started(host, d, "b", min_step=host.step("b") + 3)
    assert s["pid"] == sb["pid"], s
    assert sorted(int(p.name) for p in (host.job_dir("b") / "pids").iterdir()) == [sb["pid"]]
    assert [i["job"] for i in host.incidents()] == ["a"]


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket: the service manager's end of NOTIFY_SOCKET."""
    if importlib.util.find_spec("systemd") is None:
        missing("systemd-python is not installed (pip install -e '.[dev]')")
    root = tempfile.mkdtemp(prefix="twsd", dir="/tmp")
    path = os.path.join(root, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    try:
        yield s, path
    finally:
        s.close()
        shutil.rmtree(root, ignore_errors=True)


def test_notify_socket_gets_ready_status_watchdog_reloading_stopping(
        host: Host, notify_socket: tuple[socket.socket, str]) -> None:
    """sd_notify: READY=1 once jobs start, STATUS, WATCHDOG=1, RELOADING=1, STOPPING=1."""
    sock, path = notify_socket
    got: list[str] = []

    def have(field: str) -> bool:
        sock.settimeout(0.05)
        with contextlib.suppress(TimeoutError, BlockingIOError):
            while True:
                got.extend(sock.recv(4096).decode().splitlines())
        return field in got

    host.config([host.job_doc("a")])
    env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_VARS}
    env.update(NOTIFY_SOCKET=path, WATCHDOG_USEC="2000000")
    d = host.daemon(env)
    wait_for(lambda: have("READY=1"), timeout=60, what="READY=1")
    # Ready means the jobs are up: status.json says so already.
    assert host.status("a").get("state") in ("starting", "running"), host.status("a")
    assert any(x.startswith("STATUS=") for x in got), got
    wait_for(lambda: have("WATCHDOG=1"), timeout=10, what="WATCHDOG=1")
    pid = started(host, d, "a", min_step=1)["pid"]

    n = len(got)
    d.signal(signal.SIGHUP)
    wait_for(lambda: have("RELOADING=1"), timeout=20, what="RELOADING=1")
    wait_for(lambda: "READY=1" in got[got.index("RELOADING=1", n):], timeout=20,
             what="READY=1 after the reload")
    d.signal(signal.SIGTERM)
    wait_for(lambda: have("STOPPING=1"), timeout=20, what="STOPPING=1")
    assert d.proc.wait(timeout=30) == 0, d.output()[-2000:]
    have("")
    assert got.index("READY=1") < got.index("RELOADING=1") < got.index("STOPPING=1"), got
    assert all(x.split("=", 1)[0] in {"READY", "STATUS", "WATCHDOG", "RELOADING", "STOPPING",
                                       "MONOTONIC_USEC", "MAINPID", "ERRNO"} for x in got), got
    assert alive(pid)


def test_sigterm_leaves_jobs_running(host: Host) -> None:
    """SIGTERM ends the daemon with 0 and leaves its jobs running (KillMode=process)."""
    host.config([host.job_doc("a"), host.job_doc("b")])
    d = host.daemon()
    sa = started(host, d, "a")
    sb = started(host, d, "b")
    d.signal(signal.SIGTERM)
    assert d.proc.wait(timeout=30) == 0, d.output()[-2000:]
    for s in (sa, sb):
        assert alive(s["pid"])
        log_grows(Path(s["log"]))
        assert "signal" not in Path(s["log"]).read_text()


def test_an_upgrade_sigterm_then_start_adopts_every_job_untouched(host: Host) -> None:
    """docs/operating.md's upgrade (systemctl stop: SIGTERM; replace; start): the next daemon
    adopts each job (same pid and attempt, steps go on, no signal, no incident, no restart)."""
    host.config([host.job_doc("a"), host.job_doc("b")])
    d1 = host.daemon()
    before = {j: started(host, d1, j) for j in ("a", "b")}
    d1.signal(signal.SIGTERM)
    assert d1.proc.wait(timeout=30) == 0, d1.output()[-2000:]
    for s in before.values():
        log_grows(Path(s["log"]))  # nobody watches: the job goes on

    d2 = host.daemon()
    for j, s in before.items():
        after = started(host, d2, j, min_step=host.step(j) + 5)
        assert (after["pid"], after["attempt"]) == (s["pid"], s["attempt"]), (s, after)
        assert "signal" not in Path(s["log"]).read_text()
    assert host.incidents() == []
    adopted = {t["job"] for t in host.transitions() if "adopt" in t["reason"].lower()}
    assert adopted == {"a", "b"}, host.transitions()
    assert all(host.runtime(j).get("restart_count") == 0 for j in before)
    assert d2.alive(), d2.output()[-2000:]


def test_a_daemon_whose_jobs_just_run_writes_no_log_lines(host: Host) -> None:
    """Steady state is silent: no log line while a job beats and nothing happens (journald)."""
    host.config([host.job_doc("a", "--ckpt-every", "100000")])
    d = host.daemon()
    started(host, d, "a")
    time.sleep(1)  # the start's own lines are written
    before = d.output()
    s = started(host, d, "a", min_step=host.step("a") + 20)  # 2 s and more of beating
    new = d.output()[len(before):].splitlines()
    assert new == [], new[:4]
    assert s["state"] == "running" and host.incidents() == []



def test_an_operator_starts_a_job_that_exited_again(host: Host) -> None:
    """`trainwatch start` on an exited job launches it anew (a fresh attempt), and the
    daemon goes on: exited and fatal end a run, not the job's life under the daemon."""
    host.config([host.job_doc("a")])
    d = host.daemon()
    pid = started(host, d, "a")["pid"]
    host.trigger("a", "exit_code", "0")
    wait_for(lambda: host.status("a").get("state") == "exited", timeout=30, what="state exited")
    r = host.cli("start", "a", "--config", str(host.path))
    assert r.returncode == 0, r.stdout + r.stderr
    (host.job_dir("a") / "exit_code").unlink(missing_ok=True)
    again = started(host, d, "a", min_step=1)
    assert again["pid"] != pid and d.alive(), d.output()[-2000:]
    assert [t["to_state"] for t in host.transitions()][-2:] == ["starting", "running"]


def test_an_operator_start_with_too_few_healthy_gpus_is_refused_in_one_line(host: Host) -> None:
    """Xid 79 left the job one healthy GPU of the two it needs: it went FATAL. `trainwatch
    start` then says why in one line and exits non-zero; the job stays fatal and the
    daemon goes on, with no traceback in its log."""
    job = {**host.job_doc("a"), "gpus": {"devices": [0, 1], "min": 2}}
    host.config([job], gpu={"backend": "sim", "count": 2, "kmsg": None, "poll_interval": "0.2s"})
    d = host.daemon()
    started(host, d, "a", min_step=1)
    drill = subprocess.run([sys.executable, "-m", "faultinject.cli", "gpu-xid", "--gpu", "0",
                            "--xid", "79", "--run-dir", str(host.run_dir)],
                           capture_output=True, text=True, timeout=60, check=False)
    assert drill.returncode == 0, drill.stderr
    wait_for(lambda: host.status("a").get("state") == "fatal", timeout=60, what="state fatal")
    r = host.cli("start", "a", "--config", str(host.path))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stdout + r.stderr
    assert "1 healthy GPUs, the job needs at least 2" in r.stderr, r.stderr
    assert host.status("a").get("state") == "fatal" and d.alive()
    assert "Traceback" not in d.output(), d.output()[-3000:]
