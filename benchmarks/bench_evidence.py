"""Time spent capturing evidence (``trainwatch.evidence.capture.Capture``) for 2
and 8 ranks: real Python processes (``tests/jobs/stacktarget.py``, the main
thread ``--depth`` frames deep plus a helper thread), the last rank SIGSTOPped
as in the drill, all read with the real py-spy, plus a 10 MB job log with
rank-prefixed lines for the tail. Each run captures into a fresh folder; the
figure is the wall time from ``start()`` until ``wait()`` returns, median over
``--runs`` runs (and the capture's own ``seconds``).

Goal (issue 12): <= 5 s for 8 ranks. Run:
``.venv/bin/python benchmarks/bench_evidence.py`` (``--native`` adds native frames).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, fmt_summary, machine_line, scratch_dir, summarize
from trainwatch.evidence import pyspy
from trainwatch.evidence.capture import Capture, Target

TARGET = ROOT / "tests" / "jobs" / "stacktarget.py"


def ranks(n: int, depth: int) -> list[subprocess.Popen[bytes]]:
    ps = []
    for r in range(n):
        mode = "train" if r == n - 1 else "wait"
        p = subprocess.Popen([sys.executable, str(TARGET), mode, str(depth)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        ps.append(p)
    for p in ps:
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    ps[-1].send_signal(signal.SIGSTOP)
    return ps


def write_log(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(100_000):  # about 10 MB
            f.write(f"[rank{i % n}]:[I step {i}] loss=0.{i:06d} lr=3e-4 tokens/s=123456.7 ok\n")


def bench(n: int, runs: int, depth: int, native: bool, root: Path) -> None:
    ps = ranks(n, depth)
    log = root / f"job{n}.log"
    write_log(log, n)
    walls, own = [], []
    try:
        for i in range(runs):
            out = root / f"n{n}-run{i}"
            c = Capture(out, [Target(p.pid, r) for r, p in enumerate(ps)], log,
                        timeout=5.0, native=native, named=n - 1)
            t0 = time.perf_counter()
            c.start()
            c.wait()
            walls.append(time.perf_counter() - t0)
            s = c.summary or {}
            own.append(float(s.get("seconds", float("nan"))))
            v = s.get("verdict") or {}
            ok = sum(1 for t in s.get("targets", []) if (t.get("py_spy") or {}).get("ok"))
            if i == 0:
                print(f"  {n} ranks: stacks read {ok}/{n}, verdict {v.get('suspects')} by "
                      f"{v.get('decided_by')}, deadline hit {s.get('deadline_hit')}, "
                      f"errors {s.get('errors')}")
            shutil.rmtree(out, ignore_errors=True)
    finally:
        for p in ps:
            p.kill()
            p.wait()
            if p.stdout:
                p.stdout.close()
    print(f"{n} ranks: capture wall {fmt_summary(summarize(walls), 's')}")
    print(f"{n} ranks: capture's own seconds {fmt_summary(summarize(own), 's')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--depth", type=int, default=20, help="frames of train_step recursion")
    ap.add_argument("--native", action="store_true", help="py-spy --native for running ranks")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    a = ap.parse_args()
    print(machine_line())
    print(f"py-spy: {pyspy.find()}, runs {a.runs}, depth {a.depth}, native {a.native}")
    root = scratch_dir("twev")
    try:
        for n in a.ranks:
            bench(n, a.runs, a.depth, a.native, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
