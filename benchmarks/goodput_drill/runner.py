"""One system through the schedule: launch it, play the faults at their times against
the ranks it runs, watch which processes die when, stop it after the run's minutes.

What a system did is read from outside only (the trainer's pid files and progress log,
process liveness every 50 ms), the same way for each: none of its internals are asked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import json_lines

from goodput_drill import systems
from goodput_drill.schedule import Fault

POLL = 0.05


@dataclass
class Played:
    kind: str
    at: float  # wall clock
    rank: int
    pids: dict[int, int]  # rank -> pid when it was played
    note: str = ""


@dataclass
class Result:
    system: str
    launched: float
    stopped: float
    first_step: float | None
    played: list[Played]
    deaths: dict[int, float]  # pid -> when it was first seen gone
    progress: list[dict[str, object]]
    log: Path
    extra: dict[str, object] = field(default_factory=dict)


class Watch(threading.Thread):
    """Rank pids as the trainer writes them, and when each is first seen gone."""

    def __init__(self, pids: Path) -> None:
        super().__init__(daemon=True)
        self.dir = pids
        self.alive: dict[int, int] = {}  # pid -> rank
        self.deaths: dict[int, float] = {}
        self.stop_ = threading.Event()

    def current(self) -> dict[int, int]:
        out = {}
        for f in self.dir.glob("rank-*"):
            with contextlib.suppress(OSError, ValueError):
                out[int(f.name[5:])] = int(f.read_text())
        return out

    def run(self) -> None:
        while not self.stop_.wait(POLL):
            for rank, pid in self.current().items():
                if pid not in self.alive and pid not in self.deaths:
                    self.alive[pid] = rank
            now = time.time()
            for pid in list(self.alive):
                if not _exists(pid):
                    self.deaths[pid] = now
                    del self.alive[pid]


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def progress(path: Path) -> list[dict[str, Any]]:
    return json_lines(path)


def _first_step(path: Path) -> float | None:
    return next((float(r["t"]) for r in progress(path) if "step" in r), None)  # type: ignore[arg-type]


def gpu_of(pid: int) -> str:
    env = dict(kv.split("=", 1) for kv in
               Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
               if "=" in kv)
    local = int(env.get("LOCAL_RANK", "0"))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[local] if visible else str(local)


def corrupt_newest(ckpt: Path) -> str:
    done = [p for p in ckpt.glob("step_*") if (p / "done").exists()]
    if not done:
        return "no checkpoint yet"
    newest = max(done, key=lambda p: int(p.name[5:]))
    f = newest / "weights.pt"
    size = f.stat().st_size
    with open(f, "r+b") as fh:  # bit rot: the middle of the file, its size unchanged
        fh.seek(size // 2)
        block = fh.read(64)
        fh.seek(size // 2)
        fh.write(bytes(b ^ 0xFF for b in block))
    return f"{newest.name}/weights.pt: 64 bytes flipped at {size // 2}"


def play(f: Fault, watch: Watch, d: Path, system: str) -> Played:
    # Only live ranks: between attempts the pid files still name the dead ones (a fault
    # played then hits nothing, and their earlier deaths read as a negative detection).
    pids = {r: p for r, p in watch.current().items() if _exists(p)}
    pid = pids.get(f.rank)
    p = Played(f.kind, time.time(), f.rank, pids)
    if pid is None:
        p.note = "no such rank running"
        return p
    if f.kind in ("crash", "corrupt"):
        if f.kind == "corrupt":
            p.note = corrupt_newest(d / "ckpt")
            time.sleep(0.5)
            p.at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    elif f.kind == "hang":
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    elif f.kind == "stall":
        (d / "state" / f"stall-{pid}").write_text("")
    elif f.kind == "xid":
        try:
            gpu = gpu_of(pid)
        except OSError as e:
            p.note = f"rank gone: {e}"
            return p
        (d / "state" / f"gpu-lost-{gpu}").write_text("79")
        p.note = f"GPU {gpu}"
        if system == "trainwatch":
            r = subprocess.run([sys.executable, "-m", "faultinject.cli", "gpu-xid", "--gpu", gpu,
                                "--xid", "79", "--run-dir", str(d / "tw-run")],
                               capture_output=True, text=True, timeout=60, check=False)
            if r.returncode != 0:
                p.note += f"; faultinject: {r.stderr.strip()[-200:]}"
    return p


def run(system: str, d: Path, ranks: int, faults: list[Fault], seconds: float, every: int,
        step_time: float, nan: tuple[int, int] | None) -> Result:
    (d / "ckpt").mkdir(parents=True)
    (d / "state" / "pids").mkdir(parents=True)
    rest = systems.trainer_args(d / "ckpt", d / "state", every, step_time, nan)
    launch = systems.LAUNCHERS[system](d, ranks, rest)
    watch = Watch(d / "state" / "pids")
    log = d / f"{system}.log"
    played: list[Played] = []
    launched = time.time()
    with open(log, "wb") as out:
        proc = subprocess.Popen(launch.argv, env=launch.env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    watch.start()
    end = launched + seconds
    first = None
    try:
        while first is None and time.time() < end:
            time.sleep(POLL)
            first = _first_step(d / "state" / "progress.jsonl")
        for f in [f for f in faults if f.kind != "nan"]:
            if first is None:
                break
            due = first + f.at
            if due >= end:
                break
            time.sleep(max(0.0, due - time.time()))
            played.append(play(f, watch, d, system))
        time.sleep(max(0.0, end - time.time()))
    finally:
        stopped = time.time()
        stop(proc, watch)
    return Result(system, launched, stopped, first, played, dict(watch.deaths),
                  progress(d / "state" / "progress.jsonl"), log)


def stop(proc: subprocess.Popen[bytes], watch: Watch) -> None:
    """The system first (SIGTERM to its group), then anything of the job left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    watch.stop_.set()
    watch.join()
    for pid in list(watch.alive):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
