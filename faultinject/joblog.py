"""The ``log-line`` drill: one line appended to a job's captured output, as if the
job had printed it, for trainwatch's job-log rules (trainwatch.detectors.logrules)
to read like any other.

The line goes to the attempt's log named in the job's status (``log``), in one
``write`` on an ``O_APPEND`` descriptor, so a reader never sees half of it and
the job's own writes are not overwritten. When the job is in the middle of a
line (the log does not end in a newline) the drill's line starts with one, so
that it is a line of its own; the job's line then ends early, which is what a
log of interleaved writers looks like anyway.

Presets are real-format lines (the texts PyTorch, NCCL and CUDA print) for the
built-in rules; each is checked against its rule before it is written, so a
drill never writes a line trainwatch cannot read.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from trainwatch.detectors.logrules import BUILTIN, compile_rules

from faultinject.drills import DrillError, job_status, notify

LONGEST = 4096  # bytes: trainwatch matches no further into one line (logwatch.py)

# name -> (the built-in rule it must fire, the line); the texts are as printed by
# torch 2.x (ProcessGroupNCCL.cpp, NCCLUtils, CUDACachingAllocator) and CUDA.
PRESETS: dict[str, tuple[str, str]] = {
    "nccl-timeout": (
        "nccl_watchdog_timeout",
        "[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, "
        "NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000) ran for 600060 milliseconds "
        "before timing out."),
    "nccl-heartbeat": (
        "nccl_heartbeat_monitor",
        "[rank1]:[F1124 10:11:12.000000000 ProcessGroupNCCL.cpp:1614] [PG ID 0 PG GUID "
        "0(default_pg) Rank 1] ProcessGroupNCCL's watchdog got stuck for 480 seconds without "
        "making progress in monitoring enqueued collectives. This typically indicates a "
        "NCCL/CUDA API (e.g., CudaEventDestroy) hang blocking the watchdog, and could be "
        "triggered by another thread holding the GIL inside a CUDA api (for example, "
        "CudaEventDestroy), or other deadlock-prone behaviors."),
    "nccl-error": (
        "nccl_error",
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
        "ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for "
        "details), NCCL version 2.21.5"),
    "illegal-memory": (
        "cuda_illegal_memory_access",
        "RuntimeError: CUDA error: an illegal memory access was encountered"),
    "ecc": (
        "cuda_ecc_uncorrectable",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered"),
    "cuda-oom": (
        "cuda_oom",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 79.10 GiB of which 1.06 GiB is free. Of the allocated memory 75.2 GiB "
        "is allocated by PyTorch, and 1.3 GiB is reserved by PyTorch but unallocated."),
}


def builtin_rule(line: str) -> str | None:
    """The built-in rule that fires on ``line`` alone, or None."""
    fired = compile_rules(BUILTIN).feed([line], 0.0)
    return fired[0].rule if fired else None


def preset_line(name: str) -> tuple[str, str]:
    """(the line, its rule) of preset ``name``, once proven to fire that rule."""
    if name not in PRESETS:
        raise DrillError(f"--preset: unknown preset {name!r}, expected one of "
                         f"{', '.join(sorted(PRESETS))}")
    rule, line = PRESETS[name]
    if builtin_rule(line) != rule:  # never write what trainwatch cannot read
        raise DrillError(f"preset {name}: its line no longer fires trainwatch's built-in rule "
                         f"{rule}; not written")
    return line, rule


def check_line(line: str) -> bytes:
    """The line as written (without its newline); DrillError for one that is not a line."""
    if not line.strip():
        raise DrillError("--line: expected some text, got an empty line")
    if any(c in line for c in "\n\r\0"):
        raise DrillError("--line: expected one line, without newline, carriage return or NUL")
    data = line.encode(errors="surrogateescape")  # bytes from argv pass through as they were
    if len(data) > LONGEST:
        raise DrillError(f"--line: expected at most {LONGEST} bytes (trainwatch matches no "
                         f"further into a line), got {len(data)}")
    return data


@dataclass
class Appended:
    """What the drill wrote, where, and whether trainwatch was told."""

    path: str
    line: str
    rule: str | None  # the built-in rule that reads it, if any
    not_told: str | None = None


def log_line(state_dir: str, job: str, line: str | None = None,
             preset: str | None = None) -> Appended:
    """Append ``line`` (or preset ``preset``'s line) to the running job's log."""
    if (line is None) == (preset is None):
        raise DrillError("expected --line TEXT or --preset NAME (one of them)")
    rule: str | None
    if preset is not None:
        line, rule = preset_line(preset)
        data = check_line(line)
    else:
        assert line is not None
        data = check_line(line)
        rule = builtin_rule(line)
    s = job_status(state_dir, job)
    path = s.get("log")
    if not isinstance(path, str) or not path:
        raise DrillError(f"job {job!r}: its status names no log (its output is not captured)")
    fd = _open_log(job, path)
    try:
        why = notify(s, "log_line", [], {"line": line})
        try:
            size = os.fstat(fd).st_size
            # Mid-line (the job wrote no newline yet): start a line of our own.
            lead = b"\n" if size and os.pread(fd, 1, size - 1) != b"\n" else b""
            os.write(fd, lead + data + b"\n")
        except OSError as e:
            raise DrillError(f"{path}: cannot write: {e.strerror}") from None
    finally:
        os.close(fd)
    return Appended(path, line, rule, why)


def _open_log(job: str, path: str) -> int:
    flags = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)  # never created: a log that is gone is the job's no longer
    except OSError as e:
        raise DrillError(f"job {job!r}: its log {path}: cannot open: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DrillError(f"job {job!r}: its log {path} is not a file (its output is not "
                         "captured)")
    return fd
