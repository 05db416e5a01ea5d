"""The supervisor's own CPU and memory while 8 ranks beat at 10 Hz.

How: ``trainwatch run`` (real CLI, subprocess, ``--no-passthrough -q``, a
short temp dir under /tmp) supervises a job whose leader spawns ``--ranks``
child processes; child r calls ``client.connect(rank=r)`` and beats every
``--period`` s (default 0.1) on a fixed schedule with loss and grad_norm, each
at the phase it started with (so the supervisor wakes once per beat; with
``--aligned`` every rank beats on one wall-clock grid, as ranks in lock-step
do). The leader itself only waits. Once status.json lists every rank, a ``--warmup``
(3 s) passes, then the trainwatch process (the CLI's own pid, one thread) is
sampled every ``--interval`` s for ``--duration`` s (≥ 20 s):

* CPU: psutil ``cpu_times()`` (user + system) over the whole window, as % of
  one core; psutil's figure has clock-tick (10 ms) resolution, so the
  per-interval distribution comes from /proc/<pid>/schedstat (on-CPU time in
  ns) instead;
* memory: psutil ``memory_info().rss`` at every sample, and USS/PSS at the end.

The job's processes are not counted. The run fails if the job leaves the
running state or an incident is recorded meanwhile. ``--ranks 0`` gives the
idle baseline (the job beats never). Goals (issue): ≤ 1 % of a core, ≤ 60 MB.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    TrainwatchRun,
    fmt_summary,
    machine,
    machine_line,
    remove,
    schedstat_ns,
    scratch_dir,
    summarize,
    write_config,
    write_json,
)

JOB = """\
import math, subprocess, sys, time

ranks, period, aligned = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
if len(sys.argv) > 4:
    from trainwatch import client

    rank = int(sys.argv[4])
    hb = client.connect(rank=rank)
    step = 0
    # aligned: every rank beats on the same wall-clock grid, as ranks in
    # lock-step (DDP) do; else each keeps the phase it started with.
    clock = time.time if aligned else time.monotonic
    nxt = math.ceil(clock() / period) * period if aligned else clock()
    while True:
        time.sleep(max(0.0, nxt - clock()))
        hb.beat(step, loss=2.5 / (1 + step * 1e-3), grad_norm=1.0 + 0.01 * rank)
        step += 1
        nxt += period
children = [
    subprocess.Popen([sys.executable, __file__, *sys.argv[1:4], str(r)])
    for r in range(ranks)
]
if not children:
    while True:
        time.sleep(3600)
for c in children:
    c.wait()
sys.exit(1)
"""
CPU_GOAL_PCT = 1.0
RSS_GOAL_MB = 60.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    d = scratch_dir("twbs-")
    job = d / "job.py"
    job.write_text(JOB)
    argv = [sys.executable, str(job), str(args.ranks), str(args.period), str(int(args.aligned))]
    cfg = write_config(d, argv)
    tw = TrainwatchRun(d, cfg, ["--heartbeat-timeout", "30s"])
    samples_pct: list[float] = []
    rss_mb: list[float] = []
    rc: int | None = None
    try:
        if args.ranks:
            tw.wait_running(0, ranks=args.ranks, timeout=30.0)
        else:
            tw.wait_for(lambda s: s.get("state") in ("starting", "running"), 30.0, "the start")
        time.sleep(args.warmup)
        p = psutil.Process(tw.pid)
        threads = p.num_threads()
        db = tw.ledger()
        incidents0 = db.execute("SELECT COUNT(*) FROM incidents").fetchone()[0]
        c0 = p.cpu_times()
        x0 = p.num_ctx_switches().voluntary
        w0 = time.monotonic()
        s_prev, w_prev = schedstat_ns(tw.pid), w0
        rss_mb.append(p.memory_info().rss / 1e6)
        next_t = w0
        while True:
            next_t += args.interval
            time.sleep(max(0.0, next_t - time.monotonic()))
            s_now, w_now = schedstat_ns(tw.pid), time.monotonic()
            samples_pct.append(100.0 * (s_now - s_prev) / 1e9 / (w_now - w_prev))
            s_prev, w_prev = s_now, w_now
            rss_mb.append(p.memory_info().rss / 1e6)
            if w_now - w0 >= args.duration:
                break
        c1 = p.cpu_times()
        x1 = p.num_ctx_switches().voluntary
        w1 = time.monotonic()
        full = p.memory_full_info()
        status = tw.status() or {}
        incidents1 = db.execute("SELECT COUNT(*) FROM incidents").fetchone()[0]
        db.close()
    finally:
        rc = tw.stop()
    remove(d, args.keep)

    wall = w1 - w0
    cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
    cpu_pct = 100.0 * cpu_s / wall
    user_pct = 100.0 * (c1.user - c0.user) / wall
    sys_pct = 100.0 * (c1.system - c0.system) / wall
    per = summarize(samples_pct)
    rss = summarize(rss_mb)
    beats_per_s = args.ranks / args.period if args.ranks else 0.0
    cpu_per_beat_us = (cpu_s / (beats_per_s * wall) * 1e6) if beats_per_s else float("nan")
    wakes_per_s = (x1 - x0) / wall
    cpu_per_wake_us = cpu_s / max(1, x1 - x0) * 1e6
    problems = []
    if status.get("state") != "running" and args.ranks:
        problems.append(f"job state {status.get('state')!r}")
    if incidents1 != incidents0:
        problems.append(f"{incidents1 - incidents0} incident(s) during the window")

    print("bench_supervisor: trainwatch run's own CPU and RSS")
    print(machine_line())
    print(
        f"{args.ranks} ranks beating every {args.period * 1000:g} ms ({beats_per_s:g} beats/s, "
        f"{'aligned' if args.aligned else 'each at its own phase'}); "
        f"warm-up {args.warmup:g} s; window {wall:.1f} s sampled every {args.interval:g} s; "
        f"trainwatch pid {tw.pid}, {threads} thread(s)"
    )
    print(
        f"  CPU (psutil cpu_times over the window): {cpu_pct:.3f} % of one core "
        f"(user {user_pct:.3f} %, system {sys_pct:.3f} %) = {cpu_s * 1000:.0f} ms CPU"
        + (f", {cpu_per_beat_us:.0f} µs per beat" if beats_per_s else "")
    )
    print(
        f"  wake-ups (voluntary context switches): {wakes_per_s:.1f}/s, "
        f"{cpu_per_wake_us:.0f} µs CPU per wake-up"
    )
    print(f"  CPU per {args.interval:g} s interval (schedstat): {fmt_summary(per, '%', 3)}")
    print(f"  RSS: {fmt_summary(rss, 'MB', 1)}")
    print(
        f"  at the end: RSS {full.rss / 1e6:.1f} MB, USS {full.uss / 1e6:.1f} MB, "
        f"PSS {getattr(full, 'pss', float('nan')) / 1e6:.1f} MB (MB = 10^6 bytes)"
    )
    if problems:
        print("  PROBLEM: " + "; ".join(problems))
    print(
        f"goals: CPU ≤ {CPU_GOAL_PCT:g} % of a core: "
        f"{'meets' if cpu_pct <= CPU_GOAL_PCT else 'misses'} ({cpu_pct:.3f} %); "
        f"RSS ≤ {RSS_GOAL_MB:g} MB: {'meets' if rss.max <= RSS_GOAL_MB else 'misses'} "
        f"(max {rss.max:.1f} MB)"
    )
    print(f"trainwatch run exit code after SIGINT: {rc} (expected 130)")
    return {
        "machine": machine(),
        "ranks": args.ranks,
        "period_s": args.period,
        "aligned": args.aligned,
        "window_s": wall,
        "cpu_pct": cpu_pct,
        "cpu_user_pct": user_pct,
        "cpu_system_pct": sys_pct,
        "cpu_per_beat_us": cpu_per_beat_us,
        "wakes_per_s": wakes_per_s,
        "cpu_per_wake_us": cpu_per_wake_us,
        "cpu_interval_pct": per.as_dict(),
        "rss_mb": rss.as_dict(),
        "uss_mb": full.uss / 1e6,
        "problems": problems,
        "exit_code": rc,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--ranks", type=int, default=8, help="beating child processes (default 8)")
    p.add_argument("--period", type=float, default=0.1, help="each rank's beat period, s")
    p.add_argument(
        "--aligned",
        action="store_true",
        help="ranks beat on one shared wall-clock grid (lock-step, as in DDP) instead of each"
        " at its own phase (the default, which gives the supervisor one wake-up per beat)",
    )
    p.add_argument("--warmup", type=float, default=3.0, help="s after every rank has beaten")
    p.add_argument("--duration", type=float, default=20.0, help="sampling window, s (≥ 20)")
    p.add_argument("--interval", type=float, default=1.0, help="sampling interval, s")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    write_json(args.json, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
