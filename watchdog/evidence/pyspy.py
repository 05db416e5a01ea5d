"""``py-spy dump --json`` of many processes at once, under one deadline.

Measured here (py-spy 0.4.3, as root): a dump takes about 10-15 ms, 0.9 s
with ``--native`` on a process that loaded libtorch; blocking mode (py-spy
pauses the process for a consistent snapshot) FAILS on a SIGSTOPped process
("Failed to suspend process: unexpected waitpid result ... SIGSTOP");
``--nonblocking`` reads it (its memory does not change while it is stopped, so
the snapshot is consistent anyway). ``--native`` cannot be combined with
``--nonblocking``.

So the modes tried, in order, per process: a stopped, traced or D-state
process (which a ptrace stop could also wait on) is read ``nonblocking`` only,
its native frames skipped; others ``native`` (when asked), then
``blocking``, then ``nonblocking``, each after the one before failed. Every
process starts at once; whatever still runs at the deadline is killed.

py-spy's output goes straight to a file (a pipe would stall a large dump until
read); ``RUST_BACKTRACE=0`` keeps its errors to the message.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwatch.state.atomic import FILE_MODE

NO_PAUSE = frozenset("TtD")  # read these without a ptrace stop
GONE = frozenset("ZX")  # nothing left to read
_POLL = 0.005


def find() -> str | None:
    """py-spy on PATH, else the one installed beside this Python (the extra)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if os.access(beside, os.X_OK) else None


def modes(state: str | None, native: bool) -> list[str]:
    if state is not None and state in NO_PAUSE:
        return ["nonblocking"]
    return (["native"] if native else []) + ["blocking", "nonblocking"]


def command(binary: str, pid: int, mode: str) -> list[str]:
    extra = {"native": ["--native"], "blocking": [], "nonblocking": ["--nonblocking"]}[mode]
    return [binary, "dump", "--pid", str(pid), "--json", *extra]


def error_of(stderr: str, rc: int | None) -> str:
    """py-spy's error as one line: the message and its causes."""
    parts = []
    for line in stderr.splitlines():
        s = line.strip()
        if s.startswith("Stack backtrace"):
            break
        if not s or s == "Caused by:":
            continue
        s = s.removeprefix("Error: ")
        head, sep, rest = s.partition(": ")
        s = (rest if sep and head.isdigit() else s).rstrip(".")
        if s not in parts:  # py-spy repeats the OS error as its own cause
            parts.append(s)
    return ": ".join(parts)[:400] or f"py-spy exited with status {rc}"


@dataclass
class Dump:
    """One target's dump: the modes left to try, the running py-spy, the outcome."""

    pid: int
    json_path: Path
    left: list[str]
    native_skipped: bool = False
    tries: list[dict[str, Any]] = field(default_factory=list)
    ok: bool = False
    mode: str | None = None
    error: str | None = None
    seconds: float = 0.0
    proc: subprocess.Popen[bytes] | None = None
    _err: Path | None = None
    _t0: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "mode": self.mode, "error": self.error,
                "seconds": round(self.seconds, 4), "native_skipped": self.native_skipped,
                "tries": self.tries}


class Runner:
    """Runs the dumps of ``targets`` ((pid, file stem, state letter)) in
    parallel into ``folder``; ``finish`` returns when all are done or the
    deadline passed (then True: something was killed)."""

    def __init__(self, binary: str, targets: Sequence[tuple[int, str, str | None]],
                 folder: Path, native: bool, deadline: float,
                 clock: Callable[[], float] = time.monotonic, pause: bool = True) -> None:
        """``pause`` False: never stop a process to read it (``--nonblocking`` only)."""
        self.binary, self.folder, self.deadline, self.clock = binary, folder, deadline, clock
        self.dumps: list[Dump] = []
        for pid, stem, state in targets:
            ms = modes(state, native) if pause else ["nonblocking"]
            d = Dump(pid, folder / f"{stem}.json", ms, native_skipped=native and "native" not in ms)
            if state is None or state in GONE:  # say so rather than ask py-spy
                d.left, d.error = [], "process gone"
            self.dumps.append(d)

    def start(self) -> None:
        for d in self.dumps:
            if d.left:
                self._launch(d)

    def _launch(self, d: Dump) -> None:
        mode = d.left.pop(0)
        part = d.json_path.with_name(d.json_path.name + ".part")
        d._err = d.json_path.with_name(d.json_path.name + ".err")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        d._t0 = self.clock()
        try:
            out = os.open(part, flags, FILE_MODE)
            try:
                err = os.open(d._err, flags, FILE_MODE)
                try:
                    d.proc = subprocess.Popen(
                        command(self.binary, d.pid, mode), stdin=subprocess.DEVNULL,
                        stdout=out, stderr=err, env={**os.environ, "RUST_BACKTRACE": "0"})
                finally:
                    os.close(err)
            finally:
                os.close(out)
        except OSError as e:
            d.proc = None
            self._done(d, mode, None, f"cannot run py-spy: {e.strerror or e}")
            return
        d.tries.append({"mode": mode})

    def _done(self, d: Dump, mode: str, rc: int | None, error: str | None) -> None:
        spent = self.clock() - d._t0
        d.seconds += spent
        if d.tries and d.tries[-1].get("mode") == mode and "rc" not in d.tries[-1]:
            d.tries[-1].update(rc=rc, error=error, seconds=round(spent, 4))
        else:
            d.tries.append({"mode": mode, "rc": rc, "error": error, "seconds": round(spent, 4)})
        part = d.json_path.with_name(d.json_path.name + ".part")
        if error is None:
            os.replace(part, d.json_path)
            d.ok, d.mode, d.error = True, mode, None
        else:
            with contextlib.suppress(OSError):
                os.unlink(part)
            d.mode, d.error = mode, error
        if d._err is not None:
            with contextlib.suppress(OSError):
                os.unlink(d._err)

    def _reap(self, d: Dump) -> None:
        assert d.proc is not None
        rc = d.proc.poll()
        if rc is None:
            return
        mode = d.tries[-1]["mode"]
        d.proc = None
        error = None
        if rc != 0:
            try:
                text = (d._err or Path("/nonexistent")).read_text(errors="replace")
            except OSError:
                text = ""
            error = error_of(text, rc)
        self._done(d, mode, rc, error)
        if error is not None and d.left and self.clock() < self.deadline:
            self._launch(d)

    def finish(self) -> bool:
        """Poll until every dump is done or the deadline; True when it cut some short."""
        while (done := self.poll()) is None:
            time.sleep(_POLL)
        return done

    def poll(self) -> bool | None:
        """Once, without waiting: None while dumps run before the deadline; else
        whether the deadline cut some short (those are killed)."""
        for d in [d for d in self.dumps if d.proc is not None]:
            self._reap(d)
        if not any(d.proc is not None for d in self.dumps):
            return False
        if self.clock() < self.deadline:
            return None
        for d in self.dumps:
            if d.proc is not None:
                with contextlib.suppress(OSError):
                    d.proc.kill()
                d.proc.wait()
                d.proc = None
                self._done(d, d.tries[-1]["mode"], None, "deadline: py-spy killed")
        return True


def text(threads: Sequence[Any]) -> str:
    """A dump as people read it: each thread, then its frames innermost first."""
    lines = []
    for t in threads:
        if not isinstance(t, dict):
            continue
        how = "active" if t.get("active") else "idle"
        if t.get("owns_gil"):
            how += ", holds the GIL"
        lines.append(f'Thread {t.get("os_thread_id")} "{t.get("thread_name")}" ({how})')
        for f in t.get("frames") or []:
            if isinstance(f, dict):
                lines.append(f"    {frame(f)}")
    return "\n".join(lines) + "\n"


def frame(f: dict[str, Any]) -> str:
    where = f.get("short_filename") or f.get("filename") or "?"
    line = f.get("line")
    return f"{f.get('name')} ({where}:{line})" if line else f"{f.get('name')} ({where})"
