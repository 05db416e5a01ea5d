"""Evidence before the kill (trainwatch.evidence): real processes, real py-spy,
real FIFOs; the capture is bounded by its deadline and never raises."""

from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import missing, wait_for
from trainwatch.evidence import flightrecorder, pyspy
from trainwatch.evidence.capture import Capture, Target
from trainwatch.evidence.show import folder, render
from trainwatch.sources.procstat import proc_stat

JOBS = Path(__file__).parent / "jobs"
TARGET = JOBS / "stacktarget.py"
FRPIPE = JOBS / "frpipe.py"
Start = Callable[..., "subprocess.Popen[bytes]"]


@pytest.fixture
def pyspy_bin() -> str:
    found = pyspy.find()
    if found is None:
        missing("py-spy is not installed (pip install py-spy; in the dev extra)")
        raise AssertionError("unreachable")
    return found


@pytest.fixture
def start() -> Iterator[Start]:
    """Start a real process; with ready=True wait for its "ready" line. All are killed after."""
    started: list[subprocess.Popen[bytes]] = []

    def go(*argv: str | Path, ready: bool = True) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
        started.append(p)
        if ready:
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        return p

    yield go
    for p in started:
        p.kill()  # SIGKILL ends a stopped process too
        p.wait()
        if p.stdout:
            p.stdout.close()


def stop(p: subprocess.Popen[bytes]) -> None:
    p.send_signal(signal.SIGSTOP)
    wait_for(lambda: (proc_stat(p.pid) or ("?",))[0] == "T", what=f"{p.pid} stopped")


def capture(c: Capture) -> dict[str, Any]:
    c.start()
    assert c.wait(30), "the capture never finished"
    assert c.done and c.summary is not None
    return c.summary


def three_ranks(start: Start, tmp: Path) -> tuple[Capture, list[int]]:
    """Ranks 0 and 1 wait in barrier_wait; rank 2 is in train_step and stopped."""
    ps = [start(sys.executable, TARGET, "wait", "3"), start(sys.executable, TARGET, "wait", "3"),
          start(sys.executable, TARGET, "train", "3")]
    stop(ps[2])
    log = tmp / "job.log"
    log.write_text("".join(f"[rank{i % 3}]: step {i}\n" for i in range(10)) + "plain line\n")
    c = Capture(tmp / "incident", [Target(p.pid, r) for r, p in enumerate(ps)], log,
                timeout=5.0, named=2)
    return c, [p.pid for p in ps]


def row(pyspy_of: dict[str, Any]) -> tuple[bool, str | None]:
    return pyspy_of["ok"], pyspy_of["mode"]


def test_capture_reads_every_rank_and_names_the_stopped_odd_one(
        pyspy_bin: str, start: Start, tmp_path: Path) -> None:
    """Stacks of all ranks (the stopped one read --nonblocking), the verdict names the
    odd one, the files are written private, and the deadline holds."""
    c, pids = three_ranks(start, tmp_path)
    s = capture(c)
    assert s["errors"] == [] and s["deadline_hit"] is False
    assert s["seconds"] < 5.0
    t = s["targets"]
    assert [x["pid"] for x in t] == pids and t[2]["state"] == "T"
    # The waiting ranks sleep in a loop: on a busy machine one just woken reads R.
    assert [x["state"] in ("S", "R") for x in t[:2]] == [True, True]
    assert [row(x["py_spy"]) for x in t] == [(True, "blocking"), (True, "blocking"),
                                             (True, "nonblocking")]
    assert all(isinstance(x["cpu_seconds"], float) for x in t)
    v = s["verdict"]
    assert (v["suspects"], v["decided_by"], v["agrees"]) == ([2], "majority", True)
    out = tmp_path / "incident"
    for r in range(3):
        assert f"stacks/rank{r}.json" in s["files"] and f"stacks/rank{r}.txt" in s["files"]
    txt = (out / "stacks" / "rank2.txt").read_text()
    assert '"MainThread"' in txt and "train_step (stacktarget.py:" in txt
    assert "barrier_wait (stacktarget.py:" in (out / "stacks" / "rank0.txt").read_text()
    assert json.loads((out / "evidence.json").read_text()) == json.loads(json.dumps(s))
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    for f in s["files"]:
        assert stat.S_IMODE((out / f).stat().st_mode) == 0o640, f
    assert not [p for p in out.rglob(".*")], "a temp file was left"
    assert proc_stat(pids[2])[0] == "T"  # type: ignore[index]  # py-spy left it stopped


def test_non_python_and_gone_targets_are_errors_not_hangs(
        pyspy_bin: str, start: Start, tmp_path: Path) -> None:
    """`sleep` (not Python) and a pid that is gone each give an error entry; the rest
    is captured within the deadline."""
    py = start(sys.executable, TARGET, "train", "2")
    sleeper = start("sleep", "100", ready=False)
    gone = subprocess.Popen(["true"])
    gone.wait()
    s = capture(Capture(tmp_path / "i", [Target(py.pid, 0), Target(sleeper.pid, None),
                                         Target(gone.pid, 1)], None, timeout=5.0))
    assert s["seconds"] < 5.0 and s["deadline_hit"] is False
    ok, launcher, dead = s["targets"]
    assert ok["py_spy"]["ok"] is True
    assert launcher["file"] == f"pid{sleeper.pid}" and launcher["py_spy"]["ok"] is False
    assert "python" in launcher["py_spy"]["error"].lower()
    assert dead["state"] is None and dead["py_spy"]["error"] == "process gone"
    assert dead["py_spy"]["tries"] == []
    assert "no stack for rank 1" in s["verdict"]["why"]
    assert s["log_tail"] == {"error": "no log file"}


def test_a_hung_py_spy_is_killed_at_the_deadline(start: Start, tmp_path: Path) -> None:
    """A py-spy that never returns is killed at the deadline: the capture ends, says so."""
    py = start(sys.executable, TARGET, "train", "1")
    hang = tmp_path / "py-spy"
    hang.write_text("#!/bin/sh\nexec sleep 100\n")
    hang.chmod(0o755)
    s = capture(Capture(tmp_path / "i", [Target(py.pid, 0)], None, timeout=1.0,
                        pyspy_path=str(hang)))
    assert s["deadline_hit"] is True
    assert 1.0 <= s["seconds"] < 4.0
    assert s["targets"][0]["py_spy"]["error"] == "deadline: py-spy killed"
    assert not (tmp_path / "i" / "stacks" / "rank0.json").exists()


def test_missing_py_spy_is_recorded_and_the_rest_still_captured(
        start: Start, tmp_path: Path) -> None:
    """No py-spy binary: an error per target, the log tail and summary still written."""
    py = start(sys.executable, TARGET, "train", "1")
    log = tmp_path / "log"
    log.write_text("last words\n")
    s = capture(Capture(tmp_path / "i", [Target(py.pid, 0)], log,
                        pyspy_path=str(tmp_path / "no" / "py-spy")))
    assert s["targets"][0]["py_spy"]["error"].startswith("cannot run py-spy")
    assert (tmp_path / "i" / "log-tail.txt").read_text() == "last words\n"
    assert (tmp_path / "i" / "evidence.json").exists()


def test_capture_never_raises_when_it_cannot_write(tmp_path: Path) -> None:
    """An output folder that cannot be made is an error in the summary, not an exception."""
    (tmp_path / "file").write_text("")
    s = capture(Capture(tmp_path / "file" / "incident", [Target(os.getpid(), 0)], None))
    assert s["errors"] and any("capture failed" in e for e in s["errors"])


def test_log_tail_reads_the_end_and_splits_ranks(tmp_path: Path) -> None:
    """The last lines, and each rank's ([rankN]: from PyTorch, [defaultN]: from torchrun
    --tee), from the end of a file larger than the window read."""
    log = tmp_path / "job.log"
    with log.open("w") as f:
        f.write("FIRST LINE\n" + ("x" * 99 + "\n") * 30_000)  # 3 MB before the tail
        for i in range(20):
            f.write(f"[rank0]:[W step {i}] zero\n[default1]:one {i}\nplain {i}\n")
    s = capture(Capture(tmp_path / "i", [], log, log_lines=4))
    out = tmp_path / "i"
    assert (out / "log-tail.txt").read_text().splitlines() == [
        "plain 18", "[rank0]:[W step 19] zero", "[default1]:one 19", "plain 19"]
    assert (out / "log-tail.rank0.txt").read_text().splitlines() == [
        f"[rank0]:[W step {i}] zero" for i in range(16, 20)]
    assert (out / "log-tail.rank1.txt").read_text().splitlines() == [
        f"[default1]:one {i}" for i in range(16, 20)]
    assert s["log_tail"]["ranks"] == [0, 1] and s["verdict"] is None
    assert "FIRST LINE" not in (out / "log-tail.txt").read_text()


def test_missing_log_file_is_an_error_line(tmp_path: Path) -> None:
    """A log path that does not exist is recorded, nothing else is lost."""
    s = capture(Capture(tmp_path / "i", [], tmp_path / "absent.log"))
    assert "absent.log" in s["log_tail"]["error"] and not (tmp_path / "i" / "log-tail.txt").exists()


def test_flight_recorder_dump_is_triggered_waited_for_and_collected(
        pyspy_bin: str, start: Start, tmp_path: Path) -> None:
    """A pipe with a reader dumps and the dump is copied whole; a stopped rank's pipe is not
    waited for; a pipe without a reader is skipped; pipes themselves are not copied."""
    fr = tmp_path / "fr"
    fr.mkdir()
    prefix = str(fr / flightrecorder.PREFIX)
    r0 = start(sys.executable, FRPIPE, prefix, "0")
    r1 = start(sys.executable, FRPIPE, prefix, "1")
    stop(r1)
    os.mkfifo(f"{prefix}2.pipe")  # its rank is gone: no reader
    (fr / "notes.txt").write_text("kept\n")
    s = capture(Capture(tmp_path / "i", [Target(r0.pid, 0), Target(r1.pid, 1)], None,
                        fr_dir=fr, timeout=5.0))
    outcomes = {p["pipe"]: p["outcome"] for p in s["flight_recorder"]["pipes"]}
    assert outcomes == {"nccl_trace_rank_0.pipe": "dumped",
                        "nccl_trace_rank_1.pipe": "skipped: rank stopped",
                        "nccl_trace_rank_2.pipe": "skipped: no reader"}
    assert s["deadline_hit"] is False and s["seconds"] < 5.0
    assert sorted(s["flight_recorder"]["files"]) == ["nccl_trace_rank_0", "notes.txt"]
    got = (tmp_path / "i" / "flight-recorder" / "nccl_trace_rank_0").read_bytes()
    dump = pickle.loads(got)  # whole: the capture waited for the second part
    assert (dump["rank"], dump["dump"], len(dump["entries"])) == (0, 1, 100)
    assert "flight-recorder/nccl_trace_rank_0" in s["files"]
    assert not list((tmp_path / "i" / "flight-recorder").glob("*.pipe"))


def test_a_rank_that_never_dumps_holds_the_capture_only_to_the_deadline(
        start: Start, tmp_path: Path) -> None:
    """A running rank whose pipe is never read: the wait ends at the deadline."""
    fr = tmp_path / "fr"
    fr.mkdir()
    start(sys.executable, FRPIPE, str(fr / flightrecorder.PREFIX), "0", "--mute")
    s = capture(Capture(tmp_path / "i", [], None, fr_dir=fr, timeout=1.0))
    assert s["flight_recorder"]["pipes"][0]["outcome"] == "timeout"
    assert s["deadline_hit"] is True and 1.0 <= s["seconds"] < 4.0


def test_flight_recorder_env_sets_old_and_new_names(tmp_path: Path) -> None:
    """Both spellings of the buffer and dump path, dump on timeout and the pipe prefix."""
    e = flightrecorder.env(tmp_path)
    prefix = f"{tmp_path}/nccl_trace_rank_"
    assert e == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000",
                 "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
                 "TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": prefix}


def test_native_is_skipped_for_a_stopped_process_and_said_so(
        pyspy_bin: str, start: Start, tmp_path: Path) -> None:
    """native=True: a running rank is read with --native, a stopped one without (noted)."""
    run = start(sys.executable, TARGET, "train", "1")
    held = start(sys.executable, TARGET, "train", "1")
    stop(held)
    s = capture(Capture(tmp_path / "i", [Target(run.pid, 0), Target(held.pid, 1)], None,
                        native=True, timeout=5.0))
    a, b = (t["py_spy"] for t in s["targets"])
    assert (a["ok"], a["mode"], a["native_skipped"]) == (True, "native", False)
    assert (b["ok"], b["mode"], b["native_skipped"]) == (True, "nonblocking", True)


def test_py_spy_errors_read_as_one_line() -> None:
    """py-spy's error, its causes and no backtrace, repeated causes once."""
    err = ("Error: Failed to get stack traces\n\nCaused by:\n    0: Failed to suspend process\n"
           "    1: unexpected waitpid result\n\nStack backtrace:\n   0: anyhow::x\n")
    assert pyspy.error_of(err, 1) == ("Failed to get stack traces: Failed to suspend process: "
                                      "unexpected waitpid result")
    assert pyspy.error_of("", 3) == "py-spy exited with status 3"


def test_show_renders_the_incident_and_its_evidence(
        pyspy_bin: str, start: Start, tmp_path: Path) -> None:
    """`incidents --show`: the row, the verdict and why, the rank named, states, stacks,
    log tail and files."""
    state = tmp_path / "state"
    where = folder(str(state), "train", 7)
    assert where == state / "jobs" / "train" / "incidents" / "7"
    c, _ = three_ranks(start, tmp_path)
    c.out = where
    capture(c)
    text = render({"id": 7, "time": 1.8e9, "job": "train", "kind": "nccl_stall", "rank": 2,
                   "gpu": None, "action": "restart", "decision": "stall 12s",
                   "evidence": json.dumps({"step": 41, "stopped": [2]})}, where)
    for want in ("incident 7 at", "  kind: nccl_stall", "  decision: stall 12s", "    step: 41",
                 "verdict: rank 2 (decided by majority)",
                 "rank named by the step/CPU evidence: 2 (the stacks agree)",
                 "state T", "py-spy nonblocking", "  rank0, rank1:",
                 "train_step (stacktarget.py:", "barrier_wait (stacktarget.py:",
                 "  [rank0]: step 9", "  plain line", "stacks/rank2.json", "evidence.json"):
        assert want in text, want
    assert "gpu:" not in text  # empty fields are left out


def test_show_without_evidence_says_so(tmp_path: Path) -> None:
    """An incident with no folder prints the row and one line, no traceback."""
    text = render({"id": 1, "time": 1.8e9, "job": "j", "kind": "hang", "evidence": "{}"},
                  tmp_path / "none")
    assert "incident 1" in text and "stacks and log tail: none kept for this hang" in text


def test_folder_refuses_a_path_as_job_name() -> None:
    """A job name cannot climb out of the state folder."""
    with pytest.raises(ValueError):
        folder("/s", "../x", 1)
