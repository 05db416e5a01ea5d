"""crash: the job's leader exited with a non-zero code or by a signal."""

from __future__ import annotations

import signal

from trainwatch.types import Fault, FaultKind, ProcessExit


def detect_crash(job: str, exit: ProcessExit, last_step: int | None) -> Fault | None:
    """Exit 0 means the job finished: no fault."""
    if exit.returncode == 0:
        return None
    evidence: dict[str, object] = {"pid": exit.pid}
    if exit.returncode < 0:
        sig = -exit.returncode
        try:
            evidence["signal"] = signal.Signals(sig).name
        except ValueError:
            evidence["signal"] = str(sig)
    else:
        evidence["exit_code"] = exit.returncode
    if last_step is not None:
        evidence["last_step"] = last_step
    # exit.at is when the exit was seen; when the process died is not known.
    return Fault(FaultKind.CRASH, job, exit.at, evidence, onset_step=last_step,
                 onset_known=False)
