"""What happened when, read back from the ledger (state/ledger.py): an
incident's phases (onset, detection, evidence, kill, backoff, relaunch, first
beat) from its row and the job's ``transitions``; and a job's goodput over
time, the cumulative time it made progress. Pure: rows in, values out.

Goodput is the exporter's (export/goodput.py) read back after the fact: a
fault that stopped the job costs from its onset until its relaunch beats
again, plus the time to redo the steps it lost (steps lost x the seconds a
step took in the attempt that faulted, where the ledger tells both).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Actions after which the job's tree is killed (alert records only).
STOPS = frozenset({"restart", "rollback", "restart_exclude_gpu", "exec", "stop", "requeue",
                   "drain"})
ENDS = frozenset({"exited", "fatal", "paused"})  # the job is not running after these
SLACK = 1.0  # s: a transition recorded this long before its incident's row still belongs to it
_STEP = re.compile(r"\bstep (\d+)\b")
_GPUS = re.compile(r"\bGPUs ([0-9][0-9,]*)")


@dataclass(frozen=True)
class Phase:
    name: str  # onset | detection | evidence | kill | stopped | relaunch | first beat
    at: float | None  # Unix seconds; None: not known
    note: str


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def stops(row: Mapping[str, Any]) -> bool:
    """Whether the incident's action killed the job (not an alert, not observe-only)."""
    return str(row.get("action")) in STOPS and not row.get("observe_only")


def onset(row: Mapping[str, Any]) -> float | None:
    """When the fault began (detection minus its latency), where measured."""
    t, lat = _num(row.get("time")), _num(row.get("detection_latency_s"))
    return t - lat if t is not None and lat is not None else None


def _after(ts: Sequence[Mapping[str, Any]], since: float, attempt: int,
           states: frozenset[str]) -> Mapping[str, Any] | None:
    for t in ts:
        at = _num(t.get("time"))
        if (at is not None and at >= since and t.get("attempt") == attempt
                and t.get("to_state") in states):
            return t
    return None


def step_of(reason: object) -> int | None:
    """The step a transition's reason names ("first heartbeat (rank 0, step 49)")."""
    m = _STEP.search(str(reason or ""))
    return int(m.group(1)) if m else None


def gpus_of(reason: object) -> str | None:
    """The GPUs a start's reason names ("..., GPUs 0,2,3")."""
    m = _GPUS.search(str(reason or ""))
    return m.group(1) if m else None


@dataclass(frozen=True)
class Steps:
    """The transitions that belong to one incident (None: not in the ledger)."""

    kill: Mapping[str, Any] | None
    stopped: Mapping[str, Any] | None
    start: Mapping[str, Any] | None  # the attempt it faulted in
    relaunch: Mapping[str, Any] | None
    beat: Mapping[str, Any] | None


def steps(row: Mapping[str, Any], ts: Sequence[Mapping[str, Any]]) -> Steps:
    """``ts``: the job's transitions, oldest first."""
    t, attempt = _num(row.get("time")), row.get("attempt")
    if t is None or not isinstance(attempt, int):
        return Steps(None, None, None, None, None)
    start = next((x for x in reversed(ts) if x.get("attempt") == attempt
                  and x.get("to_state") == "starting"), None)
    kill = stopped = None
    if stops(row):
        kill = _after(ts, t - SLACK, attempt, frozenset({"stopping"}))
        if kill is not None:
            stopped = _after(ts, float(kill["time"]), attempt,
                             frozenset({"backoff", *ENDS}))
    relaunch = beat = None
    if row.get("relaunched_at") is not None or (stopped and stopped["to_state"] == "backoff"):
        relaunch = _after(ts, t - SLACK, attempt + 1, frozenset({"starting"}))
        if relaunch is not None:
            beat = _after(ts, float(relaunch["time"]), attempt + 1, frozenset({"running"}))
    return Steps(kill, stopped, start, relaunch, beat)


def phases(row: Mapping[str, Any], ts: Sequence[Mapping[str, Any]],
           captured: Mapping[str, Any] | None = None) -> list[Phase]:
    """The incident's phases in order; ``captured``: its evidence summary
    (capture.SUMMARY), when stacks and a log tail were taken before the kill."""
    s = steps(row, ts)
    lat = _num(row.get("detection_latency_s"))
    out = [Phase("onset", onset(row),
                 f"step {row['onset_step']}" if row.get("onset_step") is not None
                 else "not measured" if lat is None else ""),
           Phase("detection", _num(row.get("time")),
                 f"{row.get('kind')}, {lat:.3f} s after the onset" if lat is not None
                 else str(row.get("kind")))]
    if captured is not None and _num(captured.get("time")) is not None:
        took = _num(captured.get("seconds"))
        out.append(Phase("evidence", float(captured["time"]) + (took or 0.0),
                         f"stacks and log tail taken in {took:g} s" if took is not None
                         else "stacks and log tail taken"))
    if s.kill is not None:
        out.append(Phase("kill", _num(s.kill.get("time")),
                         f"stopping the tree: {s.kill.get('reason', '')}"))
    if s.stopped is not None:
        out.append(Phase("stopped", _num(s.stopped.get("time")),
                         f"the tree is gone; {s.stopped.get('to_state')}: "
                         f"{s.stopped.get('reason', '')}"))
    backoff = _num(row.get("backoff_s"))
    if s.relaunch is not None or row.get("relaunched_at") is not None:
        at = _num(s.relaunch.get("time")) if s.relaunch else _num(row.get("relaunched_at"))
        why = str(s.relaunch.get("reason", "")) if s.relaunch else "relaunched"
        if backoff is not None:
            why += f" (after {backoff:g} s of policy backoff)"
        out.append(Phase("relaunch", at, why))
    if s.beat is not None:
        out.append(Phase("first beat", _num(s.beat.get("time")), str(s.beat.get("reason", ""))))
    # In the order they happened (the evidence is taken while the job stops, before
    # the signal); a phase whose time is not known keeps its place.
    known = sorted((p for p in out if p.at is not None), key=lambda p: p.at or 0.0)
    it = iter(known)
    return [p if p.at is None else next(it) for p in out]


@dataclass(frozen=True)
class Outage:
    incident: int
    start: float
    back: float  # when the relaunch beat again (or the end)
    redo: float  # s to redo the steps lost


@dataclass(frozen=True)
class Goodput:
    start: float
    end: float
    points: list[tuple[float, float]]  # (time, seconds of progress so far)
    outages: list[Outage]

    @property
    def ratio(self) -> float | None:
        total = self.end - self.start
        return self.points[-1][1] / total if total > 0 and self.points else None


def _step_seconds(row: Mapping[str, Any], s: Steps, ts: Sequence[Mapping[str, Any]]) -> float:
    """Seconds a step took in the attempt that faulted: from its first beat to the onset."""
    attempt = row.get("attempt")
    first = next((x for x in ts if x.get("attempt") == attempt and x.get("to_state") == "running"
                  and step_of(x.get("reason")) is not None), None)
    at, step = onset(row) or _num(row.get("time")), row.get("onset_step")
    if first is None or at is None or not isinstance(step, int):
        return 0.0
    steps_done = step - (step_of(first.get("reason")) or 0)
    return max(0.0, (at - float(first["time"])) / steps_done) if steps_done > 0 else 0.0


def goodput(rows: Sequence[Mapping[str, Any]], ts: Sequence[Mapping[str, Any]],
            now: float | None = None) -> Goodput | None:
    """A job's cumulative progress over time from its incidents and transitions
    (both oldest first); None when it never started."""
    starts = [float(t["time"]) for t in ts if t.get("to_state") == "starting"
              and _num(t.get("time")) is not None]
    if not starts:
        return None
    t0 = starts[0]
    last = ts[-1]
    end = (float(last["time"]) if last.get("to_state") in ENDS
           else max(float(last["time"]), time.time() if now is None else now))
    outages = []
    for row in rows:
        if not stops(row) or _num(row.get("time")) is None:
            continue
        s = steps(row, ts)
        begin = onset(row) or float(row["time"])
        back = _num(s.beat.get("time")) if s.beat is not None else end
        lost = row.get("steps_lost")
        redo = lost * _step_seconds(row, s, ts) if isinstance(lost, int) and lost > 0 else 0.0
        outages.append(Outage(int(row.get("id") or 0), max(t0, begin), back or end, redo))
    # Progress stops from an onset until the relaunch beats and has redone what was lost.
    spans = sorted((o.start, min(end, o.back + o.redo)) for o in outages)
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    points, done, at = [(t0, 0.0)], 0.0, t0
    for a, b in merged:
        if b <= at:
            continue
        a = max(a, at)
        done += a - at
        points += [(a, done), (b, done)]
        at = b
    points.append((end, done + max(0.0, end - at)))
    return Goodput(t0, end, points, outages)
