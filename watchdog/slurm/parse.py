"""Pure functions of the Slurm package (no I/O): the checks of what goes into a
Slurm command, the parsers of what comes out, and the rules the actions follow.

A parser never raises on what a command printed: garbage, a changed format or
a field that a user's job name imitates gives ``Parsed(None, why)``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")

MAX_JOB = 0xFFFFFFFD  # job ids are uint32; 0xFFFFFFFE and 0xFFFFFFFF are NO_VAL, INFINITE
MAX_UID = 0xFFFFFFFE  # uid_t is uint32; (uid_t)-1 is no user
# A node name, one of them: no hostlist (n[1-2]), no list (n1,n2), no option (-x).
NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# `scontrol update NodeName=ALL` (any case) acts on every node of the cluster.
ALL_NODES = "all"
REASON_PREFIX = "trainwatch: "
OURS = "trainwatch:"  # a drain whose reason starts so is trainwatch's (NHC's `NHC:` rule)
MAX_REASON = 200  # characters of a drain reason, prefix included
# After `scontrol requeue`, a start is sent this long after the requeue's second
# ended: slurmd refuses a credential made in the second it revoked the job's old
# one, and the job then ends FAILED ("Job credential revoked").
START_MARGIN = 0.1
LISTPIDS_HEADER = ["PID", "JOBID", "STEPID", "LOCALID", "GLOBALID"]
_INT = re.compile(r"[0-9]{1,10}")
_STEP = re.compile(r"[A-Za-z0-9_+]{1,32}")  # 0, batch, extern, interactive, 0+1
_STATE = re.compile(r"[a-z_]{1,32}")
_EXIT = re.compile(r"([0-9]{1,3}):([0-9]{1,3})")
MAX_STATUS = 255  # an exit status is 8 bits (WEXITSTATUS)
MAX_SIGNAL = 127  # a signal number is 7 bits (WTERMSIG)
OUT_OF_SERVICE = frozenset({"drain", "down", "fail"})
# JobStates of a requeued job on its way back to PENDING (scontrol shows a flag
# such as COMPLETING in place of the base state).
SETTLING = frozenset({"COMPLETING", "REQUEUED", "SIGNALING", "STAGE_OUT"})


@dataclass(frozen=True)
class Parsed(Generic[T]):
    """A parser's answer: the value, or None and why not."""

    value: T | None
    why: str = ""


@dataclass(frozen=True)
class ListedPid:
    """One row of ``scontrol listpids``: a process a slurmstepd on this node
    tracks for the job. ``step`` is a step number, or ``batch`` (the batch
    script, ranked 0/0, and what it starts outside srun, ranked -/-) or
    ``extern``; a rank's global id means something only in a numbered step."""

    pid: int
    job: int
    step: str
    local_id: int | None
    global_id: int | None


class ExitCode(NamedTuple):
    """A job's ``ExitCode=A:B``: the exit status A of its batch script (of salloc or
    srun, for a job that has none), or the signal B that ended it; Slurm 22.05
    sets at most one of them. A job that has not ended reads ``0:0``."""

    status: int  # 0..MAX_STATUS
    signal: int  # 0..MAX_SIGNAL

    @property
    def returncode(self) -> int:
        """As subprocess says it: the status, or minus the signal."""
        return -self.signal if self.signal else self.status


@dataclass(frozen=True)
class JobInfo:
    """What trainwatch reads of a job from ``scontrol show job -o``."""

    job: int
    state: str  # JobState: RUNNING, PENDING, COMPLETED, ...
    restarts: int  # Restarts: requeues so far (SLURM_RESTART_COUNT of its next run)
    # ExitCode; None when it is missing, odd or seen twice (a forged one is never
    # believed), which leaves the rest believed: nothing is proven by it.
    exit_code: ExitCode | None = None


@dataclass(frozen=True)
class NodeInfo:
    """A node's state (sinfo's StateComplete: ``idle+drain``) and drain reason
    ("" when there is none)."""

    node: str
    state: str
    reason: str

    @property
    def flags(self) -> frozenset[str]:
        return frozenset(self.state.split("+"))

    @property
    def drained(self) -> bool:
        """Drained or draining (DRAIN, with the job on it still running or not)."""
        return "drain" in self.flags

    @property
    def ours(self) -> bool:
        return self.reason.startswith(OURS)


# --- what goes in ---

def bad_job(job: object) -> str | None:
    """Why `job` is not a job id to act on; None when it is one."""
    if isinstance(job, bool) or not isinstance(job, int):
        return f"a job id is a positive int, got {job!r}"
    if not 0 < job <= MAX_JOB:
        return f"a job id is between 1 and {MAX_JOB}, got {job}"
    return None


def bad_node(node: object) -> str | None:
    """Why `node` is not one node's name; None when it is one."""
    if not isinstance(node, str) or not NODE.fullmatch(node):
        return (f"a node name is 1 to 64 letters, digits, '_', '.' or '-', not first, "
                f"got {node!r:.80}")
    if node.lower() == ALL_NODES:
        return f"{node!r} names every node of the cluster, not one"
    return None


def bad_delay(delay: object) -> str | None:
    """Why `delay` is not a number of seconds to wait; None when it is one."""
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) \
            or not math.isfinite(delay) or delay < 0:
        return f"a delay is a number of seconds >= 0, got {delay!r}"
    return None


def drain_reason(why: str) -> str:
    """The reason a drain by trainwatch carries: ``trainwatch: `` and `why` on one
    line of printable characters, with no double quote (scontrol strips one at
    the end), at most MAX_REASON characters."""
    text = "".join(c if c.isprintable() else " " for c in why).replace('"', "'")
    text = " ".join(text.split())
    text = text.removeprefix(OURS).strip() or "no reason given"
    reason = REASON_PREFIX + text
    if len(reason) > MAX_REASON:
        reason = reason[:MAX_REASON - 3].rstrip() + "..."
    return reason


# --- what comes out ---

def _listed_id(col: str) -> int | None:
    return None if col == "-" else int(col)


def parse_listpids(text: str, job: int) -> Parsed[tuple[ListedPid, ...]]:
    """``scontrol listpids <job> <node>``: the header, then one row per process."""
    lines = [x.split() for x in text.splitlines() if x.strip()]
    if not lines or lines[0] != LISTPIDS_HEADER:
        first = " ".join(lines[0]) if lines else ""
        return Parsed(None, f"no listpids header ({' '.join(LISTPIDS_HEADER)}): {first!r:.80}")
    rows = []
    for cols in lines[1:]:
        ok = (len(cols) == 5 and all(_INT.fullmatch(c) for c in cols[:2])
              and _STEP.fullmatch(cols[2])
              and all(c == "-" or _INT.fullmatch(c) for c in cols[3:]))
        if not ok or int(cols[0]) == 0:
            return Parsed(None, f"unexpected listpids row {' '.join(cols)!r:.80}")
        row = ListedPid(int(cols[0]), int(cols[1]), cols[2],
                        _listed_id(cols[3]), _listed_id(cols[4]))
        if row.job != job:
            return Parsed(None, f"listpids of job {job} listed job {row.job}")
        rows.append(row)
    return Parsed(tuple(rows))


def _field(line: str, key: str) -> Parsed[str]:
    """The one value of ``key=`` in a ``show -o`` line. Values may hold spaces and a
    job's name may hold ``Key=``: a key seen twice is not believed."""
    found = re.findall(rf"(?:^|\s){re.escape(key)}=(\S*)", line)
    if len(found) != 1:
        return Parsed(None, f"{key}= appears {len(found)} times")
    return Parsed(found[0])


def _job_line(text: str, job: int) -> Parsed[str]:
    """The one line of ``scontrol show job -o`` that is the job's: the output must be
    that one line. A job name with a line break (its owner may set one at any time,
    ``scontrol update JobName=``) puts every field after it on lines of their own,
    where a forged ``JobState=``/``Restarts=``/``UserId=`` in the name would stand
    first; an array job prints a line per task. Both give nothing."""
    lines = [x for x in text.splitlines() if x.strip()]
    if len(lines) != 1 or not re.match(rf"JobId={job}(\s|$)", lines[0]):
        return Parsed(None, f"{len(lines)} lines, not the one line of job {job} (a field "
                      "with a line break, or an array job)")
    return Parsed(lines[0])


def parse_exit_code(value: str) -> ExitCode | None:
    """``ExitCode=``'s value, ``A:B``: None unless both are numbers in range."""
    m = _EXIT.fullmatch(value)
    if m is None:
        return None
    status, signal = int(m.group(1)), int(m.group(2))
    return ExitCode(status, signal) if status <= MAX_STATUS and signal <= MAX_SIGNAL else None


def parse_job(text: str, job: int) -> Parsed[JobInfo]:
    """``scontrol show job -o <job>``: its state, restart count and exit code."""
    line = _job_line(text, job)
    if line.value is None:
        return Parsed(None, line.why)
    state, restarts = _field(line.value, "JobState"), _field(line.value, "Restarts")
    if state.value is None or restarts.value is None:
        return Parsed(None, state.why or restarts.why)
    if not re.fullmatch(r"[A-Z_]{1,32}", state.value):
        return Parsed(None, f"unexpected JobState={state.value!r:.40}")
    if not _INT.fullmatch(restarts.value):
        return Parsed(None, f"unexpected Restarts={restarts.value!r:.40}")
    code = _field(line.value, "ExitCode").value
    return Parsed(JobInfo(job, state.value, int(restarts.value),
                          None if code is None else parse_exit_code(code)))


def parse_owner(text: str, job: int) -> Parsed[int]:
    """``scontrol show job -o <job>``: the uid of the job's owner, from
    ``UserId=alice(1000)`` (a uid Slurm cannot name reads ``nobody(1234)``: the
    number, last, is what counts). Guarded as parse_job is: a second
    ``UserId=`` (a job name, comment or path that holds one) gives nothing."""
    line = _job_line(text, job)
    if line.value is None:
        return Parsed(None, line.why)
    user = _field(line.value, "UserId")
    if user.value is None:
        return Parsed(None, user.why)
    m = re.fullmatch(r"\S*\(([0-9]{1,10})\)", user.value)
    if m is None or int(m.group(1)) > MAX_UID:
        return Parsed(None, f"unexpected UserId={user.value!r:.60}")
    return Parsed(int(m.group(1)))


def parse_job_owner(text: str, job: int) -> Parsed[tuple[JobInfo, int]]:
    """``scontrol show job -o <job>``: parse_job and parse_owner of one answer."""
    info, owner = parse_job(text, job), parse_owner(text, job)
    if info.value is None or owner.value is None:
        return Parsed(None, info.why or owner.why)
    return Parsed((info.value, owner.value))


def parse_node(text: str, node: str) -> Parsed[NodeInfo]:
    """``sinfo -N -n <node> -O NodeList:|,StateComplete:|,Reason:``: one line per
    partition the node is in, ``n2|idle+drain|the reason`` (the free-text reason
    last, so a ``|`` in it stays in it; sinfo says "none" for no reason)."""
    lines = [x for x in text.splitlines() if x.startswith(f"{node}|")]
    if not lines:
        return Parsed(None, f"no line for node {node}: {text.strip()!r:.80}")
    parts = lines[0].split("|", 2)
    if len(parts) != 3:
        return Parsed(None, f"unexpected sinfo line {lines[0]!r:.80}")
    state = parts[1].strip().lower().rstrip("*~#!%$@^-")
    if not all(_STATE.fullmatch(f) for f in state.split("+")):
        return Parsed(None, f"unexpected node state {parts[1]!r:.40}")
    reason = parts[2].strip()
    return Parsed(NodeInfo(node, state, "" if reason == "none" else reason))


# --- rules ---

def start_not_before(requeued_at: float, delay: float) -> float:
    """When (wall clock, seconds) a job requeued at `requeued_at` may be started:
    after `delay`, and never in the whole second of the requeue."""
    return max(math.floor(requeued_at) + 1 + START_MARGIN, requeued_at + delay)


def after_requeue(state: str) -> str:
    """What a requeued job's JobState says to do: "wait" while it completes (a
    start sent then is undone: when it has completed, Slurm sets its BeginTime to
    now + cred_expire + 1 s), "start" once it is PENDING, "leave" otherwise (it
    runs again already, is held, or has ended)."""
    if state in SETTLING:
        return "wait"
    return "start" if state == "PENDING" else "leave"


def judge_resume(info: NodeInfo) -> tuple[bool, str]:
    """Whether trainwatch may resume the node, and why: only a drain whose reason
    is still trainwatch's (an operator's drain, or one with no reason, is never
    undone)."""
    if not info.drained:
        return False, f"{info.node} is not drained ({info.state}): nothing to resume"
    if not info.reason:
        return False, f"{info.node} is drained with no reason: not trainwatch's, left drained"
    if not info.ours:
        return False, (f"{info.node} is drained by someone else (reason {info.reason!r:.120}): "
                       "left drained")
    return True, f"{info.node} was drained by trainwatch (reason {info.reason!r:.120})"


def judge_drain(info: NodeInfo) -> tuple[bool, str]:
    """Whether trainwatch may drain the node, and why: not over another's mark (a
    node already drained, down or failed, with a reason that is not trainwatch's
    or none, keeps it, so that resume_if_ours can never undo it; NHC's rule)."""
    if info.flags & OUT_OF_SERVICE and not info.ours:
        return False, (f"{info.node} is already out of service ({info.state}, reason "
                       f"{info.reason or 'none'!r:.120}): left as it is")
    return True, f"{info.node} is {info.state}"
