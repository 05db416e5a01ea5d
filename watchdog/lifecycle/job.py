"""One supervised job: its state machine and everything that drives it.

Events come from the supervisor's loop: heartbeat datagrams, the leader's
exit (pidfd), output, and ticks. Detectors turn them into faults, the policy
turns a fault into a decision, and this is the only code that signals the
job's processes.

    start ─▶ STARTING ─first beat─▶ RUNNING
    fault or exit ─▶ STOPPING (SIGTERM, kill_grace, SIGKILL, wait for every process)
        ─▶ BACKOFF ─delay─▶ STARTING       relaunch from the last good checkpoint
        ─▶ EXITED                           the job finished (exit 0)
        ─▶ FATAL                            budget spent, or the action was stop
        ─▶ PAUSED                           the operator stopped it (Ctrl-C)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import selectors
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence

from trainwatch.actions import background, prune, pull
from trainwatch.actions import stop as stopping
from trainwatch.actions.attempt import Attempt
from trainwatch.actions.launch import launch
from trainwatch.config import Config, Job, socket_path
from trainwatch.detectors import JobView
from trainwatch.detectors import next_deadline as detector_deadline
from trainwatch.export import status
from trainwatch.export.events import Events
from trainwatch.export.goodput import Goodput
from trainwatch.lifecycle import adopt, respond, saved
from trainwatch.lifecycle.drill import DrillNotice
from trainwatch.lifecycle.engines import engine_for
from trainwatch.lifecycle.policy import RestartHistory, XidHistory
from trainwatch.lifecycle.runner import Stop
from trainwatch.multihost import group
from trainwatch.privsep import credentials, jobhands
from trainwatch.sources.ranks import Ranks
from trainwatch.state import jobdir, runtime, verifier
from trainwatch.state.catalog import Catalog
from trainwatch.state.entry import Summary
from trainwatch.state.ledger import Ledger
from trainwatch.types import TRANSITIONS, Beat, JobState, ProcessExit
from trainwatch.watch import anomalies, exits, live, reports, stallwatch
from trainwatch.watch.gpuwatch import GpuWatch
from trainwatch.watch.intake import RING_POLL, Intake
from trainwatch.watch.state import FirstFailure, LogWatch, LossFeed, Refusals, StallWatch

log = logging.getLogger("trainwatch")

# The grid a job ticks on (the supervisor's ``grid``: 1 s, 2 s under the daemon),
# its rings read on the same (one wake-up serves every job). A tick reads the
# rings, publishes the step and runs the watchers; what waits for it is
# freshness (steps/s, status.json's step), a log rule's match and the loss
# statistics (a spike acted on up to a grid step later), never an exit, a hang
# or stall deadline, a NaN or a GPU fault: those wake the loop themselves.
GRID = RING_POLL
# The published status carries the step at most this often, times the grid (each
# rewrite is an atomic replace, ~0.1-0.4 ms on ext4), so at each grid tick and not
# at the ticks for events between them: faultinject and scripts wait on it, and 5 s
# made them act after a short job had ended.
_PUBLISH_EVERY = 0.75
# The checkpoint summary the exporter shows is refreshed this often.
_CATALOG_EVERY = 10.0
# While stopping, look at the tree this often.
_STOP_POLL = 0.05
# Without a pidfd (kernels before 5.3), poll the leader this often.
_EXIT_POLL = 0.1



class JobRunner:
    def __init__(
        self,
        config: Config,
        job: Job,
        ledger: Ledger,
        selector: selectors.BaseSelector,
        passthrough: bool = False,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        gpus: GpuWatch | None = None,
        events: Events | None = None,
        die_with_parent: bool = False,
        umask: int = -1,
        grid: float = GRID,
    ) -> None:
        self.config = config
        self.events = events if events is not None else Events(None)
        self.events.add_job(job.name)
        self.gpuwatch = gpus
        self.xids_seen: XidHistory = deque(maxlen=256)
        self.job = job
        self.policy = config.policy_for(job)
        self.ledger = ledger
        self.sel = selector
        self.passthrough = passthrough
        self.grid = grid
        self.clock = clock
        self.rng = rng or random.Random()
        self.dir = jobdir.job_dir(config.state_dir, job.name)
        owner = job.checkpoints.dir or " ".join(job.command)
        # Its folders are read and changed as its user, in processes of their own.
        self.hands = jobhands.for_job(job.name, credentials.resolve(job.user, job.group))
        self.catalog = Catalog(job.checkpoints, self.dir / "catalog.json",
                               owner=f"{owner}|{job.checkpoints.pattern}",
                               verifier=verifier.for_job(job.checkpoints, self.dir,
                                                         self.hands.bulk),
                               hand=self.hands.quick)
        self.history = RestartHistory()
        self.state: JobState | None = None
        self.attempt: Attempt | None = None
        self.number = -1
        self.die_with_parent = die_with_parent  # trainwatch run: the job dies with it
        self.umask = umask  # the job's, not trainwatch's own 0o077
        self.ranks = Ranks(started=clock(), max_ranks=job.heartbeat.max_ranks)
        self.ever_beaten = False
        self.last_step: int | None = None  # the step this attempt has reached
        self.hang_latched = False  # a hang already reported and not acted on
        self.stopping: Stop | None = None
        self.relaunch_at = 0.0
        self.pending_incident: int | None = None
        self.last_incident = 0  # the newest incident that stopped an attempt, by id
        # After a rollback past a loss anomaly: the steps whose data the next
        # attempts skip, and how many rollbacks came back into that window.
        self.skip: tuple[int, int, int] | None = None
        self.anomalies = LossFeed(job.anomalies.detect)
        self.logwatch: LogWatch | None = None
        self.stall = StallWatch(job.stall)
        self.paused = False  # the operator: keep watching, stop acting
        self.restarts = 0  # relaunches, every attempt after the first
        self.drill: DrillNotice | None = None
        self.exit_handled = -1  # the attempt whose leader's exit has been acted on
        self.refused = Refusals()  # checkpoint reports the catalog refused
        self.over_cap_before = 0  # beats of ranks beyond the cap, in earlier attempts
        self.output_dropped_before = 0  # bytes of output lost by earlier attempts
        self.published_step: int | None = None
        self.published_at = 0.0
        self.socket_path = socket_path(config.run_dir, job.name)
        ident = credentials.resolve(job.user, job.group)
        self.intake = Intake(job.name, self.socket_path, selector, self._believe, clock,
                             (ident.uid, ident.gid) if ident else None,
                             self._on_beats, lambda obs: reports.on_report(self, obs),
                             max_rings=2 * job.heartbeat.max_ranks, poll_every=self.grid)
        self.socket = self.intake.socket
        self.first_failure = FirstFailure(selector, clock, 2 * job.heartbeat.max_ranks)
        # For the exporter: the catalog's summary, and the time faults cost.
        self.checkpoints = Summary()
        self.checkpoints_at = 0.0
        self.outages = Goodput()
        self.group = group.for_job(config, job)  # a job across hosts: its group
        self.engine = engine_for(job)

    # --- state ---------------------------------------------------------------

    def to(self, new: JobState, reason: str) -> None:
        old = self.state
        if old is not None and new not in TRANSITIONS[old]:
            raise AssertionError(f"illegal transition {old.value} -> {new.value} ({reason})")
        self.state = new
        if new in (JobState.EXITED, JobState.FATAL, JobState.PAUSED):
            self.outages.ended_at = self.clock()
        elif new is JobState.STARTING:
            self.outages.ended_at = None
        self.ledger.transition(self.job.name, max(self.number, 0), old, new, reason)
        log.info(
            "job %s: %s -> %s: %s", self.job.name, old.value if old else "-", new.value, reason
        )
        self.save()
        self.publish()

    def publish(self) -> None:
        self.published_step, self.published_at = self.last_step, self.clock()
        status.publish(self.config.state_dir, self.job.name, status.of(self))

    def save(self) -> None:
        """The runtime state, for a restarted daemon (state/runtime.py)."""
        runtime.save(self.dir, saved.of(self), time.time())

    @property
    def ranks_over_cap(self) -> int:
        """Beats dropped because their rank was beyond the job's cap, every attempt."""
        return self.over_cap_before + self.ranks.over_cap

    @property
    def output_dropped(self) -> int:
        """Bytes of the job's output lost (log or passthrough), every attempt."""
        a = self.attempt
        return self.output_dropped_before + (a.dropped if a is not None else 0)

    @property
    def done(self) -> bool:
        return self.state in (JobState.EXITED, JobState.FATAL, JobState.PAUSED)

    # --- launching -----------------------------------------------------------

    def start(self) -> None:
        launch(self, "start")

    def adopt_or_start(self) -> None:
        """The daemon's start: take back what a daemon before us left running (adopt.py)."""
        adopt.adopt_or_start(self)

    # --- the operator (operations.py) ----------------------------------------

    @property
    def observing(self) -> bool:
        """Faults are recorded, not acted on: observe_only, or paused by the operator."""
        return self.config.observe_only or self.paused

    def reconfigure(self, config: Config, job: Job) -> None:
        """A reload changed the job: the change applies from its next launch."""
        self.config, self.job, self.policy = config, job, config.policy_for(job)
        self.hands.follow(job.name, job.user, job.group)  # its folders, as its user now
        log.info("job %s: config changed; applies at its next launch", job.name)
        if type(engine_for(job)) is not type(self.engine):  # nodes: or Slurm's, changed
            log.warning("job %s: nodes changed: what restarts it stays as it was until "
                        "trainwatch restarts", job.name)

    def gpus(self) -> list[int] | None:
        """The GPUs an attempt gets now; None when trainwatch does not see GPUs."""
        w = self.gpuwatch
        if w is None or w.backend is None:
            return None
        return w.healthy(self.job.gpus.devices)

    def uses_gpu(self, gpu: int | None) -> bool:
        w = self.gpuwatch
        if gpu is None or w is None:
            return True  # an Xid on an unmapped GPU concerns every job
        devices = self.job.gpus.devices
        return gpu in (devices if devices is not None else w.indices)

    # --- events from the loop ------------------------------------------------

    def _believe(self, pid: int, uid: int) -> bool:
        a = self.attempt  # not a worker of a group's round before (multihost/group.py);
        # one that has beaten stays believed once gone (a loaded loop reads it late)
        return a is not None and (a.tree.owns(pid, uid) or self.ranks.beat_from(pid)) \
            and not self.engine.of_rounds_before(self, pid)

    def _on_beats(self, beats: Sequence[Beat]) -> None:
        """Beats in the order they were sent (a ring's batch, or one datagram)."""
        if self.state not in (JobState.STARTING, JobState.RUNNING):
            return  # late beats from an attempt being stopped
        first = not self.ranks.beaten
        new_pid, taken, observe = False, None, self.ranks.observe
        for b in beats:
            seen = observe(b)
            if seen is None:
                continue  # a rank beyond the job's cap: dropped and counted
            new_pid, taken = new_pid or seen, b
            if self.last_step is None or b.step > self.last_step:
                self.last_step = b.step
        if taken is None:
            return
        self.hang_latched = False
        self.ever_beaten = True
        resumed = self.engine.resumed_step(self) if first else None
        if resumed is not None:
            self.catalog.start_succeeded(resumed)
        if first:
            # Back at work: the outage cost its downtime and the steps it must redo.
            lost = self.outages.back(taken.at)
            if lost is not None:
                self.events.seconds_lost.labels(self.job.name).inc(lost)
        if self.state is JobState.STARTING:
            self.to(JobState.RUNNING, f"first heartbeat (rank {taken.rank}, step {taken.step})")
        elif new_pid:
            self.publish()
        respond.act_on(self, anomalies.check(self, beats))

    def _unregister(self, fd: int) -> None:
        if fd in self.sel.get_map():
            self.sel.unregister(fd)

    def on_exit_ready(self, fd: int) -> None:
        # Handled first: should it raise, the pidfd stays registered (it stays
        # readable once the process has exited) and the exit is handled next round.
        respond.act_on(self, exits.check(self))
        self._unregister(fd)
        a = self.attempt
        if a is not None and a.pidfd == fd:
            a.exit_seen()

    def mark_exit_handled(self, attempt: int) -> None:
        self.exit_handled = attempt

    def refresh_checkpoints(self) -> None:
        self.checkpoints = self.catalog.summary()
        self.checkpoints_at = self.clock() + _CATALOG_EVERY
        prune.after_refresh(self)

    def tick(self, now: float) -> None:
        self.intake.tick(now)
        self.catalog.flush()
        if now >= self.checkpoints_at:
            self.refresh_checkpoints()
        a = self.attempt
        if a is not None and not a.closed:
            a.follow()
        running = self.state in (JobState.STARTING, JobState.RUNNING)
        if running and a is not None and a.pidfd is None and self.exit_handled != a.number:
            respond.act_on(self, exits.check(self))
        if self.last_step != self.published_step \
                and now - self.published_at >= _PUBLISH_EVERY * self.grid:
            self.publish()
        if self.state in (JobState.STARTING, JobState.RUNNING) and a is not None:
            respond.act_on(self, live.check(self, a, now))
        elif self.state is JobState.STOPPING:
            stopping.advance(self, now)
        elif self.state is JobState.BACKOFF and self.engine.relaunch_due(self, now):
            launch(self, "relaunch")

    def next_wake(self, now: float) -> float:
        """The latest time the loop may sleep until."""
        wake = self._next_wake(now)
        poll = self.intake.next_wake()
        return min(wake, poll) if poll is not None else wake

    def _next_wake(self, now: float) -> float:
        if self.state is JobState.STOPPING:
            return now + _STOP_POLL
        if self.state is JobState.BACKOFF:
            return self.relaunch_at
        # On the grid every job and the ring poll share: one wake-up serves them all.
        wake = (math.floor(now / self.grid) + 1) * self.grid
        a = self.attempt
        if a is not None and a.pidfd is None:
            wake = now + _EXIT_POLL
        if self.state is JobState.STARTING:
            wake = min(wake, self.ranks.started + live.RUNNING_WITHOUT_BEATS)
        if self.state in (JobState.STARTING, JobState.RUNNING):
            times = [stallwatch.deadline(self, now), self.engine.wake(self, now),
                     self.first_failure.next_scan(),
                     None if self.hang_latched else detector_deadline(self.view(now))]
            wake = min([wake, *(t for t in times if t is not None)])
        return wake

    def view(self, now: float, exit: ProcessExit | None = None,
              stopped: frozenset[int] = frozenset()) -> JobView:
        learned = self.job.heartbeat.learned
        snap = self.ranks.snapshot(now, learned.min_samples if learned else 1 << 30)
        if stopped:
            snap = dataclasses.replace(snap, stopped=stopped)
        return JobView(self.job, now, self.last_step, snap, exit=exit)

    # --- faults --------------------------------------------------------------

    def expect_drill(self, kind: str, pids: list[int]) -> None:
        """faultinject is about to inject ``kind`` (crash or hang) into ``pids``."""
        self.drill = DrillNotice(kind, self.clock(), frozenset(pids))

    def take_drill(self, *kinds: str) -> DrillNotice | None:
        d, self.drill = self.drill, None
        return d if d is not None and any(d.fits(k, self.clock()) for k in kinds) else None

    # --- stopping ------------------------------------------------------------

    def stop(self, reason: str) -> None:
        """The operator asked: stop the job, do not relaunch."""
        stopping.request(self, reason)

    def begin_stop(self, outcome: JobState, reason: str, delay: float = 0.0) -> None:
        stopping.start(self, outcome, reason, delay)

    def close(self, release: bool = False) -> None:
        """Release the socket. The attempt: left running for the next daemon to adopt
        (``release``), else a tree still running here (the loop failed) is killed
        outright rather than left behind without a supervisor."""
        a = self.attempt
        if a is not None and release:
            a.release()
        elif a is not None and not self.done and not self.config.observe_only:
            a.tree.signal(signal.SIGKILL, a.tree.scan())
        self.intake.close()
        if self.logwatch is not None:
            self.logwatch.close()
        if self.done and not release:
            prune.at_end(self)
        self.catalog.close()
        background.wait(self)  # what it left to threads (its last ring folder, removals)
        self.hands.close()
        pull.cancel(self)

    def goodput(self, now: float) -> float | None:
        """1 - seconds lost to faults / seconds supervised; None before the first launch."""
        return self.outages.ratio(now)

    @property
    def exit_code(self) -> int:
        return {JobState.EXITED: 0, JobState.PAUSED: 130}.get(self.state or JobState.FATAL, 1)
