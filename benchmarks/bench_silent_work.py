"""False alarms of the no-client stall rules on a job that is silent while it
works (issue 40, item 5): a 2-rank torchrun job on gloo, without the client,
under ``trainwatch run`` with default settings (``stall.silence`` 5 minutes, the
stopped-rank floor 5 s), goes through phases of ``--seconds`` each (10 minutes
by default) with no output at all:

- ``eval``: every rank at full CPU (a matmul loop, one thread each);
- ``eval-rank0``: rank 0 at full CPU, rank 1 waiting in a ``barrier``;
- ``checkpoint``: rank 0 writing a checkpoint to disk slowly (1 MiB, fsync, a
  pause: about 4 MB/s at next to no CPU, as to a slow file system), rank 1
  waiting in a ``barrier``.

Each phase begins and ends with a line of output and a barrier. Printed: each
phase's length and the incidents trainwatch recorded in it (0 is the goal), and
whether the job ended on its own (exit 0, one attempt).

    .venv/bin/python benchmarks/bench_silent_work.py [--seconds 600] [--phases eval,checkpoint]
        [--silence 20s]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _common import TRAINWATCH, VENV_BIN, machine_line

PHASES = ("eval", "eval-rank0", "checkpoint")

TRAINER = textwrap.dedent("""
    import datetime, os, sys, time
    import torch
    import torch.distributed as dist
    seconds, out, phases = float(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3 * seconds + 300))
    rank = dist.get_rank()

    def say(what):
        if rank == 0:
            print(f"phase {what} {time.time():.3f}", flush=True)

    def spin():
        t, x = time.monotonic(), torch.randn(256, 256)
        while time.monotonic() - t < seconds:
            x = torch.tanh(x @ x)

    for step in range(20):  # a little training, loud
        g = torch.ones(4)
        dist.all_reduce(g)
        say(f"train-{step}")
    for phase in phases:
        dist.barrier()
        say(f"begin-{phase}")
        if phase == "eval" or (phase == "eval-rank0" and rank == 0):
            spin()
        elif phase == "checkpoint" and rank == 0:
            t, chunk = time.monotonic(), bytes(1 << 20)
            with open(os.path.join(out, "ckpt.bin"), "wb") as f:
                while time.monotonic() - t < seconds:
                    if f.tell() >= 64 << 20:
                        f.seek(0)  # the same 64 MiB again: the disk's space is not the point
                    f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
                    time.sleep(0.2)
        dist.barrier()
        say(f"end-{phase}")
    dist.destroy_process_group()
""")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--phases", default="eval,eval-rank0,checkpoint")
    ap.add_argument("--silence", default=None,
                    help="stall.silence for the run (default: trainwatch's, 5m)")
    args = ap.parse_args()
    phases = args.phases.split(",")
    if not phases or any(p not in PHASES for p in phases):
        print(f"--phases: expected a comma-separated list of {', '.join(PHASES)}",
              file=sys.stderr)
        return 2
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="tw-silent-") as tmp:
        d = Path(tmp)
        (d / "trainer.py").write_text(TRAINER)
        cmd = [TRAINWATCH, "run", "--name", "silent", "--state-dir", str(d / "state"),
               "--run-dir", str(d / "run"), "--metrics-port", "0", "--no-passthrough",
               *(["--stall-silence", args.silence] if args.silence else []), "--",
               str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2",
               str(d / "trainer.py"), str(args.seconds), str(d), ",".join(phases)]
        t0 = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True, check=False,
                           timeout=len(phases) * args.seconds * 2 + 600)
        log = sorted(d.rglob("attempt-*.log"))
        said = "\n".join(p.read_text(errors="replace") for p in log)
        marks = {}
        for line in said.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "phase":
                marks[parts[1]] = float(parts[2])
        got = subprocess.run([TRAINWATCH, "incidents", "--json", "--state-dir", str(d / "state")],
                             capture_output=True, text=True, check=False)
        rows = json.loads(got.stdout or "[]")
        rows = rows.get("incidents", []) if isinstance(rows, dict) else rows
        print(f"trainwatch run: exit {r.returncode} after {time.time() - t0:.0f}s; "
              f"{len(rows)} incident(s) in all")
        for p in phases:
            a, b = marks.get(f"begin-{p}"), marks.get(f"end-{p}")
            if a is None or b is None:
                print(f"  {p:<11} did not complete")
                continue
            inside = [x for x in rows if a <= float(x["time"]) <= b]
            print(f"  {p:<11} {b - a:7.1f}s silent, {len(inside)} incident(s)"
                  + "".join(f"; {x['kind']}: {x.get('reason', '')}"[:200] for x in inside))
        if r.returncode != 0 or rows:
            print(r.stderr[-3000:], file=sys.stderr)
        return 0 if r.returncode == 0 and not rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
