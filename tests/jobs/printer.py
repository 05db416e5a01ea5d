"""A job for the daemon tests: prints "step N" and beats every --interval,
writes and reports a checkpoint every --ckpt-every steps, resumes from its
checkpoint, and exits when a file asks it to. Uses only the client API.

Triggers in --dir (each is consumed, so a relaunch does not obey it again):
  exit_code  exit with the number it holds
  crash      SIGKILL itself
Every signal it can catch is printed ("signal N"), so a test can prove that
nobody signalled it; SIGTERM and SIGINT then end it (143, 130).
Every process writes its pid to --dir/pids/<pid> (the test's cleanup list).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from trainwatch import client

_CAUGHT = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGTERM, signal.SIGCONT, signal.SIGALRM, signal.SIGPIPE)


def on_signal(sig: int, _frame: FrameType | None) -> None:
    print(f"signal {sig}", flush=True)
    if sig in (signal.SIGTERM, signal.SIGINT):
        os._exit(128 + sig)


def take(trigger: Path) -> str | None:
    """The trigger's text, removing it; None when there is none."""
    try:
        text = trigger.read_text()
        trigger.unlink()
    except OSError:
        return None
    return text.strip()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, help="triggers, pids/ and (default) ckpt/")
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--ranks", type=int, default=1, help="fork ranks 1..R-1 that beat too")
    p.add_argument("--quiet", action="store_true", help="print only every 10th step")
    p.add_argument("--resume-from")
    a = p.parse_args()
    d = Path(a.dir)
    ckpt = d / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    (d / "pids").mkdir(exist_ok=True)

    resume = a.resume_from or client.resume_from()
    start = 0
    if resume:
        start = int(Path(resume).read_text().strip() or "0")
    attempt = os.environ.get("TRAINWATCH_ATTEMPT")
    print(f"start pid={os.getpid()} attempt={attempt} step={start} resume={resume}"
          f" argv={' '.join(sys.argv[1:])}", flush=True)
    print(f"stderr too, pid={os.getpid()}", file=sys.stderr, flush=True)

    rank = 0
    leader = os.getpid()
    for r in range(1, a.ranks):
        if os.fork() == 0:
            rank = r
            break
    (d / "pids" / str(os.getpid())).write_text("")
    for s in _CAUGHT:
        signal.signal(s, on_signal)
    hb = client.connect(rank=rank)

    step = start
    while True:
        time.sleep(a.interval)
        step += 1
        hb.beat(step, loss=1.0 / step)
        if rank != 0:
            if os.getppid() != leader:  # rank 0 is gone (we were reparented)
                return 0
            continue
        if not a.quiet or step % 10 == 0:
            print(f"step {step}", flush=True)
        if step % a.ckpt_every == 0:
            path = ckpt / f"step_{step}"
            tmp = ckpt / f".step_{step}.tmp"
            tmp.write_text(str(step))
            os.replace(tmp, path)
            hb.checkpoint(step, path)
        code = take(d / "exit_code")
        if code is not None:
            print(f"exit {code} at step {step}", flush=True)
            return int(code)
        if take(d / "crash") is not None:
            print(f"crash at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
