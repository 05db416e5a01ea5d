"""hang: a rank has not beaten for the heartbeat timeout, or (with a startup
timeout) an attempt has not beaten at all since it started.

With a learned timeout the effective limit is factor x the p99 step interval,
never below the floor and never above the configured timeout (NVRx uses
5 x the largest interval seen).

A rank that sent a single beat never decides a hang on its own (it may be a
stray or forged rank): the hang is judged on the ranks with two beats or more,
or, when there are none, fires once every rank is stale.

Which rank hung: the stale one at the lowest step, then the oldest beat. Beats
are read in batches (up to ~50 ms late, one receive time per batch), so ranks
that stopped together have tied receive times; among ranks tied on step and
within ``TIE_WINDOW`` of the oldest beat, the fault names one only when it is
the single rank whose process is stopped (``snapshot.stopped``), else none.
The single stopped rank at that step is named even when it beat the step later
than the others, stale yet or not: ranks in lockstep (DDP) beat a step in any
order, and a busy machine spreads those beats far beyond the batch window.
"""

from __future__ import annotations

from trainwatch.config import Heartbeat
from trainwatch.types import Fault, FaultKind, HeartbeatSnapshot, RankView

# Beats this close together may have arrived in one batch: their order is unknown.
TIE_WINDOW = 0.1


def effective_timeout(hb: Heartbeat, p99: float | None) -> float:
    if hb.learned is None or p99 is None:
        return hb.timeout
    return min(hb.timeout, max(hb.learned.floor, hb.learned.factor * p99))


def _deciding(snap: HeartbeatSnapshot) -> tuple[tuple[RankView, ...], float]:
    """The ranks that may decide a hang, and the last beat from which it is timed."""
    judges = tuple(r for r in snap.ranks if r.beats >= 2)
    if judges:
        return judges, min(r.last_beat for r in judges)
    # Every rank beat once: the hang is when the last of them went quiet.
    return snap.ranks, max(r.last_beat for r in snap.ranks)


def _culprit(
    deciding: tuple[RankView, ...], stale: list[RankView], stopped: frozenset[int]
) -> tuple[int | None, list[int], RankView]:
    """The rank to name (None: ambiguous), the ranks tied for it, and the
    rank the evidence describes (the named one, else the oldest tied)."""
    low = min(r.step for r in stale)
    # Every rank still at that step (stale or not) has not got past it either.
    at_low = sorted((r for r in deciding if r.step == low), key=lambda r: (r.last_beat, r.rank))
    oldest = at_low[0]  # stale: at least one stale rank beat this step no later
    tied = [r for r in at_low if r.last_beat - oldest.last_beat <= TIE_WINDOW]
    halted_at_low = [r for r in at_low if r.rank in stopped]
    if len(halted_at_low) == 1 and halted_at_low[0] not in tied:
        # It beat this step after the others (a busy machine ran it later), then
        # stopped; the others wait for it in the step's collective.
        return halted_at_low[0].rank, sorted(r.rank for r in at_low), halted_at_low[0]
    if len(tied) == 1:
        return oldest.rank, [oldest.rank], oldest
    halted = [r for r in tied if r.rank in stopped]
    ref = halted[0] if len(halted) == 1 else oldest
    return (ref.rank if len(halted) == 1 else None), sorted(r.rank for r in tied), ref


def detect_hang(job: str, snap: HeartbeatSnapshot, hb: Heartbeat) -> Fault | None:
    if not snap.ranks:
        if hb.startup_timeout is None or not hb.required:  # silence never promised
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
    deciding, since = _deciding(snap)
    onset = since + timeout
    if snap.now < onset:
        return None
    stale = [r for r in deciding if r.last_beat + timeout <= snap.now]
    rank, tied, ref = _culprit(deciding, stale, snap.stopped)
    evidence: dict[str, object] = {
        "no_beat_for_s": round(snap.now - ref.last_beat, 3),
        "timeout_s": round(timeout, 3),
        "learned": timeout != hb.timeout,
        "last_step": ref.step,
        "ranks_stale": sorted(r.rank for r in snap.ranks if r.last_beat + timeout <= snap.now),
    }
    if len(tied) > 1:
        evidence["ranks_tied"] = tied  # went quiet together: the order of their beats is unknown
    if snap.stopped:
        evidence["ranks_stopped"] = sorted(snap.stopped)
    return Fault(FaultKind.HANG, job, onset, evidence, rank=rank, onset_step=ref.step)


def next_deadline(snap: HeartbeatSnapshot, hb: Heartbeat) -> float | None:
    """When detect_hang could next fire, for the loop's select timeout."""
    if not snap.ranks:
        if hb.startup_timeout is None or not hb.required:
            return None
        return snap.attempt_started + hb.startup_timeout
    return _deciding(snap)[1] + effective_timeout(hb, snap.intervals_p99)
