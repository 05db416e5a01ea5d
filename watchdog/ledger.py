"""The incident ledger: SQLite in WAL mode in ``state_dir``. Every incident
and every state change, kept across daemon restarts; what ``trainwatch
incidents`` reads. Times are wall-clock Unix seconds."""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
"""

LEDGER_NAME = "ledger.db"
log = logging.getLogger("trainwatch")


@dataclass(frozen=True)
class Relaunch:
    at: float
    resumed_from: str | None
    resumed_step: int | None
    steps_lost: int | None


def _survive(default: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A failed write (disk full, I/O error) is logged and survived: losing a
    ledger row is better than a supervisor that dies and leaves its job behind."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def guarded(self: Ledger, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except sqlite3.Error as e:
                self.errors += 1
                log.error("ledger %s: %s failed: %s", self.path, fn.__name__, e)
                return default

        return guarded

    return wrap


class Ledger:
    def __init__(self, state_dir: str | os.PathLike[str], readonly: bool = False) -> None:
        path = Path(state_dir) / LEDGER_NAME
        if readonly:
            if not path.exists():
                raise FileNotFoundError(path)
            uri = f"file:{urllib.parse.quote(str(path))}?mode=ro"
            self.db = sqlite3.connect(uri, uri=True, timeout=5)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(path, timeout=5, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
        self.db.row_factory = sqlite3.Row
        self.path = path
        self.errors = 0  # writes that failed and were survived

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
                time.time(), fault.job, fault.kind.value, fault.rank, fault.gpu,
                json.dumps(fault.evidence, sort_keys=True), action, decision,
                int(observe_only), int(injected), attempt, fault.onset_step,
                detection_latency, backoff,
            ),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    @_survive(None)
    def relaunched(self, incident_id: int, r: Relaunch) -> None:
        self.db.execute(
            "UPDATE incidents SET relaunched_at=?, time_to_relaunch_s=? - time,"
            " resumed_from=?, resumed_step=?, steps_lost=? WHERE id=?",
            (r.at, r.at, r.resumed_from, r.resumed_step, r.steps_lost, incident_id),
        )

    @_survive(None)
    def transition(
        self, job: str, attempt: int, old: JobState | None, new: JobState, reason: str
    ) -> None:
        self.db.execute(
            "INSERT INTO transitions (time, job, attempt, from_state, to_state, reason)"
            " VALUES (?,?,?,?,?,?)",
            (time.time(), job, attempt, old.value if old else None, new.value, reason),
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

    def transitions(self, job: str | None = None) -> list[dict[str, Any]]:
        q = "SELECT * FROM transitions" + (" WHERE job=?" if job else "") + " ORDER BY id"
        return [dict(r) for r in self.db.execute(q, (job,) if job else ()).fetchall()]

    def close(self) -> None:
        self.db.close()
