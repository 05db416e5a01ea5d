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
import random
import selectors
import signal
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import psutil
from trainwatch import credentials, hook, status
from trainwatch.attempt import Attempt
from trainwatch.catalog import Catalog, Entry, Summary
from trainwatch.config import Config, Job, socket_path
from trainwatch.detectors.crash import detect_crash
from trainwatch.detectors.hang import detect_hang, next_deadline
from trainwatch.drill import DrillNotice
from trainwatch.gpuwatch import GpuWatch
from trainwatch.ledger import Ledger, Relaunch
from trainwatch.metrics import Events
from trainwatch.policy import RestartHistory, decide
from trainwatch.ranks import Ranks
from trainwatch.sources.heartbeat import HeartbeatSocket
from trainwatch.types import (
    TRANSITIONS,
    Action,
    Beat,
    CheckpointReport,
    Fault,
    FaultKind,
    HeartbeatSnapshot,
    JobState,
    ProcessExit,
)
from trainwatch.xid import classify

log = logging.getLogger("trainwatch")

# A job that never uses the client counts as running once it has been up this
# long; one that does counts as running at its first beat.
_RUNNING_WITHOUT_BEATS = 10.0
# The published status carries the step at most this often.
_PUBLISH_EVERY = 1.0
# While beats flow, the socket is read this often rather than on every datagram
# (8 ranks x 10 Hz: 4 datagrams a batch, 20 wake-ups/s instead of 80); a
# beat's receive time is then late by at most this. The kernel queues only
# net.unix.max_dgram_qlen datagrams (10 by default) before a sender's beat is
# dropped, and with many ranks in lock-step the same slow rank would lose
# every round and look hung: a poll that finds the queue full goes
# back to waking on every datagram for _WAKE_FOR seconds.
_BEAT_POLL = 0.05
_WAKE_FOR = 30.0


def _queue_limit() -> int:
    try:
        with open("/proc/sys/net/unix/max_dgram_qlen") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 10


_QUEUE_FULL = max(2, _queue_limit())
# The checkpoint summary the exporter shows is refreshed this often.
_CATALOG_EVERY = 10.0
# While stopping, look at the tree this often.
_STOP_POLL = 0.05
# Without a pidfd (kernels before 5.3), poll the leader this often.
_EXIT_POLL = 0.1


@dataclass
class _Outage:
    """A fault that stopped the job, until the relaunch's first heartbeat."""

    kind: str
    onset: float  # monotonic
    detected: float
    redo_seconds: float = 0.0  # steps lost x the step interval before the fault


@dataclass
class _Stop:
    outcome: JobState
    reason: str
    deadline: float
    delay: float = 0.0
    killed: bool = False


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
    ) -> None:
        self.config = config
        self.events = events if events is not None else Events(None)
        self.events.add_job(job.name)
        self.gpuwatch = gpus
        self.xids_seen: deque[tuple[int | None, float]] = deque(maxlen=256)  # (gpu, at)
        self.job = job
        self.policy = config.policy_for(job)
        self.ledger = ledger
        self.sel = selector
        self.passthrough = passthrough
        self.clock = clock
        self.rng = rng or random.Random()
        self.dir = status.job_dir(config.state_dir, job.name)
        owner = job.checkpoints.dir or " ".join(job.command)
        self.catalog = Catalog(job.checkpoints, self.dir / "catalog.json",
                               owner=f"{owner}|{job.checkpoints.pattern}")
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
        self.stopping: _Stop | None = None
        self.relaunch_at = 0.0
        self.pending_incident: int | None = None
        self.drill: DrillNotice | None = None
        self._exit_handled = -1  # the attempt whose leader's exit has been acted on
        self.reports_refused = 0  # checkpoint reports outside checkpoints.dir
        self._over_cap_before = 0  # beats of ranks beyond the cap, in earlier attempts
        self._output_dropped_before = 0  # bytes of output lost by earlier attempts
        self.published_step: int | None = None
        self.published_at = 0.0
        self.socket_path = socket_path(config.run_dir, job.name)
        ident = credentials.resolve(job.user, job.group)
        # Only the job's user (and root) may reach its socket at all.
        self.socket = HeartbeatSocket(self.socket_path, self._believe, clock,
                                      owner=(ident.uid, ident.gid) if ident else None)
        self.socket_poll_at = 0.0  # 0: waiting on the socket; else: next poll of it
        self.socket_wake_until = 0.0  # until then, wake on every datagram
        # For the exporter: the catalog's summary, and the time faults cost.
        self.checkpoints = Summary()
        self.checkpoints_at = 0.0
        self.outage: _Outage | None = None
        self.lost_seconds = 0.0
        self.first_started: float | None = None
        self.ended_at: float | None = None
        selector.register(self.socket, selectors.EVENT_READ, self._on_socket)

    # --- state ---------------------------------------------------------------

    def _to(self, new: JobState, reason: str) -> None:
        old = self.state
        if old is not None and new not in TRANSITIONS[old]:
            raise AssertionError(f"illegal transition {old.value} -> {new.value} ({reason})")
        self.state = new
        if new in (JobState.EXITED, JobState.FATAL, JobState.PAUSED):
            self.ended_at = self.clock()
        elif new is JobState.STARTING:
            self.ended_at = None
        self.ledger.transition(self.job.name, max(self.number, 0), old, new, reason)
        log.info(
            "job %s: %s -> %s: %s", self.job.name, old.value if old else "-", new.value, reason
        )
        self._publish()

    def _publish(self) -> None:
        a = self.attempt
        self.published_step, self.published_at = self.last_step, self.clock()
        status.publish(
            self.config.state_dir,
            self.job.name,
            {
                "job": self.job.name,
                "state": self.state.value if self.state else None,
                "attempt": self.number,
                "pid": a.pid if a else None,
                "pgid": a.pid if a else None,
                "ranks": {str(r): p for r, p in self.ranks.pids().items()},
                "step": self.last_step,
                "socket": self.socket_path,
                "run_dir": self.config.run_dir,  # where faultinject finds the control socket
                "cgroup": a.tree.cgroup.path if a and a.tree.cgroup else None,
                "log": str(a.log_path) if a else None,
                "resumed_from": a.resume_from if a else None,
                "observe_only": self.config.observe_only,
                "datagrams": dataclasses.asdict(self.socket.counters),
                "ranks_over_cap": self.ranks_over_cap,
            },
        )

    @property
    def ranks_over_cap(self) -> int:
        """Beats dropped because their rank was beyond the job's cap, every attempt."""
        return self._over_cap_before + self.ranks.over_cap

    @property
    def output_dropped(self) -> int:
        """Bytes of the job's output lost (log or passthrough), every attempt."""
        a = self.attempt
        return self._output_dropped_before + (a.dropped if a is not None else 0)

    @property
    def done(self) -> bool:
        return self.state in (JobState.EXITED, JobState.FATAL, JobState.PAUSED)

    # --- launching -----------------------------------------------------------

    def start(self) -> None:
        self._launch("start")

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

    def _launch(self, reason: str) -> None:
        cp: Entry | None = self.catalog.last_good()
        gpus = self.gpus()
        if gpus is None and any("{num_gpus}" in x for x in self.job.command):
            why = ("the command uses {num_gpus}, but trainwatch sees no GPUs here (NVML is "
                   "absent or gpu.backend is off): write the number itself")
            log.error("job %s: %s", self.job.name, why)
            self._to(JobState.FATAL, why)
            return
        if gpus is not None and len(gpus) < self.job.gpus.min:
            why = f"{len(gpus)} healthy GPUs, the job needs at least {self.job.gpus.min}"
            self._run_exec_hook("insufficient_gpus", None)
            self._to(JobState.FATAL, why)
            return
        self.number += 1
        try:
            a = Attempt(
                self.job,
                self.number,
                self.socket_path,
                cp.path if cp else None,
                cp.step if cp else None,
                self.dir / "logs",
                self.passthrough,
                gpus,
                die_with_parent=self.die_with_parent,
                umask=self.umask,
            )
        except (OSError, KeyError) as e:  # KeyError: no such user
            why = f"no such user {self.job.user!r}"
            if isinstance(e, OSError):
                why = e.strerror or str(e)
            where = getattr(e, "filename", None) or self.job.command[0]
            what = f"{where}: cannot start: {why}"
            log.error("job %s: %s", self.job.name, what)
            self._to(JobState.FATAL, what)
            return
        if self.attempt is not None:
            self._output_dropped_before += self.attempt.dropped
        self.attempt = a
        if self.first_started is None:
            self.first_started = a.started
        intervals = self.ranks.intervals  # the faulted attempt's seconds per step
        step_s = statistics.median(intervals) if intervals else 0.0
        self._over_cap_before += self.ranks.over_cap  # counters that outlive an attempt
        self.ranks = Ranks(started=a.started, max_ranks=self.job.heartbeat.max_ranks)
        self.socket.forget_senders()  # the last attempt's processes are no longer ours
        self.hang_latched = False
        self.drill = None  # a notice for the attempt before is not this one's
        reached, self.last_step = self.last_step, cp.step if cp else None
        if a.pidfd is not None:
            self.sel.register(a.pidfd, selectors.EVENT_READ, self._on_exit_ready)
        for fd in a.pipes:
            self.sel.register(fd, selectors.EVENT_READ, self._on_output)
        where = f"from {cp.path} (step {cp.step})" if cp else "fresh"
        if gpus is not None:
            where += f", GPUs {','.join(map(str, gpus))}"
        self._to(JobState.STARTING, f"{reason}: attempt {a.number}, pid {a.pid}, {where}")
        if self.pending_incident is not None:
            # The faulted attempt reached `reached`; this one starts over at cp. A job
            # that has never beaten has told nothing of its steps: unknown, not 0.
            lost = None if reached is None or not self.ever_beaten \
                else max(0, reached - (cp.step if cp else 0))
            if self.outage is not None:
                o, name = self.outage, self.job.name
                self.events.restarts.labels(name, o.kind).inc()
                self.events.relaunch.labels(name).observe(max(0.0, a.started - o.detected))
                self.events.steps_lost.labels(name).inc(lost or 0)
                o.redo_seconds += (lost or 0) * step_s
            self.ledger.relaunched(
                self.pending_incident,
                Relaunch(a.started_wall, a.resume_from, a.resumed_step, lost),
            )
            self.pending_incident = None

    # --- events from the loop ------------------------------------------------

    def _believe(self, pid: int, uid: int) -> bool:
        a = self.attempt
        return a is not None and a.tree.owns(pid, uid)

    def _on_socket(self, _fd: int) -> None:
        self._drain()
        now = self.clock()
        if now >= self.socket_wake_until:
            # Beats are flowing: stop waiting on the socket and poll it every
            # _BEAT_POLL instead. One wake-up then takes a batch, and a sender
            # does not pay for waking us.
            self._unregister(self.socket.fileno())
            self.socket_poll_at = now + _BEAT_POLL

    def _poll_socket(self, now: float) -> None:
        if not self.socket_poll_at or now < self.socket_poll_at:
            return
        n = self._drain()
        if n and n < _QUEUE_FULL:
            self.socket_poll_at = now + _BEAT_POLL
            return
        if n:
            # The kernel's queue filled between two polls (many ranks): beats
            # were being dropped, so wake on every datagram for a while.
            self.socket_wake_until = now + _WAKE_FOR
        self.socket_poll_at = 0.0  # quiet, or too busy: wait on the socket again
        self.sel.register(self.socket, selectors.EVENT_READ, self._on_socket)

    def _drain(self) -> int:
        """Read and act on everything queued on the socket; how many datagrams."""
        c = self.socket.counters
        before = (c.malformed, c.oversized, c.foreign)
        observations = self.socket.drain()
        for what, old, new in zip(("malformed", "oversized", "foreign"), before,
                                  (c.malformed, c.oversized, c.foreign), strict=True):
            if old == 0 and new > 0:  # the first of its kind; the rest are only counted
                log.warning("job %s: dropped a %s datagram on %s", self.job.name, what,
                            self.socket_path)
        for obs in observations:
            if isinstance(obs, Beat):
                self._on_beat(obs)
            elif isinstance(obs, CheckpointReport):
                if not self.catalog.report(obs.step, obs.path):
                    self.reports_refused += 1
                    if self.reports_refused == 1:
                        log.warning("job %s: refused a checkpoint report outside %s: %.200s",
                                    self.job.name, self.job.checkpoints.dir, obs.path)
                    continue
                self.checkpoints_at = 0.0  # the exporter's summary: refresh at the next tick
                log.info("job %s: checkpoint step %d complete: %s", self.job.name, obs.step,
                         obs.path)
        return len(observations) + c.malformed + c.oversized + c.foreign - sum(before)

    def _on_beat(self, b: Beat) -> None:
        if self.state not in (JobState.STARTING, JobState.RUNNING):
            return  # a late beat from an attempt being stopped
        first = not self.ranks.beaten
        new_pid = self.ranks.observe(b)
        if new_pid is None:
            return  # a rank beyond the job's cap: dropped and counted
        self.hang_latched = False
        self.ever_beaten = True
        if self.last_step is None or b.step > self.last_step:
            self.last_step = b.step
        a = self.attempt
        if first and a is not None and a.resumed_step is not None:
            self.catalog.start_succeeded(a.resumed_step)
        if first and self.outage is not None:
            # Back at work: the outage cost its downtime and the steps it must redo.
            lost = max(0.0, b.at - self.outage.onset) + self.outage.redo_seconds
            self.events.seconds_lost.labels(self.job.name).inc(lost)
            self.lost_seconds += lost
            self.outage = None
        if self.state is JobState.STARTING:
            self._to(JobState.RUNNING, f"first heartbeat (rank {b.rank}, step {b.step})")
        elif new_pid:
            self._publish()

    def _on_output(self, fd: int) -> None:
        a = self.attempt
        if a is not None and fd in a.pipes and not a.pump(fd):
            self._unregister(fd)
            a.pipes.pop(fd, None)  # EOF: the writers are gone

    def _unregister(self, fd: int) -> None:
        if fd in self.sel.get_map():
            self.sel.unregister(fd)

    def _on_exit_ready(self, fd: int) -> None:
        # Handled first: should it raise, the pidfd stays registered (it stays
        # readable once the process has exited) and the exit is handled next round.
        self._check_exit()
        self._unregister(fd)

    def _check_exit(self) -> None:
        a = self.attempt
        if a is None or self._exit_handled == a.number:
            return
        rc = a.returncode if a.returncode is not None else a.poll_exit()
        if rc is None:
            return
        if self.state is not JobState.STARTING and self.state is not JobState.RUNNING:
            return  # we are stopping it; _progress_stop finishes the job
        self._drain()  # its last beats, still queued, count towards the steps it reached
        at = a.exited_at if a.exited_at is not None else self.clock()
        fault = detect_crash(self.job.name, ProcessExit(a.pid, rc, at), self.last_step)
        drill = self._take_drill("crash")
        if fault is not None and drill is not None:
            fault = dataclasses.replace(fault, onset=drill.at, onset_known=True,
                                        evidence={**fault.evidence, "source": "drill"})
        if fault is None:
            self._begin_stop(JobState.EXITED, "the job finished (exit 0)")
        else:
            self._handle(fault)
        self._exit_handled = a.number  # not before: a handling that raised is tried again

    def tick(self, now: float) -> None:
        self._poll_socket(now)
        self.catalog.flush()
        if now >= self.checkpoints_at:
            self.checkpoints = self.catalog.summary()
            self.checkpoints_at = now + _CATALOG_EVERY
        a = self.attempt
        live = self.state in (JobState.STARTING, JobState.RUNNING)
        if live and a is not None and a.pidfd is None and self._exit_handled != a.number:
            self._check_exit()
        if self.last_step != self.published_step and now - self.published_at >= _PUBLISH_EVERY:
            self._publish()
        if self.state in (JobState.STARTING, JobState.RUNNING) and a is not None:
            if (
                self.state is JobState.STARTING
                and not self.ranks.beaten
                and now - a.started >= _RUNNING_WITHOUT_BEATS
            ):
                self._to(JobState.RUNNING, f"up {_RUNNING_WITHOUT_BEATS:g}s without heartbeats")
            if not self.hang_latched:
                fault = detect_hang(self.job.name, self._snapshot(now), self.job.heartbeat)
                if fault is not None:
                    # A beat may be queued while we poll: read it before judging; and
                    # which ranks' processes are stopped names the hung one among
                    # ranks that went quiet together (DDP's wait in the collective).
                    self._drain()
                    snap = dataclasses.replace(self._snapshot(now), stopped=self._stopped())
                    fault = detect_hang(self.job.name, snap, self.job.heartbeat)
                if fault is not None:
                    if self._take_drill("hang") is not None:
                        fault = dataclasses.replace(
                            fault, evidence={**fault.evidence, "source": "drill"})
                    self._handle(fault)
        elif self.state is JobState.STOPPING:
            self._progress_stop(now)
        elif self.state is JobState.BACKOFF and now >= self.relaunch_at:
            self._launch("relaunch")

    def next_wake(self, now: float) -> float:
        """The latest time the loop may sleep until."""
        wake = self._next_wake(now)
        return min(wake, self.socket_poll_at) if self.socket_poll_at else wake

    def _next_wake(self, now: float) -> float:
        if self.state is JobState.STOPPING:
            return now + _STOP_POLL
        if self.state is JobState.BACKOFF:
            return self.relaunch_at
        wake = now + 1.0
        a = self.attempt
        if a is not None and a.pidfd is None:
            wake = now + _EXIT_POLL
        if self.state is JobState.STARTING:
            wake = min(wake, (a.started if a else now) + _RUNNING_WITHOUT_BEATS)
        if self.state in (JobState.STARTING, JobState.RUNNING) and not self.hang_latched:
            d = next_deadline(self._snapshot(now), self.job.heartbeat)
            if d is not None:
                wake = min(wake, d)
        return wake

    def _stopped(self) -> frozenset[int]:
        """Ranks whose process is stopped (T) or in uninterruptible sleep (D)."""
        out = set()
        for rank, pid in self.ranks.pids().items():
            try:
                st = psutil.Process(pid).status()
            except psutil.Error:
                continue
            if st in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP,
                      psutil.STATUS_DISK_SLEEP):
                out.add(rank)
        return frozenset(out)

    def _snapshot(self, now: float) -> HeartbeatSnapshot:
        learned = self.job.heartbeat.learned
        return self.ranks.snapshot(now, learned.min_samples if learned else 1 << 30)

    # --- faults --------------------------------------------------------------

    def expect_drill(self, kind: str, pids: list[int]) -> None:
        """faultinject is about to inject ``kind`` (crash or hang) into ``pids``."""
        self.drill = DrillNotice(kind, self.clock(), frozenset(pids))

    def _take_drill(self, kind: str) -> DrillNotice | None:
        d, self.drill = self.drill, None
        return d if d is not None and d.fits(kind, self.clock()) else None

    def on_gpu_fault(self, fault: Fault) -> None:
        """A fault of one of this job's GPUs (routed here by the supervisor)."""
        fault = dataclasses.replace(fault, job=self.job.name, onset_step=self.last_step,
                                    evidence=dict(fault.evidence))
        action = self._gpu_action(fault)
        pid = fault.evidence.get("pid")
        a = self.attempt
        # An application-level Xid names the process it hit: one of an earlier attempt
        # (e.g. Xid 45 as we killed it) or of another program is not this attempt's fault.
        foreign = (action is Action.RESTART and isinstance(pid, int) and pid > 0
                   and a is not None and not a.tree.owns(pid, uid=-1))
        if self.state in (JobState.STARTING, JobState.RUNNING) and not foreign:
            self._handle(fault, action)
            return
        # Nothing of ours runs on it now: record it, and keep the GPU out of the next launch.
        reason = f"job {self.state.value if self.state else '-'}: recorded only"
        if foreign:
            reason = f"pid {pid} is not this attempt's: recorded only"
        if (action is Action.RESTART_EXCLUDE_GPU and fault.gpu is not None
                and not self.config.observe_only):
            self._exclude(fault)
            reason += f"; GPU {fault.gpu} excluded"
        self.events.faults.labels(self.job.name, fault.kind.value).inc()
        latency = max(0.0, self.clock() - fault.onset) if fault.onset_known else None
        self.ledger.incident(fault, action.value, reason, max(self.number, 0), latency,
                             observe_only=self.config.observe_only,
                             injected=fault.evidence.get("source") == "drill")
        log.warning("job %s: %s on GPU %s -> %s", self.job.name, fault.kind.value, fault.gpu,
                    reason)

    def _gpu_action(self, fault: Fault) -> Action:
        if fault.kind is not FaultKind.GPU_XID:
            return self.policy.action_for(fault.kind)
        xid = int(fault.evidence["xid"])
        info = classify(xid, str(fault.evidence.get("message", "")))
        over = self.policy.xid_actions
        # Per Xid, then per class, then one action for every Xid, then the catalog's.
        action = (over.get(xid) or over.get(info.immediate.value)
                  or self.policy.actions.get(FaultKind.GPU_XID) or info.action)
        fault.evidence["class"] = info.immediate.value
        # The same GPU faulting again and again within the window is the GPU, not the job.
        now, esc = fault.onset, self.policy.escalate
        self.xids_seen.append((fault.gpu, now))
        repeats = sum(1 for g, t in self.xids_seen if g == fault.gpu and now - t <= esc.window)
        if action is Action.RESTART and fault.gpu is not None and repeats >= esc.after:
            fault.evidence["escalated"] = f"{repeats} Xids on GPU {fault.gpu}"
            return Action.RESTART_EXCLUDE_GPU
        return action

    def _exclude(self, fault: Fault) -> None:
        if self.gpuwatch is not None and fault.gpu is not None:
            self.gpuwatch.exclude(fault.gpu, f"{fault.kind.value} {fault.evidence.get('xid', '')}"
                                  f" (job {self.job.name})".replace("  ", " "))

    def _run_exec_hook(self, kind: str, gpu: int | None) -> None:
        hook.run(self.policy.exec, self.job.name, kind, gpu, self.umask)

    def _handle(self, fault: Fault, action: Action | None = None) -> None:
        a = self.attempt
        assert a is not None
        now = self.clock()
        exited = a.returncode is not None
        resumed = a.resumed_step
        # Dying (or hanging) before the first beat after loading a checkpoint
        # counts against that checkpoint.
        failed_start = not self.ranks.beaten and resumed is not None and self.ever_beaten
        if failed_start and resumed is not None and self.catalog.start_failed(resumed):
            log.warning("job %s: checkpoint step %d marked bad: %s", self.job.name, resumed,
                        self.catalog.bad[resumed])
        if action is None:
            action = self.policy.action_for(fault.kind)
        if self.config.observe_only:
            reason, delay, fatal = f"observe_only: would {action.value}", None, False
        else:
            d = decide(self.policy, fault, self.history, now, now - a.started, self.rng, action)
            reason, delay, fatal = d.reason, d.delay, d.fatal
        self.events.faults.labels(self.job.name, fault.kind.value).inc()
        latency = max(0.0, now - fault.onset) if fault.onset_known else None
        if latency is not None:
            self.events.detection.labels(self.job.name).observe(latency)
        incident = self.ledger.incident(
            fault, action.value, reason, a.number, latency,
            observe_only=self.config.observe_only, backoff=delay,
            injected=fault.evidence.get("source") == "drill",
        )
        ev = ", ".join(f"{k}={v}" for k, v in fault.evidence.items())
        log.warning("job %s: %s (%s) -> %s: %s", self.job.name, fault.kind.value, ev,
                    action.value, reason)

        if not self.config.observe_only and (action is not Action.ALERT or exited):
            # The job stops working from the fault's onset (the first fault's, if the
            # relaunch after it faulted too) until a relaunch beats again.
            if self.outage is None:
                self.outage = _Outage(fault.kind.value, fault.onset, now)
            else:
                self.outage.kind, self.outage.detected = fault.kind.value, now
        if self.config.observe_only or action is Action.ALERT:
            if exited:
                self._begin_stop(JobState.FATAL, f"{fault.kind.value}: not relaunched ({reason})")
            elif fault.kind is FaultKind.HANG:
                self.hang_latched = True  # reported; again only after a new beat
            return
        if action is Action.RESTART_EXCLUDE_GPU:
            self._exclude(fault)
            left = self.gpus()
            if left is not None and len(left) < self.job.gpus.min:
                self._run_exec_hook(fault.kind.value, fault.gpu)
                self._begin_stop(JobState.FATAL, f"{fault.kind.value}: only {len(left)} healthy "
                                 f"GPUs left, the job needs {self.job.gpus.min}")
                return
        if action is Action.EXEC:
            self._run_exec_hook(fault.kind.value, fault.gpu)
            self._begin_stop(JobState.FATAL, f"{fault.kind.value}: handed to the exec hook")
            return
        if action is Action.STOP or fatal:
            self._begin_stop(JobState.FATAL, f"{fault.kind.value}: {reason}")
            return
        self.pending_incident = incident
        self._begin_stop(JobState.BACKOFF, f"{fault.kind.value}: {reason}", delay or 0.0)

    # --- stopping ------------------------------------------------------------

    def stop(self, reason: str) -> None:
        """The operator asked: stop the job, do not relaunch."""
        if self.state in (JobState.STARTING, JobState.RUNNING):
            self._begin_stop(JobState.PAUSED, reason)
        elif self.state is JobState.BACKOFF:
            self._to(JobState.PAUSED, reason)
        elif self.stopping is not None and self.stopping.outcome is JobState.BACKOFF:
            self.stopping.outcome, self.stopping.reason = JobState.PAUSED, reason

    def _begin_stop(self, outcome: JobState, reason: str, delay: float = 0.0) -> None:
        now = self.clock()
        self.stopping = _Stop(outcome, reason, now + self.policy.kill_grace, delay)
        self._to(JobState.STOPPING, reason)
        a = self.attempt
        if a is not None and not self.config.observe_only:
            members = a.tree.scan()
            # SIGCONT after SIGTERM so that a stopped process can act on it.
            a.tree.signal(signal.SIGTERM, members)
            a.tree.signal(signal.SIGCONT, members)
        self._progress_stop(now)

    def _progress_stop(self, now: float) -> None:
        s, a = self.stopping, self.attempt
        assert s is not None
        if a is not None:
            a.poll_exit()
            a.tree.reap()
            # observe_only never signals, so it cannot wait for the tree either.
            alive = set() if self.config.observe_only else a.tree.alive()
            if alive:
                if now >= s.deadline and not s.killed:
                    log.warning("job %s: %d processes outlived kill_grace %gs: SIGKILL",
                                self.job.name, len(alive), self.policy.kill_grace)
                    a.tree.signal(signal.SIGKILL, alive)
                    s.killed = True
                return
            for fd in [*a.pipes, a.pidfd]:
                if fd is not None:
                    self._unregister(fd)
            a.close()
        self.stopping = None
        if s.outcome is JobState.BACKOFF:
            self.relaunch_at = now + s.delay
            self._to(JobState.BACKOFF, f"relaunch in {s.delay:.2f}s")
        else:
            self._to(s.outcome, s.reason)

    def close(self) -> None:
        """Release the socket; a tree still running here (the loop failed) is killed
        outright rather than left behind without a supervisor."""
        a = self.attempt
        if a is not None and not self.done and not self.config.observe_only:
            a.tree.signal(signal.SIGKILL, a.tree.scan())
        self._unregister(self.socket.fileno())
        self.socket_poll_at = 0.0
        self.socket.close()
        self.catalog.flush(force=True)

    def goodput(self, now: float) -> float | None:
        """1 - seconds lost to faults / seconds supervised; None before the first launch."""
        if self.first_started is None:
            return None
        end = self.ended_at if self.ended_at is not None else now
        total = end - self.first_started
        if total <= 0:
            return None
        lost = self.lost_seconds
        if self.outage is not None:  # still down, or ended down: it counts until now
            lost += max(0.0, end - self.outage.onset) + self.outage.redo_seconds
        return max(0.0, min(1.0, 1.0 - lost / total))

    @property
    def exit_code(self) -> int:
        return {JobState.EXITED: 0, JobState.PAUSED: 130}.get(self.state or JobState.FATAL, 1)
