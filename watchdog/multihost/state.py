"""What this host keeps of a job across hosts (``r.group``): the group's restarts
it took part in, its workers kept for a fault's evidence, a restart waiting for
the job's hand, this host out of the group, a peer's join. State only: group.py,
rounds.py, decision.py and leave.py act on it with the job's runner; this does
not take one, so that the runner's protocol names it without an import circle."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trainwatch.multihost import preflight, records

if TYPE_CHECKING:
    from trainwatch.evidence.capture import Capture
    from trainwatch.types import Fault


@dataclass
class Group:
    root: str  # the checkpoint folder every host sees
    host: str
    base: int | None = None  # the newest restart when this daemon first looked
    gen: int = 0  # the newest restart this host took part in
    poll_at: float = 0.0
    # The rank processes of the rounds before: their exits are the restart's, not new faults.
    before: set[int] = field(default_factory=set)
    exits_seen: int = 0
    held_since: float | None = None  # a hang held for the host that has its cause
    absorbed: int = 0  # failures taken as part of the last restart (before a beat)
    log_from: int = 0  # where this round's output begins in the attempt's log
    pending: Pending | None = None  # our workers, kept for the fault's evidence
    skip: tuple[int, int] | None = None  # the skip window of the last restart taken part in
    widenings: int = 0  # peers' restarts in a row that widened it (decision.followed_charged)
    waiting: Waiting | None = None  # a restart waiting for the job's hand
    settle: tuple[int, int, str | None, float] | None = None  # restart, incident, began, when
    out: Out | None = None  # this host left the group: its pre-flight (leave.py)
    joining: Joining | None = None  # a peer's join, followed: its admission is due
    rounds: int = 0  # the rounds this attempt's agent has begun since its launch
    resumed: int | None = None  # the step the newest round resumed from (None: scratch)


@dataclass
class Pending:
    """This host's workers, kept until the evidence of the fault is taken, and
    (by this host: it acted) until the other hosts' stacks are in too."""

    capture: Capture
    rec: records.Restart | None
    incident: int | None
    reason: str
    onset: float
    deadline: float  # for this host's capture
    peers: bool  # this host acted on the fault: the others' stacks are waited for
    shared: bool = False
    look_at: float = 0.0


@dataclass
class Waiting:
    """A restart this host acted on, not decided yet: its hand does not answer."""

    fault: Fault
    incident: int | None
    reason: str
    charged: bool
    capture: Capture | None
    since: float  # the loop's clock
    retry_at: float
    why: str


@dataclass
class Out:
    """This host, out of its group until a pre-flight passes."""

    kind: str  # the fault that made it leave
    gpus: tuple[int, ...]  # the GPUs it would use: the ones the pre-flight checks
    check: preflight.Check
    waiting: str  # its BACKOFF reason
    said: str = ""  # the last result logged (logged again only when it changes)
    thread: threading.Thread | None = None
    box: list[preflight.Result] = field(default_factory=list)


@dataclass
class Joining:
    """A peer's join, followed here: its agent is about to be admitted."""

    rec: records.Restart
    incident: int | None
    until: float  # monotonic
