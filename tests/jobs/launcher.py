"""A launcher like torchrun's agent, minus its text: starts --workers processes
with RANK in their environment (each in a session of its own, as torchrun's),
writes "rank pid" lines to --pids, and when one of them fails SIGTERMs the
others, waits for them and exits 1, printing nothing about it.

--late-summary: workers without RANK; on a failure it prints torchrun's first
line ("ChildFailedError") at once and its Root Cause block only when it is
SIGTERMed: the summary comes after the incident was recorded.

--reap-at-once: blocks in wait() and so reaps a failed worker the moment it
ends (before trainwatch can read its status, as torchrun may on a busy host),
then prints torchrun's Root Cause block for it, SIGTERMs the others, exits 1."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

WORKER = "import time\nwhile True:\n    time.sleep(0.05)\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pids", required=True)
    p.add_argument("--late-summary", action="store_true")
    p.add_argument("--reap-at-once", action="store_true")
    a = p.parse_args()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], start_new_session=True,
                              env=os.environ if a.late_summary
                              else {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(a.workers)]
    tmp = a.pids + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(f"{r} {w.pid}\n" for r, w in enumerate(procs)))
    os.replace(tmp, a.pids)
    if a.reap_at_once:
        return reap_at_once(procs)
    while True:
        time.sleep(0.1)  # torchrun's agent looks every 0.1 s too
        if any(w.poll() not in (None, 0) for w in procs):
            break
    if a.late_summary:
        failed = next(r for r, w in enumerate(procs) if w.poll() not in (None, 0))
        code = procs[failed].returncode

        def summary(_sig: int, _frame: object) -> None:
            print(f"Root Cause (first observed failure):\n[0]:\n  rank      : {failed} "
                  f"(local_rank: {failed})\n  exitcode  : {code} (pid: {procs[failed].pid})\n"
                  f"{'=' * 54}", file=sys.stderr, flush=True)
            sys.exit(1)

        signal.signal(signal.SIGTERM, summary)
        print("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(1)
    for w in procs:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    for w in procs:
        w.wait()
    return 1


def reap_at_once(procs: list[subprocess.Popen[bytes]]) -> int:
    pid, status = os.wait()
    rank = next(r for r, w in enumerate(procs) if w.pid == pid)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    print(f"Root Cause (first observed failure):\n[0]:\n  rank      : {rank} "
          f"(local_rank: {rank})\n  exitcode  : {code} (pid: {pid})\n{'=' * 54}",
          file=sys.stderr, flush=True)
    for w in procs:
        if w.pid != pid:
            w.send_signal(signal.SIGTERM)
            w.wait()
    return 1


if __name__ == "__main__":
    sys.exit(main())
