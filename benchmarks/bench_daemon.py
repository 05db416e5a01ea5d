"""`trainwatch daemon` as a host service: its own cost under load, how fast it is
ready, how fast a restarted daemon re-adopts its jobs, and what a restart costs
the jobs.

How: a config with 4 jobs, each ``tests/jobs/printer.py --ranks 8 --interval
0.1 --quiet`` (8 processes per job, each beating at 10 Hz through
``trainwatch.client``, a checkpoint every 50 steps), ``gpu: {backend: sim,
count: 8, poll_interval: 1s}``, exporter off; ``trainwatch daemon --config C``
is a subprocess with ``NOTIFY_SOCKET`` set to a datagram socket this script
binds (systemd-python must be installed for READY=1).

(a) Steady state: after 5 s of settling, the daemon's CPU over 30 s, as
    utime+stime from /proc/<pid>/stat (all threads, 10 ms ticks) over the whole
    30 s, and the median of six 5 s windows of /proc/<pid>/task/*/schedstat
    (ns); its PSS from /proc/<pid>/smaps_rollup (median of the windows). The
    per-job keepers (runtime.json ``launched.keeper``) are reported beside it.
    Goals: <= 0.5 % of one core, <= 60 MB.
(b) Start -> READY=1: a fresh daemon on an empty state dir (it launches the 4
    jobs), from just before Popen to the datagram. Restart: SIGKILL the daemon,
    start a new one (t0 just before Popen); READY=1, and "adopted": every job's
    status.json names the same pid as before, state running, and the ledger has a
    transition for the job after t0 whose to_state or reason says "adopt".
    Goal: <= 1 s each. For scale, the time a new interpreter takes to import
    trainwatch.cli and trainwatch.host.daemon is printed too.
(c) Steps lost across the restarts: each job's log ("step N" every 10 steps) must
    never go backwards nor skip, its attempt must not change, and the longest
    time its printed step stood still during a restart window is reported (the
    job prints every 1 s, so anything near 1 s is no stall).

Every process started is killed at the end by pid (jobs from their pid files,
checked against their command line; keepers by pid and start time).
``--quick``: 2 runs instead of 5 and 10 s of steady state.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    ROOT,
    fmt_summary,
    machine,
    machine_line,
    remove,
    schedstat_ns,
    scratch_dir,
    summarize,
    voluntary_switches,
    write_json,
)

PRINTER = ROOT / "tests" / "jobs" / "printer.py"
JOBS = ("j0", "j1", "j2", "j3")
RANKS = 8
TICK = os.sysconf("SC_CLK_TCK")


def start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def cpu_ticks(pid: int) -> int:
    """utime + stime of the process (all its threads), in clock ticks."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])


def pss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


class Host:
    """The scratch dir, the config, the daemon and everything to kill at the end."""

    def __init__(self, d: Path, ranks: int = RANKS, gpu: str = "sim") -> None:
        self.d = d
        self.ranks, self.gpu = ranks, gpu
        d.mkdir(parents=True, exist_ok=True)
        self.state = d / "s"
        self.config = d / "trainwatch.yaml"
        self.notify_path = str(d / "notify")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(self.notify_path)
        self.daemon: subprocess.Popen[bytes] | None = None
        self.n = 0
        self.seen: set[tuple[int, int]] = set()
        self.cgroups: set[str] = set()  # every attempt's, removed at the end when empty
        self.write_config()

    def write_config(self) -> None:
        jobs = []
        for j in JOBS:
            jd = self.d / j
            (jd / "ckpt").mkdir(parents=True, exist_ok=True)
            jobs.append({
                "name": j,
                "command": [sys.executable, str(PRINTER), "--dir", str(jd), "--ranks",
                            str(self.ranks), "--interval", "0.1", "--quiet", "--ckpt-every", "50"],
                "resume_args": ["--resume-from", "{checkpoint}"],
                "checkpoints": {"dir": str(jd / "ckpt"), "pattern": "step_{step}"},
                "heartbeat": {"timeout": "60s", "ranks": self.ranks},
                "policy": "default",
            })
        cfg = {
            "state_dir": str(self.state), "run_dir": str(self.d / "r"),
            "metrics": {"port": 0},
            "gpu": ({"backend": "sim", "count": 8, "poll_interval": "1s", "kmsg": None}
                    if self.gpu == "sim" else {"backend": "off", "kmsg": None}),
            "jobs": jobs,
            "policies": {"default": {"max_restarts": 100, "kill_grace": "2s",
                                     "backoff": {"initial": "0.2s", "max": "1s",
                                                 "jitter": 0}}},
        }
        self.config.write_text(json.dumps(cfg, indent=1) + "\n")

    # the daemon

    def start(self) -> float:
        """Start a daemon; the time just before Popen (time.time())."""
        self.drain()
        env = {k: v for k, v in os.environ.items()
               if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        env["NOTIFY_SOCKET"] = self.notify_path
        out = open(self.d / f"daemon-{self.n}.out", "wb")  # noqa: SIM115 - the child holds it
        self.n += 1
        t0 = time.time()
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "trainwatch.cli", "daemon", "--config", str(self.config)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
        out.close()
        return t0

    def output(self) -> str:
        try:
            return (self.d / f"daemon-{self.n - 1}.out").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.kill()
        if self.daemon is not None:
            self.daemon.wait(30)

    def terminate(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()

    def drain(self) -> None:
        self.notify.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                self.notify.recv(4096)

    def wait_ready(self, t0: float, timeout: float = 30.0) -> float:
        """Seconds from t0 to READY=1."""
        deadline = time.monotonic() + timeout
        self.notify.settimeout(0.05)
        while time.monotonic() < deadline:
            self.alive_or_fail("READY=1")
            try:
                data = self.notify.recv(4096).decode()
            except TimeoutError:
                continue
            if "READY=1" in data.splitlines():
                return time.time() - t0
        raise RuntimeError(f"no READY=1 within {timeout:g}s:\n{self.output()}")

    def alive_or_fail(self, what: str) -> None:
        if self.daemon is not None and self.daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited ({self.daemon.returncode}) waiting for"
                               f" {what}:\n{self.output()}")

    # what it wrote

    def _json(self, job: str, name: str) -> dict[str, Any]:
        try:
            d = json.loads((self.state / "jobs" / job / name).read_text())
        except (OSError, ValueError):
            return {}
        return d if isinstance(d, dict) else {}

    def status(self, job: str) -> dict[str, Any]:
        s = self._json(job, "status.json")
        self.remember(s.get("pid"))
        if isinstance(s.get("cgroup"), str):
            self.cgroups.add(s["cgroup"])
        return s

    def keepers(self) -> list[int]:
        out = []
        for j in JOBS:
            launched = self._json(j, "runtime.json").get("launched")
            if isinstance(launched, dict) and isinstance(launched.get("keeper"), int):
                out.append(int(launched["keeper"]))
                self.remember(launched["keeper"])
                self.remember(launched.get("pid"))
                if isinstance(launched.get("cgroup_path"), str):
                    self.cgroups.add(launched["cgroup_path"])
        return out

    def remember(self, pid: object) -> None:
        if isinstance(pid, int) and pid > 0:
            t = start_time(pid)
            if t is not None:
                self.seen.add((pid, t))

    def adoptions_since(self, t0: float) -> set[str]:
        db = self.state / "ledger.db"
        if not db.exists():
            return set()
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
            try:
                rows = con.execute("SELECT job, to_state, reason FROM transitions WHERE time >= ?",
                                   (t0,)).fetchall()
            finally:
                con.close()
        except sqlite3.Error:
            return set()
        return {j for j, to, why in rows if "adopt" in f"{to} {why}".lower()}

    def all_running(self, timeout: float) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.alive_or_fail("the jobs to run")
            st = {j: self.status(j) for j in JOBS}
            if all(s.get("state") == "running" and (s.get("step") or 0) > 0
                   for s in st.values()):
                return st
            time.sleep(0.05)
        raise RuntimeError(f"jobs not running after {timeout:g}s:\n{self.output()}")

    # cleanup

    def kill_jobs(self) -> None:
        self.keepers()
        for j in JOBS:
            self.status(j)
            for f in (self.d / j / "pids").glob("*"):
                with contextlib.suppress(ValueError, OSError):
                    if str(self.d).encode() in Path(f"/proc/{f.name}/cmdline").read_bytes():
                        self.remember(int(f.name))
        killed = []
        for pid, t in sorted(self.seen):
            if start_time(pid) == t:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        self.seen.clear()
        deadline = time.monotonic() + 10
        while any(start_time(p) is not None for p in killed) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.remove_cgroups()

    def remove_cgroups(self) -> None:
        """The attempts' cgroups, empty now, that no daemon is left to remove."""
        with open("/proc/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[2:3] == ["cgroup2"]]
        for cg in sorted(self.cgroups):
            if not any(cg.startswith(m + "/") for m in mounts):
                continue
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    if Path(cg, "cgroup.procs").read_text().strip():
                        time.sleep(0.02)
                        continue
                    os.rmdir(cg)
                except OSError:
                    pass
                break

    def close(self) -> None:
        self.kill()
        self.kill_jobs()
        self.notify.close()


def written_since(path: Path, t0: float) -> bool:
    """The file was (atomically re)written after t0: not the killed daemon's."""
    try:
        return path.stat().st_mtime >= t0
    except OSError:
        return False


def log_steps(log: Path) -> list[int]:
    try:
        return [int(m) for m in re.findall(r"^step (\d+)$", log.read_text(errors="replace"),
                                           re.M)]
    except OSError:
        return []


def last_step(log: Path) -> int:
    """The last printed step, reading only the file's tail."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 256))
            found = re.findall(rb"^step (\d+)$", f.read(), re.M)
    except OSError:
        return 0
    return int(found[-1]) if found else 0


def import_floor(runs: int) -> list[float]:
    """A new interpreter until it has imported the daemon (it then prints a line):
    the floor under READY=1."""
    out = []
    for _ in range(runs):
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", "import trainwatch.cli, trainwatch.host.daemon;"
                              " print('ok', flush=True)"], stdout=subprocess.PIPE)
        assert p.stdout is not None
        p.stdout.readline()
        out.append(time.monotonic() - t0)
        p.communicate(timeout=60)
    return out


def fresh_starts(d: Path, runs: int, ranks: int, gpu: str) -> list[float]:
    """start -> READY=1 on an empty state dir (the daemon launches 4 jobs)."""
    out = []
    for i in range(runs):
        h = Host(d / f"fresh{i}", ranks, gpu)
        try:
            t0 = h.start()
            out.append(h.wait_ready(t0))
            h.all_running(60)  # the jobs really came up (and their pids are known)
            h.terminate()
        finally:
            h.close()
    return out


def steady(h: Host, seconds: float) -> dict[str, Any]:
    assert h.daemon is not None
    pid = h.daemon.pid
    windows = 6
    step = seconds / windows
    cpu_w: list[float] = []
    pss_w: list[float] = []
    keeper_cpu0 = {k: cpu_ticks(k) for k in h.keepers() if start_time(k) is not None}
    t_start, ticks0, wake0 = time.monotonic(), cpu_ticks(pid), voluntary_switches(pid)
    for _ in range(windows):
        a, ta = schedstat_ns(pid), time.monotonic()
        time.sleep(step)
        b, tb = schedstat_ns(pid), time.monotonic()
        cpu_w.append(100.0 * (b - a) / 1e9 / (tb - ta))
        pss_w.append(pss_bytes(pid) / 1e6)
    elapsed = time.monotonic() - t_start
    wakeups = (voluntary_switches(pid) - wake0) / elapsed
    total = 100.0 * (cpu_ticks(pid) - ticks0) / TICK / elapsed
    keeper_cpu = sum(cpu_ticks(k) - t for k, t in keeper_cpu0.items() if start_time(k))
    keepers = list(keeper_cpu0)
    return {
        "cpu_pct_stat_total": total,
        "cpu_pct_windows": summarize(cpu_w),
        "pss_mb": summarize(pss_w),
        "keepers": len(keepers),
        "keepers_cpu_pct_total": 100.0 * keeper_cpu / TICK / elapsed,
        "keepers_pss_mb": sum(pss_bytes(k) for k in keepers if start_time(k)) / 1e6,
        "seconds": elapsed,
        "wakeups_per_s": wakeups,
        "threads": len(list(Path(f"/proc/{pid}/task").iterdir())),
    }


class LogWatch:
    """The longest time each job's printed step stood still, into `stall`."""

    def __init__(self, logs: dict[str, Path], stall: dict[str, float]) -> None:
        self.logs = logs
        self.stall = stall
        now = time.monotonic()
        self.progress = {j: (last_step(p), now) for j, p in logs.items()}

    def __call__(self) -> None:
        now = time.monotonic()
        for j, log in self.logs.items():
            cur = last_step(log)
            if cur != self.progress[j][0]:
                self.progress[j] = (cur, now)
            self.stall[j] = max(self.stall[j], now - self.progress[j][1])


def restarts(h: Host, runs: int) -> dict[str, Any]:
    ready: list[float] = []
    adopted: list[float] = []
    no_transition = 0
    stall: dict[str, float] = dict.fromkeys(JOBS, 0.0)
    for _ in range(runs):
        before = h.all_running(30)
        pids = {j: s["pid"] for j, s in before.items()}
        watch = LogWatch({j: Path(s["log"]) for j, s in before.items()}, stall)
        h.kill()
        t0 = h.start()
        got_ready: float | None = None
        got_adopted: float | None = None
        h.notify.settimeout(0.005)
        deadline = time.monotonic() + 30
        while (got_ready is None or got_adopted is None) and time.monotonic() < deadline:
            h.alive_or_fail("adoption")
            with contextlib.suppress(TimeoutError):
                if "READY=1" in h.notify.recv(4096).decode().splitlines() and got_ready is None:
                    got_ready = time.time() - t0
            watch()
            if got_adopted is None:
                st = {j: h._json(j, "status.json") for j in JOBS}
                if all(s.get("state") == "running" and s.get("pid") == pids[j]
                       and written_since(h.state / "jobs" / j / "status.json", t0)
                       for j, s in st.items()):
                    t_status = time.time() - t0
                    if h.adoptions_since(t0) >= set(JOBS):
                        got_adopted = t_status
                    elif t_status > 5:
                        no_transition += 1  # status says adopted; the ledger does not
                        got_adopted = t_status
        if got_ready is None or got_adopted is None:
            raise RuntimeError(f"restart: READY {got_ready}, adopted {got_adopted} after 30 s;"
                               f" status {[h.status(j) for j in JOBS]}\n{h.output()}")
        ready.append(got_ready)
        adopted.append(got_adopted)
        end = time.monotonic() + 2  # the jobs' logs a little beyond the window
        while time.monotonic() < end:
            watch()
            time.sleep(0.02)
    return {"ready": summarize(ready), "adopted": summarize(adopted),
            "no_adoption_transition": no_transition, "stall_s": stall}


def steps_lost(h: Host, attempts0: dict[str, int]) -> dict[str, Any]:
    lost = 0
    backwards = 0
    relaunched = 0
    for j in JOBS:
        s = h.status(j)
        if s.get("attempt") != attempts0[j]:
            relaunched += 1
        seq = log_steps(Path(s["log"]))
        for a, b in itertools.pairwise(seq):
            if b < a:
                backwards += 1
                lost += a - b
            elif b - a > 10:  # printed every 10 steps: a larger gap is steps not printed
                lost += b - a - 10
    return {"steps_lost": lost, "backwards": backwards, "relaunched_jobs": relaunched}


def run(args: argparse.Namespace) -> dict[str, Any]:
    runs = 2 if args.quick else args.runs
    seconds = 10.0 if args.quick else args.seconds
    d = scratch_dir("twbd")
    result: dict[str, Any] = {"machine": machine(), "runs": runs, "ranks": args.ranks,
                              "gpu": args.gpu}
    try:
        result["import_s"] = summarize(import_floor(runs))
        result["fresh_ready_s"] = summarize(fresh_starts(d, runs, args.ranks, args.gpu))
        h = Host(d / "main", args.ranks, args.gpu)
        try:
            t0 = h.start()
            h.wait_ready(t0)
            st = h.all_running(60)
            attempts0 = {j: int(s["attempt"]) for j, s in st.items()}
            time.sleep(args.settle)
            result["steady"] = steady(h, seconds)
            result["restart"] = restarts(h, runs)
            result["steps"] = steps_lost(h, attempts0)
            h.terminate()
        finally:
            h.close()
    finally:
        remove(d, args.keep)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--seconds", type=float, default=30.0, help="steady-state measurement")
    p.add_argument("--settle", type=float, default=5.0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ranks", type=int, default=RANKS, help="beating processes per job")
    p.add_argument("--gpu", choices=("sim", "off"), default="sim",
                   help="off: no GPU polling (to tell its cost from the beats')")
    p.add_argument("--keep", action="store_true", help="keep the scratch dir")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    print(machine_line())
    try:
        r = run(args)
    except RuntimeError as e:
        print(f"bench_daemon: {e}", file=sys.stderr)
        return 1
    s = r["steady"]
    rs = r["restart"]
    gpus = "8 sim GPUs polled at 1 Hz" if r["gpu"] == "sim" else "no GPU backend"
    print(f"{len(JOBS)} jobs x {r['ranks']} ranks at 10 Hz, {gpus}; {r['runs']} runs")
    rows = [
        ("daemon CPU, utime+stime", f"{s['cpu_pct_stat_total']:.3f} % of a core over"
         f" {s['seconds']:.0f} s", "<= 0.5 %", s["cpu_pct_stat_total"] <= 0.5),
        ("daemon CPU, schedstat", fmt_summary(s["cpu_pct_windows"], "%"), "<= 0.5 %",
         s["cpu_pct_windows"].median <= 0.5),
        ("daemon PSS", fmt_summary(s["pss_mb"], "MB", 1), "<= 60 MB", s["pss_mb"].median <= 60),
        ("daemon wake-ups (all threads)", f"{s['wakeups_per_s']:.0f} /s, {s['threads']}"
         " threads", "", None),
        (f"keepers ({s['keepers']}) CPU, PSS", f"{s['keepers_cpu_pct_total']:.3f} %,"
         f" {s['keepers_pss_mb']:.1f} MB in all", "", None),
        ("python + imports (floor)", fmt_summary(r["import_s"], "s"), "", None),
        ("fresh start -> READY=1", fmt_summary(r["fresh_ready_s"], "s"), "<= 1 s",
         r["fresh_ready_s"].median <= 1),
        ("restart -> READY=1", fmt_summary(rs["ready"], "s"), "<= 1 s", rs["ready"].median <= 1),
        ("restart -> all 4 adopted", fmt_summary(rs["adopted"], "s"), "<= 1 s",
         rs["adopted"].median <= 1),
        ("steps lost across restarts", f"{r['steps']['steps_lost']} (backwards"
         f" {r['steps']['backwards']}, jobs relaunched {r['steps']['relaunched_jobs']})", "0",
         r["steps"]["steps_lost"] == 0 and r["steps"]["relaunched_jobs"] == 0),
        ("longest log stall in restarts", f"{max(rs['stall_s'].values()):.2f} s (prints every"
         " 1 s)", "", None),
    ]
    w = max(len(x[0]) for x in rows)
    for name, value, goal, ok in rows:
        mark = "" if ok is None else ("  ok" if ok else "  MISSED")
        print(f"{name:<{w}}  {value}  {('goal ' + goal) if goal else ''}{mark}")
    if rs["no_adoption_transition"]:
        print(f"note: {rs['no_adoption_transition']} restart(s) adopted per status.json but the"
              " ledger showed no adoption transition within 5 s")
    write_json(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
