"""Capture: the evidence of a stalled job, taken just before it is killed.

``start`` returns at once; the work runs in a daemon thread and is bounded by
``timeout`` (py-spy runs still going and the wait for flight-recorder dumps
end at the deadline; copying and writing the summary come after it), so
recovery waits at most about that long, and need not wait at all. Nothing
raises into the caller: every failure (py-spy missing, permission denied, a
process gone, the deadline) is a line in ``summary`` and ``evidence.json``.

The order: process states and CPU times first (before py-spy touches the
processes), the flight-recorder trigger (the dumps take longest), every
py-spy at once, the log tail while they run, then the wait, the copies, the
readable stacks, the verdict (``trainwatch.detectors.stacks``), and
``evidence.json`` written atomically.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from trainwatch.detectors import stacks
from trainwatch.evidence import flightrecorder, logtail, pyspy
from trainwatch.privsep.hand import Hand, HandError
from trainwatch.sources.procstat import proc_stat
from trainwatch.state.atomic import FILE_MODE, makedirs, write_json

SUMMARY = "evidence.json"
VERSION = 1


@dataclass(frozen=True)
class Target:
    pid: int
    rank: int | None  # None: a non-rank process (the launcher)


def _write(path: Path, data: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 FILE_MODE)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(data)


def _probe(pid: int) -> dict[str, Any]:
    """The process state letter and CPU seconds (user + system) now; None when gone."""
    st = proc_stat(pid)
    cpu = None
    try:
        t = psutil.Process(pid).cpu_times()
        cpu = round(t.user + t.system, 3)
    except psutil.Error:
        pass
    return {"state": st[0] if st else None, "cpu_seconds": cpu}


def _stems(targets: Sequence[Target]) -> list[str]:
    """File names per target: rank<N>, pid<P> for non-ranks and repeated ranks."""
    seen: set[int] = set()
    out = []
    for t in targets:
        if t.rank is None or t.rank in seen:
            out.append(f"pid{t.pid}" if t.rank is None else f"rank{t.rank}-pid{t.pid}")
        else:
            seen.add(t.rank)
            out.append(f"rank{t.rank}")
    return out


class Capture:
    def __init__(self, out: Path, targets: Sequence[Target], log_path: Path | None, *,
                 timeout: float = 5.0, native: bool = False, log_lines: int = 50,
                 fr_dir: Path | None = None, named: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 pyspy_path: str | None = None, hand: Hand | None = None) -> None:
        """``pyspy_path``: the py-spy binary; None finds it (``pyspy.find``).
        ``hand``: the job's (privsep), where its dump folder is read; without one,
        in this process."""
        self.hand = hand
        self.out, self.targets, self.log_path = Path(out), list(targets), log_path
        self.timeout, self.native, self.log_lines = timeout, native, log_lines
        self.fr_dir, self.named, self.clock = fr_dir, named, clock
        self.pyspy_path = pyspy_path
        self.summary: dict[str, Any] | None = None
        self._done = threading.Event()

    def start(self) -> None:
        try:
            threading.Thread(target=self._run, name="trainwatch-evidence", daemon=True).start()
        except RuntimeError as e:  # no thread to be had: say so, do not raise
            self.summary = {"version": VERSION, "errors": [f"cannot start: {e}"],
                            "seconds": 0.0, "deadline_hit": False}
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def _run(self) -> None:
        t0 = self.clock()
        s: dict[str, Any] = {"version": VERSION, "time": time.time(), "timeout": self.timeout,
                             "native": self.native, "named": self.named, "errors": [],
                             "deadline_hit": False, "targets": [], "verdict": None,
                             "files": []}
        try:
            self._collect(s, t0 + self.timeout)
        except Exception as e:  # the daemon loop must never see it
            s["errors"].append(f"capture failed: {type(e).__name__}: {e}")
        s["seconds"] = round(self.clock() - t0, 4)
        try:
            s["files"] = sorted({*self._files(), SUMMARY})
            write_json(self.out / SUMMARY, s)
        except (OSError, ValueError, TypeError) as e:
            s["errors"].append(f"{SUMMARY}: {e}")
        self.summary = s
        self._done.set()

    def _files(self) -> list[str]:
        return [str(p.relative_to(self.out)) for p in self.out.rglob("*")
                if p.is_file() and not p.name.startswith(".")]

    def _collect(self, s: dict[str, Any], deadline: float) -> None:
        makedirs(self.out)
        for t, stem in zip(self.targets, _stems(self.targets), strict=True):
            s["targets"].append({"pid": t.pid, "rank": t.rank, "file": stem, **_probe(t.pid)})
        runner = self._spy(s, deadline)
        self._log_tail(s)
        if self.fr_dir is not None:  # while py-spy runs
            self._flight_recorder(s, deadline)
        if runner is not None:
            s["deadline_hit"] = runner.finish() or s["deadline_hit"]
            for d, row in zip(runner.dumps, s["targets"], strict=True):
                row["py_spy"] = d.as_dict()
        self._stacks(s)

    def _spy(self, s: dict[str, Any], deadline: float) -> pyspy.Runner | None:
        binary = self.pyspy_path or pyspy.find()
        s["py_spy"] = binary
        if binary is None:
            s["errors"].append("py-spy is not installed (the pyspy extra: pip install"
                               " '/path/to/trainwatch[pyspy]'): no stacks")
            return None
        folder = self.out / "stacks"
        makedirs(folder)
        live = [(row["pid"], row["file"], row["state"]) for row in s["targets"]]
        runner = pyspy.Runner(binary, live, folder, self.native, deadline, self.clock)
        runner.start()
        return runner

    def _log_tail(self, s: dict[str, Any]) -> None:
        if self.log_path is None:
            s["log_tail"] = {"error": "no log file"}
            return
        try:
            lines = logtail.read_tail(Path(self.log_path))
        except OSError as e:
            s["log_tail"] = {"error": f"{self.log_path}: {e.strerror or e}"}
            return
        tail = lines[-self.log_lines:] if self.log_lines > 0 else []
        _write(self.out / "log-tail.txt", "".join(x + "\n" for x in tail))
        ranks = logtail.by_rank(lines, self.log_lines)
        for r, rl in ranks.items():
            _write(self.out / f"log-tail.rank{r}.txt", "".join(x + "\n" for x in rl))
        s["log_tail"] = {"path": str(self.log_path), "lines": len(tail), "ranks": list(ranks)}

    def _flight_recorder(self, s: dict[str, Any], deadline: float) -> None:
        """Dumps triggered, waited for and read in the job's hand, as its user;
        written here, bounded (flightrecorder.dumps)."""
        assert self.fr_dir is not None
        stopped = [row["rank"] for row in s["targets"]
                   if row["rank"] is not None and row["state"] in pyspy.NO_PAUSE | pyspy.GONE]
        seconds = max(0.0, deadline - self.clock())
        fr: dict[str, Any] = {"dir": str(self.fr_dir), "pipes": [], "files": [], "errors": []}
        try:
            if self.hand is None:
                b = flightrecorder.dumps(str(self.fr_dir), stopped, seconds)
                got, blobs = b.result, b.blobs
            else:
                got, blobs = self.hand.call_blobs(
                    flightrecorder.dumps, str(self.fr_dir), stopped, seconds,
                    timeout=seconds + 10.0, max_reply=flightrecorder.MAX_TOTAL + (1 << 20))
        except HandError as e:
            fr["errors"].append(f"{self.fr_dir}: no answer as the job's user: {e}")
            s["flight_recorder"] = fr
            return
        if isinstance(got, dict):
            pipes, errs = got.get("pipes"), got.get("errors")
            fr["pipes"] = pipes[:1024] if isinstance(pipes, list) else []
            fr["errors"] = [str(x)[:300] for x in errs[:64]] if isinstance(errs, list) else []
            fr["limited"] = got.get("limited") if isinstance(got.get("limited"), int) else 0
            if got.get("deadline_hit"):
                s["deadline_hit"] = True
        fr["files"], errors = flightrecorder.write(self.out / "flight-recorder", got, blobs)
        fr["errors"] += errors
        s["flight_recorder"] = fr

    def _stacks(self, s: dict[str, Any]) -> None:
        """The readable stacks beside the JSON, and the verdict over the ranks."""
        by_rank: dict[int, list[Any] | None] = {}
        states: dict[int, str] = {}
        for row in s["targets"]:
            threads: list[Any] | None = None
            path = self.out / "stacks" / f"{row['file']}.json"
            if (row.get("py_spy") or {}).get("ok"):
                try:
                    loaded = json.loads(path.read_text())
                    threads = loaded if isinstance(loaded, list) else None
                    if threads is None:
                        row["py_spy"].update(ok=False, error="py-spy output is not a list")
                except (OSError, ValueError) as e:
                    row["py_spy"].update(ok=False, error=f"py-spy output unreadable: {e}")
            if threads is not None:
                _write(path.with_suffix(".txt"), pyspy.text(threads))
            if row["rank"] is not None and row["rank"] not in by_rank:
                by_rank[row["rank"]] = threads
                if row["state"] is not None:
                    states[row["rank"]] = row["state"]
        if by_rank:
            s["verdict"] = stacks.verdict(by_rank, states, self.named).as_dict()
