"""Ranks: per-rank heartbeat state and the learned step interval."""

from __future__ import annotations

from trainwatch.sources.ranks import Ranks
from trainwatch.types import Beat, RankView


def _beat(rank: int, step: int, at: float, pid: int = 100) -> Beat:
    return Beat(rank=rank, step=step, at=at, pid=pid + rank)


def test_first_beat_of_a_rank_is_new() -> None:
    """observe() says True for a rank's first beat and False for its later ones."""
    r = Ranks(started=0.0)
    assert not r.beaten
    assert r.observe(_beat(0, 1, 1.0)) is True
    assert r.observe(_beat(0, 2, 2.0)) is False
    assert r.observe(_beat(1, 1, 2.5)) is True
    assert r.beaten


def test_new_pid_for_a_rank_is_reported() -> None:
    """observe() says True when a known rank beats from a different pid (a restarted worker)."""
    r = Ranks(started=0.0)
    r.observe(Beat(rank=0, step=1, at=1.0, pid=10))
    assert r.observe(Beat(rank=0, step=2, at=2.0, pid=11)) is True
    assert r.pids() == {0: 11}


def test_interval_is_seconds_per_step() -> None:
    """The learned interval is time between beats divided by the steps they advanced."""
    r = Ranks(started=0.0)
    r.observe(_beat(0, 0, 10.0))
    r.observe(_beat(0, 10, 15.0))  # a client beating every 10 steps
    r.observe(_beat(0, 11, 16.0))
    assert list(r.intervals) == [0.5, 1.0]


def test_repeated_or_older_step_teaches_no_interval() -> None:
    """A beat that does not advance the step adds no interval and is no advance (the stall
    detector's clock), but refreshes the last beat time."""
    r = Ranks(started=0.0)
    r.observe(_beat(0, 5, 1.0))
    r.observe(_beat(0, 5, 3.0))
    r.observe(_beat(0, 4, 4.0))
    assert list(r.intervals) == []
    (view,) = r.snapshot(now=5.0, min_samples=1).ranks
    assert view == RankView(rank=0, last_beat=4.0, step=4, beats=3, advanced_at=1.0)


def test_p99_none_until_min_samples() -> None:
    """learned_p99 stays None until min_samples intervals were seen, then gives a value."""
    r = Ranks(started=0.0)
    r.observe(_beat(0, 0, 0.0))
    for step in range(1, 20):
        r.observe(_beat(0, step, float(step) * 2.0))
    assert len(r.intervals) == 19
    assert r.learned_p99(min_samples=20) is None
    assert r.snapshot(now=100.0, min_samples=20).intervals_p99 is None
    r.observe(_beat(0, 20, 40.0))
    assert r.learned_p99(min_samples=20) == 2.0
    assert r.snapshot(now=100.0, min_samples=20).intervals_p99 == 2.0


def test_p99_ignores_rare_outliers() -> None:
    """Fewer than 1% slow steps do not move the p99 off the usual interval."""
    r = Ranks(started=0.0)
    t, step = 0.0, 0
    r.observe(_beat(0, step, t))
    for i in range(500):
        t += 30.0 if i in (100, 250, 400) else 1.0  # 3 in 500 slow steps
        step += 1
        r.observe(_beat(0, step, t))
    assert r.learned_p99(min_samples=20) == 1.0


def test_p99_reflects_a_slower_job() -> None:
    """When most steps are slow, the p99 is the slow interval."""
    r = Ranks(started=0.0)
    r.observe(_beat(0, 0, 0.0))
    for step in range(1, 101):
        r.observe(_beat(0, step, step * 1.0 if step <= 50 else 50.0 + (step - 50) * 4.0))
    assert r.learned_p99(min_samples=20) == 4.0


def test_step_is_the_slowest_ranks() -> None:
    """step is the step every rank has reached (the minimum); max_step the furthest."""
    r = Ranks(started=0.0)
    assert r.step is None and r.max_step is None
    r.observe(_beat(0, 120, 1.0))
    r.observe(_beat(1, 95, 1.1))
    r.observe(_beat(2, 130, 1.2))
    assert r.step == 95
    assert r.max_step == 130
    r.observe(_beat(1, 125, 2.0))
    assert r.step == 120


def test_snapshot_lists_every_rank() -> None:
    """snapshot() carries now, the attempt's start and one view per rank."""
    r = Ranks(started=7.0)
    r.observe(_beat(0, 3, 8.0))
    r.observe(_beat(1, 2, 9.0))
    snap = r.snapshot(now=10.0, min_samples=20)
    assert (snap.now, snap.attempt_started) == (10.0, 7.0)
    assert sorted(snap.ranks, key=lambda v: v.rank) == [
        RankView(rank=0, last_beat=8.0, step=3, beats=1, advanced_at=8.0),
        RankView(rank=1, last_beat=9.0, step=2, beats=1, advanced_at=9.0),
    ]
    assert r.pids() == {0: 100, 1: 101}


def test_beats_are_counted_per_rank() -> None:
    """Each rank's view carries how many beats it sent this attempt."""
    r = Ranks(started=0.0)
    for i in range(3):
        r.observe(_beat(0, i, float(i)))
    r.observe(_beat(1, 0, 0.5))
    views = {v.rank: v.beats for v in r.snapshot(now=5.0, min_samples=20).ranks}
    assert views == {0: 3, 1: 1}


def test_a_rank_at_or_beyond_the_cap_is_dropped_and_counted() -> None:
    """Ranks 0..max_ranks-1 are kept; a beat of a rank beyond is dropped (None) and counted."""
    r = Ranks(started=0.0, max_ranks=4)
    for rank in range(4):
        assert r.observe(_beat(rank, 1, 1.0)) is True
    assert r.observe(_beat(4, 1, 1.0)) is None
    assert r.observe(_beat(2**63 - 1, 1, 1.0)) is None
    assert r.over_cap == 2
    assert sorted(r.ranks) == [0, 1, 2, 3]
    assert r.observe(_beat(3, 2, 2.0)) is False  # a known rank still beats


def test_fifty_thousand_fake_ranks_keep_a_bounded_state() -> None:
    """50,000 distinct ranks leave at most the default cap (1,024) in memory and count the rest."""
    r = Ranks(started=0.0)
    for rank in range(50_000):
        r.observe(_beat(rank, 1, 1.0))
    assert len(r.ranks) == 1024
    assert r.over_cap == 50_000 - 1024
    assert len(r.snapshot(now=2.0, min_samples=20).ranks) == 1024



def test_a_beat_without_a_value_keeps_the_last_and_its_step() -> None:
    """loss= every k steps only: the last loss and grad norm stay, with the step they came at."""
    r = Ranks(started=0.0)
    r.observe(Beat(rank=0, step=1, at=1.0, pid=10, loss=2.5, grad_norm=0.5))
    r.observe(Beat(rank=0, step=2, at=2.0, pid=10))
    r.observe(Beat(rank=0, step=3, at=3.0, pid=10, grad_norm=0.25))
    rv = r.ranks[0]
    assert (rv.loss, rv.loss_step) == (2.5, 1)
    assert (rv.grad_norm, rv.grad_norm_step) == (0.25, 3)
    assert rv.step == 3
