"""The goodput drill's NVRx side (benchmarks/goodput_drill/nvrx.py) with real processes: a
job under NVIDIA's ft_launcher beats through nvrx.Heartbeat; once its heartbeat timeouts are
calculated (also in a 1-process job, which has no process group), a SIGSTOPped rank is found
by its rank monitor (the beats stop) and the workers are restarted (2 ranks on gloo), and so
are they after a SIGKILLed rank. How long each took is printed, not asserted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
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
world = int(os.environ["WORLD_SIZE"])
if world > 1:
    dist.init_process_group("gloo")
hb = Heartbeat()
hb.start()
log = open(d / f"rank{rank}.jsonl", "a", buffering=1)
x, step, paced = torch.ones(1), 0, time.monotonic()
while not (d / "stop").exists():
    step += 1
    if world > 1:
        dist.all_reduce(x)  # the ranks wait on each other, as DDP's do
    hb.beat()
    calc = hb.client is not None and hb.client.hb_timeouts.were_calculated
    timeout = hb.client.hb_timeouts.subsequent if calc else None
    log.write(json.dumps({"t": time.time(), "attempt": attempt, "pid": os.getpid(),
                          "step": step, "calculated": calc, "timeout": timeout}) + "\\n")
    paced += 0.1
    time.sleep(max(0.0, paced - time.monotonic()))
hb.stop()
if world > 1:
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


@contextlib.contextmanager
def launched(d: Path, nproc: int) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """The worker on nproc ranks under nvrx.command(); everything killed at the end."""
    launcher = Path(sys.executable).parent / "ft_launcher"
    if not launcher.exists():
        missing("nvidia-resiliency-ext is not installed (make installs it: "
                "pip install --no-deps nvidia-resiliency-ext==0.4.1)")
    (d / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(BENCH), "OMP_NUM_THREADS": "1"}
    argv, env = nvrx.command([str(d / "worker.py"), str(d)], nproc, env)
    out = d / "launcher.log"
    t0 = time.time()
    with open(out, "wb") as f:
        p = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        # Every rank past calculate_and_set_hb_timeouts (CALIBRATE_AFTER beats).
        wait_for(lambda: {r["rank"] for r in records(d) if r["calculated"]} == set(range(nproc)),
                 40, "every rank to calculate its heartbeat timeouts")
        print(f"\n{nproc} rank(s): ft_launcher start to the first step "
              f"{min(r['t'] for r in records(d)) - t0:.2f} s")
        yield p, out
        # A clean end: the ranks disconnect from their monitors and exit 0, and so does it.
        (d / "stop").write_text("")
        assert p.wait(timeout=30) == 0, out.read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher and its rank monitors
            p.wait()
        for r in records(d):  # the ranks run in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(r["pid"], signal.SIGKILL)


def calculated_timeout(d: Path, rank: int, attempt: int) -> float:
    """The beat timeout the rank's client calculated (the ranks' longest interval x 5)."""
    return next(r["timeout"] for r in records(d)
                if r["rank"] == rank and r["attempt"] == attempt and r["calculated"])


def stop_a_rank(d: Path, out: Path, rank: int) -> dict[str, Any]:
    """SIGSTOP the rank of attempt 0; its monitor must kill it and the workers restart."""
    hung = pid_of(d, rank, 0)
    # Well under a second on a quiet machine; on a loaded one a slow step during the
    # calibration makes it several seconds (5 x the longest interval), so the wait follows it.
    timeout = calculated_timeout(d, rank, 0)
    t_fault = time.time()
    os.kill(hung, signal.SIGSTOP)
    try:
        killed_at = time_gone(hung, timeout + nvrx.CHECK_INTERVAL_S + 30)
    except AssertionError as e:  # what its monitor said, and the timeout it had
        raise AssertionError(f"{e} (calculated timeout {timeout:.2f} s)\n"
                             f"{out.read_text()[-4000:]}") from None
    nxt: dict[str, Any] = wait_for(lambda: first_step_after(d, 0), 60, "the workers' restart")
    log = out.read_text()
    # Found by the calculated timeout, not the 15 s one the monitor started with: the
    # monitor's line names the timeout it waited.
    waited = [float(ln.split("Waited ")[1].split()[0]) for ln in log.splitlines()
              if "Did not get subsequent heartbeat" in ln]
    assert any(abs(w - timeout) < 0.006 for w in waited), (timeout, waited, log[-3000:])
    print(f"SIGSTOP: killed after {killed_at - t_fault:.2f} s (timeout {max(waited)} s), "
          f"first step of the next attempt after {nxt['t'] - t_fault:.2f} s")
    return nxt


def test_two_ranks_a_stopped_or_killed_rank_is_found_and_the_workers_restarted(
        tmp_path: Path) -> None:
    """2 ranks on gloo, as the drill's DDP trainer: a hang, then a crash, each restarted."""
    with launched(tmp_path, 2) as (_, out):
        # A hang: rank 1 stopped. Its monitor sees no beats (nor does rank 0's, waiting on it).
        nxt = stop_a_rank(tmp_path, out, 1)
        # A crash: rank 0 of the attempt that followed, killed.
        crashed = pid_of(tmp_path, 0, nxt["attempt"])
        t_fault = time.time()
        os.kill(crashed, signal.SIGKILL)
        nxt2 = wait_for(lambda: first_step_after(tmp_path, nxt["attempt"]), 60,
                        "the workers' restart after the crash")
        print(f"SIGKILL: first step of the next attempt after {nxt2['t'] - t_fault:.2f} s")


def test_one_process_without_a_process_group_calculates_its_timeouts_too(
        tmp_path: Path) -> None:
    """The calculation all-reduces; a 1-process job has no group (nvrx makes one for it):
    without one the rank would die at its CALIBRATE_AFTER-th beat and never get here."""
    with launched(tmp_path, 1) as (_, out):
        assert {r["attempt"] for r in records(tmp_path)} == {0}, out.read_text()[-3000:]


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
