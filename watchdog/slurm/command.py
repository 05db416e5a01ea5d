"""Running one Slurm command: an argv list (never a shell), a deadline (a hung
slurmctld must not hang the daemon), an environment built from ``Slurm`` alone
(SLURM_CONF, PATH: none of the daemon's own SLURM_* or *_FORMAT variables,
which change what Slurm's commands print), stdout and stderr captured, and the
exit judged into a ``Result`` (``judge``, pure)."""

from __future__ import annotations

import contextlib
import enum
import os
import re
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from trainwatch.config.schema import SlurmWatch

T = TypeVar("T")

TIMEOUT = 15.0  # seconds; scontrol itself gives up on a dead slurmctld after ~10 s
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MESSAGE_CHARS = 300  # of Slurm's message line kept in a Result

# Slurm's answers that mean "no" to the request itself (slurm_errno.c strings and
# scontrol's own lines): the same request again gets the same answer. Anything
# else that exits non-zero (no controller, a timeout, munge down) is a failure.
REFUSALS = tuple(re.compile(p) for p in (
    r"Access/permission denied",
    r"Invalid job id specified",
    r"Invalid node name specified",
    r"Invalid node state specified",
    r"Invalid job array specification",
    r"Job is pending execution",  # requeue of a pending job
    r"Job is no longer pending execution",  # StartTime=now of a running job
    r"Job is not pending nor running",
    r"Job/step already completing or completed",
    r"Requested operation is presently disabled",  # requeue of a --no-requeue job
    r"Only batch jobs are accepted or processed",  # requeue of an srun/salloc job
    r"Requested operation not supported on this system",
    r"Job is current suspended, requested operation disabled",
    r"Operation not permitted on individual component of heterogeneous job",
    r"^Node \S+ not found$",  # scontrol show node
    r"does not exist on node",  # scontrol listpids: no step of the job there
))


# The answer to a Slurm rank's attach where no Slurm jobs are watched.
NO_SLURM = "this trainwatch watches no Slurm jobs (its config has no slurm: section)"

class Outcome(enum.Enum):
    OK = "ok"
    REFUSED = "refused"
    FAILED = "failed"


@dataclass(frozen=True)
class Result(Generic[T]):
    """What one request through Slurm came to.

    - ok: settled: what was asked was done, or trainwatch's rule says to do
      nothing (a drain that is not ours is left as it is); ``value`` holds what
      a query read.
    - refused: it cannot be done: Slurm said no (``message`` is Slurm's line),
      or an input was invalid and nothing ran. The same request again gets the
      same answer.
    - failed: no usable answer (no controller, the deadline passed, output that
      could not be read). What was sent may still take effect: a slurmctld that
      was stopped acts on a request it received after the client gave up.

    ``done`` names the steps that took effect, in order (``("requeue", "start")``).
    """

    outcome: Outcome
    message: str = ""
    done: tuple[str, ...] = ()
    value: T | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


@dataclass(frozen=True)
class Slurm:
    """How to reach Slurm: its config file, a deadline for each command, and
    where its commands are."""

    conf: str | None = None  # SLURM_CONF; None: Slurm's default (or configless)
    timeout: float = TIMEOUT  # seconds for each command
    path: str = PATH  # PATH to find scontrol and sinfo on
    env: Mapping[str, str] = field(default_factory=dict)  # more variables, if a site needs them

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"Slurm.timeout must be a positive number of seconds, "
                             f"got {self.timeout!r}")

    def environ(self) -> dict[str, str]:
        """The whole environment of a Slurm command."""
        env = {"PATH": self.path, "LC_ALL": "C", **self.env}
        if self.conf is not None:
            env["SLURM_CONF"] = self.conf
        return env


def for_settings(s: SlurmWatch) -> Slurm:
    """How the daemon runs Slurm's commands for its ``slurm:`` settings."""
    return Slurm(conf=s.conf, timeout=s.timeout)


def message_line(stdout: str, stderr: str) -> str:
    """Slurm's own message: the last non-blank line of stderr, else of stdout
    (``scontrol show node`` says "Node x not found" on stdout), capped."""
    for text in (stderr, stdout):
        lines = [x.strip() for x in text.splitlines() if x.strip()]
        if lines:
            return lines[-1][:MESSAGE_CHARS]
    return ""


def judge(command: str, returncode: int, stdout: str, stderr: str) -> Result[str]:
    """A finished command's Result: ok with its stdout, or refused/failed with
    Slurm's message line."""
    if returncode == 0:
        return Result(Outcome.OK, value=stdout)
    if returncode < 0:
        return Result(Outcome.FAILED, f"{command} was killed by signal {-returncode}")
    line = message_line(stdout, stderr)
    if not line:
        return Result(Outcome.FAILED, f"{command} exited {returncode} without a message")
    refused = any(p.search(line) for p in REFUSALS)
    return Result(Outcome.REFUSED if refused else Outcome.FAILED, line)


def run(slurm: Slurm, argv: Sequence[str]) -> Result[str]:
    """Run one Slurm command (``argv[0]`` is looked up on ``slurm.path``) and judge
    its exit; past ``slurm.timeout`` it is killed (its process group) and failed."""
    argv = list(argv)
    command = argv[0]
    try:
        proc = subprocess.Popen(argv, env=slurm.environ(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    except OSError as e:
        return Result(Outcome.FAILED, f"{command} cannot be run: {e.strerror or e}")
    with proc:
        try:
            out, err = proc.communicate(timeout=slurm.timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Result(Outcome.FAILED,
                          f"{command} had no answer within {slurm.timeout:g}s (killed); "
                          "what it sent may still take effect")
    return judge(command, proc.returncode, out.decode(errors="replace"),
                 err.decode(errors="replace"))
