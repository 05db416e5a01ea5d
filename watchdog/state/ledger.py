"""The incident ledger: SQLite in WAL mode in ``state_dir``. Every incident
and every state change, kept across daemon restarts; what ``trainwatch
incidents`` reads. Times are wall-clock Unix seconds."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwatch.state import atomic, statewrites
from trainwatch.state.atomic import FILE_MODE
from trainwatch.state.ownership import set_mode
from trainwatch.types import Fault, JobState

_SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,             -- when it was detected
    job TEXT NOT NULL,
    kind TEXT NOT NULL,
    rank INTEGER,
    gpu INTEGER,
    evidence TEXT NOT NULL,         -- JSON
    action TEXT NOT NULL,
    decision TEXT NOT NULL,         -- the policy's reason
    observe_only INTEGER NOT NULL DEFAULT 0,
    injected INTEGER NOT NULL DEFAULT 0,
    attempt INTEGER NOT NULL,       -- the attempt that faulted
    onset_step INTEGER,
    detection_latency_s REAL,       -- detection minus onset
    backoff_s REAL,
    relaunched_at REAL,
    time_to_relaunch_s REAL,        -- new process started minus detection, backoff included
    resumed_from TEXT,
    resumed_step INTEGER,
    steps_lost INTEGER
);
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,
    job TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    from_state TEXT,
    to_state TEXT NOT NULL,
    reason TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS incidents_job ON incidents (job, id);
CREATE INDEX IF NOT EXISTS transitions_job ON transitions (job, id);
CREATE TABLE IF NOT EXISTS deletions (
    id INTEGER PRIMARY KEY,
    time REAL NOT NULL,
    job TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    size_bytes INTEGER,
    outcome TEXT                    -- NULL: deleted; else why it was not
);
"""

LEDGER_NAME = "ledger.db"


@dataclass(frozen=True)
class Relaunch:
    at: float
    resumed_from: str | None
    resumed_step: int | None
    steps_lost: int | None


def steps_lost(resumed: int | None, *reached: int | None) -> int | None:
    """Steps redone from ``resumed``: counted from the newest step reached that
    anyone knows (this host's ranks, the group's claims); None when none is known."""
    known = [s for s in reached if s is not None]
    return max(0, max(known) - (resumed or 0)) if known else None


def _survive(default: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A failed write (disk full, I/O error, a value SQLite cannot bind) is
    logged, counted and survived: losing a ledger row is better than a
    supervisor that dies and leaves its job behind. A write to the in-memory
    stand-in counts as failed too: it will not outlive this process."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def guarded(self: Ledger, *args: Any, **kwargs: Any) -> Any:
            try:
                out = fn(self, *args, **kwargs)
            except (sqlite3.Error, ValueError, TypeError, OverflowError) as e:
                self._failed(f"{fn.__name__} failed", e)
                return default
            if not self.persistent:
                self._failed("kept in memory only", _NOT_PERSISTENT)
            return out

        return guarded

    return wrap


_NOT_PERSISTENT = OSError("the ledger file could not be opened for writing")
_INT64 = (-(2**63), 2**63 - 1)


def _int(v: Any) -> Any:
    """An integer SQLite can store: a value past int64 (from a job's datagram)
    is clamped; the evidence JSON keeps it whole."""
    if isinstance(v, int) and not isinstance(v, bool) and not _INT64[0] <= v <= _INT64[1]:
        return max(_INT64[0], min(_INT64[1], v))
    return v


def _evidence(evidence: Any) -> str:
    """JSON of whatever a detector put in the evidence; never raises."""
    try:
        return json.dumps(evidence, sort_keys=True, default=repr)
    except (TypeError, ValueError):  # keys of mixed types, a cycle
        return json.dumps({"repr": repr(evidence)[:4096]})


def _open_file(path: Path) -> sqlite3.Connection:
    """The ledger file, created 0640 (SQLite gives -wal and -shm the same mode)
    and brought to it if it was looser."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    os.close(fd)
    for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        with contextlib.suppress(FileNotFoundError):
            if stat.S_IMODE(os.lstat(p).st_mode) != FILE_MODE:
                set_mode(p, FILE_MODE)
    db = sqlite3.connect(path, timeout=5, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
    except sqlite3.Error:
        db.close()
        raise
    return db


class Ledger:
    def __init__(self, state_dir: str | os.PathLike[str], readonly: bool = False) -> None:
        """``readonly``: for the CLI; raises FileNotFoundError when there is no
        ledger. Otherwise it never raises: when the file cannot be opened for
        writing (read-only or full state_dir) the ledger lives in memory, every
        write to it is counted as failed, and supervision goes on."""
        path = Path(state_dir) / LEDGER_NAME
        self.path = path
        self.errors = 0  # writes that failed (or only reached memory) and were survived
        self.persistent = True
        if readonly:
            if not path.exists():
                raise FileNotFoundError(path)
            uri = f"file:{urllib.parse.quote(str(path))}?mode=ro"
            self.db = sqlite3.connect(uri, uri=True, timeout=5)
        else:
            try:
                atomic.makedirs(path.parent)
                self.db = _open_file(path)
            except (sqlite3.Error, OSError) as e:
                self.persistent = False
                self._failed("cannot open it for writing; incidents are kept in memory "
                             "until trainwatch restarts", e)
                self.db = sqlite3.connect(":memory:", isolation_level=None)
                self.db.executescript(_SCHEMA)
        self.db.row_factory = sqlite3.Row

    def _failed(self, what: str, e: BaseException) -> None:
        self.errors += 1
        statewrites.failed("ledger", self.path, OSError(f"{what}: {e}"))

    @_survive(-1)
    def incident(
        self,
        fault: Fault,
        action: str,
        decision: str,
        attempt: int,
        detection_latency: float,
        observe_only: bool = False,
        backoff: float | None = None,
        injected: bool = False,
    ) -> int:
        cur = self.db.execute(
            "INSERT INTO incidents (time, job, kind, rank, gpu, evidence, action, decision,"
            " observe_only, injected, attempt, onset_step, detection_latency_s, backoff_s)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                time.time(), fault.job, fault.kind.value, _int(fault.rank), _int(fault.gpu),
                _evidence(fault.evidence), action, decision,
                int(observe_only), int(injected), _int(attempt), _int(fault.onset_step),
                _int(detection_latency), _int(backoff),
            ),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    @_survive(None)
    def relaunched(self, incident_id: int, r: Relaunch) -> None:
        self.db.execute(
            "UPDATE incidents SET relaunched_at=?, time_to_relaunch_s=? - time,"
            " resumed_from=?, resumed_step=?, steps_lost=? WHERE id=?",
            (r.at, r.at, r.resumed_from, _int(r.resumed_step), _int(r.steps_lost), incident_id),
        )

    @_survive(None)
    def backoff_applied(self, incident_id: int, seconds: float) -> None:
        """The backoff the restart waited, where its engine does not wait the
        policy's (a requeue, a round the agent starts at once)."""
        self.db.execute("UPDATE incidents SET backoff_s=? WHERE id=?", (seconds, incident_id))

    @_survive(None)
    def amend(self, incident_id: int, evidence: dict[str, Any], rank: int | None) -> None:
        """Evidence that came after the incident was recorded (the stacks taken
        before the kill); ``rank`` fills the rank only where none was named."""
        row = self.db.execute("SELECT evidence FROM incidents WHERE id=?",
                              (incident_id,)).fetchone()
        if row is None:
            return
        merged = {**json.loads(row[0]), **evidence}
        self.db.execute("UPDATE incidents SET evidence=?, rank=COALESCE(rank, ?) WHERE id=?",
                        (_evidence(merged), _int(rank), incident_id))

    def evidence(self, incident_id: int) -> dict[str, Any]:
        """One incident's evidence as recorded ({} when there is no such incident)."""
        row = self.db.execute("SELECT evidence FROM incidents WHERE id=?",
                              (incident_id,)).fetchone()
        return dict(json.loads(row[0])) if row is not None else {}

    @_survive(None)
    def transition(
        self, job: str, attempt: int, old: JobState | None, new: JobState, reason: str
    ) -> None:
        self.db.execute(
            "INSERT INTO transitions (time, job, attempt, from_state, to_state, reason)"
            " VALUES (?,?,?,?,?,?)",
            (time.time(), job, _int(attempt), old.value if old else None, new.value, reason),
        )

    def incidents(self, job: str | None = None) -> list[dict[str, Any]]:
        q = "SELECT * FROM incidents" + (" WHERE job=?" if job else "") + " ORDER BY id"
        rows = self.db.execute(q, (job,) if job else ()).fetchall()
        out = []
        for row in rows:
            d = dict(row)
            d["evidence"] = json.loads(d["evidence"])
            d["observe_only"] = bool(d["observe_only"])
            d["injected"] = bool(d["injected"])
            out.append(d)
        return out

    @_survive(None)
    def deletion(self, job: str, attempt: int, step: int, path: str, size: int | None,
                 outcome: str | None) -> None:
        """A checkpoint deleted by retention (``outcome`` None), or not (why)."""
        self.db.execute(
            "INSERT INTO deletions (time, job, attempt, step, path, size_bytes, outcome)"
            " VALUES (?,?,?,?,?,?,?)",
            (time.time(), job, _int(attempt), _int(step), path, _int(size), outcome))

    def deletions(self, job: str | None = None) -> list[dict[str, Any]]:
        q = "SELECT * FROM deletions" + (" WHERE job=?" if job else "") + " ORDER BY id"
        return [dict(r) for r in self.db.execute(q, (job,) if job else ()).fetchall()]

    def transitions(self, job: str | None = None) -> list[dict[str, Any]]:
        q = "SELECT * FROM transitions" + (" WHERE job=?" if job else "") + " ORDER BY id"
        return [dict(r) for r in self.db.execute(q, (job,) if job else ()).fetchall()]

    def close(self) -> None:
        self.db.close()
