"""Helpers shared by the benchmark scripts: summary statistics, the machine
line every script prints, a scratch directory under /tmp, and the pieces
that drive a real ``trainwatch run`` (config file, status.json, ledger).

Not a benchmark itself; the ``bench_*.py`` scripts import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
TRAINWATCH = str(VENV_BIN / "trainwatch")
JOB_NAME = "bench"


# --- statistics ----------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    n: int
    median: float
    p99: float
    min: float
    max: float
    mean: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def summarize(values: Sequence[float]) -> Summary:
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        nan = float("nan")
        return Summary(0, nan, nan, nan, nan, nan)
    return Summary(
        n=int(a.size),
        median=float(np.median(a)),
        p99=float(np.percentile(a, 99)),
        min=float(a.min()),
        max=float(a.max()),
        mean=float(a.mean()),
    )


def fmt_summary(s: Summary, unit: str, digits: int = 3) -> str:
    """One line: median and p99 (or min/max where there are few samples) and n."""
    f = f"{{:.{digits}f}}"
    parts = [f"median {f.format(s.median)} {unit}"]
    if s.n >= 50:
        parts.append(f"p99 {f.format(s.p99)} {unit}")
    parts.append(f"min {f.format(s.min)}")
    parts.append(f"max {f.format(s.max)} {unit}")
    parts.append(f"n={s.n}")
    return ", ".join(parts)


# --- the machine ---------------------------------------------------------------


def machine() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "cpu": cpu,
        "loadavg": [round(x, 2) for x in load],
    }


def machine_line() -> str:
    m = machine()
    la = " ".join(f"{x:.2f}" for x in m["loadavg"])
    return (
        f"machine: nproc={m['nproc']}, {m['implementation']} {m['python']}, "
        f"Linux {m['kernel']}, {m['cpu']}, loadavg {la}"
    )


def schedstat_ns(pid: int) -> int:
    """Total on-CPU time of every thread of ``pid``, in ns (/proc/<pid>/task/*/schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def voluntary_switches(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid``: how often it went to sleep
    (each one followed by a wake-up)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def json_lines(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file as written so far: a missing file is empty, a torn line skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def write_json(path: str | None, obj: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(obj, indent=1, sort_keys=True, default=str))


# --- driving `trainwatch run` --------------------------------------------------


def scratch_dir(prefix: str) -> Path:
    """A short directory under /tmp (a socket path must fit in 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def write_config(
    d: Path,
    command: Sequence[str],
    *,
    backoff_initial: str = "0.2s",
    backoff_max: str = "1s",
    kill_grace: str = "2s",
    max_restarts: int = 1000,
) -> Path:
    """A config for one job named JOB_NAME. JSON is valid YAML and has no
    surprises such as an unquoted ``off`` becoming false."""
    cfg = {
        "state_dir": str(d / "s"),
        "run_dir": str(d / "r"),
        "jobs": [{"name": JOB_NAME, "command": list(command), "policy": "default"}],
        "policies": {
            "default": {
                "max_restarts": max_restarts,
                "kill_grace": kill_grace,
                "backoff": {"initial": backoff_initial, "max": backoff_max, "jitter": 0},
            }
        },
    }
    path = d / "trainwatch.yaml"
    path.write_text(json.dumps(cfg, indent=1) + "\n")
    return path


class TrainwatchRun:
    """``trainwatch run`` as a subprocess, with its stderr in a file; stopped
    with SIGINT (exit 130 expected) and, failing that, killed together with
    whatever job process status.json names."""

    def __init__(self, d: Path, config: Path, extra: Sequence[str] = ()) -> None:
        self.d = d
        self.state_dir = d / "s"
        self.run_dir = d / "r"
        self.stderr_path = d / "trainwatch.stderr"
        self.argv = [
            TRAINWATCH,
            "run",
            "--config",
            str(config),
            "--state-dir",
            str(self.state_dir),
            "--run-dir",
            str(self.run_dir),
            "--no-passthrough",
            "-q",
            *extra,
        ]
        self._err = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._err
        )
        self.pid = self.proc.pid
        self.returncode: int | None = None
        self._job_pids: set[int] = set()

    # status.json and the ledger

    def status(self) -> dict[str, Any] | None:
        try:
            s = json.loads((self.state_dir / "jobs" / JOB_NAME / "status.json").read_text())
        except (OSError, ValueError):
            return None
        if isinstance(s, dict):
            if s.get("pid"):
                self._job_pids.add(int(s["pid"]))
            for p in (s.get("ranks") or {}).values():
                self._job_pids.add(int(p))
            return s
        return None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for(
        self,
        pred: Callable[[dict[str, Any]], bool],
        timeout: float,
        what: str,
        poll: float = 0.01,
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"trainwatch run exited ({self.proc.returncode}) "
                    f"waiting for {what}:\n{self.stderr_tail()}"
                )
            s = self.status()
            if s is not None and pred(s):
                return s
            time.sleep(poll)
        raise RuntimeError(
            f"timed out after {timeout:g}s waiting for {what}; "
            f"status {self.status()}\n{self.stderr_tail()}"
        )

    def wait_running(
        self, min_attempt: int, ranks: int = 1, timeout: float = 20.0
    ) -> dict[str, Any]:
        def ok(s: dict[str, Any]) -> bool:
            return (
                s.get("state") == "running"
                and int(s.get("attempt", -1)) >= min_attempt
                and bool(s.get("pid"))
                and len(s.get("ranks") or {}) >= ranks
            )

        return self.wait_for(ok, timeout, f"attempt {min_attempt} running with {ranks} rank(s)")

    def ledger(self, timeout: float = 10.0) -> sqlite3.Connection:
        path = self.state_dir / "ledger.db"
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path}: no ledger after {timeout:g}s")
            time.sleep(0.01)
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        db.row_factory = sqlite3.Row
        return db

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # stopping

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGINT and wait; returns the exit code (130 expected)."""
        if self.returncode is not None:
            return self.returncode
        self.status()  # remember the last job pid before it goes
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGINT)
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait()
        finally:
            self._err.close()
            self._reap_job()
        return self.returncode

    def _reap_job(self) -> None:
        """Anything of the job still alive after trainwatch is gone: kill it (by pid,
        only pids that status.json named as this job's)."""
        for pid in self._job_pids:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if b"TRAINWATCH_SOCKET=" + str(self.run_dir).encode() not in env:
                continue  # the pid was reused by someone else
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)


def remove(d: Path, keep: bool) -> None:
    if keep:
        print(f"kept {d}")
    else:
        shutil.rmtree(d, ignore_errors=True)
