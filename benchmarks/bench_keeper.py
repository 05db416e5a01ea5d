"""What the per-attempt keeper costs: launch latency, memory, exit-to-wake-up.

How (``--n`` rounds each, default 30; the job's stdout is a pipe we read, so
its first line is timed to the µs; files in a temp dir under ``--dir``,
default /tmp):

(a) launch. ``kept.launch()`` of ``sh -c 'echo x'``: t0 before the call;
    "leader pid known" when the keeper's first report line arrives (its
    ``_read_report`` wrapped to timestamp lines), "exec'd" when launch()
    returns (the keeper saw its close-on-exec pipe close), "first line" when
    ``x`` is read. Baselines: ``subprocess.Popen`` of the same job with
    ``start_new_session=True`` (vfork path), and with today's Attempt's
    ``preexec_fn=credentials.child_setup(...)`` (fork path), each to its first
    line. Also the keeper's interpreter alone (``python -I -S -c pass``, run
    to exit). Goal (issue 10): ≤ 30 ms from launch to the job's exec.
(b) memory. The keeper's RSS and PSS (/proc/<pid>/smaps_rollup) while
    ``sleep`` runs under it, without and with ``pdeathsig`` (which loads
    ctypes). Goal: ≤ 12 MB RSS.
(c) exit. ``sleep`` SIGKILLed through a pidfd at t0; the exit file's
    ``exited_at`` (the keeper's waitpid returned and it took the time) and
    the moment the keeper's pidfd turns readable (select) after it wrote the
    exit file (fsync of file and folder) and exited.

Run: ``.venv/bin/python benchmarks/bench_keeper.py [--n 30] [--dir /var/lib/x]``.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_summary, machine, machine_line, summarize, write_json
from trainwatch.actions import kept
from trainwatch.privsep import credentials

MS = 1000.0


def spec(d: Path, argv: list[str], **kw: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "argv": argv, "env": {"PATH": os.environ.get("PATH", os.defpath)}, "cwd": str(d),
        "uid": None, "gid": None, "groups": None, "umask": 0o022, "cgroup_procs": None,
        "pdeathsig": False, "exit": str(d / "exit"), "job": "bench", "attempt": 0}
    s.update(kw)
    return s


def read_line(fd: int) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = os.read(fd, 256)
        if not chunk:
            break
        buf += chunk
    return buf


def finish(rec: kept.Launched, pidfd: int | None) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [], 30)
        kept.reap(rec, pidfd)
        os.close(pidfd)


def launch_rounds(d: Path, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"pid": [], "exec": [], "line": []}
    real_read = kept._read_report
    first_line: list[float] = []

    def timed_read(fd: int, deadline: float) -> list[list[str]]:
        # The first report line is "pid ...": note when it arrives, then read on.
        select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        first_line.append(time.perf_counter())
        return real_read(fd, deadline)

    kept._read_report = timed_read  # benchmark instrumentation
    try:
        for i in range(n):
            r, w = os.pipe()
            s = spec(d, ["sh", "-c", "echo x"], exit=str(d / f"exit-a{i}"))
            t0 = time.perf_counter()
            rec, pidfd = kept.launch(s, w)
            t1 = time.perf_counter()
            os.close(w)
            read_line(r)
            t2 = time.perf_counter()
            os.close(r)
            out["pid"].append((first_line[-1] - t0) * MS)
            out["exec"].append((t1 - t0) * MS)
            out["line"].append((t2 - t0) * MS)
            finish(rec, pidfd)
    finally:
        kept._read_report = real_read
    return out


def popen_rounds(n: int, preexec: bool) -> list[float]:
    out = []
    for _ in range(n):
        r, w = os.pipe()
        t0 = time.perf_counter()
        p = subprocess.Popen(
            ["sh", "-c", "echo x"], stdin=subprocess.DEVNULL, stdout=w, start_new_session=True,
            preexec_fn=credentials.child_setup(None, None, False) if preexec else None)
        os.close(w)
        read_line(r)
        out.append((time.perf_counter() - t0) * MS)
        os.close(r)
        p.wait()
    return out


def python_rounds(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)
        out.append((time.perf_counter() - t0) * MS)
    return out


def rollup(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MB (10^6 bytes)."""
    vals = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            vals[key] = int(rest.split()[0]) * 1024 / 1e6
    return vals["Rss"], vals["Pss"]


def memory_rounds(d: Path, n: int, pdeathsig: bool) -> tuple[list[float], list[float]]:
    rss, pss = [], []
    for i in range(n):
        s = spec(d, ["sleep", "30"], exit=str(d / f"exit-m{i}"), pdeathsig=pdeathsig)
        rec, pidfd = kept.launch(s, None)
        time.sleep(0.05)  # the keeper is asleep in waitpid by now
        a, b = rollup(rec.keeper)
        rss.append(a)
        pss.append(b)
        kill_leader(rec)
        finish(rec, pidfd)
    return rss, pss


def kill_leader(rec: kept.Launched) -> None:
    fd = kept.leader_pidfd(rec)
    assert fd is not None
    signal.pidfd_send_signal(fd, signal.SIGKILL)
    os.close(fd)


def exit_rounds(d: Path, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"noticed": [], "woken": [], "file_to_wake": []}
    for i in range(n):
        s = spec(d, ["sleep", "30"], exit=str(d / f"exit-e{i}"))
        rec, pidfd = kept.launch(s, None)
        assert pidfd is not None
        time.sleep(0.05)
        fd = kept.leader_pidfd(rec)
        assert fd is not None
        t0 = time.time()
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        select.select([pidfd], [], [], 30)
        t1 = time.time()
        os.close(fd)
        info = kept.read_exit(rec)
        assert info is not None and info["returncode"] == -9, info
        out["noticed"].append((info["exited_at"] - t0) * MS)
        out["woken"].append((t1 - t0) * MS)
        out["file_to_wake"].append((t1 - info["exited_at"]) * MS)
        kept.reap(rec, pidfd)
        os.close(pidfd)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="twkb", dir=args.dir))
    try:
        launch_rounds(d, 3)  # warm the page cache
        a = launch_rounds(d, args.n)
        popen = popen_rounds(args.n, preexec=False)
        popen_pre = popen_rounds(args.n, preexec=True)
        py = python_rounds(args.n)
        rss, pss = memory_rounds(d, max(5, args.n // 5), pdeathsig=False)
        rss_p, pss_p = memory_rounds(d, max(5, args.n // 5), pdeathsig=True)
        e = exit_rounds(d, args.n)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    fs = subprocess.run(["stat", "-f", "-c", "%T", args.dir], capture_output=True, text=True,
                        check=False).stdout.strip()
    res = {k: summarize(v) for k, v in {
        "launch_pid_ms": a["pid"], "launch_exec_ms": a["exec"], "launch_line_ms": a["line"],
        "popen_line_ms": popen, "popen_preexec_line_ms": popen_pre, "python_ms": py,
        "rss_mb": rss, "pss_mb": pss, "rss_pdeathsig_mb": rss_p, "pss_pdeathsig_mb": pss_p,
        "exit_noticed_ms": e["noticed"], "exit_woken_ms": e["woken"],
        "exit_file_to_wake_ms": e["file_to_wake"]}.items()}
    print("bench_keeper: the per-attempt keeper (trainwatch.actions.keeper / kept)")
    print(machine_line())
    print(f"files in {args.dir} ({fs}); job: sh -c 'echo x' for (a), sleep for (b), (c)")
    print("(a) launch of sh -c 'echo x':")
    print(f"  kept.launch → leader pid known:   {fmt_summary(res['launch_pid_ms'], 'ms', 2)}")
    print(f"  kept.launch → exec'd (returns):   {fmt_summary(res['launch_exec_ms'], 'ms', 2)}")
    print(f"  kept.launch → first output line:  {fmt_summary(res['launch_line_ms'], 'ms', 2)}")
    print(f"  Popen → first line (vfork):       {fmt_summary(res['popen_line_ms'], 'ms', 2)}")
    print(f"  Popen+preexec_fn → first line:    "
          f"{fmt_summary(res['popen_preexec_line_ms'], 'ms', 2)}")
    print(f"  python -I -S -c pass, to exit:    {fmt_summary(res['python_ms'], 'ms', 2)}")
    print("(b) the keeper's memory while the job runs (MB = 10^6 bytes):")
    print(f"  RSS {fmt_summary(res['rss_mb'], 'MB', 2)}; PSS {fmt_summary(res['pss_mb'], 'MB', 2)}")
    print(f"  with pdeathsig (ctypes): RSS {fmt_summary(res['rss_pdeathsig_mb'], 'MB', 2)}; "
          f"PSS {fmt_summary(res['pss_pdeathsig_mb'], 'MB', 2)}")
    print("(c) leader SIGKILLed at t0:")
    print(f"  t0 → keeper's waitpid returned (exited_at): "
          f"{fmt_summary(res['exit_noticed_ms'], 'ms', 2)}")
    print(f"  exited_at → exit file written, keeper pidfd readable: "
          f"{fmt_summary(res['exit_file_to_wake_ms'], 'ms', 2)}")
    print(f"  t0 → keeper pidfd readable: {fmt_summary(res['exit_woken_ms'], 'ms', 2)}")
    exec_ok = res["launch_exec_ms"].median <= 30
    rss_ok = res["rss_mb"].max <= 12 and res["rss_pdeathsig_mb"].max <= 12
    rss_max = max(res["rss_mb"].max, res["rss_pdeathsig_mb"].max)
    print(f"goals: launch → exec ≤ 30 ms: {'meets' if exec_ok else 'misses'} "
          f"(median {res['launch_exec_ms'].median:.1f} ms); RSS ≤ 12 MB: "
          f"{'meets' if rss_ok else 'misses'} (max {rss_max:.1f} MB)")
    return {"machine": machine(), "fs": fs, **{k: v.as_dict() for k, v in res.items()}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--n", type=int, default=30, help="rounds of (a) and (c) (≥ 20)")
    p.add_argument("--dir", default="/tmp", help="where the exit files go (its file system)")
    p.add_argument("--json", help="also write the figures as JSON here")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    write_json(args.json, run(args))


if __name__ == "__main__":
    main()
