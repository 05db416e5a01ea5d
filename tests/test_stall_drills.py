"""`faultinject nccl-stall` and `faultinject log-line` against a real `trainwatch run`:
the stall drill stops exactly the named rank's process (found through the status when
the job beats, else through the RANK in its processes' environment), and the log drill
appends exactly one real-format line to the job's log. What the daemon then decides
about a stall is not asserted here, only what the drill did."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Iterator

import psutil
import pytest
from conftest import Workspace, wait_for
from test_torchrun import _ddp
from trainwatch.detectors.logrules import BUILTIN, compile_rules
from trainwatch.sources.procstat import proc_stat

from faultinject.joblog import PRESETS

# A launcher (the leader, no RANK) with two ranks; rank 1 has a child of its own that
# inherits RANK=1, as a DataLoader worker does. Cheap: sleeps, not torch.
_LIVE = ("starting", "running")  # a job without heartbeats is "running" only after 10 s
RANKED = ["sh", "-c", "RANK=0 sleep 300 & RANK=1 sh -c 'sleep 302 & exec sleep 301' & wait"]


def _state(pid: int) -> str:
    st = proc_stat(pid)
    return st[0] if st is not None else "gone"


def _rank_env(pid: int) -> str | None:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).environ().get("RANK")
    return None


def _named(argv: list[str], leader: int) -> int | None:
    """The pid of the leader's descendant running ``argv``, once it runs it."""
    with contextlib.suppress(psutil.Error):
        for p in psutil.Process(leader).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.cmdline() == argv:
                    return int(p.pid)
    return None


def _said_pid(stdout: str) -> int:
    m = re.search(r"pids (\d+)$", stdout.strip())
    assert m, stdout
    return int(m.group(1))


def _one_line_refusal(r: subprocess.CompletedProcess[str], says: str) -> None:
    assert r.returncode == 2, r
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.fixture
def resumed() -> Iterator[list[int]]:
    """pidfds of what a test stopped: SIGCONT at the end, so the job can be stopped."""
    fds: list[int] = []
    yield fds
    for fd in fds:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGCONT)
        os.close(fd)


def _stopped(pid: int, resumed: list[int]) -> None:
    """Hold a pidfd on ``pid`` for the cleanup, then wait for it to be stopped."""
    resumed.append(os.pidfd_open(pid))
    wait_for(lambda: _state(pid) == "T", timeout=5, what=f"process {pid} stopped")


def _running_ranked(ws: Workspace) -> tuple[int, int, int, int]:
    """Start the RANKED job; (leader, rank 0, rank 1, rank 1's child) pids."""
    ws.run(ws.config({"command": RANKED}))
    s = wait_for(lambda: (st := ws.status()).get("state") in _LIVE and st, timeout=30,
                 what="started")
    leader = int(s["pid"])
    pids = wait_for(lambda: all(found := [_named(a, leader) for a in (
        ["sleep", "300"], ["sleep", "301"], ["sleep", "302"])]) and found,
        timeout=20, what="both ranks and the child")
    return leader, *pids


# --- nccl-stall ---------------------------------------------------------------


def test_nccl_stall_without_status_ranks_stops_the_topmost_process_with_that_rank(
        ws: Workspace, resumed: list[int]) -> None:
    """With no ranks in the status, rank 1 is the topmost process whose environment says
    RANK=1: it alone is stopped, not its child (same RANK), rank 0 or the launcher."""
    leader, rank0, rank1, child = _running_ranked(ws)
    r = ws.faultinject("nccl-stall", "--rank", "1")
    assert r.returncode == 0, r.stderr
    assert _said_pid(r.stdout) == rank1, r.stdout
    assert f"rank 1 (pid {rank1}, RANK=1 in its environment)" in r.stdout
    _stopped(rank1, resumed)
    assert {_state(p) for p in (leader, rank0, child)} <= {"S", "R"}


def test_nccl_stall_of_an_unknown_rank_names_the_ranks_seen(ws: Workspace) -> None:
    """A rank no process carries: one line naming the ranks seen; nothing is stopped."""
    leader, rank0, rank1, child = _running_ranked(ws)
    _one_line_refusal(ws.faultinject("nccl-stall", "--rank", "2"),
                      "job 'job' has no rank 2 (ranks seen: 0, 1)")
    assert {_state(p) for p in (leader, rank0, rank1, child)} <= {"S", "R"}


def test_nccl_stall_ignores_a_rank_the_launcher_inherited(ws: Workspace,
                                                          resumed: list[int]) -> None:
    """A launcher started with RANK=0 in its environment (a scheduler's) is not rank 0 when
    its children carry ranks 0 and 1: its child with RANK=0 is."""
    ws.run(ws.config({"command": ["env", "RANK=0", "sh", "-c",
                                  "RANK=0 sleep 300 & RANK=1 sleep 301 & wait"]}))
    s = wait_for(lambda: (st := ws.status()).get("state") in _LIVE and st, timeout=30,
                 what="started")
    leader = int(s["pid"])
    rank0 = wait_for(lambda: _named(["sleep", "300"], leader), what="rank 0")
    wait_for(lambda: _named(["sleep", "301"], leader), what="rank 1")
    assert _rank_env(leader) == "0"
    r = ws.faultinject("nccl-stall", "--rank", "0")
    assert r.returncode == 0, r.stderr
    assert _said_pid(r.stdout) == rank0
    _stopped(rank0, resumed)
    assert _state(leader) != "T"


def test_nccl_stall_refuses_a_rank_that_two_processes_carry(ws: Workspace) -> None:
    """Two unrelated processes with the same RANK: one line naming both, neither stopped."""
    ws.run(ws.config({"command": ["sh", "-c", "RANK=1 sleep 301 & RANK=1 sleep 302 & wait"]}))
    s = wait_for(lambda: (st := ws.status()).get("state") in _LIVE and st, timeout=30,
                 what="started")
    leader = int(s["pid"])
    pids = wait_for(lambda: all(found := [_named(["sleep", n], leader) for n in ("301", "302")])
                    and found, what="both")
    _one_line_refusal(ws.faultinject("nccl-stall", "--rank", "1"),
                      f"2 processes carry RANK=1 (pids {' '.join(map(str, sorted(pids)))})")
    assert all(_state(p) != "T" for p in pids)


@pytest.mark.parametrize("rank", ["-1", "x"])
def test_nccl_stall_refuses_a_rank_that_is_not_one(ws: Workspace, rank: str) -> None:
    """--rank must be a number >= 0; --rank is required."""
    _one_line_refusal(ws.faultinject("nccl-stall", "--rank", rank), "expected a rank")
    _one_line_refusal(ws.faultinject("nccl-stall"), "--rank")


def test_nccl_stall_with_seconds_resumes_the_rank(ws: Workspace) -> None:
    """--seconds: the rank is stopped, then running again when the drill returns."""
    _leader, _rank0, rank1, _child = _running_ranked(ws)
    r = ws.faultinject("nccl-stall", "--rank", "1", "--seconds", "0.3")
    assert r.returncode == 0, r.stderr
    assert _said_pid(r.stdout.split(";")[0]) == rank1
    assert "resumed (SIGCONT) after 0.3s" in r.stdout
    wait_for(lambda: _state(rank1) in ("S", "R"), timeout=5, what="rank 1 resumed")


def test_nccl_stall_of_a_torchrun_job_without_client_finds_the_worker_by_environment(
        ws: Workspace, resumed: list[int]) -> None:
    """A real torchrun DDP job that never beats: rank 1's worker (RANK=1 set by torchrun) is
    stopped and rank 0's is not, while rank 0 waits in its collective."""
    ws.run(ws.config({"command": _ddp(ws, "--steps", "100000", "--interval", "0.05")}))
    wait_for(lambda: (ws.ckpt / "step_10.pt").exists(), timeout=120, what="training")
    r = ws.faultinject("nccl-stall", "--rank", "1")
    assert r.returncode == 0, r.stderr
    pid = _said_pid(r.stdout)
    assert "RANK=1 in its environment" in r.stdout
    assert _rank_env(pid) == "1"
    _stopped(pid, resumed)
    leader = int(ws.status()["pid"])
    rank0 = [p.pid for p in psutil.Process(leader).children() if _rank_env(p.pid) == "0"]
    assert len(rank0) == 1 and _state(rank0[0]) != "T"
    assert _state(leader) != "T"


def test_nccl_stall_of_a_torchrun_job_with_client_takes_the_rank_from_status(
        ws: Workspace, resumed: list[int]) -> None:
    """A DDP job beating through the client: the pid is the one its status names for rank 1,
    which alone is stopped."""
    job = {"command": _ddp(ws, "--beat", "--steps", "100000", "--interval", "0.05"),
           "heartbeat": {"timeout": "120s"}}
    ws.run(ws.config(job))
    s = wait_for(lambda: (st := ws.status()).get("state") == "running"
                 and len(st.get("ranks", {})) == 2 and st, timeout=120, what="both ranks beating")
    r = ws.faultinject("nccl-stall", "--rank", "1")
    assert r.returncode == 0, r.stderr
    pid = _said_pid(r.stdout)
    assert pid == int(s["ranks"]["1"])
    assert f"rank 1 (pid {pid}) of job job" in r.stdout  # not found through the environment
    _stopped(pid, resumed)
    assert _state(int(s["ranks"]["0"])) != "T"


# --- log-line -----------------------------------------------------------------


def _running_printer(ws: Workspace, script: str = "echo started; exec sleep 300",
                     **job: object) -> str:
    """Start a job that prints, then waits; the path of its log once the output is in it."""
    ws.run(ws.config({"command": ["sh", "-c", script], **job}))
    s = wait_for(lambda: (st := ws.status()).get("state") in _LIVE and st.get("log") and st,
                 timeout=30, what="started")
    path = str(s["log"])
    wait_for(lambda: os.path.exists(path) and os.path.getsize(path) > 0, what="its output")
    return path


def test_log_line_appends_exactly_that_line_to_the_jobs_log(ws: Workspace) -> None:
    """--line: the log gains that line and a newline, after what the job wrote."""
    path = _running_printer(ws)
    line = "step 12 | loss 2.31 | custom marker \u00e9"
    r = ws.faultinject("log-line", "--line", line)
    assert r.returncode == 0, r.stderr
    assert path in r.stdout and "no built-in rule reads it" in r.stdout
    with open(path, encoding="utf-8") as f:
        assert f.read() == f"started\n{line}\n"


def test_log_line_in_the_middle_of_the_jobs_line_starts_a_line_of_its_own(
        ws: Workspace) -> None:
    """A job mid-line (no newline yet): the drill's line still stands on a line of its own."""
    path = _running_printer(ws, "printf partial; exec sleep 300")
    r = ws.faultinject("log-line", "--line", "RuntimeError: boom")
    assert r.returncode == 0, r.stderr
    with open(path, encoding="utf-8") as f:
        assert f.read() == "partial\nRuntimeError: boom\n"


def test_every_preset_fires_its_builtin_rule() -> None:
    """Each preset line, alone, fires the built-in rule it names (never an unreadable line)."""
    for name, (rule, line) in PRESETS.items():
        fired = compile_rules(BUILTIN).feed([line], 0.0)
        assert [m.rule for m in fired] == [rule], name
    assert {"nccl-timeout", "nccl-error", "cuda-oom", "illegal-memory", "ecc"} <= set(PRESETS)


def test_log_line_presets_append_their_real_format_lines(ws: Workspace) -> None:
    """--preset: each preset's line is appended as it is (rules off, so the job runs on)."""
    path = _running_printer(ws, logs={"builtin": False})
    for name in sorted(PRESETS):
        r = ws.faultinject("log-line", "--preset", name)
        assert r.returncode == 0, r.stderr
        assert f"preset {name}, built-in rule {PRESETS[name][0]} reads it" in r.stdout
    with open(path, encoding="utf-8") as f:
        assert f.read().splitlines() == ["started", *(PRESETS[n][1] for n in sorted(PRESETS))]


def test_log_line_preset_is_read_by_trainwatch(ws: Workspace) -> None:
    """The cuda-oom preset, appended to a running job's log, ends in an oom incident from the
    cuda_oom rule: trainwatch reads what the drill writes."""
    _running_printer(ws)
    r = ws.faultinject("log-line", "--preset", "cuda-oom")
    assert r.returncode == 0, r.stderr
    incident = wait_for(lambda: ws.incidents(), timeout=30, what="the oom incident")[0]
    assert incident["kind"] == "oom"
    assert '"cuda_oom"' in incident["evidence"]


@pytest.mark.parametrize(("args", "says"), [
    (("--line", "two\nlines"), "expected one line"),
    (("--line", "carriage\rreturn"), "expected one line"),
    (("--line", ""), "empty line"),
    (("--line", "   "), "empty line"),
    (("--line", "x" * 5000), "at most 4096 bytes"),
    (("--preset", "nope"), "invalid choice: 'nope'"),
    (("--line", "a", "--preset", "ecc"), "not allowed with argument"),
    ((), "one of the arguments --line --preset is required"),
])
def test_log_line_refuses_what_is_not_one_line(ws: Workspace, args: tuple[str, ...],
                                               says: str) -> None:
    """A line that is not one line, an unknown preset, or both/neither: one line, exit 2,
    and the job's log is untouched."""
    path = _running_printer(ws)
    _one_line_refusal(ws.faultinject("log-line", *args), says)
    with open(path, encoding="utf-8") as f:
        assert f.read() == "started\n"


def test_log_line_refuses_a_job_that_is_not_running(ws: Workspace) -> None:
    """A job that has exited (no trainwatch holds it): one line, exit 2, its log untouched."""
    p = ws.run(ws.config({"command": ["sh", "-c", "echo done"]}))
    assert p.wait(timeout=30) == 0
    path = str(ws.status()["log"])
    _one_line_refusal(ws.faultinject("log-line", "--line", "late"), "job job is not supervised")
    with open(path, encoding="utf-8") as f:
        assert f.read() == "done\n"
    _one_line_refusal(ws.faultinject("log-line", "--line", "x", job="other"),
                      "no status for job 'other'")
