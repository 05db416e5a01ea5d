"""The catalog's cost does not grow with history (issue 13).

1. In process: a catalog over N checkpoints on disk (N = 10, 1,000, 10,000;
   generic layout, reported): the first full judgement (``entries()``), a
   forced listing later (a relaunch), and what one new report costs (the
   report, then the summary the exporter refreshes after it).
2. A real ``trainwatch run`` of a job checkpointing 3.3 times a second (the
   issue's trainer) with N checkpoints already in its folder: trainwatch's CPU
   (utime + stime over ``--seconds``). The issue measured 1.0 % of a core at 8
   checkpoints, 3.3 % at 304 and 6.2 % at 632 before this change.

Run: ``.venv/bin/python benchmarks/bench_catalog.py [--seconds 30]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
from _common import JOB_NAME, ROOT, TrainwatchRun, machine_line, remove, scratch_dir
from trainwatch.config import Checkpoints
from trainwatch.state.catalog import Catalog

WORKER = ROOT / "tests" / "jobs" / "worker.py"


def _fill(d: Path, n: int) -> None:
    """n checkpoints as the test worker writes them (every 10 steps, the step inside),
    written an hour ago."""
    old = time.time() - 3600
    for step in range(10, 10 * n + 1, 10):
        p = d / f"step_{step}"
        p.write_text(str(step))
        os.utime(p, (old, old))


def in_process(n: int, runs: int = 5) -> dict[str, float]:
    first, forced, report = [], [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(dir="/tmp") as t:
            d = Path(t) / "ckpt"
            d.mkdir()
            _fill(d, n)
            cat = Catalog(Checkpoints(dir=str(d), quiet_for=0.0), Path(t) / "catalog.json")
            t0 = time.perf_counter()
            cat.entries()
            first.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            cat.entries()
            forced.append(time.perf_counter() - t0)
            costs = []
            for step in range(10 * n + 10, 10 * n + 210, 10):
                p = d / f"step_{step}"
                p.write_text(str(step))
                t0 = time.perf_counter()
                cat.report(step, str(p))
                cat.summary()
                costs.append(time.perf_counter() - t0)
            report.append(statistics.median(costs))
    return {"first_judgement_s": statistics.median(first),
            "forced_listing_s": statistics.median(forced),
            "report_and_summary_s": statistics.median(report)}


def daemon_cpu(n: int, seconds: float, keep: bool) -> float:
    d = scratch_dir("twcat")
    ckpt = d / "ckpt"
    ckpt.mkdir()
    _fill(ckpt, n)
    # Resumed from the newest (judged by quiet time), it goes on writing new ones.
    cmd = [sys.executable, str(WORKER), "--ckpt-dir", str(ckpt), "--steps", "10000000",
           "--interval", "0.03", "--ckpt-every", "10"]
    cfg = {"state_dir": str(d / "s"), "run_dir": str(d / "r"), "metrics": {"port": 0},
           "gpu": {"backend": "off"},
           "jobs": [{"name": JOB_NAME, "command": cmd,
                     "checkpoints": {"dir": str(ckpt), "pattern": "step_{step}",
                                     "quiet_for": "1s"}}]}
    (d / "tw.yaml").write_text(json.dumps(cfg))
    tw = TrainwatchRun(d, d / "tw.yaml")
    try:
        tw.wait_for(lambda s: s.get("state") == "running" and (s.get("step") or 0) > 0, 60,
                    "the job beating")
        time.sleep(3.0)  # past the start-up
        p = psutil.Process(tw.pid)
        t0, c0 = time.monotonic(), sum(p.cpu_times()[:2])
        time.sleep(seconds)
        t1, c1 = time.monotonic(), sum(p.cpu_times()[:2])
        return 100.0 * (c1 - c0) / (t1 - t0)
    finally:
        tw.stop()
        remove(d, keep)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args()
    print(machine_line())
    for n in (10, 1000, 10000):
        r = in_process(n)
        print(f"in process, {n:>6} checkpoints: first judgement {r['first_judgement_s']*1e3:.1f}"
              f" ms, forced listing {r['forced_listing_s']*1e3:.2f} ms, one report + summary "
              f"{r['report_and_summary_s']*1e6:.0f} us (medians of 5)")
    for n in (10, 1000, 10000):
        cpu = daemon_cpu(n, a.seconds, a.keep)
        print(f"trainwatch run, {n:>6} checkpoints on disk, 3.3 new per second: "
              f"{cpu:.2f} % of a core over {a.seconds:g} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
