"""The incident ledger on a real SQLite file in tmp_path."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from trainwatch.ledger import LEDGER_NAME, Ledger, Relaunch
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
