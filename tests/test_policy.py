"""The policy: restart budget over a sliding window, capped exponential backoff
with jitter, a reset after a stable attempt, and actions that relaunch nothing."""

from __future__ import annotations

import random

import pytest
from trainwatch.config import Backoff, Policy
from trainwatch.lifecycle.policy import RestartHistory, backoff_delay, decide
from trainwatch.types import Action, Fault, FaultKind

CRASH = Fault(FaultKind.CRASH, "llama", onset=0.0)
HANG = Fault(FaultKind.HANG, "llama", onset=0.0, rank=1)
NO_JITTER = Backoff(initial=10.0, factor=2.0, max=60.0, jitter=0.0, reset_after=600.0)


def _policy(max_restarts: int = 3, window: float = 100.0, backoff: Backoff = NO_JITTER) -> Policy:
    return Policy(name="p", max_restarts=max_restarts, window=window, backoff=backoff)


def _rng() -> random.Random:
    return random.Random(1234)


def test_restarts_granted_until_budget_then_fatal() -> None:
    """Up to max_restarts restarts within the window are granted; the next one is fatal."""
    policy, history, rng = _policy(max_restarts=3), RestartHistory(), _rng()
    for i, now in enumerate((1.0, 2.0, 3.0)):
        d = decide(policy, CRASH, history, now=now, attempt_ran_for=1.0, rng=rng)
        assert d.action is Action.RESTART
        assert not d.fatal
        assert f"restart {i + 1} of 3" in d.reason
    d = decide(policy, HANG, history, now=4.0, attempt_ran_for=1.0, rng=rng)
    assert d.action is Action.RESTART
    assert d.fatal
    assert "budget spent" in d.reason
    assert list(history.restarts) == [1.0, 2.0, 3.0]  # a refusal is not a restart


def test_zero_budget_is_fatal_at_once() -> None:
    """max_restarts 0 makes the first relaunching fault fatal."""
    d = decide(_policy(max_restarts=0), CRASH, RestartHistory(), 1.0, 1.0, _rng())
    assert d.fatal


def test_restarts_older_than_window_no_longer_count() -> None:
    """Once earlier restarts fall out of the sliding window, restarts are granted again."""
    policy, history, rng = _policy(max_restarts=2, window=100.0), RestartHistory(), _rng()
    decide(policy, CRASH, history, now=10.0, attempt_ran_for=1.0, rng=rng)
    decide(policy, CRASH, history, now=50.0, attempt_ran_for=1.0, rng=rng)
    assert decide(policy, CRASH, history, now=100.0, attempt_ran_for=1.0, rng=rng).fatal
    d = decide(policy, CRASH, history, now=110.0, attempt_ran_for=1.0, rng=rng)  # 10 has expired
    assert not d.fatal
    assert "restart 2 of 2" in d.reason
    assert list(history.restarts) == [50.0, 110.0]


def test_window_boundary_is_exclusive() -> None:
    """A restart exactly one window ago has expired; one just inside still counts."""
    history = RestartHistory()
    history.restarts.extend([0.0, 0.5])
    assert history.in_window(now=100.4, window=100.0) == 1
    assert history.in_window(now=100.5, window=100.0) == 0


def test_backoff_doubles_and_is_capped() -> None:
    """Backoff goes initial, x factor each time, and stops at max (jitter 0)."""
    policy, history, rng = _policy(max_restarts=10), RestartHistory(), _rng()
    delays = [
        decide(policy, CRASH, history, now=float(i), attempt_ran_for=1.0, rng=rng).delay
        for i in range(6)
    ]
    assert delays == [10.0, 20.0, 40.0, 60.0, 60.0, 60.0]


def test_jitter_stays_within_fraction() -> None:
    """With jitter j, delays lie within base x (1 +/- j), vary, and never pass the cap."""
    policy = _policy(backoff=Backoff(initial=10.0, factor=2.0, max=60.0, jitter=0.2))
    rng = _rng()
    for consecutive, base in ((0, 10.0), (1, 20.0)):
        delays = [backoff_delay(policy, consecutive, rng) for _ in range(500)]
        assert all(base * 0.8 <= d <= base * 1.2 for d in delays)
        assert len(set(delays)) > 1
        assert min(delays) < base < max(delays)
    capped = [backoff_delay(policy, 5, rng) for _ in range(500)]
    assert all(60.0 * 0.8 <= d <= 60.0 for d in capped)
    assert min(capped) < 60.0


def test_jitter_is_reproducible_with_a_seed() -> None:
    """The same seed gives the same delays, so a drill can be replayed."""
    policy = _policy(backoff=Backoff(jitter=0.1))
    a = [backoff_delay(policy, 1, random.Random(7)) for _ in range(3)]
    b = [backoff_delay(policy, 1, random.Random(7)) for _ in range(3)]
    assert a == b


def test_stable_attempt_resets_backoff() -> None:
    """An attempt that ran at least reset_after starts the backoff over at initial."""
    policy, history, rng = _policy(max_restarts=10), RestartHistory(), _rng()
    for i in range(3):
        decide(policy, CRASH, history, now=float(i), attempt_ran_for=1.0, rng=rng)
    assert history.consecutive == 3
    short = decide(policy, CRASH, history, now=5.0, attempt_ran_for=599.9, rng=rng)
    assert short.delay == 60.0
    stable = decide(policy, CRASH, history, now=6.0, attempt_ran_for=600.0, rng=rng)
    assert stable.delay == 10.0
    assert history.consecutive == 1
    assert len(history.restarts) == 5  # the reset touches backoff, not the budget


def test_an_attempt_that_saved_a_checkpoint_past_its_start_resets_backoff() -> None:
    """Progress kept (a good checkpoint past the one it resumed from) is stability
    enough, however short the attempt: the backoff starts over, the budget does not."""
    policy, history, rng = _policy(max_restarts=10), RestartHistory(), _rng()
    for i in range(3):
        decide(policy, CRASH, history, now=float(i), attempt_ran_for=1.0, rng=rng)
    again = decide(policy, CRASH, history, now=4.0, attempt_ran_for=30.0, rng=rng)
    assert again.delay == 60.0
    saved = decide(policy, CRASH, history, now=5.0, attempt_ran_for=30.0, rng=rng,
                   progressed=True)
    assert saved.delay == 10.0 and history.consecutive == 1
    assert len(history.restarts) == 5


@pytest.mark.parametrize(
    ("kind", "action"),
    [
        (FaultKind.CRASH, Action.ALERT),
        (FaultKind.HANG, Action.STOP),
        (FaultKind.LOG_PATTERN, Action.ALERT),  # not configured: alert by default
    ],
    ids=["alert", "stop", "unconfigured"],
)
def test_non_relaunching_action_leaves_history_alone(kind: FaultKind, action: Action) -> None:
    """alert and stop are returned as they are: no delay, never fatal, history untouched."""
    policy = Policy(
        name="p",
        max_restarts=0,  # a spent budget must not turn an alert or a stop fatal
        actions={FaultKind.CRASH: Action.ALERT, FaultKind.HANG: Action.STOP},
    )
    history = RestartHistory()
    history.restarts.extend([1.0, 2.0])
    history.consecutive = 2
    d = decide(policy, Fault(kind, "llama", onset=0.0), history, 3.0, 10_000.0, _rng())
    assert d.action is action
    assert (d.delay, d.fatal) == (0.0, False)
    assert list(history.restarts) == [1.0, 2.0]
    assert history.consecutive == 2


def test_an_explicit_action_is_budgeted_like_the_policys_own() -> None:
    """An Xid's class-derived restart_exclude_gpu gets a backoff and counts against the budget."""
    policy, history = _policy(max_restarts=1), RestartHistory()
    first = decide(policy, CRASH, history, 0.0, 1.0, _rng(), Action.RESTART_EXCLUDE_GPU)
    assert first.action is Action.RESTART_EXCLUDE_GPU and not first.fatal and first.delay > 0
    second = decide(policy, CRASH, history, 1.0, 1.0, _rng(), Action.RESTART_EXCLUDE_GPU)
    assert second.fatal


def test_backoff_after_thousands_of_restarts_stays_at_the_cap() -> None:
    """factor**n overflows a float past ~1,000 restarts; the delay stays the cap instead."""
    p = Policy(backoff=Backoff(initial=1.0, factor=2.0, max=60.0, jitter=0.0))
    assert backoff_delay(p, 5000, random.Random(0)) == 60.0
