"""The drills themselves, as functions (the CLI and the demo call these).

A job's processes are found through its published status in ``state_dir``
(``jobs/<job>/status.json``): the leader's pid, its process group, and the pid
of every rank that has beaten.

GPU drills reach the running trainwatch over its control socket in ``run_dir``
(``trainwatch.control``), which hands them to the GPU source to be handled like
a real fault; the kernel-log drill instead appends a real-format ``NVRM: Xid``
line to a text file that trainwatch tails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import time
from typing import Any

from trainwatch import control
from trainwatch import status as jobstatus
from trainwatch.sources.kmsg import normalise_pci, parse_line
from trainwatch.xid import classify


class DrillError(Exception):
    """The drill cannot be carried out: one line for the user."""


def job_status(state_dir: str, job: str) -> dict[str, Any]:
    s = jobstatus.read(state_dir, job)
    if s is None:
        raise DrillError(f"{jobstatus.status_path(state_dir, job)}: no status for job {job!r}"
                         " (is trainwatch supervising it, with this --state-dir?)")
    if s.get("state") not in ("starting", "running") or not s.get("pid"):
        raise DrillError(f"job {job!r} is {s.get('state')}, not running")
    return s


def _rank_pid(s: dict[str, Any], rank: int) -> int:
    pid = s.get("ranks", {}).get(str(rank))
    if pid is None:
        known = ", ".join(sorted(s.get("ranks", {}))) or "none yet"
        raise DrillError(f"job {s['job']!r} has no rank {rank} (ranks seen: {known})")
    return int(pid)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise DrillError(f"process {pid} is gone") from None
    except PermissionError:
        raise DrillError(f"process {pid}: not permitted (run as the job's user or root)") from None


def crash(state_dir: str, job: str, rank: int | None = None) -> int:
    """SIGKILL the job's leader (or one rank's process). Returns the pid killed."""
    s = job_status(state_dir, job)
    pid = int(s["pid"]) if rank is None else _rank_pid(s, rank)
    _kill(pid, signal.SIGKILL)
    return pid


def hang(state_dir: str, job: str, rank: int | None = None, seconds: float | None = None) -> str:
    """SIGSTOP one rank's process, or the job's whole process group; with
    ``seconds``, SIGCONT it again after that long. Returns what was stopped."""
    s = job_status(state_dir, job)
    if rank is None:
        pgid = int(s["pgid"])
        try:
            os.killpg(pgid, signal.SIGSTOP)
        except ProcessLookupError:
            raise DrillError(f"process group {pgid} is gone") from None

        def resume() -> None:
            os.killpg(pgid, signal.SIGCONT)

        what = f"process group {pgid}"
    else:
        pid = _rank_pid(s, rank)
        _kill(pid, signal.SIGSTOP)

        def resume() -> None:
            os.kill(pid, signal.SIGCONT)

        what = f"rank {rank} (pid {pid})"
    if seconds is not None:
        time.sleep(seconds)
        with contextlib.suppress(ProcessLookupError):
            resume()  # unless trainwatch already killed and relaunched it
    return what


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
