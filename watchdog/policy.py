"""The policy: a fault and the job's restart history -> a Decision.

A restart budget (at most ``max_restarts`` within a sliding ``window``),
exponential backoff with a cap and jitter, reset once an attempt has run for
``backoff.reset_after``; ``fatal`` once the budget is spent. It decides; only
the supervisor acts.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from trainwatch.config import Policy
from trainwatch.types import Action, Decision, Fault

_RELAUNCHING = frozenset({Action.RESTART, Action.ROLLBACK, Action.RESTART_EXCLUDE_GPU})


@dataclass
class RestartHistory:
    """What the policy remembers of one job. Times are monotonic seconds."""

    restarts: deque[float] = field(default_factory=deque)
    consecutive: int = 0  # restarts since the last stable attempt

    def in_window(self, now: float, window: float) -> int:
        while self.restarts and self.restarts[0] <= now - window:
            self.restarts.popleft()
        return len(self.restarts)


def backoff_delay(policy: Policy, consecutive: int, rng: random.Random) -> float:
    b = policy.backoff
    # factor**n overflows a float after a thousand or so restarts: past the cap, stop.
    base = b.initial
    for _ in range(consecutive):
        if base >= b.max:
            break
        base *= b.factor
    base = min(b.max, base)
    # Jittered around the base but never past the cap, so that at the cap the
    # delays still spread (downwards).
    return min(b.max, max(0.0, base * (1 + rng.uniform(-b.jitter, b.jitter))))


def decide(
    policy: Policy,
    fault: Fault,
    history: RestartHistory,
    now: float,
    attempt_ran_for: float,
    rng: random.Random,
    action: Action | None = None,
) -> Decision:
    """Pure apart from updating ``history`` when it grants a restart. ``action``:
    when the caller already knows it (an Xid's class), else the policy's for the kind."""
    if action is None:
        action = policy.action_for(fault.kind)
    if action not in _RELAUNCHING:
        return Decision(
            action, reason=f"policy {policy.name}: {fault.kind.value} -> {action.value}"
        )
    if attempt_ran_for >= policy.backoff.reset_after:
        history.consecutive = 0  # the attempt was stable: start the backoff over
    used = history.in_window(now, policy.window)
    if used >= policy.max_restarts:
        return Decision(
            action,
            fatal=True,
            reason=f"restart budget spent: {used} of {policy.max_restarts} "
            f"within {policy.window:g}s",
        )
    delay = backoff_delay(policy, history.consecutive, rng)
    history.restarts.append(now)
    history.consecutive += 1
    return Decision(
        action,
        delay=delay,
        reason=f"restart {used + 1} of {policy.max_restarts} within {policy.window:g}s",
    )
