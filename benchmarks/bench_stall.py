"""Stall -> incident on the 2-rank drill (issue 12): a real ``torchrun
--nproc-per-node=2`` DDP job on gloo (tests/jobs/ddp.py) under a real
``trainwatch run``; rank 1's worker is SIGSTOPped here (the timestamp taken
just before the signal) and rank 0 blocks in its all-reduce. The figure is
the incident's wall time minus that timestamp, with the default stall
settings (the client beats every step of about 0.05 s: the stall timeout is
its 5 s floor), and without the client, default settings (the stopped
process, the output silent). Then, without the client, rank 1 wedged rather
than stopped: it sleeps in its own code after step 60 (idle, not stopped),
timed from its ``step 60`` line, and named by its stacks. Also the evidence
capture time the incident records (py-spy of both ranks before the kill) and
the relaunch.

Run: ``.venv/bin/python benchmarks/bench_stall.py [--runs 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import JOB_NAME, ROOT, TrainwatchRun, machine_line, remove, scratch_dir

DDP = ROOT / "tests" / "jobs" / "ddp.py"


def _rank_pid(tw: TrainwatchRun, rank: int, beat: bool) -> int:
    if beat:
        s = tw.wait_for(lambda s: len(s.get("ranks") or {}) == 2 and (s.get("step") or 0) >= 30,
                        90, "both ranks beating")
        return int(s["ranks"][str(rank)])
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # the worker whose environment says RANK=rank
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if (f"RANK={rank}".encode() in env
                    and f"TRAINWATCH_SOCKET={tw.run_dir}".encode() in b"\0".join(env)
                    and (tw.d / "ckpt" / "step_40.pt").exists()):
                return int(name)
        time.sleep(0.2)
    raise RuntimeError("rank 1's worker not found")


def one(beat: bool, keep: bool, wedged: bool = False) -> dict[str, Any]:
    d = scratch_dir("twstall")
    (d / "ckpt").mkdir()
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2",
           str(DDP), "--ckpt-dir", str(d / "ckpt"), "--steps", "100000", "--interval", "0.05",
           "--ckpt-every", "20", "--print-every", "5", *(["--beat"] if beat else []),
           *(["--sleep-rank1-at", "60"] if wedged else [])]
    job: dict[str, Any] = {"name": JOB_NAME, "command": cmd, "policy": "default",
                           "checkpoints": {"dir": str(d / "ckpt"), "pattern": "step_{step}.pt",
                                           "quiet_for": "1s"}}
    cfg = {"state_dir": str(d / "s"), "run_dir": str(d / "r"), "metrics": {"port": 0},
           "jobs": [job], "policies": {"default": {"kill_grace": "2s",
                                                   "backoff": {"initial": "0.2s", "jitter": 0}}}}
    (d / "tw.yaml").write_text(json.dumps(cfg))
    tw = TrainwatchRun(d, d / "tw.yaml")
    try:
        if wedged:
            t_stop = _line_seen(d, "[rank1]: step 60 ")
        else:
            pid = _rank_pid(tw, 1, beat)
            t_stop = time.time()
            os.kill(pid, signal.SIGSTOP)
        db = tw.ledger(timeout=30)
        deadline = time.monotonic() + 60
        row = None
        while time.monotonic() < deadline and row is None:
            row = db.execute("SELECT time, kind, rank, evidence FROM incidents ORDER BY id"
                             ).fetchone()
            time.sleep(0.05)
        if row is None:
            raise RuntimeError("no incident")
        tw.wait_for(lambda s: int(s.get("attempt", 0)) >= 1 and s.get("state") == "running",
                    90, "the relaunch running")
        relaunch = db.execute("SELECT time_to_relaunch_s, resumed_step, evidence FROM incidents"
                              " ORDER BY id").fetchone()
        ev = json.loads(relaunch[2])
        return {"stall_to_incident_s": row[0] - t_stop, "kind": row[1], "rank": row[2],
                "capture_s": ev.get("capture_s"), "decided_by": ev.get("decided_by"),
                "stacks": (ev.get("stacks") or {}).get("decided_by"),
                "time_to_relaunch_s": relaunch[0], "resumed_step": relaunch[1]}
    finally:
        tw.stop()
        remove(d, keep)


def _line_seen(d: Path, text: str) -> float:
    """The wall time the first attempt's output showed ``text`` (looked at every 10 ms)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for log in d.glob("s/jobs/*/logs/attempt-0-*.log"):
            if text in log.read_text(errors="replace"):
                return time.time()
        time.sleep(0.01)
    raise RuntimeError(f"no {text!r} in the output")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args()
    print(machine_line())
    for beat, wedged, label in ((True, False, "with the client"),
                                (False, False, "without the client"),
                                (False, True, "without the client, rank 1 wedged")):
        rows = [one(beat, a.keep, wedged) for _ in range(a.runs)]
        for r in rows:
            print("  ", json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                    for k, v in r.items()}))
        med = statistics.median(r["stall_to_incident_s"] for r in rows)
        caps = [r["capture_s"] for r in rows if r["capture_s"] is not None]
        rel = statistics.median(r["time_to_relaunch_s"] for r in rows)
        named = sum(1 for r in rows if r["rank"] == 1 and r["kind"] == "nccl_stall")
        print(f"{label}: stall -> incident median {med:.2f} s over {len(rows)} runs; "
              f"rank 1 named as nccl_stall in {named}/{len(rows)}; evidence capture median "
              f"{statistics.median(caps) if caps else float('nan'):.3f} s; "
              f"incident -> relaunch median {rel:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
