"""Slurm jobs trainwatch attaches to (issue 23), on the real Slurm of
tests/slurmcluster.py (munge, slurmctld, two slurmd n1 and n2 on this host) and
two ``trainwatch daemon --host n1|n2``, as tests/test_slurm_attach.py runs them.

(a) A stopped rank (SIGSTOP of rank 1 of a 2-node ``sbatch`` + ``srun`` job that
    beats every 0.05 s through the client): seconds from the SIGSTOP to both
    ranks of the requeued run beating again, with trainwatch (heartbeat timeout
    3 s; requeue, then StartTime=now) and with Slurm alone (the same job, no
    daemon: Slurm sees nothing wrong while a rank is stopped; waited ``--alone``
    seconds). Split with trainwatch: detection (SIGSTOP to the incident) and
    the rest (the requeue, Slurm ending the tasks, the new run attaching).
(b) Attach cost per rank: the seconds ``client.connect()`` takes in the
    trainer (the claim proven through scontrol, then the runner and attempt).
(c) The n1 daemon's CPU over ``--seconds`` with the 2-node job attached
    (schedstat), beats every 0.05 s, a checkpoint every 10 steps.

Medians over ``--rounds``. Needs root and Debian's Slurm packages (as the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _common import machine_line, schedstat_ns
from slurmcluster import NODES, SlurmCluster

TRAINER = textwrap.dedent("""
    import os, sys, time
    t0 = time.monotonic()
    from trainwatch import client
    hb = client.connect()
    took = time.monotonic() - t0
    rank = int(os.environ["SLURM_PROCID"])
    out = sys.argv[1]
    with open(os.path.join(out, f"attach-{os.environ['SLURM_JOB_ID']}-"
                                f"{os.environ.get('SLURM_RESTART_COUNT', '0')}-{rank}"), "w") as f:
        f.write(f"{took:.4f}")
    ckpt = os.path.join(out, "ckpt")
    for step in range(1, 10**6):
        time.sleep(0.05)
        hb.beat(step, loss=1.0 / step)
        with open(os.path.join(out, f"beat-{rank}"), "w") as f:
            f.write(f"{os.environ.get('SLURM_RESTART_COUNT', '0')} {time.time()}")
        if rank == 0 and step % 10 == 0:
            p = os.path.join(ckpt, f"step_{step}")
            with open(p + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(p + ".tmp", p)
            hb.checkpoint(step, p)
""")


def wait(cond: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise SystemExit(f"timed out after {timeout:g}s waiting for {what}")


def daemons(cluster: SlurmCluster, root: Path) -> dict[str, subprocess.Popen[bytes]]:
    out = {}
    for n in NODES:
        d = root / n
        d.mkdir(parents=True, exist_ok=True)
        cfg = {"state_dir": str(d / "state"), "run_dir": str(d / "run"),
               "metrics": {"port": 0}, "gpu": {"backend": "off", "kmsg": None}, "jobs": [],
               "slurm": {"node": n, "conf": str(cluster.conf), "job": {
                   "checkpoints": {"pattern": "step_{step}", "quiet_for": "1s"},
                   "heartbeat": {"timeout": "3s"}}}}
        (d / "trainwatch.json").write_text(json.dumps(cfg))
        log = (d / "daemon.log").open("ab")
        out[n] = subprocess.Popen([sys.executable, "-m", "trainwatch.cli", "daemon", "--config",
                                   str(d / "trainwatch.json"), "--host", n], env=cluster.env,
                                  stdout=log, stderr=subprocess.STDOUT)
    for n in NODES:
        wait(lambda n=n: (root / n / "run" / "control.sock").exists(), 60, f"{n}'s daemon")
    return out


def submit(cluster: SlurmCluster, root: Path) -> int:
    (root / "ckpt").mkdir(exist_ok=True)
    (root / "train.py").write_text(TRAINER)
    script = (f"#!/bin/sh\nexport TRAINWATCH_RUN_DIR='{root}/{{node}}/run'\n"
              f"export TRAINWATCH_CHECKPOINT_DIR='{root}/ckpt'\n"
              f"export PYTHONPATH='{os.pathsep.join(sys.path[2:])}'\n"
              f"srun -N2 -n2 {sys.executable} {root / 'train.py'} {root}\n")
    return cluster.sbatch(script, "-N2", "-n2")


def beat_of(root: Path, rank: int) -> tuple[int, float] | None:
    try:
        run, at = (root / f"beat-{rank}").read_text().split()
        return int(run), float(at)
    except (OSError, ValueError):
        return None


def rank1_pid(root: Path, job: int) -> int:
    for n in NODES:
        try:
            s = json.loads((root / n / "state" / "jobs" / f"slurm-{job}" / "status.json")
                           .read_text())
        except (OSError, ValueError):
            continue
        if "1" in (s.get("ranks") or {}):
            return int(s["ranks"]["1"])
    return 0


def one_round(cluster: SlurmCluster, watched: bool, alone: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="twbslurm", dir="/tmp"))
    procs = daemons(cluster, root) if watched else {}
    job = submit(cluster, root)
    try:
        wait(lambda: all((b := beat_of(root, r)) and b[1] > time.time() - 1 for r in (0, 1)),
             120, "both ranks beating")
        time.sleep(3)  # a few checkpoints
        if watched:
            pid = wait(lambda: rank1_pid(root, job), 30, "rank 1's pid")
        else:
            pid = int(subprocess.run(["pgrep", "-f", f"{root}/train.py"], capture_output=True,
                                     text=True, check=False).stdout.split()[-1])
        stopped = time.time()
        os.kill(pid, signal.SIGSTOP)
        if not watched:
            time.sleep(alone)
            b = [beat_of(root, r) for r in (0, 1)]
            again = all(x and x[0] >= 1 for x in b)
            return {"recovered": again, "waited_s": alone}
        wait(lambda: all((b := beat_of(root, r)) and b[0] >= 1 for r in (0, 1)), 120,
             "both ranks of run 1 beating")
        back = time.time()
        inc = subprocess.run([sys.executable, "-m", "trainwatch.cli", "incidents", "--json",
                              "--state-dir", str(root / "n1" / "state")], capture_output=True,
                             text=True, check=False).stdout
        inc2 = subprocess.run([sys.executable, "-m", "trainwatch.cli", "incidents", "--json",
                               "--state-dir", str(root / "n2" / "state")], capture_output=True,
                              text=True, check=False).stdout
        rows = [x for t in (inc, inc2) for x in _rows(t) if x.get("kind") == "hang"]
        detected = min(float(x["time"]) for x in rows) if rows else float("nan")
        attach = [float(p.read_text()) for p in root.glob(f"attach-{job}-*")]
        return {"recovered_s": back - stopped, "detect_s": detected - stopped,
                "rest_s": back - detected, "attach_s": attach}
    finally:
        cluster.cancel(job)
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)


def _rows(text: str) -> list[dict[str, Any]]:
    try:
        got = json.loads(text)
    except ValueError:
        return []
    return got.get("incidents", []) if isinstance(got, dict) else got


def cpu(cluster: SlurmCluster, seconds: float) -> float:
    root = Path(tempfile.mkdtemp(prefix="twbslurm", dir="/tmp"))
    procs = daemons(cluster, root)
    job = submit(cluster, root)
    try:
        wait(lambda: all((b := beat_of(root, r)) and b[1] > time.time() - 1 for r in (0, 1)),
             120, "both ranks beating")
        time.sleep(5)
        pid = procs["n1"].pid
        a, t = schedstat_ns(pid), time.monotonic()
        time.sleep(seconds)
        return 100.0 * (schedstat_ns(pid) - a) / 1e9 / (time.monotonic() - t)
    finally:
        cluster.cancel(job)
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--alone", type=float, default=60.0)
    p.add_argument("--seconds", type=float, default=30.0)
    a = p.parse_args()
    print(machine_line())
    with SlurmCluster.start() as cluster:
        rounds = [one_round(cluster, True, 0) for _ in range(a.rounds)]
        alone = one_round(cluster, False, a.alone)
        pct = cpu(cluster, a.seconds)
    each = ", ".join(f"{r['recovered_s']:.1f}" for r in rounds)
    med = {k: statistics.median(r[k] for r in rounds)
           for k in ("recovered_s", "detect_s", "rest_s")}
    attach = [x for r in rounds for x in r["attach_s"]]
    print(f"(a) stopped rank -> both ranks beating again, trainwatch (timeout 3 s), "
          f"n={a.rounds}: median {med['recovered_s']:.1f} s (detection {med['detect_s']:.1f} s, "
          f"requeue to beating {med['rest_s']:.1f} s); all: "
          f"{each} s")
    print(f"    Slurm alone: {'recovered' if alone['recovered'] else 'not recovered'} within "
          f"{alone['waited_s']:.0f} s (a stopped rank is not a failure to Slurm)")
    print(f"(b) attach per rank (client.connect(), proof included), n={len(attach)}: median "
          f"{statistics.median(attach) * 1000:.0f} ms, max {max(attach) * 1000:.0f} ms")
    print(f"(c) n1 daemon CPU with the 2-node job attached, {a.seconds:.0f} s: {pct:.3f} % of "
          "a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
