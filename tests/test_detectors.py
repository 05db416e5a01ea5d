"""The crash and hang detectors: pure functions of observations, tested by table."""

from __future__ import annotations

import pytest
from trainwatch.config import Heartbeat, Learned
from trainwatch.detectors.crash import detect_crash
from trainwatch.detectors.hang import detect_hang, effective_timeout, next_deadline
from trainwatch.types import FaultKind, HeartbeatSnapshot, ProcessExit, RankView

JOB = "llama"

# --- crash --------------------------------------------------------------------


def test_clean_exit_is_not_a_crash() -> None:
    """Exit code 0 means the job finished: detect_crash returns None."""
    assert detect_crash(JOB, ProcessExit(pid=10, returncode=0, at=5.0), last_step=100) is None


@pytest.mark.parametrize(
    ("returncode", "last_step", "evidence"),
    [
        (1, 250, {"pid": 10, "exit_code": 1, "last_step": 250}),
        (137, None, {"pid": 10, "exit_code": 137}),
        (-9, 3, {"pid": 10, "signal": "SIGKILL", "last_step": 3}),
        (-11, None, {"pid": 10, "signal": "SIGSEGV"}),
        (-6, 0, {"pid": 10, "signal": "SIGABRT", "last_step": 0}),
        (-200, None, {"pid": 10, "signal": "200"}),
    ],
    ids=["exit-1", "exit-137", "sigkill", "sigsegv", "sigabrt", "unknown-signal"],
)
def test_nonzero_exit_is_a_crash_with_evidence(
    returncode: int, last_step: int | None, evidence: dict[str, object]
) -> None:
    """A non-zero exit or a signal is a crash whose evidence names the code or the signal."""
    fault = detect_crash(JOB, ProcessExit(pid=10, returncode=returncode, at=5.0), last_step)
    assert fault is not None
    assert fault.kind is FaultKind.CRASH
    assert fault.job == JOB
    assert fault.onset == 5.0
    assert fault.onset_step == last_step
    assert fault.evidence == evidence


# --- hang ---------------------------------------------------------------------


def _snap(
    now: float,
    ranks: tuple[tuple[int, float, int] | tuple[int, float, int, int], ...] = (),
    p99: float | None = None,
    started: float = 1000.0,
    stopped: frozenset[int] = frozenset(),
) -> HeartbeatSnapshot:
    """Ranks as (rank, last_beat, step[, beats]); a rank has beaten twice unless told."""
    views = tuple(
        RankView(rank=r[0], last_beat=r[1], step=r[2], beats=r[3] if len(r) == 4 else 2)
        for r in ranks
    )
    return HeartbeatSnapshot(now=now, attempt_started=started, ranks=views, intervals_p99=p99,
                             stopped=stopped)


HB = Heartbeat(timeout=300.0)
HB_STARTUP = Heartbeat(timeout=300.0, startup_timeout=1800.0, required=True)
HB_LEARNED = Heartbeat(timeout=300.0, learned=Learned(factor=5.0, floor=60.0, min_samples=20))


@pytest.mark.parametrize(
    ("hb", "now"),
    [(HB, 1000.0), (HB, 1e9)],
    ids=["at-start", "forever-later"],
)
def test_no_beat_without_startup_timeout_is_never_a_hang(hb: Heartbeat, now: float) -> None:
    """Without a startup timeout, an attempt that never beat is never a hang (not armed)."""
    assert detect_hang(JOB, _snap(now), hb) is None


@pytest.mark.parametrize(
    ("now", "fires"),
    [(1000.0, False), (2799.9, False), (2800.0, True), (5000.0, True)],
    ids=["at-start", "just-before", "at-timeout", "long-after"],
)
def test_no_beat_past_startup_timeout_is_a_hang(now: float, fires: bool) -> None:
    """With a startup timeout, no beat by started + startup_timeout is a hang with that onset."""
    fault = detect_hang(JOB, _snap(now), HB_STARTUP)
    if not fires:
        assert fault is None
        return
    assert fault is not None
    assert fault.kind is FaultKind.HANG
    assert fault.onset == 1000.0 + 1800.0
    assert fault.rank is None
    assert fault.evidence["startup_timeout_s"] == 1800.0
    assert fault.evidence["no_beat_for_s"] == pytest.approx(now - 1000.0)


def test_one_stale_rank_among_fresh_ones_is_a_hang_naming_it() -> None:
    """One rank silent past the timeout is a hang naming that rank, onset = last beat + timeout."""
    ranks = ((0, 1390.0, 52), (1, 1100.0, 40), (2, 1395.0, 52))
    fault = detect_hang(JOB, _snap(1400.0, ranks), HB)
    assert fault is not None
    assert fault.kind is FaultKind.HANG
    assert fault.rank == 1
    assert fault.onset == 1100.0 + 300.0
    assert fault.onset_step == 40
    assert fault.evidence["ranks_stale"] == [1]
    assert fault.evidence["last_step"] == 40
    assert fault.evidence["learned"] is False
    assert fault.evidence["timeout_s"] == 300.0


def test_all_stale_ranks_are_listed_and_the_stalest_named() -> None:
    """When several ranks are stale, all are listed and the one silent longest is named."""
    ranks = ((0, 1000.0, 9), (1, 1050.0, 10), (2, 1390.0, 12))
    fault = detect_hang(JOB, _snap(1360.0, ranks), HB)
    assert fault is not None
    assert fault.rank == 0
    assert fault.evidence["ranks_stale"] == [0, 1]


@pytest.mark.parametrize(
    ("now", "fires"),
    [(1399.999, False), (1400.0, True)],
    ids=["just-before-timeout", "at-timeout"],
)
def test_hang_fires_exactly_at_timeout(now: float, fires: bool) -> None:
    """A rank silent for just under the timeout is fine; at the timeout it is a hang."""
    fault = detect_hang(JOB, _snap(now, ((0, 1100.0, 7),)), HB)
    assert (fault is not None) is fires


def test_startup_timeout_does_not_apply_once_beating() -> None:
    """Once a rank has beaten, the startup timeout no longer matters; the beat timeout does."""
    fault = detect_hang(JOB, _snap(5000.0, ((0, 4900.0, 1),)), HB_STARTUP)
    assert fault is None


@pytest.mark.parametrize(
    ("hb", "p99", "expected"),
    [
        (HB, 20.0, 300.0),  # not learned: the configured timeout
        (HB_LEARNED, None, 300.0),  # learned, but too few samples yet
        (HB_LEARNED, 2.0, 60.0),  # 5 x 2 = 10, raised to the floor
        (HB_LEARNED, 20.0, 100.0),  # 5 x 20, within bounds
        (HB_LEARNED, 100.0, 300.0),  # 5 x 100 = 500, capped at the timeout
    ],
    ids=["not-learned", "no-p99", "floor", "factor", "cap"],
)
def test_effective_timeout_is_factor_times_p99_clamped(
    hb: Heartbeat, p99: float | None, expected: float
) -> None:
    """The learned timeout is factor x p99, never below the floor nor above the timeout."""
    assert effective_timeout(hb, p99) == expected


@pytest.mark.parametrize(
    ("p99", "silent_for", "fires"),
    [(20.0, 99.0, False), (20.0, 100.0, True), (2.0, 59.0, False), (2.0, 60.0, True)],
    ids=["factor-before", "factor-at", "floor-before", "floor-at"],
)
def test_learned_timeout_drives_hang_detection(p99: float, silent_for: float, fires: bool) -> None:
    """With a learned p99, a hang fires at the learned timeout and says it was learned."""
    fault = detect_hang(JOB, _snap(2000.0 + silent_for, ((0, 2000.0, 5),), p99=p99), HB_LEARNED)
    assert (fault is not None) is fires
    if fault is not None:
        assert fault.evidence["learned"] is True
        assert fault.onset == 2000.0 + effective_timeout(HB_LEARNED, p99)


@pytest.mark.parametrize(
    ("hb", "snap", "expected"),
    [
        (HB, _snap(1000.0), None),
        (HB_STARTUP, _snap(1000.0), 2800.0),
        (HB, _snap(1400.0, ((0, 1390.0, 1), (1, 1200.0, 1))), 1500.0),
        (HB_STARTUP, _snap(1400.0, ((0, 1390.0, 1),)), 1690.0),
        (HB_LEARNED, _snap(1400.0, ((0, 1390.0, 1),), p99=20.0), 1490.0),
    ],
    ids=["unarmed", "startup", "stalest-rank", "beating-ignores-startup", "learned"],
)
def test_next_deadline_is_when_hang_could_fire(
    hb: Heartbeat, snap: HeartbeatSnapshot, expected: float | None
) -> None:
    """next_deadline is when detect_hang would next fire, or None when it cannot."""
    assert next_deadline(snap, hb) == expected
    if expected is not None:
        at = HeartbeatSnapshot(expected, snap.attempt_started, snap.ranks, snap.intervals_p99)
        before = HeartbeatSnapshot(
            expected - 0.001, snap.attempt_started, snap.ranks, snap.intervals_p99
        )
        assert detect_hang(JOB, at, hb) is not None
        assert detect_hang(JOB, before, hb) is None


# --- hang: single-beat ranks and which rank is named ---------------------------


@pytest.mark.parametrize(
    ("ranks", "now", "fires"),
    [
        # A forged rank that beat once long ago, beside a rank still beating: no hang.
        (((0, 1390.0, 50, 40), (7, 1000.0, 1, 1)), 1400.0, False),
        (((0, 1390.0, 50, 40), (7, 1000.0, 1, 1)), 1689.0, False),
        # ... until the real rank goes quiet too.
        (((0, 1390.0, 50, 40), (7, 1000.0, 1, 1)), 1690.0, True),
        # Every rank beat once, then all stopped: caught once the last one is stale.
        (((0, 1000.0, 1, 1), (1, 1010.0, 1, 1)), 1309.9, False),
        (((0, 1000.0, 1, 1), (1, 1010.0, 1, 1)), 1310.0, True),
        # One rank, one beat, then silence: still a hang.
        (((0, 1000.0, 1, 1),), 1300.0, True),
    ],
    ids=["forged-old", "forged-older", "real-stale-too", "all-once-before", "all-once-stale",
         "lone-single-beat"],
)
def test_a_rank_with_one_beat_never_decides_a_hang_alone(
    ranks: tuple[tuple[int, float, int, int], ...], now: float, fires: bool
) -> None:
    """A single-beat rank alone is no hang; established ranks, or every rank stale, decide."""
    snap = _snap(now, ranks)
    assert (detect_hang(JOB, snap, HB) is not None) is fires
    deadline = next_deadline(snap, HB)
    assert deadline is not None and (now >= deadline) is fires


def test_hang_decided_by_established_ranks_names_one_of_them() -> None:
    """When a hang fires, the single-beat rank is listed stale but never named."""
    fault = detect_hang(JOB, _snap(1700.0, ((0, 1390.0, 50, 40), (7, 1000.0, 1, 1))), HB)
    assert fault is not None
    assert fault.rank == 0
    assert fault.onset == 1690.0
    assert fault.evidence["ranks_stale"] == [0, 7]


# (rank, last_beat, step); now 2000, timeout 300: everything beat before 1700 is stale.
_TABLE = [
    # lowest step wins, even with the newer beat
    ("lowest-step", ((0, 1600.0, 10), (1, 1500.0, 11)), frozenset(), 0, None),
    # same step: the oldest beat wins when it is clearly older than the batch window
    ("oldest-beat", ((0, 1600.0, 10), (1, 1500.0, 10)), frozenset(), 1, None),
    # same step, beats in one batch (torchrun DDP): unknown, never dict order
    ("tie", ((1, 1600.00, 10), (0, 1600.05, 10)), frozenset(), None, [0, 1]),
    ("tie-reversed", ((0, 1600.00, 10), (1, 1600.05, 10)), frozenset(), None, [0, 1]),
    # a tie broken by the one stopped process among the tied ranks
    ("tie-one-stopped", ((1, 1600.00, 10), (0, 1600.05, 10)), frozenset({0}), 0, [0, 1]),
    # both stopped: still unknown
    ("tie-both-stopped", ((1, 1600.0, 10), (0, 1600.0, 10)), frozenset({0, 1}), None, [0, 1]),
    # a stopped rank outside the tie does not name itself
    ("stopped-not-tied", ((0, 1600.0, 10), (1, 1600.0, 10), (2, 1600.0, 12)), frozenset({2}),
     None, [0, 1]),
    # a lone stale rank is named whatever the others are
    ("one-stale", ((0, 1990.0, 11), (1, 1600.0, 10)), frozenset(), 1, None),
    # three tied, one of them stopped
    ("three-tied", ((2, 1600.0, 9), (0, 1600.02, 9), (1, 1600.08, 9)), frozenset({1}), 1,
     [0, 1, 2]),
    # a busy machine ran the stopped rank's beat of the step well after its peer's
    ("stopped-beat-step-last", ((1, 1600.0, 10), (0, 1650.0, 10)), frozenset({0}), 0, [0, 1]),
    # ... so late that it is not stale yet when its peer is
    ("stopped-not-stale-yet", ((1, 1600.0, 10), (0, 1750.0, 10)), frozenset({0}), 0, [0, 1]),
    # the stopped rank is the oldest anyway: named alone, as before
    ("stopped-oldest", ((0, 1500.0, 10), (1, 1600.0, 10)), frozenset({0}), 0, None),
    # two stopped at that step, neither tied with the oldest: the oldest beat decides
    ("two-stopped-late", ((2, 1500.0, 10), (0, 1600.0, 10), (1, 1650.0, 10)),
     frozenset({0, 1}), 2, None),
]


@pytest.mark.parametrize(
    ("ranks", "stopped", "named", "tied"),
    [pytest.param(r, s, n, t, id=i) for i, r, s, n, t in _TABLE],
)
def test_hang_names_a_rank_only_when_it_is_unambiguous(
    ranks: tuple[tuple[int, float, int], ...], stopped: frozenset[int], named: int | None,
    tied: list[int] | None,
) -> None:
    """The hung rank is the lowest step, then the oldest beat; a tie is unknown unless
    exactly one of the tied ranks is stopped; the one stopped rank at that step is named."""
    fault = detect_hang(JOB, _snap(2000.0, ranks, stopped=stopped), HB)
    assert fault is not None
    assert fault.rank == named
    assert fault.evidence.get("ranks_tied") == tied
    assert fault.onset_step == min(s for _, t, s in ranks if t + 300.0 <= 2000.0)


def test_startup_timeout_without_required_never_fires() -> None:
    """Silence that was never promised (required false) is never a hang, even with a startup
    timeout built in code past the config check."""
    hb = Heartbeat(timeout=300.0, startup_timeout=1.0, required=False)
    snap = HeartbeatSnapshot(now=1e6, attempt_started=0.0, ranks=(), intervals_p99=None)
    assert detect_hang(JOB, snap, hb) is None
    assert next_deadline(snap, hb) is None
