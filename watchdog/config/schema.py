"""The config schema of DESIGN.md as frozen, typed objects, and what follows from
them alone: default folders and each job's socket path."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainwatch.config.fields import show
from trainwatch.detectors.logrules import LogRule
from trainwatch.detectors.losssettings import LossSettings
from trainwatch.detectors.stall import StallSettings
from trainwatch.types import Action, FaultKind

# sun_path in struct sockaddr_un is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107
DEFAULT_MAX_RANKS = 1024  # ranks believed per job when it declares no world size


class ConfigError(ValueError):
    """A user's mistake in a config file or flag: printed as one line, exit 2."""


@dataclass(frozen=True)
class Keep:
    """``checkpoints.keep``; all unset: never delete anything."""

    last: int | None = None  # keep the newest N good checkpoints
    every: int | None = None  # keep every good checkpoint whose step is a multiple of K
    pinned: tuple[int, ...] = ()  # steps never deleted
    min_free_bytes: int | None = None  # delete only while free space is below this

    def __post_init__(self) -> None:
        for name, least in (("last", 1), ("every", 1), ("min_free_bytes", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < least):
                raise ValueError(f"checkpoints.keep.{name} must be a whole number >= {least},"
                                 f" not {value!r}")
        for step in self.pinned:
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"checkpoints.keep.pinned must hold steps (whole numbers >= 0),"
                                 f" not {step!r}")

    @property
    def deletes(self) -> bool:
        """Whether any rule allows a deletion at all."""
        return self.last is not None or self.every is not None or self.min_free_bytes is not None


@dataclass(frozen=True)
class Backoff:
    initial: float = 10.0  # 0: relaunch at once
    factor: float = 2.0
    max: float = 600.0
    jitter: float = 0.1  # +/- this fraction, so that many hosts do not retry in step
    reset_after: float = 600.0  # an attempt that ran this long resets the backoff


DEFAULT_ACTIONS: Mapping[FaultKind, Action] = {
    FaultKind.CRASH: Action.RESTART,
    FaultKind.HANG: Action.RESTART,
    # gpu_xid has no entry: each Xid's action comes from its class (trainwatch.detectors.xid).
    FaultKind.GPU_LOST: Action.RESTART_EXCLUDE_GPU,
    FaultKind.GPU_ECC: Action.ALERT,  # a fatal ECC error also raises an Xid (48, 94, 95)
    FaultKind.GPU_THERMAL: Action.ALERT,
    # A loss anomaly the detector calls sustained (level act); a transient spike is
    # only ever an alert, whatever this says.
    FaultKind.NAN_LOSS: Action.ROLLBACK,
    FaultKind.LOSS_SPIKE: Action.ROLLBACK,
    FaultKind.GRAD_NORM_OUTLIER: Action.ROLLBACK,
    FaultKind.DIVERGENCE: Action.ROLLBACK,
    # From the job's log (jobs[].logs): restarting into the same OOM is a loop.
    FaultKind.OOM: Action.STOP,
    FaultKind.NCCL_STALL: Action.RESTART,
    FaultKind.LOG_PATTERN: Action.ALERT,
}


@dataclass(frozen=True)
class Escalate:
    """This many Xids on one GPU within ``window`` turn a restart into restart_exclude_gpu."""

    after: int = 3
    window: float = 3600.0


@dataclass(frozen=True)
class Rollback:
    """A rollback past a loss anomaly (actions/rollback.py): where it resumes,
    which steps' data it skips, and how often one anomaly may widen it."""

    # Resume from the newest good checkpoint more than this many steps before the
    # skip window. 1: the checkpoint of the step just before the onset holds the
    # weights that produced the first anomalous loss (a blown-up update ruins them
    # a step before the loss shows it); PaLM went back about 100 steps.
    before: int = 1
    # The first window: from skip_before steps before the onset to skip_after
    # steps after the last anomalous step seen (PaLM skipped 200-500 batches).
    skip_before: int = 0
    skip_after: int = 0
    # The anomaly back in (or beside) the window: the window doubles, at most this
    # many times. One anomaly's rollbacks spend one restart of the budget.
    max_widenings: int = 3


@dataclass(frozen=True)
class Policy:
    name: str = "default"
    max_restarts: int = 10
    window: float = 86400.0
    backoff: Backoff = field(default_factory=Backoff)
    kill_grace: float = 30.0
    actions: Mapping[FaultKind, Action] = field(default_factory=lambda: dict(DEFAULT_ACTIONS))
    # Per Xid (an int) or per class (an xid.Immediate name such as "RESET_GPU").
    xid_actions: Mapping[int | str, Action] = field(default_factory=dict)
    escalate: Escalate = field(default_factory=Escalate)
    exec: tuple[str, ...] = ()  # the operator hook: {job}, {gpu}, {kind} are filled in
    rollback: Rollback = field(default_factory=Rollback)

    def action_for(self, kind: FaultKind) -> Action:
        return self.actions.get(kind, Action.ALERT)


@dataclass(frozen=True)
class Learned:
    """Learned hang timeout: factor x p99 of observed step intervals, at least floor."""

    factor: float = 5.0
    floor: float = 60.0
    min_samples: int = 20


@dataclass(frozen=True)
class Heartbeat:
    timeout: float = 300.0
    startup_timeout: float | None = None  # None: armed by the first beat only
    learned: Learned | None = None
    # The job declared that it beats: only then may silence from the start count.
    required: bool = False
    ranks: int | None = None  # the declared world size; None: not declared

    @property
    def max_ranks(self) -> int:
        """How many distinct ranks of one attempt are believed; the rest are refused."""
        return self.ranks if self.ranks is not None else DEFAULT_MAX_RANKS


@dataclass(frozen=True)
class Checkpoints:
    dir: str | None = None
    layout: str = "auto"  # the framework recognised, else the pattern (learned from reports)
    pattern: str = "step_{step}"
    marker: str | None = None  # a file whose presence inside (or beside) means complete
    quiet_for: float | None = None  # unchanged this long means complete; None: off
    bad_after: int = 3  # deaths before the first beat that mark a checkpoint bad
    keep: Keep = field(default_factory=Keep)  # retention; unset: nothing is ever deleted
    verify: bool = True  # a manifest per checkpoint, checked before a relaunch resumes from it
    verify_timeout: float = 60.0  # a relaunch waits at most this long for the check
    # A remote snapshot store (layout trainwatch): with no good local checkpoint, a
    # launch pulls the newest snapshot from it first (actions/pull.py).
    remote: str | None = None
    # A pull that failed (or a remote that could not be listed) with nothing good on
    # local disk: "stop" (the job goes fatal, loudly: a fresh run would upload over
    # the remote's snapshots, two runs mixed in one prefix) or "retire" (the
    # remote's manifests renamed *.json.retired first, then a fresh start).
    on_pull_failure: str = "stop"


@dataclass(frozen=True)
class Anomalies:
    """A job's loss and grad-norm watch (detectors/loss.py); what a rollback past
    an anomaly does is its policy's (Policy.rollback)."""

    detect: LossSettings = field(default_factory=LossSettings)


@dataclass(frozen=True)
class Logs:
    """The job's output matched against log rules (detectors/logrules.py)."""

    builtin: bool = True  # the rules for what PyTorch, NCCL, CUDA and torchrun print
    rules: tuple[LogRule, ...] = ()  # the job's own, after the built-in ones


@dataclass(frozen=True)
class Evidence:
    """What is kept of a faulted attempt before it is killed (actions/evidence.py)."""

    kinds: frozenset[FaultKind] = frozenset({FaultKind.NCCL_STALL, FaultKind.HANG})
    timeout: float = 5.0  # the kill waits at most this long for it
    native: bool = False  # py-spy --native: C/C++ frames too (slower)
    log_lines: int = 50  # of the job's output, per rank where its lines say which
    flight_recorder: bool = False  # set PyTorch's flight recorder up in the job's environment


@dataclass(frozen=True)
class Job:
    name: str
    command: tuple[str, ...]
    workdir: str | None = None
    user: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    # Variables of the daemon's environment a daemon job gets too (it starts from
    # a clean one: actions/jobenv.py); `env` wins.
    env_passthrough: tuple[str, ...] = ()
    resume_args: tuple[str, ...] = ()
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    policy: str = "default"
    gpus: Gpus = field(default_factory=lambda: Gpus())
    group: str | None = None  # the job's primary group; None: the user's own
    # The job spans hosts (torchrun's --nnodes MIN:MAX; config/torchrun.py); None:
    # this host only. Not `group`, which is the Unix group above.
    nodes: tuple[int, int] | None = None
    anomalies: Anomalies = field(default_factory=Anomalies)
    logs: Logs = field(default_factory=Logs)
    stall: StallSettings = field(default_factory=StallSettings)
    evidence: Evidence = field(default_factory=Evidence)
    slurm: int | None = None  # the Slurm job id of a job attached to, never launched


@dataclass(frozen=True)
class SlurmWatch:
    """The ``slurm:`` section (config/slurmwatch.py)."""

    node: str  # Slurm's name for this node
    job: Job  # the template of every attached job
    conf: str | None = None  # SLURM_CONF for scontrol; None: Slurm's own default
    timeout: float = 15.0  # seconds for each Slurm command
    forget_after: float = 600.0  # an attached job that ended is dropped this long after


@dataclass(frozen=True)
class Gpus:
    """The GPUs a job runs on (NVML indices; None: every GPU of the host), and the
    fewest it can run on after restart_exclude_gpu takes one away."""

    devices: tuple[int, ...] | None = None
    min: int = 1
    # A host of a multi-host job that lost GPUs below min runs a pre-flight of
    # them this often while it is out of the group (multihost/leave.py).
    preflight_every: float = 10.0


@dataclass(frozen=True)
class Metrics:
    address: str = "127.0.0.1"  # 0.0.0.0 only when Prometheus scrapes from another host
    port: int = 9445


@dataclass(frozen=True)
class Gpu:
    backend: str = "auto"
    count: int = 0  # sim: how many GPUs to simulate
    poll_interval: float = 1.0
    kmsg: str | None = "/dev/kmsg"  # the kernel log read for Xids; null: off
    thermal_sustain: float = 30.0
    recheck_after: float | None = 3600.0  # excluded GPUs fault-free this long return; None: never


@dataclass(frozen=True)
class Config:
    state_dir: str
    run_dir: str
    jobs: tuple[Job, ...]
    policies: Mapping[str, Policy]
    metrics: Metrics = field(default_factory=Metrics)
    gpu: Gpu = field(default_factory=Gpu)
    observe_only: bool = False
    removed_jobs: str = "keep"  # a reload: keep running unwatched, or stop
    # Its members act on every job over the control socket: privsep/access.py's GROUP
    # by default (not imported: the config sits below the host).
    admin_group: str = "trainwatch"
    source: str = "<defaults>"
    # This host's name in incidents and group records (`host:`, or --host for tests
    # that run several "hosts" on one machine).
    host: str = field(default_factory=socket.gethostname)
    slurm: SlurmWatch | None = None  # watch the Slurm jobs that attach (slurm/attach.py)

    def policy_for(self, job: Job) -> Policy:
        return self.policies[job.policy]

    def job(self, name: str | None) -> Job:
        if name is None:
            if not self.jobs:
                raise ConfigError(f"{self.source}: jobs: no job to run (the list is empty)")
            if len(self.jobs) != 1:
                names = ", ".join(j.name for j in self.jobs)
                raise ConfigError(f"{self.source}: jobs: expected one job or --name, got {names}")
            return self.jobs[0]
        for j in self.jobs:
            if j.name == name:
                return j
        raise ConfigError(f"{self.source}: jobs: no job named {show(name)}")


def default_dirs() -> tuple[str, str]:
    """(state_dir, run_dir): the system paths for root, per-user ones otherwise."""
    if os.geteuid() == 0:
        return "/var/lib/trainwatch", "/run/trainwatch"
    home = Path.home()
    state = os.environ.get("XDG_STATE_HOME") or str(home / ".local" / "state")
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/trainwatch-{os.getuid()}"
    return f"{state}/trainwatch", f"{runtime}/trainwatch"

def socket_room(run_dir: str, job: str) -> int | None:
    """None when the job's socket fits sun_path; else the longest run_dir that would."""
    over = len(os.fsencode(socket_path(run_dir, job))) - MAX_SOCKET_PATH
    return None if over <= 0 else len(os.fsencode(run_dir)) - over


def socket_problem(run_dir: str, job: str) -> str | None:
    """Why run_dir cannot hold this job's socket ("expected ..., got ..."), or None."""
    most = socket_room(run_dir, job)
    if most is None:
        return None
    return (f"expected a path of at most {most} bytes, so that job {job}'s socket"
            f" jobs/{job}.sock fits an AF_UNIX address ({MAX_SOCKET_PATH} bytes), got"
            f" {len(os.fsencode(run_dir))} bytes: {show(run_dir, 300)}")

def check_socket_paths(source: str, run_dir: str, jobs: tuple[Job, ...]) -> None:
    """Each job's socket, run_dir/jobs/<name>.sock, must fit in sockaddr_un.sun_path."""
    for j in jobs:
        problem = socket_problem(run_dir, j.name)
        if problem is not None:
            raise ConfigError(f"{source}: run_dir: {problem}")


def socket_path(run_dir: str, job: str) -> str:
    """A job's heartbeat socket. In a folder of their own, so that no job's name
    (``control``, say) can take the place of trainwatch's control socket."""
    return os.path.join(run_dir, "jobs", f"{job}.sock")


def with_job(config: Config, job: Job) -> Config:
    """The config with its jobs replaced by this one (for `trainwatch run`)."""
    return replace(config, jobs=(job,))
