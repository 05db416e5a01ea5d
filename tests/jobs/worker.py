"""A scriptable training job for the integration tests: beats, checkpoints,
resumes, and misbehaves on request. Uses only the client API, as a user would."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from trainwatch import client


def journal(journal_path: str | None, **event: object) -> None:
    if journal_path:
        event["attempt"] = int(os.environ.get("TRAINWATCH_ATTEMPT", "-1"))
        event["pid"] = os.getpid()
        with open(journal_path, "a") as f:
            f.write(json.dumps(event) + "\n")


def escape(pidfile: str) -> None:
    """Double-fork a process into its own session that ignores SIGTERM."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            Path(pidfile).write_text(str(os.getpid()))
            while True:
                time.sleep(1)
        os._exit(0)
    os.wait()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=float, default=0.02)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir")
    p.add_argument("--journal")
    p.add_argument("--crash-at", type=int, help="exit 3 at this step, on attempt 0 only")
    p.add_argument("--silent-at", type=int, help="stop beating at this step (keep running)")
    p.add_argument("--silent-for", type=float, default=3600.0)
    p.add_argument("--fail-on-load", type=int, help="exit 1 before beating when resuming here")
    p.add_argument("--escapee", help="double-fork an escaping process; write its pid here")
    p.add_argument("--trap-term", help="on SIGTERM write this file, then exit 143")
    p.add_argument("--ranks", type=int, default=1, help="fork ranks 1..R-1 that beat too")
    p.add_argument("--no-report", action="store_true", help="never call checkpoint()")
    a = p.parse_args()

    if a.trap_term:
        def on_term(_sig: int, _frame: object) -> None:
            Path(a.trap_term).write_text("SIGTERM")
            sys.exit(143)
        signal.signal(signal.SIGTERM, on_term)

    start = 0
    resume = client.resume_from()
    if resume:
        start = int(Path(resume).read_text().strip() or "0") if Path(resume).is_file() else 0
        if a.fail_on_load is not None and start == a.fail_on_load:
            journal(a.journal, event="load_failed", step=start, path=resume)
            return 1
    journal(a.journal, event="start", step=start, resume=resume,
            gpus=os.environ.get("CUDA_VISIBLE_DEVICES"))
    if a.escapee:
        escape(a.escapee)

    rank = 0
    children = []
    for r in range(1, a.ranks):
        pid = os.fork()
        if pid == 0:
            rank = r
            children = []
            break
        children.append(pid)
    hb = client.connect(rank=rank)

    for step in range(start + 1, a.steps + 1):
        time.sleep(a.interval)
        if a.silent_at is not None and step == a.silent_at:
            time.sleep(a.silent_for)
        hb.beat(step, loss=1.0 / step, grad_norm=0.5)
        if rank != 0:
            continue
        if a.ckpt_dir and step % a.ckpt_every == 0:
            path = Path(a.ckpt_dir) / f"step_{step}"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(str(step))
            os.replace(tmp, path)
            if not a.no_report:
                hb.checkpoint(step, path)
            journal(a.journal, event="checkpoint", step=step)
        first = os.environ.get("TRAINWATCH_ATTEMPT") == "0"
        if a.crash_at is not None and step == a.crash_at and first:
            journal(a.journal, event="crash", step=step)
            os._exit(3)
    if rank != 0:
        os._exit(0)
    for pid in children:
        os.waitpid(pid, 0)
    journal(a.journal, event="done", step=a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
