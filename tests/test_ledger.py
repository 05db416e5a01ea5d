"""The incident ledger on a real SQLite file in tmp_path."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from trainwatch.state.ledger import LEDGER_NAME, Ledger, Relaunch
from trainwatch.types import Fault, FaultKind, JobState

HANG = Fault(
    FaultKind.HANG,
    "llama",
    onset=100.0,
    evidence={"no_beat_for_s": 301.5, "ranks_stale": [1, 3], "learned": False},
    rank=1,
    onset_step=4200,
)
CRASH = Fault(FaultKind.CRASH, "bert", onset=5.0, evidence={"signal": "SIGKILL"})


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(tmp_path)
    yield led
    led.close()


def test_incident_round_trips_through_file(tmp_path: Path) -> None:
    """An incident written by one Ledger is read back, fields intact, by a new one on the file."""
    t0 = time.time()
    writer = Ledger(tmp_path)
    iid = writer.incident(
        HANG, "restart", "restart 1 of 10", attempt=2, detection_latency=0.25, backoff=10.0
    )
    writer.close()
    assert (tmp_path / LEDGER_NAME).is_file()

    reader = Ledger(tmp_path)
    try:
        (row,) = reader.incidents()
    finally:
        reader.close()
    assert row["id"] == iid
    assert t0 - 1 <= row["time"] <= time.time() + 1
    assert (row["job"], row["kind"], row["rank"], row["gpu"]) == ("llama", "hang", 1, None)
    assert row["evidence"] == {"no_beat_for_s": 301.5, "ranks_stale": [1, 3], "learned": False}
    assert (row["action"], row["decision"], row["attempt"]) == ("restart", "restart 1 of 10", 2)
    assert (row["onset_step"], row["detection_latency_s"], row["backoff_s"]) == (4200, 0.25, 10.0)
    assert row["observe_only"] is False and row["injected"] is False
    assert row["relaunched_at"] is None and row["steps_lost"] is None


def test_incidents_filter_by_job_in_order(ledger: Ledger) -> None:
    """incidents(job) returns only that job's incidents, oldest first; flags read back as bools."""
    a = ledger.incident(HANG, "restart", "r", attempt=0, detection_latency=0.1)
    b = ledger.incident(CRASH, "alert", "a", attempt=0, detection_latency=0.0, observe_only=True)
    c = ledger.incident(HANG, "restart", "r", attempt=1, detection_latency=0.1, injected=True)
    assert [r["id"] for r in ledger.incidents()] == [a, b, c]
    assert [r["id"] for r in ledger.incidents("llama")] == [a, c]
    (bert,) = ledger.incidents("bert")
    assert bert["observe_only"] is True and bert["injected"] is False
    assert ledger.incidents("llama")[1]["injected"] is True
    assert ledger.incidents("nobody") == []


def test_transitions_round_trip(tmp_path: Path) -> None:
    """State transitions are recorded in order, per job, and survive reopening the file."""
    writer = Ledger(tmp_path)
    writer.transition("llama", 0, None, JobState.STARTING, "launched")
    writer.transition("llama", 0, JobState.STARTING, JobState.RUNNING, "first beat")
    writer.transition("bert", 0, None, JobState.STARTING, "launched")
    writer.close()
    reader = Ledger(tmp_path)
    try:
        rows = reader.transitions("llama")
        assert [(r["attempt"], r["from_state"], r["to_state"], r["reason"]) for r in rows] == [
            (0, None, "starting", "launched"),
            (0, "starting", "running", "first beat"),
        ]
        assert len(reader.transitions()) == 3
    finally:
        reader.close()


def test_journal_mode_is_wal(tmp_path: Path, ledger: Ledger) -> None:
    """The ledger file is in WAL mode, as seen by any other connection to it."""
    other = sqlite3.connect(tmp_path / LEDGER_NAME)
    try:
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        other.close()


def test_readonly_reads_while_writer_open(tmp_path: Path, ledger: Ledger) -> None:
    """A readonly Ledger reads while a writer holds the file open, and sees later writes."""
    ledger.incident(HANG, "restart", "r", attempt=0, detection_latency=0.1)
    ro = Ledger(tmp_path, readonly=True)
    try:
        assert len(ro.incidents()) == 1
        ledger.incident(CRASH, "restart", "r", attempt=0, detection_latency=0.1)
        ledger.transition("bert", 0, None, JobState.STARTING, "launched")
        assert [r["job"] for r in ro.incidents()] == ["llama", "bert"]
        assert len(ro.transitions("bert")) == 1
        # A write through a readonly ledger fails; like any failed write it is
        # counted and survived rather than raised into the supervisor loop.
        ro.transition("bert", 0, JobState.STARTING, JobState.RUNNING, "nope")
        assert ro.errors == 1
    finally:
        ro.close()
    assert len(ledger.transitions()) == 1


def test_readonly_without_ledger_raises_not_found(tmp_path: Path) -> None:
    """Opening a readonly ledger where none exists raises FileNotFoundError and creates nothing."""
    with pytest.raises(FileNotFoundError):
        Ledger(tmp_path, readonly=True)
    assert not (tmp_path / LEDGER_NAME).exists()


def test_relaunched_fills_time_to_relaunch_and_steps_lost(ledger: Ledger) -> None:
    """relaunched() records when and from where the job came back, and how many steps were lost."""
    iid = ledger.incident(HANG, "restart", "r", attempt=0, detection_latency=0.1, backoff=10.0)
    other = ledger.incident(CRASH, "restart", "r", attempt=0, detection_latency=0.1)
    detected = ledger.incidents("llama")[0]["time"]
    ledger.relaunched(iid, Relaunch(detected + 12.5, "/ckpt/step_4000", 4000, 200))
    row = ledger.incidents("llama")[0]
    assert row["relaunched_at"] == detected + 12.5
    assert row["time_to_relaunch_s"] == pytest.approx(12.5)
    assert (row["resumed_from"], row["resumed_step"], row["steps_lost"]) == (
        "/ckpt/step_4000",
        4000,
        200,
    )
    untouched = ledger.incidents("bert")[0]
    assert untouched["id"] == other
    assert untouched["relaunched_at"] is None and untouched["time_to_relaunch_s"] is None


def test_relaunch_from_scratch_records_no_checkpoint(ledger: Ledger) -> None:
    """A relaunch with no checkpoint to resume from stores nulls for it but still times it."""
    iid = ledger.incident(CRASH, "restart", "r", attempt=0, detection_latency=0.0)
    detected = ledger.incidents()[0]["time"]
    ledger.relaunched(iid, Relaunch(detected + 3.0, None, None, None))
    row = ledger.incidents()[0]
    assert row["time_to_relaunch_s"] == pytest.approx(3.0)
    assert (row["resumed_from"], row["resumed_step"], row["steps_lost"]) == (None, None, None)


def test_integers_past_int64_are_clamped_and_kept_whole_in_the_evidence(ledger: Ledger) -> None:
    """A step, rank or gpu past int64 (a job's `beat(2**63)`) is stored clamped,
    the evidence keeps it whole, and nothing raises or counts as a failure."""
    huge = Fault(FaultKind.HANG, "j", onset=1.0, evidence={"step": 2**80, "rank": -(2**70)},
                 rank=2**70, gpu=2**64, onset_step=2**63)
    iid = ledger.incident(huge, "restart", "r", attempt=2**65, detection_latency=2**90)
    assert iid > 0 and ledger.errors == 0
    (row,) = ledger.incidents()
    top = 2**63 - 1
    assert (row["rank"], row["gpu"], row["onset_step"], row["attempt"]) == (top, top, top, top)
    assert row["evidence"] == {"step": 2**80, "rank": -(2**70)}
    ledger.relaunched(iid, Relaunch(time.time(), "/c", -(2**64), 2**64))
    ledger.transition("j", 2**64, None, JobState.STARTING, "launched")
    assert ledger.incidents()[0]["resumed_step"] == -(2**63)
    assert ledger.transitions()[0]["attempt"] == top and ledger.errors == 0


def test_evidence_json_cannot_encode_is_stored_as_its_repr(ledger: Ledger) -> None:
    """Evidence with keys of mixed types or odd values is stored, never raised."""
    odd = Fault(FaultKind.CRASH, "j", onset=1.0, evidence={1: "a", "b": {2, 3}})
    assert ledger.incident(odd, "restart", "r", attempt=0, detection_latency=0.0) > 0
    assert ledger.errors == 0
    assert "repr" in ledger.incidents()[0]["evidence"]


def test_a_ledger_that_cannot_be_opened_lives_in_memory_and_counts_each_write(
        tmp_path: Path) -> None:
    """When the file cannot be opened (here a folder stands where it should be, as a full
    or read-only state_dir would refuse it) the Ledger still opens, keeps incidents in
    memory for this process, and counts the open and every write as failed writes."""
    from trainwatch.state import statewrites

    (tmp_path / LEDGER_NAME).mkdir()
    before = statewrites.counts()["ledger"]
    led = Ledger(tmp_path)
    try:
        assert led.persistent is False and led.errors == 1
        iid = led.incident(CRASH, "restart", "r", attempt=0, detection_latency=0.0)
        led.relaunched(iid, Relaunch(time.time(), None, None, None))
        led.transition("bert", 0, None, JobState.STARTING, "launched")
        assert [r["id"] for r in led.incidents()] == [iid]
        assert led.incidents()[0]["relaunched_at"] is not None
        assert led.errors == 4
        assert statewrites.counts()["ledger"] == before + 4
    finally:
        led.close()


def test_ledger_files_are_0640_and_a_looser_ledger_is_tightened(tmp_path: Path) -> None:
    """ledger.db and the -wal and -shm files SQLite creates beside it are not
    world-readable, even under umask 022; a ledger left 0644 is brought to 0640."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        (tmp_path / LEDGER_NAME).touch(mode=0o644)
        os.chmod(tmp_path / LEDGER_NAME, 0o644)
        led = Ledger(tmp_path)
        led.transition("j", 0, None, JobState.STARTING, "launched")
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
        led.close()
    finally:
        os.umask(old)
    assert modes == {LEDGER_NAME: 0o640, f"{LEDGER_NAME}-wal": 0o640,
                     f"{LEDGER_NAME}-shm": 0o640}, modes
