"""A crash names the rank that failed first (issue 21, item C24): when one rank of
a multi-process job dies, its launcher SIGTERMs the others and exits 1; the
incident names the rank that died first and how (its process's own exit, seen
as it happened), with torchrun's "Root Cause" summary as a second source."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import psutil
from conftest import Workspace, finish, wait_for
from test_torchrun import _ddp
from trainwatch.detectors.torchrun import root_cause
from trainwatch.sources.rankexits import RankExit, RankExits

LAUNCHER = Path(__file__).parent / "jobs" / "launcher.py"

# What torchrun 2.x printed here for `faultinject crash --rank 1` of a 2-rank job.
SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
/work/main/tests/jobs/ddp.py FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-25_12:38:56
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 9126)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 9126
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_12:38:56
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 9127)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 9127
======================================================
"""


def _watched_by(pid: int) -> set[int]:
    """The pids that process `pid` holds pidfds of (/proc/<pid>/fdinfo "Pid:" lines)."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Pid:"):
                out.add(int(line.split()[1]))
    return out


def _torchrun_ranks(ckpt: Path) -> dict[int, int]:
    """rank -> pid of the workers of the DDP job writing to ckpt (by RANK in their environment)."""
    out = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if str(ckpt) in (proc.info["cmdline"] or []) and "torchrun" not in " ".join(
                    proc.info["cmdline"]):
                rank = proc.environ().get("RANK")
                if rank is not None and proc.ppid() != 1:
                    out[int(rank)] = proc.pid
        except psutil.Error:
            continue
    return out


def _ranks(path: Path) -> dict[int, int]:
    if not path.exists():
        return {}
    return {int(r): int(p) for r, p in (x.split() for x in path.read_text().splitlines())}


def test_a_rank_killed_first_is_named_not_the_one_its_launcher_sigtermed(ws: Workspace) -> None:
    """A launcher that prints nothing: rank 1 SIGKILLed, rank 0 then SIGTERMed by the launcher,
    which exits 1; the crash names rank 1 and SIGKILL, from the processes' own exits."""
    pidfile = ws.root / "ranks"
    cfg = ws.config({"command": [sys.executable, str(LAUNCHER), "--pids", str(pidfile)]},
                    {"max_restarts": 0})
    p = ws.run(cfg)
    ranks = wait_for(lambda: len(_ranks(pidfile)) == 2 and _ranks(pidfile), timeout=30,
                     what="the launcher's two ranks")
    wait_for(lambda: set(ranks.values()) <= _watched_by(p.pid), timeout=30,
             what="trainwatch watching both ranks")
    os.kill(ranks[1], signal.SIGKILL)
    rc, out = finish(p, timeout=60)
    assert rc == 1, out
    [inc] = ws.incidents()
    ev = json.loads(inc["evidence"])
    assert inc["kind"] == "crash" and inc["rank"] == 1, inc
    # Its status is read from its zombie; a launcher that reaps it first (a loaded run:
    # trainwatch's loop late) leaves none to read, since only the parent may wait for
    # it. Rank 1 is named all the same, first by its exit, not rank 0 it SIGTERMed.
    reaped = {"rank": 1, "pid": ranks[1],
              "status": "unknown (reaped by its launcher before trainwatch read it)"}
    assert ev["first_failure"] in ({"rank": 1, "pid": ranks[1], "signal": "SIGKILL"},
                                   reaped), ev
    assert ev["exit_code"] == 1 and "torchrun_root_cause" not in ev, ev


def test_a_torchrun_rank_sigkilled_is_named_with_its_signal(ws: Workspace) -> None:
    """A real 2-rank torchrun job on gloo, rank 1 SIGKILLed: the incident names rank 1 and
    SIGKILL from its process's exit, not rank 0's SIGTERM, whichever rank torchrun's Root
    Cause names (kept beside it as torchrun printed it)."""
    cfg = ws.config({"command": _ddp(ws, "--steps", "100000", "--interval", "0.05")},
                    {"max_restarts": 0})
    p = ws.run(cfg)
    wait_for(lambda: (ws.ckpt / "step_10.pt").exists(), timeout=120, what="a checkpoint")
    ranks = wait_for(lambda: len(r := _torchrun_ranks(ws.ckpt)) == 2 and r, timeout=30,
                     what="both ranks' processes")
    wait_for(lambda: set(ranks.values()) <= _watched_by(p.pid), timeout=30,
             what="trainwatch watching both ranks")
    r = ws.faultinject("crash", "--rank", "1")
    assert r.returncode == 0, r.stderr
    killed = int(r.stdout.split("(pid ", 1)[1].split(",")[0])
    assert killed == ranks[1], r.stdout
    rc, out = finish(p, timeout=120)
    assert rc == 1, out
    [inc] = ws.incidents()
    ev = json.loads(inc["evidence"])
    assert inc["kind"] == "crash" and inc["rank"] == 1, inc
    assert ev["first_failure"] == {"rank": 1, "pid": killed, "signal": "SIGKILL"}, ev
    # torchrun's Root Cause is the failure with the smallest timestamp in whole seconds, ties
    # to the lowest rank (errors/__init__.py: min over failures by int(time.time())): rank 0,
    # failing on gloo's closed connection in the same second, may be named. It is kept as
    # torchrun said it; the incident's rank and first failure come from the exits.
    said = ev["torchrun_root_cause"]
    assert said["rank"] in (0, 1), ev
    if said["rank"] == 1:
        assert said["signal"] == "SIGKILL" and said["pid"] == killed, ev
    else:
        assert said.get("signal") != "SIGKILL" and said["pid"] == ranks[0], ev


def test_a_rank_reaped_before_it_is_read_takes_how_it_ended_from_the_root_cause(
        ws: Workspace) -> None:
    """A launcher that reaps its failed rank at once (as torchrun may before a busy daemon
    reads it): the first failure still says SIGKILL, from the Root Cause of that rank and pid."""
    pidfile = ws.root / "ranks"
    cfg = ws.config({"command": [sys.executable, str(LAUNCHER), "--pids", str(pidfile),
                                 "--reap-at-once"]}, {"max_restarts": 0})
    p = ws.run(cfg)
    ranks = wait_for(lambda: len(_ranks(pidfile)) == 2 and _ranks(pidfile), timeout=30,
                     what="the launcher's two ranks")
    wait_for(lambda: set(ranks.values()) <= _watched_by(p.pid), timeout=30,
             what="trainwatch watching both ranks")
    os.kill(ranks[1], signal.SIGKILL)
    rc, out = finish(p, timeout=60)
    assert rc == 1, out
    [inc] = ws.incidents()
    ev = json.loads(inc["evidence"])
    assert inc["kind"] == "crash" and inc["rank"] == 1, inc
    assert ev["first_failure"] == {"rank": 1, "pid": ranks[1], "signal": "SIGKILL"}, ev


def test_torchruns_root_cause_printed_after_the_incident_is_added_to_it(ws: Workspace) -> None:
    """Ranks without RANK (no exits to watch); the launcher prints "ChildFailedError" (the log
    rule fires) and its Root Cause only as it is stopped: the incident gets rank 1 then."""
    pidfile = ws.root / "ranks"
    cfg = ws.config({"command": [sys.executable, str(LAUNCHER), "--pids", str(pidfile),
                                 "--late-summary"]}, {"max_restarts": 0})
    p = ws.run(cfg)
    ranks = wait_for(lambda: len(_ranks(pidfile)) == 2 and _ranks(pidfile), timeout=30,
                     what="the launcher's two ranks")
    os.kill(ranks[1], signal.SIGKILL)
    rc, out = finish(p, timeout=60)
    assert rc == 1, out
    [inc] = ws.incidents()
    ev = json.loads(inc["evidence"])
    assert ev["rule"] == "torchrun_child_failed" and "first_failure" not in ev, ev
    assert inc["rank"] == 1, inc
    assert ev["torchrun_root_cause"] == {"rank": 1, "local_rank": 1, "pid": ranks[1],
                                         "signal": "SIGKILL"}, ev


def test_torchruns_root_cause_is_read_from_its_summary_not_its_first_failure() -> None:
    """The summary lists the SIGTERMed rank 0 first; the root cause is rank 1, SIGKILL."""
    assert root_cause(SUMMARY.splitlines()) == {
        "rank": 1, "local_rank": 1, "host": "localhost", "pid": 9127, "signal": "SIGKILL"}
    exited = SUMMARY.replace("exitcode  : -9 (pid: 9127)  (SIGKILL)", "exitcode  : 1 (pid: 9127)")
    assert root_cause(exited.splitlines())["exit_code"] == 1  # type: ignore[index]
    assert root_cause(SUMMARY.splitlines()[:14]) is None  # not printed yet


def test_exits_seen_in_one_wake_up_name_the_cause_not_the_launchers_sigterm() -> None:
    """A SIGTERM seen just before (same wake-up) a SIGKILL is the victim's: the SIGKILL is
    the first failure; one seen well before it is the first failure itself."""
    import selectors

    w = RankExits(selectors.DefaultSelector(), lambda: 0.0)
    w.exits += [RankExit(0, 10, 5.0, 0), RankExit(3, 13, 6.0, -signal.SIGTERM),
                RankExit(1, 11, 6.01, -signal.SIGKILL)]
    assert w.first_failure() == RankExit(1, 11, 6.01, -signal.SIGKILL)
    w.exits[2] = RankExit(1, 11, 7.0, -signal.SIGKILL)
    assert w.first_failure() == RankExit(3, 13, 6.0, -signal.SIGTERM)
