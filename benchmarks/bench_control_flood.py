"""What a flood of requests on the control socket from another local user costs
trainwatch, now that every local user may reach that socket (issue 21, item 9),
and whether root's own requests still get through meanwhile.

Setup: a real ``trainwatch run --name bench --state-dir D/s --run-dir D/r
--metrics-port 0 --no-passthrough -- python job.py`` as root (so the job runs
as root and only admins may touch it), the job beating at 10 Hz. Once it runs,
uid 65534 (``setpriv --reuid=65534 --regid=65534 --clear-groups``: no job, not
in the trainwatch group) sends ``--requests`` (100,000) requests as fast as a
blocking ``send()`` allows, from a bound socket that never reads its replies:

* stop: ``{"op": "stop", "args": {"job": "bench"}}``, refused (not its job);
* status: ``{"op": "status"}``, answered (no jobs: it has none).

Meanwhile root asks ``status`` every 50 ms (``trainwatch.host.control.request``,
5 s timeout). For each: trainwatch's CPU seconds (psutil user+sys) from the
flood's start until it ends, less its idle rate measured for 2 s before, scaled
to 100,000 requests; the requests trainwatch read (the rest the kernel refused
to queue: the sender blocks instead); root's requests answered and their
latency; the log lines the flood added; and whether the job is untouched
(same pid, running, not paused). Medians of ``--runs`` (3) runs, a fresh
trainwatch each.

    sudo .venv/bin/python benchmarks/bench_control_flood.py [--runs 3] [--requests 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from _common import machine_line
from trainwatch.host.control import ControlError, request

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534
PY = sys.executable

JOB = textwrap.dedent(
    """
    import time
    from trainwatch import client
    hb = client.connect()
    step = 0
    while True:
        step += 1
        hb.beat(step)
        time.sleep(0.1)
    """
)

FLOOD = textwrap.dedent(
    """
    import json, os, socket, sys
    path, n, op = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    args = {"job": "bench"} if op == "stop" else {}
    data = json.dumps({"v": 1, "op": op, "args": args}).encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(f"\\0twflood-{os.getpid()}".encode())  # replies come back, never read
    s.connect(path)
    for _ in range(n):
        s.send(data)
    print(json.dumps({"sent": n}))
    """
)


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _status(d: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((d / "s" / "jobs" / "bench" / "status.json").read_text()))
    except (OSError, ValueError):
        return {}


def _wait(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.01)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


def _probe(run_dir: str, stop: threading.Event, out: list[float | None]) -> None:
    """Root's own status requests during the flood: latency, or None for no reply."""
    while not stop.is_set():
        t = time.monotonic()
        try:
            ok = request(run_dir, "status", {}, timeout=5.0)["ok"]
            out.append(time.monotonic() - t if ok else None)
        except ControlError:
            out.append(None)
        stop.wait(0.05)


def one_run(op: str, n: int) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="twcf", dir="/tmp"))
    d.chmod(0o755)  # uid 65534 reaches r/control.sock through it
    (d / "job.py").write_text(JOB)
    err = open(d / "trainwatch.stderr", "wb")  # noqa: SIM115 - closed below
    tw = subprocess.Popen(
        [PY, "-m", "trainwatch.cli", "run", "--name", "bench", "--state-dir", str(d / "s"),
         "--run-dir", str(d / "r"), "--metrics-port", "0", "--no-passthrough", "--",
         PY, str(d / "job.py")], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=err, cwd=d)
    try:
        _wait(lambda: _status(d).get("state") == "running", 30, "the job running")
        pid = _status(d)["pid"]
        c0, t0 = _cpu(tw.pid), time.monotonic()
        time.sleep(2.0)
        idle = (_cpu(tw.pid) - c0) / (time.monotonic() - t0)
        lines0 = (d / "trainwatch.stderr").read_bytes().count(b"\n")
        latencies: list[float | None] = []
        stop = threading.Event()
        prober = threading.Thread(target=_probe, args=(str(d / "r"), stop, latencies))
        c1, t1 = _cpu(tw.pid), time.monotonic()
        prober.start()
        flood = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", PY, "-c",
             FLOOD, str(d / "r" / "control.sock"), str(n), op],
            capture_output=True, text=True, timeout=600, check=True)
        time.sleep(0.5)  # the queue drained
        stop.set()
        prober.join()
        took = time.monotonic() - t1
        cpu = _cpu(tw.pid) - c1 - idle * took
        lines = (d / "trainwatch.stderr").read_bytes().count(b"\n") - lines0
        s = _status(d)
        answered = [x for x in latencies if x is not None]
        return {
            "op": op, "sent": json.loads(flood.stdout)["sent"], "seconds": took,
            "cpu_per_100k": cpu * 100_000 / n,
            "root_answered": len(answered), "root_asked": len(latencies),
            "root_median_ms": 1000 * statistics.median(answered) if answered else None,
            "root_max_ms": 1000 * max(answered) if answered else None,
            "log_lines": lines,
            "untouched": s.get("pid") == pid and s.get("state") == "running"
            and not s.get("paused"),
        }
    finally:
        tw.terminate()
        tw.wait(timeout=30)
        err.close()
        shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=100_000)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_control_flood: run as root (the flood comes from uid 65534)",
              file=sys.stderr)
        return 2
    print(machine_line())
    print(f"{a.requests:,} requests from uid 65534 per run, medians of {a.runs} runs")
    print("| request (uid 65534) | trainwatch CPU per 100,000 | flood took | root's status "
          "answered | root's latency median / max | log lines | job untouched |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for op in ("stop", "status"):
        runs = [one_run(op, a.requests) for _ in range(a.runs)]

        def med(k: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r[k] for r in runs if r[k] is not None)

        print(f"| {op} ({'refused' if op == 'stop' else 'answered, no jobs'}) "
              f"| {med('cpu_per_100k'):.2f} s | {med('seconds'):.1f} s "
              f"| {sum(r['root_answered'] for r in runs)} of "
              f"{sum(r['root_asked'] for r in runs)} "
              f"| {med('root_median_ms'):.1f} / {max(r['root_max_ms'] for r in runs):.1f} ms "
              f"| {med('log_lines'):.0f} | {all(r['untouched'] for r in runs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
