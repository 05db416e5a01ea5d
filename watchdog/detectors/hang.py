"""hang: a rank has not beaten for the heartbeat timeout, or (with a startup
timeout) an attempt has not beaten at all since it started.

With a learned timeout the effective limit is factor x the p99 step interval,
never below the floor and never above the configured timeout (NVRx uses
5 x the largest interval seen)."""

from __future__ import annotations

from trainwatch.config import Heartbeat
from trainwatch.types import Fault, FaultKind, HeartbeatSnapshot


def effective_timeout(hb: Heartbeat, p99: float | None) -> float:
    if hb.learned is None or p99 is None:
        return hb.timeout
    return min(hb.timeout, max(hb.learned.floor, hb.learned.factor * p99))


def detect_hang(job: str, snap: HeartbeatSnapshot, hb: Heartbeat) -> Fault | None:
    if not snap.ranks:
        if hb.startup_timeout is None:
            return None  # not armed until the first beat
        onset = snap.attempt_started + hb.startup_timeout
        if snap.now < onset:
            return None
        started: dict[str, object] = {
            "no_beat_for_s": round(snap.now - snap.attempt_started, 3),
            "startup_timeout_s": hb.startup_timeout,
        }
        return Fault(FaultKind.HANG, job, onset, started)
    timeout = effective_timeout(hb, snap.intervals_p99)
    stalest = min(snap.ranks, key=lambda r: r.last_beat)
    onset = stalest.last_beat + timeout
    if snap.now < onset:
        return None
    evidence: dict[str, object] = {
        "no_beat_for_s": round(snap.now - stalest.last_beat, 3),
        "timeout_s": round(timeout, 3),
        "learned": timeout != hb.timeout,
        "last_step": stalest.step,
        "ranks_stale": sorted(r.rank for r in snap.ranks if r.last_beat + timeout <= snap.now),
    }
    return Fault(FaultKind.HANG, job, onset, evidence, rank=stalest.rank, onset_step=stalest.step)


def next_deadline(snap: HeartbeatSnapshot, hb: Heartbeat) -> float | None:
    """When detect_hang could next fire, for the loop's select timeout."""
    if not snap.ranks:
        return None if hb.startup_timeout is None else snap.attempt_started + hb.startup_timeout
    return min(r.last_beat for r in snap.ranks) + effective_timeout(hb, snap.intervals_p99)
