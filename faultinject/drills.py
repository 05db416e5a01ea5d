"""The drills themselves, as functions (the CLI and the demo call these).

A job's processes are found through its published status in ``state_dir``
(``jobs/<job>/status.json``): the leader's pid, its process group, and the pid
of every rank that has beaten; a rank that has not is found by the ``RANK`` in
its process's environment (ranks.py). None is signalled unless a trainwatch holds the
job's lock and the process is proven the job's through a pidfd (identity.py).

GPU drills reach the running trainwatch over its control socket in ``run_dir``
(``trainwatch.host.control``), which hands them to the GPU source to be handled like
a real fault; loss drills (``nan``, ``grad-spike``) likewise, to the job's
loss detectors as observations marked injected. The kernel-log drill instead
appends a real-format ``NVRM: Xid`` line to a text file that trainwatch tails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import time
from dataclasses import dataclass
from typing import Any

import psutil
from trainwatch.actions import cgroup
from trainwatch.detectors.xid import classify
from trainwatch.export import status as jobstatus
from trainwatch.host import control
from trainwatch.sources.kmsgparse import normalise_pci, parse_line

from faultinject import identity, ranks


class DrillError(Exception):
    """The drill cannot be carried out: one line for the user."""


def job_status(state_dir: str, job: str) -> dict[str, Any]:
    """The job's status, refused when no trainwatch supervises the job now (the
    status of one that was SIGKILLed names pids that may be strangers' now)."""
    s = jobstatus.read(state_dir, job)
    if s is None:
        raise DrillError(f"{jobstatus.status_path(state_dir, job)}: no status for job {job!r}"
                         " (is trainwatch supervising it, with this --state-dir?)")
    if identity.supervised(state_dir, job) is False:
        raise DrillError(f"job {job} is not supervised (no trainwatch holds its lock)")
    if s.get("state") not in ("starting", "running") or not s.get("pid"):
        raise DrillError(f"job {job!r} is {s.get('state')}, not running")
    return s


def _open(owner: identity.Owner, pid: int) -> int:
    """A pidfd on pid, once it is proven the job's (see identity.py)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise DrillError(f"process {pid} is gone") from None
    except OSError as e:
        raise DrillError(f"process {pid}: cannot open a pidfd ({e.strerror}), so it cannot be "
                         "proven the job's; not signalled") from None
    why = owner.why_not(pid)
    if why is not None:
        os.close(fd)
        raise DrillError(f"process {pid} does not belong to job {owner.job!r} ({why}); "
                         "not signalled")
    return fd


def _rank_target(s: dict[str, Any], owner: identity.Owner, rank: int) -> tuple[int, int, str]:
    """Rank ``rank``'s pid, a pidfd on it (proven the job's) and how it was found:
    from the status (ranks that beat through the client), else from the RANK in
    the environment of the job's processes (ranks.py)."""
    pid = s.get("ranks", {}).get(str(rank))
    if pid is not None:
        return int(pid), _open(owner, int(pid)), ""
    found = ranks.by_environment(job_pids(s), int(s["pid"]))
    pids = found.pids.get(rank, [])
    if not pids:
        seen = sorted({*map(int, s.get("ranks", {})), *found.pids})
        unread = (f"; the environment of {found.unreadable} of its processes is not ours to "
                  "read (run as the job's user or root)") if found.unreadable else ""
        raise DrillError(f"job {s['job']!r} has no rank {rank} (ranks seen: "
                         f"{', '.join(map(str, seen)) or 'none'}){unread}")
    if len(pids) > 1:
        raise DrillError(f"job {s['job']!r}: {len(pids)} processes carry RANK={rank} "
                         f"(pids {' '.join(map(str, pids))}); none signalled")
    fd = _open(owner, pids[0])
    # Read again now that the pidfd holds it, then prove it alive: what was read
    # is this process's environment, not a stranger's that took the pid since.
    try:
        again = ranks.rank_of(pids[0])
        signal.pidfd_send_signal(fd, 0)
    except (ranks.Unreadable, ProcessLookupError):
        again = None
    if again != rank:
        os.close(fd)
        raise DrillError(f"process {pids[0]} (rank {rank}) is gone")
    return pids[0], fd, f", RANK={rank} in its environment"


def _send(fd: int, pid: int, sig: int) -> None:
    try:
        signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:
        raise DrillError(f"process {pid} is gone") from None
    except PermissionError:
        raise DrillError(f"process {pid}: not permitted (run as the job's user or root)") from None


def job_pids(s: dict[str, Any]) -> list[int]:
    """Every live process of the job's current attempt: the members of its
    cgroup when it has one, else its session and process group and every
    descendant of its leader (torchrun's workers run in sessions of their own).
    Candidates only: each is proven the job's before it is signalled."""
    leader = int(s["pid"])
    cg = s.get("cgroup")
    found: set[int] = set()
    if isinstance(cg, str) and cg:
        found = cgroup.procs_below(cg)
    else:
        for p in psutil.process_iter():
            with contextlib.suppress(OSError, psutil.Error):
                if os.getsid(p.pid) == leader or os.getpgid(p.pid) == leader:
                    found.add(p.pid)
        with contextlib.suppress(psutil.Error):
            found |= {c.pid for c in psutil.Process(leader).children(recursive=True)}
            found.add(leader)
    found.discard(os.getpid())
    if not found:
        raise DrillError(f"job {s['job']!r}: no live process found (leader pid {leader})")
    return sorted(found)


def notify(s: dict[str, Any], kind: str, pids: list[int],
           extra: dict[str, Any] | None = None) -> str | None:
    """Tell the supervising trainwatch that ``kind`` is about to be injected, so
    that it records the fault as injected (and a crash's onset as now); ``extra``:
    more of the drill's arguments (a log line's text). Returns why it could not,
    or None."""
    run_dir = s.get("run_dir")
    if not isinstance(run_dir, str):
        return "the job's status names no run_dir"
    try:
        reply = control.request(run_dir, "drill", {**(extra or {}), "job": s["job"],
                                                   "kind": kind, "pids": pids}, timeout=2.0)
    except control.ControlError as e:
        return str(e)
    return None if reply.get("ok") else str(reply.get("error"))


@dataclass
class Done:
    """What a crash or hang drill did: the signal, to which pids, and whether
    trainwatch was told (else its incident will not say injected)."""

    signal: str
    pids: list[int]
    what: str
    not_told: str | None = None


def crash(state_dir: str, job: str, rank: int | None = None) -> Done:
    """SIGKILL the job's leader (or one rank's process), once proven the job's."""
    s = job_status(state_dir, job)
    owner = identity.Owner(s)
    if rank is None:
        pid, how = int(s["pid"]), ""
        fd = _open(owner, pid)
    else:
        pid, fd, how = _rank_target(s, owner, rank)
    try:
        why = notify(s, "crash", [pid])
        _send(fd, pid, signal.SIGKILL)
    finally:
        os.close(fd)
    what = f"the leader (pid {pid})" if rank is None else f"rank {rank} (pid {pid}{how})"
    return Done("SIGKILL", [pid], what, why)


def hang(state_dir: str, job: str, rank: int | None = None,
         seconds: float | None = None, kind: str = "hang") -> Done:
    """SIGSTOP one rank's process, or every process of the job (every rank, the
    launcher, their children); with ``seconds``, SIGCONT them again after that
    long (through the same pidfds: never a process that took a pid since).
    Without a rank, a candidate not proven the job's is left alone. ``kind``:
    what trainwatch is told is injected."""
    s = job_status(state_dir, job)
    owner = identity.Owner(s)
    fds: dict[int, int] = {}
    try:
        if rank is None:
            refused: list[str] = []
            for pid in job_pids(s):
                try:
                    fds[pid] = _open(owner, pid)
                except DrillError as e:  # gone meanwhile, or not the job's
                    refused.append(str(e))
            if not fds:
                raise DrillError(refused[0] if len(refused) == 1 else
                                 f"job {job!r}: no process of it could be proven the job's "
                                 f"({len(refused)} candidates)")
            what = f"every process of the job ({len(fds)})"
        else:
            pid, fd, how = _rank_target(s, owner, rank)
            fds[pid] = fd
            what = f"rank {rank} (pid {pid}{how})"
        why = notify(s, kind, sorted(fds))
        stopped = []
        for pid, fd in sorted(fds.items()):
            with contextlib.suppress(DrillError):  # one that exited meanwhile is fine
                _send(fd, pid, signal.SIGSTOP)
                stopped.append(pid)
        if not stopped:
            raise DrillError(f"job {job!r}: every process was gone before it could be stopped")
        if seconds is not None:
            time.sleep(seconds)
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fds[pid], signal.SIGCONT)  # unless killed since
    finally:
        for fd in fds.values():
            os.close(fd)
    return Done("SIGSTOP", stopped, what, why)


def nccl_stall(state_dir: str, job: str, rank: int, seconds: float | None = None) -> Done:
    """SIGSTOP rank ``rank``'s process of a multi-process job: the other ranks
    block in their next collective, as when one rank stalls for real. Told to
    trainwatch as ``nccl_stall``; with ``seconds``, resumed after that long."""
    return hang(state_dir, job, rank, seconds, kind="nccl_stall")


# --- loss drills --------------------------------------------------------------


def loss(state_dir: str, job: str, kind: str, scale: float | None = None,
         steps: int | None = None) -> dict[str, Any]:
    """``nan`` or ``grad-spike``: trainwatch injects the values into the job's loss
    feed, marked injected, and acts on what its detectors decide (any job: no
    process is touched). Its reply: the steps injected and the anomalies found."""
    s = job_status(state_dir, job)
    run_dir = s.get("run_dir")
    if not isinstance(run_dir, str):
        raise DrillError(f"job {job!r}: its status names no run_dir")
    args: dict[str, Any] = {"job": job, "kind": kind}
    if scale is not None:
        args["scale"] = scale
    if steps is not None:
        args["steps"] = steps
    try:
        reply = control.request(run_dir, "drill", args)
    except control.ControlError as e:
        raise DrillError(str(e)) from None
    if not reply.get("ok"):
        why = str(reply.get("error") or "no reason given").removeprefix("drill: ")
        raise DrillError(f"trainwatch refused it: {why}")
    return reply


# What the bundled demo trainer does on each signal (trainwatch.demo.trainer).
TRAINER_SIGNALS = {"nan": signal.SIGUSR1, "grad-spike": signal.SIGUSR2}


def in_trainer(state_dir: str, job: str, kind: str) -> Done:
    """Tell a trainer that handles them (the bundled demo trainer) to break
    itself for real: SIGUSR1, NaN weights; SIGUSR2, a scaled gradient. Sent to
    the job's leader once it is proven the job's; a process without a handler
    would die of it, so this is for such trainers only."""
    sig = TRAINER_SIGNALS[kind]
    s = job_status(state_dir, job)
    pid = int(s["pid"])
    fd = _open(identity.Owner(s), pid)
    try:
        _send(fd, pid, sig)
    finally:
        os.close(fd)
    return Done(signal.Signals(sig).name, [pid], f"the trainer (pid {pid})")


# --- GPU drills ---------------------------------------------------------------


def xid_message(xid: int) -> str:
    """The text a drill puts after the Xid when none is given: the catalog's."""
    return classify(xid).description or "injected by faultinject"


def send(run_dir: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """One request to the trainwatch serving ``run_dir``; its reply, less ``ok``.
    Raises DrillError when it cannot be delivered or trainwatch refuses it."""
    try:
        reply = control.request(run_dir, op, args)
    except control.ControlError as e:
        raise DrillError(str(e)) from None
    if not reply.get("ok"):
        raise DrillError(f"trainwatch refused {op}: {reply.get('error') or 'no reason given'}")
    return {k: v for k, v in reply.items() if k != "ok"}


def gpu_xid(run_dir: str, gpu: int, xid: int, message: str | None = None) -> dict[str, Any]:
    """Report Xid ``xid`` on GPU ``gpu`` as if the driver had."""
    text = xid_message(xid) if message is None else message
    return send(run_dir, "gpu-xid", {"gpu": gpu, "xid": xid, "message": text})


def gpu_lost(run_dir: str, gpu: int) -> dict[str, Any]:
    """Make GPU ``gpu`` read as fallen off the bus."""
    return send(run_dir, "gpu-lost", {"gpu": gpu})


def ecc(run_dir: str, gpu: int, uncorrected: bool = False) -> dict[str, Any]:
    """A new uncorrected ECC error, or (by default) a pending row remap, on ``gpu``."""
    return send(run_dir, "ecc", {"gpu": gpu, "uncorrected": uncorrected})


def thermal(run_dir: str, gpu: int) -> dict[str, Any]:
    """A sustained HW thermal slowdown on ``gpu``."""
    return send(run_dir, "thermal", {"gpu": gpu})


def kmsg_line(pci: str, xid: int, message: str, pid: int) -> str:
    """The driver's line for an Xid (``krcReportXid``'s format), for ``pci`` in
    any form ``normalise_pci`` reads. Raises DrillError for a bad address or text."""
    try:
        bus = normalise_pci(pci)  # "00000000:06:00.0"
    except ValueError:
        raise DrillError(f"--pci: expected a PCI address such as 0000:06:00, got {pci!r}"
                         ) from None
    dom, b, rest = bus.split(":")
    dev, fn = rest.split(".")
    if fn != "0":
        raise DrillError(f"--pci: the driver names function 0 only, got {pci!r}")
    if "\n" in message or "\r" in message:
        raise DrillError("--message: expected one line for a kernel-log line")
    line = (f"NVRM: Xid (PCI:{int(dom, 16):04x}:{int(b, 16):02x}:{int(dev, 16):02x}): "
            f"{xid}, pid={pid}, name=faultinject, {message}")
    p = parse_line(line)
    if p is None or p.xid != xid or p.pci != bus:  # never write what trainwatch cannot read
        raise DrillError(f"cannot write Xid {xid} on {pci} as a kernel-log line trainwatch "
                         "reads")
    return line


def kmsg_xid(path: str, pci: str, xid: int, message: str | None = None) -> str:
    """Append the driver's line for Xid ``xid`` on ``pci`` to the text file
    ``path`` (created if absent), as one write. Returns the line."""
    line = kmsg_line(pci, xid, xid_message(xid) if message is None else message, os.getpid())
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISCHR(os.stat(path).st_mode):
            raise DrillError(f"--kmsg: {path} is a device; trainwatch ignores Xid lines "
                             "written to the kernel log from userspace, so give the text file "
                             "it tails")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise DrillError(f"--kmsg: {path}: cannot open: {e.strerror}") from None
    try:
        # One write of a whole line: a reader tailing the file never sees half of it.
        os.write(fd, (line + "\n").encode())
    except OSError as e:
        raise DrillError(f"--kmsg: {path}: cannot write: {e.strerror}") from None
    finally:
        os.close(fd)
    return line
