"""The goodput drill's NVRx side (benchmarks/goodput_drill/nvrx.py) with real processes: a
2-rank gloo job under NVIDIA's ft_launcher beats through nvrx.Heartbeat; a SIGSTOPped rank
is found by its rank monitor (heartbeats stop) and the workers are restarted, and so is a
SIGKILLed rank. How long each took is printed, not asserted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import missing, pid_gone, wait_for

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

from goodput_drill import nvrx  # noqa: E402

# One line per step: rank, attempt, pid, and whether the timeouts were calculated yet.
WORKER = """
import json, os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from goodput_drill.nvrx import Heartbeat

d, rank = Path(sys.argv[1]), int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
hb = Heartbeat()
hb.start()
log = open(d / f"rank{rank}.jsonl", "a", buffering=1)
x, step, paced = torch.ones(1), 0, time.monotonic()
while not (d / "stop").exists():
    step += 1
    dist.all_reduce(x)  # the ranks wait on each other, as DDP's do
    hb.beat()
    calc = hb.client is not None and hb.client.hb_timeouts.were_calculated
    log.write(json.dumps({"t": time.time(), "attempt": attempt, "pid": os.getpid(),
                          "step": step, "calculated": calc}) + "\\n")
    paced += 0.1
    time.sleep(max(0.0, paced - time.monotonic()))
hb.stop()
dist.barrier()
"""


def records(d: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(d.glob("rank*.jsonl")):
        rank = int(f.stem[4:])
        for line in f.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                out.append({**json.loads(line), "rank": rank})
    return out


def first_step_after(d: Path, attempt: int) -> dict[str, Any] | None:
    """The first step logged by an attempt later than `attempt` (extra restarts allowed)."""
    later = [r for r in records(d) if r["attempt"] > attempt]
    return min(later, key=lambda r: r["t"]) if later else None


def pid_of(d: Path, rank: int, attempt: int) -> int:
    return next(r["pid"] for r in records(d) if r["rank"] == rank and r["attempt"] == attempt)


def time_gone(pid: int, timeout: float) -> float:
    wait_for(lambda: pid_gone(pid), timeout, f"rank pid {pid} to be killed")
    return time.time()


def test_a_stopped_or_killed_rank_under_ft_launcher_is_found_and_the_workers_restarted(
        tmp_path: Path) -> None:
    launcher = Path(sys.executable).parent / "ft_launcher"
    if not launcher.exists():
        missing("nvidia-resiliency-ext is not installed (make installs it: "
                "pip install --no-deps nvidia-resiliency-ext==0.4.1)")
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(BENCH), "OMP_NUM_THREADS": "1"}
    argv, env = nvrx.command([str(tmp_path / "worker.py"), str(tmp_path)], 2, env)
    out = tmp_path / "launcher.log"
    t0 = time.time()
    with open(out, "wb") as f:
        p = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        # Both ranks past calculate_and_set_hb_timeouts (CALIBRATE_AFTER beats).
        wait_for(lambda: {r["rank"] for r in records(tmp_path) if r["calculated"]} == {0, 1},
                 40, "both ranks to calculate their heartbeat timeouts")
        first = min(r["t"] for r in records(tmp_path))
        print(f"\nft_launcher start to the first step: {first - t0:.2f} s")

        # A hang: rank 1 stopped. Its monitor sees no beats (nor does rank 0's, waiting on it).
        hung = pid_of(tmp_path, 1, 0)
        t_fault = time.time()
        os.kill(hung, signal.SIGSTOP)
        killed_at = time_gone(hung, 30)
        nxt = wait_for(lambda: first_step_after(tmp_path, 0), 30, "the workers' restart")
        log = out.read_text()
        assert "Did not get subsequent heartbeat" in log, log[-3000:]
        print(f"SIGSTOP: killed after {killed_at - t_fault:.2f} s, "
              f"first step of the next attempt after {nxt['t'] - t_fault:.2f} s")

        # A crash: rank 0 of the attempt that followed, killed.
        crashed = pid_of(tmp_path, 0, nxt["attempt"])
        t_fault = time.time()
        os.kill(crashed, signal.SIGKILL)
        nxt2 = wait_for(lambda: first_step_after(tmp_path, nxt["attempt"]), 30,
                        "the workers' restart after the crash")
        print(f"SIGKILL: first step of the next attempt after {nxt2['t'] - t_fault:.2f} s")

        # A clean end: the ranks disconnect from their monitors and exit 0, and so does it.
        (tmp_path / "stop").write_text("")
        assert p.wait(timeout=30) == 0, out.read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher and its rank monitors
            p.wait()
        for r in records(tmp_path):  # the ranks run in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(r["pid"], signal.SIGKILL)


def test_outside_ft_launcher_the_heartbeat_does_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer may always call it: without a rank monitor's socket nothing connects."""
    monkeypatch.delenv(nvrx.SOCKET_ENV, raising=False)
    hb = nvrx.Heartbeat()
    hb.start()
    for _ in range(nvrx.CALIBRATE_AFTER + 1):
        hb.beat()
    hb.stop()
    assert hb.client is None and hb.beats == 0
