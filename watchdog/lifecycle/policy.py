"""The policy: a fault and the job's restart history -> a Decision.

A restart budget (at most ``max_restarts`` within a sliding ``window``),
exponential backoff with a cap and jitter, reset once an attempt has run for
``backoff.reset_after`` or has saved a checkpoint past the one it resumed from
(progress kept is proof enough that the job is not crash-looping); ``fatal``
once the budget is spent. It decides; only
the supervisor acts.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from trainwatch.config import Policy
from trainwatch.detectors.xid import classify
from trainwatch.types import Action, Decision, Fault, FaultKind

_RELAUNCHING = frozenset({Action.RESTART, Action.ROLLBACK, Action.RESTART_EXCLUDE_GPU})


@dataclass
class RestartHistory:
    """What the policy remembers of one job. Times are monotonic seconds."""

    restarts: deque[float] = field(default_factory=deque)
    consecutive: int = 0  # restarts since the last stable attempt

    def to_json(self, now: float, wall: float) -> dict[str, object]:
        """Times as wall-clock seconds: they outlive the process that took them."""
        return {"restarts": [wall - (now - t) for t in self.restarts],
                "consecutive": self.consecutive}

    @classmethod
    def from_json(cls, d: dict[str, object], now: float, wall: float) -> RestartHistory:
        ts = d.get("restarts")
        n = d.get("consecutive")
        times = [now - (wall - float(t)) for t in ts if isinstance(t, (int, float))] \
            if isinstance(ts, list) else []
        return cls(deque(sorted(times)), n if isinstance(n, int) else 0)

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
    charged: bool = True,
    progressed: bool = False,
) -> Decision:
    """Pure apart from updating ``history`` when it grants a restart. ``action``:
    when the caller already knows it (an Xid's class), else the policy's for the kind.
    ``charged`` False: a rollback that widens the skip window of an anomaly
    already charged; it spends none of the budget (the policy's
    ``rollback.max_widenings`` bounds it) but backs off as usual. ``progressed``:
    the attempt saved a good checkpoint past the one it resumed from."""
    if action is None:
        action = policy.action_for(fault.kind)
    if action not in _RELAUNCHING:
        return Decision(
            action, reason=f"policy {policy.name}: {fault.kind.value} -> {action.value}"
        )
    if progressed or attempt_ran_for >= policy.backoff.reset_after:
        history.consecutive = 0  # the attempt was stable: start the backoff over
    used = history.in_window(now, policy.window)
    if not charged:
        delay = backoff_delay(policy, history.consecutive, rng)
        history.consecutive += 1
        return Decision(action, delay=delay,
                        reason=f"the same anomaly again: not charged ({used} of "
                        f"{policy.max_restarts} restarts used within {policy.window:g}s)")
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


# (gpu, monotonic time) of the Xids a job has seen, for escalation.
XidHistory = deque[tuple[int | None, float]]


def choose(policy: Policy, fault: Fault, xids: XidHistory) -> Action:
    """The action for a fault. An Xid's: per Xid, then per class, then one action
    for every Xid, then the Xid catalog's; and the same GPU faulting again and
    again within ``escalate.window`` is the GPU, not the job: its restart becomes
    restart_exclude_gpu. Records the Xid in ``xids`` and its class in the evidence."""
    if fault.kind is not FaultKind.GPU_XID:
        return policy.action_for(fault.kind)
    xid = int(fault.evidence["xid"])
    info = classify(xid, str(fault.evidence.get("message", "")))
    over = policy.xid_actions
    action = (over.get(xid) or over.get(info.immediate.value)
              or policy.actions.get(FaultKind.GPU_XID) or info.action)
    fault.evidence["class"] = info.immediate.value
    now, esc = fault.onset, policy.escalate
    xids.append((fault.gpu, now))
    repeats = sum(1 for g, t in xids if g == fault.gpu and now - t <= esc.window)
    if action is Action.RESTART and fault.gpu is not None and repeats >= esc.after:
        fault.evidence["escalated"] = f"{repeats} Xids on GPU {fault.gpu}"
        return Action.RESTART_EXCLUDE_GPU
    return action
