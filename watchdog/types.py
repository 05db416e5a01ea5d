"""The vocabulary every other module speaks: states, fault kinds, actions,
observations, faults and decisions.

This module imports nothing outside the standard library and nothing of
trainwatch, so it sits at the root of the import graph (as Supervisor's
``states.py`` does).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class JobState(str, enum.Enum):
    STARTING = "starting"  # launched, no heartbeat yet
    RUNNING = "running"
    STOPPING = "stopping"  # the tree is being killed (or reaped after the leader exited)
    BACKOFF = "backoff"  # waiting before a relaunch
    EXITED = "exited"  # finished with code 0
    FATAL = "fatal"  # budget spent or unrecoverable; trainwatch gave up
    PAUSED = "paused"  # stopped by the operator; not relaunched until resumed


# Every allowed transition. Anything else is a bug and raises (Supervisor's
# process.py asserts the same way).
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # STARTING again without a launch: a multi-host job's agent restarts its workers
    # in the group's new round (multihost/group.py).
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.STOPPING, JobState.STARTING}),
    JobState.RUNNING: frozenset({JobState.STOPPING, JobState.STARTING}),
    JobState.STOPPING: frozenset(
        {JobState.BACKOFF, JobState.EXITED, JobState.FATAL, JobState.PAUSED}
    ),
    JobState.BACKOFF: frozenset({JobState.STARTING, JobState.FATAL, JobState.PAUSED}),
    # An ended job is started again only by an operator (`trainwatch start`).
    JobState.EXITED: frozenset({JobState.STARTING}),
    JobState.FATAL: frozenset({JobState.STARTING}),
    JobState.PAUSED: frozenset({JobState.STARTING}),
}

TERMINAL = frozenset({JobState.EXITED, JobState.FATAL, JobState.PAUSED})


class FaultKind(str, enum.Enum):
    CRASH = "crash"
    HANG = "hang"
    NCCL_STALL = "nccl_stall"
    GPU_XID = "gpu_xid"
    GPU_ECC = "gpu_ecc"
    GPU_LOST = "gpu_lost"
    GPU_THERMAL = "gpu_thermal"
    NAN_LOSS = "nan_loss"
    LOSS_SPIKE = "loss_spike"
    GRAD_NORM_OUTLIER = "grad_norm_outlier"
    DIVERGENCE = "divergence"
    OOM = "oom"
    LOG_PATTERN = "log_pattern"


# Fault kinds some detector of this release raises. The config refuses an action
# for any other kind: it would promise a response to a fault nothing ever reports.
DETECTED_KINDS = frozenset(
    {FaultKind.CRASH, FaultKind.HANG, FaultKind.GPU_XID, FaultKind.GPU_ECC,
     FaultKind.GPU_LOST, FaultKind.GPU_THERMAL, FaultKind.NAN_LOSS, FaultKind.LOSS_SPIKE,
     FaultKind.GRAD_NORM_OUTLIER, FaultKind.DIVERGENCE, FaultKind.OOM, FaultKind.LOG_PATTERN,
     FaultKind.NCCL_STALL}
)


class Action(str, enum.Enum):
    ALERT = "alert"  # record and export only
    RESTART = "restart"  # kill, relaunch from the last good checkpoint
    ROLLBACK = "rollback"  # kill, relaunch from a checkpoint strictly before the onset
    RESTART_EXCLUDE_GPU = "restart_exclude_gpu"
    EXEC = "exec"  # run an operator command
    STOP = "stop"  # kill and do not relaunch


# Actions this release can carry out; the rest are accepted by name in DESIGN
# but arrive with later sources (loss) and are refused by the config check.
IMPLEMENTED_ACTIONS = frozenset(
    {Action.ALERT, Action.RESTART, Action.ROLLBACK, Action.STOP, Action.RESTART_EXCLUDE_GPU,
     Action.EXEC}
)


# --- observations (sources -> detectors) -------------------------------------


class Beat(NamedTuple):
    """One heartbeat from one rank, as received (a tuple: hundreds a second are made)."""

    rank: int
    step: int
    at: float  # monotonic receive time
    pid: int
    loss: float | None = None
    grad_norm: float | None = None


@dataclass(frozen=True)
class CheckpointReport:
    """The job said: the checkpoint at ``path`` for ``step`` is complete."""

    step: int
    path: str
    rank: int
    at: float


# How a job's data order relates to its step (DataOrder.order): "step", the batch
# of step k is a function of k wherever the run resumes (a stateful loader, HF's
# Trainer replaying its seeded sampler); "epoch-seeded", the order within an epoch
# is fixed but a resume restarts the epoch (exact only from an epoch boundary);
# "unknown", not known to be a function of the step (an unseeded shuffle).
DATA_ORDERS = ("step", "epoch-seeded", "unknown")


@dataclass(frozen=True)
class DataOrder:
    """The job said how its data order follows its step (once per process)."""

    order: str  # one of DATA_ORDERS
    why: str  # what the job's side found, in a line
    epoch_steps: int | None  # optimizer steps per epoch, when known
    step: int  # the step the process starts from
    rank: int
    at: float


@dataclass(frozen=True)
class ProcessExit:
    """The job's leader process ended."""

    pid: int
    returncode: int  # negative: killed by that signal (subprocess convention)
    at: float  # monotonic time the exit was observed


@dataclass(frozen=True)
class RankView:
    """What the hang detector needs to know about one rank."""

    rank: int
    last_beat: float  # monotonic
    step: int
    beats: int  # beats received from it this attempt (one alone never decides a hang)
    advanced_at: float = 0.0  # monotonic: when its step last went up (its first beat's time)


@dataclass(frozen=True)
class HeartbeatSnapshot:
    """The heartbeat state of one attempt at one instant."""

    now: float
    attempt_started: float
    ranks: tuple[RankView, ...]
    intervals_p99: float | None  # learned step interval, None until enough samples
    # Ranks whose process is stopped ('T') or in uninterruptible sleep ('D'),
    # filled in only when a hang is about to be reported: it names the hung
    # rank among several that went quiet together.
    stopped: frozenset[int] = frozenset()


@dataclass(frozen=True)
class XidEvent:
    """One Xid report, from whichever path saw it (NVML event, kernel log, poll, drill)."""

    xid: int
    at: float  # monotonic time it was seen
    source: str  # "nvml_event" | "kmsg" | "nvml_poll" | "drill"
    gpu: int | None = None  # NVML index; None when the PCI address maps to no known GPU
    pci: str | None = None  # bus id as NVML spells it, e.g. "00000000:06:00.0"
    uuid: str | None = None
    message: str = ""  # the driver's text after the Xid number, if any
    pid: int | None = None
    injected: bool = False


@dataclass(frozen=True)
class GpuSample:
    """One poll of one GPU. None: not supported on this GPU or driver (never 'healthy')."""

    index: int
    at: float  # monotonic
    uuid: str | None = None
    name: str | None = None
    pci: str | None = None
    temperature_c: float | None = None
    slowdown_temp_c: float | None = None  # the driver's slowdown threshold
    power_w: float | None = None
    utilization_ratio: float | None = None  # 0..1
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    clock_event_reasons: int | None = None  # nvmlClocksEventReason* bitmask
    ecc_volatile_corrected: int | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    retired_pages_pending: bool | None = None  # pre-Ampere page retirement
    pcie_replay_total: int | None = None
    nvlink_errors: tuple[tuple[str, int], ...] = ()  # (counter name, sum over links)
    recovery_action: int | None = None  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION value
    lost: str | None = None  # "gpu_is_lost" | "reset_required": the poll could not read it


# --- faults and decisions -----------------------------------------------------


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    job: str
    onset: float  # monotonic time the fault began (exit time, last beat + timeout, ...)
    evidence: dict[str, Any] = field(default_factory=dict)
    rank: int | None = None
    gpu: int | None = None
    onset_step: int | None = None
    # False when nothing tells when the fault began (a crash: the kernel reports
    # that a process died, not when): its detection latency is unknown, not 0.
    onset_known: bool = True


@dataclass(frozen=True)
class Finding:
    """What a watcher found, for the lifecycle to act on (respond.py): a fault and
    the action its rule names (None: the policy's for its kind)."""
    fault: Fault
    action: Action | None = None


@dataclass(frozen=True)
class Finished:
    """A watcher's word that the job ended well (a clean exit)."""
    why: str


@dataclass(frozen=True)
class Decision:
    action: Action
    delay: float = 0.0  # seconds of backoff before the relaunch
    fatal: bool = False  # the budget is spent: give up
    reason: str = ""
