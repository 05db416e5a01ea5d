"""The stall detector's process sampler (sources/procs.py) on real processes: which
rank a process is, for a job without the client, from the RANK in its environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
from conftest import wait_for
from trainwatch.detectors.stall import IDLE_IO, SilentView, StallSettings, detect_silent
from trainwatch.sources.procs import Sampler

# Stands in for a torchrun worker: forked without RANK, then exec'd with it.
WORKER = ("import os, sys\nsys.stdout.write('forked\\n')\nsys.stdout.flush()\n"
          "sys.stdin.readline()\nos.execve('/bin/sleep', ['sleep', '60'], {'RANK': '1'})\n")


def test_a_worker_seen_before_its_exec_is_named_by_its_rank_after_it() -> None:
    """Sampled between fork and exec, a worker still has its launcher's environment (no
    RANK): it is keyed by its pid then, and by its rank once it has exec'd (a loaded run
    saw the one stopped rank keyed by pid for good, and named the other)."""
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    p = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline() == b"forked\n"
        now = [0.0]
        s = Sampler(clock=lambda: now[0])
        assert s.by_rank([p.pid]) == {-p.pid: p.pid}
        p.stdin.write(b"\n")
        p.stdin.flush()
        wait_for(lambda: Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(b"sleep\0"),
                 timeout=30, what="the exec")
        assert s.by_rank([p.pid]) == {-p.pid: p.pid}  # asked again only a second later
        now[0] = 1.0
        assert s.by_rank([p.pid]) == {1: p.pid}
    finally:
        p.kill()
        p.wait()


def test_a_process_without_a_rank_is_asked_a_few_times_only() -> None:
    """The launcher (or a shell) never gets a RANK: its environment is read five times,
    a second apart, then no more (every scan of the job's tree asks)."""
    p = subprocess.Popen(["sleep", "60"], env={"PATH": os.defpath})
    try:
        now = [0.0]
        s = Sampler(clock=lambda: now[0])
        for i in range(40):
            now[0] = i * 0.5
            assert s.rank_of(p.pid) is None
        assert s.no_rank[p.pid][1] == 5
    finally:
        p.kill()
        p.wait()


# Sleeps until told, then spins: a launcher idle while its workers run, busy once they exit.
SPINNER = ("import sys\nsys.stdout.write('ready\\n')\nsys.stdout.flush()\n"
           "sys.stdin.readline()\nwhile True:\n    pass\n")


def test_a_process_that_went_busy_since_its_last_rate_is_not_taken_for_idle() -> None:
    """Sampled again under half a second after its rate was taken (the loop woke early),
    a process keeps the rate of when it slept; now it runs (R): no stall without the
    client (a loaded run took the launcher winding down for a stuck job)."""
    p = subprocess.Popen([sys.executable, "-c", SPINNER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline() == b"ready\n"
        proc = psutil.Process(p.pid)
        wait_for(lambda: proc.status() == psutil.STATUS_SLEEPING, what="it to sleep")
        now = [0.0]
        s = Sampler(clock=lambda: now[0])
        s.sample({-p.pid: p.pid})
        now[0] = 1.0
        idle = s.sample({-p.pid: p.pid})[-p.pid]
        assert idle.state == "S" and idle.cpu_rate is not None and idle.cpu_rate < 0.05
        slept = proc.cpu_times().user
        p.stdin.write(b"\n")
        p.stdin.flush()
        wait_for(lambda: proc.cpu_times().user > slept + 0.1, what="it to spin")
        now[0] = 1.2
        busy = s.sample({-p.pid: p.pid})[-p.pid]
        assert busy.state == "R" and busy.cpu_rate == idle.cpu_rate  # the rate carried over
        v = SilentView(now[0], 25.0, {-p.pid: busy}, 60.0, 12.5)
        assert detect_silent("j", v, StallSettings(silence=20.0)) is None
    finally:
        p.kill()
        p.wait()



# Writes a MiB every 50 ms with next to no CPU: a checkpoint going to a slow disk.
WRITER = ("import sys, time\nf = open('/dev/null', 'wb', buffering=0)\nsys.stdout.write('go\\n')\n"
          "sys.stdout.flush()\nwhile True:\n    f.write(bytes(1 << 20))\n    time.sleep(0.05)\n")


def test_a_process_writing_at_little_cpu_moves_bytes_and_a_sleeper_none() -> None:
    """The sampler's I/O rate (rchar + wchar), which makes a writer working for the
    silence rule whatever its CPU (tests/test_stall_detector.py); a launcher's is
    not asked (torchrun's agent reads 66 KB/s while its workers are stuck), a
    rank's child's is."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER], stdout=subprocess.PIPE)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert writer.stdout is not None and writer.stdout.readline() == b"go\n"
        now = [0.0]
        s = Sampler(clock=lambda: now[0])
        pids = {0: writer.pid, 1: sleeper.pid}
        s.sample(pids)

        def rates() -> dict[int, float] | None:
            now[0] += 1.0  # a rate over one second of the sampler's clock
            got = {k: p.io_rate for k, p in s.sample(pids).items()}
            return got if (got.get(0) or 0) >= IDLE_IO else None

        got = wait_for(rates, timeout=30, what="the writer's I/O rate")
        assert got[1] == 0.0, got
        # Beside ranks, a process that is none (a launcher) is not judged by its I/O.
        beside = {1: sleeper.pid, -writer.pid: writer.pid}
        now[0] += 1.0
        s.sample(beside)
        now[0] += 1.0
        assert {k: p.io_rate for k, p in s.sample(beside).items()} == {1: 0.0, -writer.pid: None}
        # A rank's child (a data loader's worker) is: this test's process stands for the rank.
        kin = {0: os.getpid(), -writer.pid: writer.pid}
        s.sample(kin)

        def child() -> float | None:
            now[0] += 1.0
            rate = s.sample(kin)[-writer.pid].io_rate
            return rate if (rate or 0) >= IDLE_IO else None

        wait_for(child, timeout=30, what="the rank's child's I/O rate")
    finally:
        for p in (writer, sleeper):
            p.kill()
            p.wait()
