"""The job as its actions, watchers and readers see it: what they use of a
``JobRunner`` (job.py), as protocols, so that they depend on this and not on
job.py, which imports them (no import circle, not even one for types).

``JobParts`` is what a job is made of (its entry, checkpoints, hands, intake,
counters): enough for the modules that only read or change its folders.
``Runner`` is all that the lifecycle's actions use: they are the job's state
machine's steps, written in modules of their own, and they call one another
(launch, respond, rollback, stop, pull), so they share one interface. A member
they only read is a read-only property here: mypy refuses an assignment to it
outside job.py. ``JobRunner`` satisfies both structurally; mypy checks that
wherever job.py passes itself on.
"""

from __future__ import annotations

import random
import selectors
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from trainwatch.types import JobState

if TYPE_CHECKING:
    from trainwatch.actions.attempt import Attempt
    from trainwatch.config import Config, Job, Policy
    from trainwatch.detectors import JobView
    from trainwatch.evidence.capture import Capture
    from trainwatch.export.events import Events
    from trainwatch.export.goodput import Goodput
    from trainwatch.lifecycle.drill import DrillNotice
    from trainwatch.lifecycle.engine import Engine
    from trainwatch.lifecycle.policy import RestartHistory, XidHistory
    from trainwatch.multihost.state import Group
    from trainwatch.privsep.jobhands import JobHands
    from trainwatch.sources.heartbeat import HeartbeatSocket
    from trainwatch.sources.ranks import Ranks
    from trainwatch.state.catalog import Catalog
    from trainwatch.state.entry import Summary
    from trainwatch.state.ledger import Ledger
    from trainwatch.types import ProcessExit
    from trainwatch.watch.gpuwatch import GpuWatch
    from trainwatch.watch.intake import Intake
    from trainwatch.watch.state import (
        FirstFailure,
        LogWatch,
        LossFeed,
        Refusals,
        StallWatch,
    )


@dataclass
class Stop:
    """A stop under way (actions/stop.py): what the job becomes once its tree is gone."""

    outcome: JobState  # the state once the tree is gone
    reason: str
    deadline: float  # SIGKILL from then
    delay: float = 0.0  # before a relaunch, when outcome is BACKOFF
    killed: bool = False
    # The evidence taken before the kill, and the incident it belongs to: the
    # SIGTERM waits for it (at most its timeout).
    capture: Capture | None = None
    incident: int = -1


class JobParts(Protocol):
    """A job's entry and what it owns for its whole life, read, never replaced."""

    @property
    def job(self) -> Job: ...
    @property
    def catalog(self) -> Catalog: ...
    @property
    def hands(self) -> JobHands: ...  # its folders, read and changed as its user
    @property
    def intake(self) -> Intake: ...  # its heartbeat socket and ranks' rings
    @property
    def events(self) -> Events: ...
    @property
    def refused(self) -> Refusals: ...  # checkpoint reports the catalog refused


class Runner(JobParts, Protocol):
    """One supervised job, as the steps of its state machine use it."""

    # --- what it runs with (a reload swaps config and policy inside job.py) ----
    @property
    def config(self) -> Config: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def sel(self) -> selectors.BaseSelector: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def rng(self) -> random.Random: ...
    @property
    def dir(self) -> Path: ...  # its state folder
    @property
    def socket(self) -> HeartbeatSocket: ...
    @property
    def socket_path(self) -> str: ...
    @property
    def passthrough(self) -> bool: ...
    @property
    def die_with_parent(self) -> bool: ...
    @property
    def umask(self) -> int: ...
    @property
    def gpuwatch(self) -> GpuWatch | None: ...
    @property
    def xids_seen(self) -> XidHistory: ...
    @property
    def stall(self) -> StallWatch: ...
    @property
    def first_failure(self) -> FirstFailure: ...
    @property
    def outages(self) -> Goodput: ...
    @property
    def engine(self) -> Engine: ...  # what restarts it (lifecycle/engine.py)
    @property
    def checkpoints(self) -> Summary: ...  # the exporter's, refreshed by job.py
    checkpoints_at: float  # when that summary is refreshed next (0: at the next tick)

    # --- where it stands: the actions change these -----------------------------
    attempt: Attempt | None
    number: int  # the attempt's; -1 before the first
    restarts: int
    history: RestartHistory
    ranks: Ranks
    anomalies: LossFeed
    logwatch: LogWatch | None
    last_step: int | None
    ever_beaten: bool
    hang_latched: bool
    stopping: Stop | None
    relaunch_at: float
    pending_incident: int | None
    last_incident: int
    skip: tuple[int, int, int] | None
    group: Group | None  # a job across hosts (multihost/group.py)
    paused: bool
    drill: DrillNotice | None
    exit_handled: int
    over_cap_before: int
    output_dropped_before: int

    @property
    def state(self) -> JobState | None: ...  # changed by to() alone
    @property
    def observing(self) -> bool: ...
    @property
    def ranks_over_cap(self) -> int: ...
    @property
    def output_dropped(self) -> int: ...

    # --- what it does ------------------------------------------------------------
    def to(self, new: JobState, reason: str) -> None: ...
    def publish(self) -> None: ...
    def save(self) -> None: ...
    def start(self) -> None: ...
    def stop(self, reason: str) -> None: ...
    def begin_stop(self, outcome: JobState, reason: str, delay: float = 0.0) -> None: ...
    def gpus(self) -> list[int] | None: ...
    def on_exit_ready(self, fd: int) -> None: ...
    def mark_exit_handled(self, attempt: int) -> None: ...
    def refresh_checkpoints(self) -> None: ...
    def view(self, now: float, exit: ProcessExit | None = None,
             stopped: frozenset[int] = frozenset()) -> JobView: ...
    def expect_drill(self, kind: str, pids: list[int]) -> None: ...
    def take_drill(self, *kinds: str) -> DrillNotice | None: ...
    def goodput(self, now: float) -> float | None: ...
