"""The policy's ``exec`` hook: an operator command (a Slurm requeue, a page)
run when trainwatch gives a job up or hands it over, with ``{job}``, ``{gpu}``
and ``{kind}`` filled in. Started and forgotten: a thread reaps it."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Sequence

log = logging.getLogger("trainwatch")


def run(cmd: Sequence[str], job: str, kind: str, gpu: int | None, umask: int = -1) -> None:
    """Start the hook (nothing when ``cmd`` is empty), with the umask trainwatch was
    started with (not its own 0o077); never raises."""
    if not cmd:
        return
    fill = {"{job}": job, "{gpu}": "" if gpu is None else str(gpu), "{kind}": kind}
    argv = []
    for a in cmd:
        for key, value in fill.items():
            a = a.replace(key, value)
        argv.append(a)
    try:
        # No TRAINWATCH_JOB: the hook is not one of the job's processes.
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWATCH_")}
        env.update(TRAINWATCH_HOOK_JOB=job, TRAINWATCH_HOOK_FAULT=kind,
                   TRAINWATCH_HOOK_GPU=fill["{gpu}"])
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                             umask=umask)
    except OSError as e:
        log.error("job %s: exec hook %s: %s", job, argv[0], e.strerror or e)
        return
    log.warning("job %s: exec hook started: %s (pid %d)", job, " ".join(argv), p.pid)
    threading.Thread(target=p.wait, name="trainwatch-exec", daemon=True).start()
