"""trainwatch.snapshot.Snapshotter: maybe_save blocks only for staging, the save
lands in the background, coalescing, every_seconds, keep (standalone, never
under trainwatch), restore with and without trainwatch, the report to the
daemon's socket, rank 0 only, close waits, and one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from conftest import wait_for
from trainwatch.snapshot import Snapshotter, format


class Gate:
    """A leaf whose pickling (done in phase 2) waits for its event: it holds
    the background writer in the middle of a save, for as long as a test needs."""

    events: ClassVar[dict[str, threading.Event]] = {}

    def __init__(self, key: str, fail: bool = False) -> None:
        self.key, self.fail = key, fail

    def __deepcopy__(self, memo: dict[int, Any]) -> Gate:  # phase 1: never waits
        return Gate(self.key, self.fail)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.fail:
            raise RuntimeError("this leaf cannot be written")
        Gate.events[self.key].wait(30)
        return (Gate, (self.key,))


@pytest.fixture
def gate() -> Iterator[tuple[str, threading.Event]]:
    key, ev = f"g{len(Gate.events)}", threading.Event()
    Gate.events[key] = ev
    yield key, ev
    ev.set()


def steps(root: Path) -> list[int]:
    return [s for s, _ in format.published(root)]


def saved(snap: Snapshotter, step: int, state: Any) -> None:
    assert snap.maybe_save(step, state)
    assert snap.wait(30)


def test_maybe_save_returns_after_staging_and_the_save_lands_later(
        tmp_path: Path, gate: tuple[str, threading.Event]) -> None:
    """maybe_save returns while phase 2 is held; the snapshot holds the state as it
    was at the call, though the caller changed it in place right after."""
    key, ev = gate
    snap = Snapshotter(tmp_path, every_steps=1)
    w = np.arange(8.0)
    t = torch.arange(4.0)
    assert snap.maybe_save(1, {"w": w, "t": t, "gate": Gate(key)})
    w += 100
    t.add_(100)  # the training loop goes on with the same buffers
    assert steps(tmp_path) == [] and not snap.wait(0)
    ev.set()
    assert snap.wait(30)
    assert steps(tmp_path) == [1]
    step, state = Snapshotter(tmp_path, every_steps=1).restore() or (None, None)
    assert step == 1 and state["w"].tolist() == list(range(8))
    assert state["t"].tolist() == [0.0, 1.0, 2.0, 3.0]
    snap.close()


def test_a_save_due_while_one_is_in_flight_is_coalesced(
        tmp_path: Path, gate: tuple[str, threading.Event]) -> None:
    """Due while the last save is still writing: skipped and counted, not queued;
    the next due step after it finishes saves."""
    key, ev = gate
    snap = Snapshotter(tmp_path, every_steps=2)
    assert snap.maybe_save(2, {"g": Gate(key)})
    assert not snap.maybe_save(3, {"s": 3})  # not due
    assert not snap.maybe_save(4, {"s": 4})  # due, in flight: coalesced
    assert snap.coalesced == 1
    ev.set()
    assert snap.wait(30)
    assert not snap.maybe_save(5, {"s": 5})
    saved(snap, 6, {"s": 6})
    assert steps(tmp_path) == [2, 6] and snap.saves == 2
    snap.close()


def test_every_seconds_saves_when_the_interval_has_passed(tmp_path: Path) -> None:
    """every_seconds: not due at once, due once the interval passed, then not again at once."""
    snap = Snapshotter(tmp_path, every_seconds=1.0)
    assert not snap.maybe_save(1, {"s": 1})
    step = iter(range(2, 10**6))
    wait_for(lambda: snap.maybe_save(next(step), {"s": 0}), 10, "a timed save")
    assert snap.wait(30)
    assert not snap.maybe_save(next(step), {"s": 0})
    assert len(steps(tmp_path)) == 1
    snap.close()


def test_keep_deletes_old_snapshots_but_never_the_one_restored_from(tmp_path: Path) -> None:
    """Standalone keep=1: only the newest stays, plus the snapshot this run restored from;
    chunks nothing links any more are collected."""
    first = Snapshotter(tmp_path, every_steps=1, keep=5)
    for s in (1, 2):
        saved(first, s, {"w": np.full(100, s)})
    first.close()
    snap = Snapshotter(tmp_path, every_steps=1, keep=1)
    restored = snap.restore()
    assert restored is not None and restored[0] == 2
    for s in (3, 4, 5):
        saved(snap, s, {"w": np.full(100, s)})
    snap.close()
    assert steps(tmp_path) == [2, 5]
    linked = {c.name for _, f in format.published(tmp_path)
              for c in format.read(f).chunks().values()}
    stored = {n for d in (tmp_path / "blobs").iterdir() for n in os.listdir(d)}
    assert stored == linked
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_under_trainwatch_keep_is_written_not_applied(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With TRAINWATCH_JOB set nothing is deleted (the daemon's retention decides);
    keep goes into each manifest for it."""
    monkeypatch.setenv("TRAINWATCH_JOB", "job")
    snap = Snapshotter(tmp_path, every_steps=1, keep=1)
    for s in (1, 2, 3):
        saved(snap, s, {"s": s})
    snap.close()
    assert steps(tmp_path) == [1, 2, 3]
    assert {format.read(f).keep for _, f in format.published(tmp_path)} == {1}


def test_restore_standalone_takes_the_newest_complete_snapshot(tmp_path: Path) -> None:
    """Standalone restore: the newest snapshot that judges complete, tensors on CPU."""
    snap = Snapshotter(tmp_path, every_steps=1)
    assert Snapshotter(tmp_path, every_steps=1).restore() is None
    for s in (1, 2, 3):
        saved(snap, s, {"t": torch.full((3,), float(s), dtype=torch.bfloat16), "s": s})
    snap.close()
    newest = tmp_path / "snapshot-3"
    for name in os.listdir(newest):
        if name != "snapshot.json":
            os.unlink(newest / name)  # torn from outside
    again = Snapshotter(tmp_path, every_steps=1)
    step, state = again.restore() or (None, None)
    assert step == 2 and state["s"] == 2 and state["t"].dtype == torch.bfloat16
    assert again.restored_from == str(tmp_path / "snapshot-2")
    assert not again.maybe_save(2, {"s": 2})  # resumed at 2: not saved again


def test_restore_under_trainwatch_reads_only_resume_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under trainwatch: TRAINWATCH_RESUME_FROM unset means a fresh start even with
    snapshots on disk; set, that snapshot (not the newest) is restored."""
    snap = Snapshotter(tmp_path, every_steps=1)
    for s in (1, 2):
        saved(snap, s, {"s": s})
    snap.close()
    monkeypatch.setenv("TRAINWATCH_JOB", "job")
    assert Snapshotter(tmp_path, every_steps=1).restore() is None
    monkeypatch.setenv("TRAINWATCH_RESUME_FROM", str(tmp_path / "snapshot-1"))
    assert Snapshotter(tmp_path, every_steps=1).restore() == (1, {"s": 1})


def test_a_run_resumed_from_an_older_step_replaces_the_abandoned_timelines_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rolled back to 1, the run's new step 2 replaces the old snapshot-2 (which a
    rollback quarantined) instead of reporting the old content as its own; a
    standalone fresh start keeps an earlier run's snapshot and reports nothing."""
    snap = Snapshotter(tmp_path, every_steps=1)
    for s in (1, 2):
        saved(snap, s, {"timeline": "old", "s": s})
    snap.close()
    fresh = Snapshotter(tmp_path, every_steps=1)  # standalone, restore() never called
    saved(fresh, 2, {"timeline": "fresh", "s": 2})
    fresh.close()
    assert fresh.saves == 0
    assert Snapshotter(tmp_path, every_steps=1).restore() == (2, {"timeline": "old", "s": 2})
    monkeypatch.setenv("TRAINWATCH_JOB", "job")
    monkeypatch.setenv("TRAINWATCH_RESUME_FROM", str(tmp_path / "snapshot-1"))
    again = Snapshotter(tmp_path, every_steps=1)
    assert again.restore() == (1, {"timeline": "old", "s": 1})
    saved(again, 2, {"timeline": "new", "s": 2})
    again.close()
    assert again.saves == 1
    monkeypatch.setenv("TRAINWATCH_RESUME_FROM", str(tmp_path / "snapshot-2"))
    assert Snapshotter(tmp_path, every_steps=1).restore() == (2, {"timeline": "new", "s": 2})
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == []


def test_each_snapshot_is_reported_on_the_daemon_socket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After publish, a ckpt datagram naming the step and folder reaches TRAINWATCH_SOCKET."""
    d = tempfile.mkdtemp(prefix="tw", dir="/tmp")  # AF_UNIX paths are short
    try:
        path = os.path.join(d, "hb.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        srv.bind(path)
        srv.settimeout(30)
        monkeypatch.setenv("TRAINWATCH_SOCKET", path)
        snap = Snapshotter(tmp_path, every_steps=1)
        saved(snap, 7, {"s": 7})
        msg = json.loads(srv.recv(4096))
        assert msg == {"v": 1, "k": "ckpt", "rank": 0, "step": 7,
                       "path": str(tmp_path / "snapshot-7")}
        snap.close()
        srv.close()
    finally:
        shutil.rmtree(d)


def test_only_rank_zero_saves_every_rank_restores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rank=1 (or RANK=1) never saves; it restores what rank 0 saved."""
    zero = Snapshotter(tmp_path, every_steps=1, rank=0)
    saved(zero, 1, {"s": 1})
    zero.close()
    one = Snapshotter(tmp_path, every_steps=1, rank=1)
    assert not one.maybe_save(2, {"s": 2})
    monkeypatch.setenv("RANK", "1")
    by_env = Snapshotter(tmp_path, every_steps=1)
    assert not by_env.maybe_save(3, {"s": 3})
    assert steps(tmp_path) == [1]
    assert one.restore() == by_env.restore() == (1, {"s": 1})


def test_close_waits_for_the_save_in_flight(
        tmp_path: Path, gate: tuple[str, threading.Event]) -> None:
    """close() returns only once the save in flight is published."""
    key, ev = gate
    snap = Snapshotter(tmp_path, every_steps=1)
    assert snap.maybe_save(1, {"g": Gate(key)})
    threading.Timer(0.3, ev.set).start()
    snap.close()
    assert steps(tmp_path) == [1] and format.judge(tmp_path / "snapshot-1")[0]


def test_a_failed_write_is_counted_and_the_next_save_works(tmp_path: Path) -> None:
    """A phase 2 error never reaches the training loop: counted, logged, nothing published."""
    snap = Snapshotter(tmp_path, every_steps=1)
    saved(snap, 1, {"bad": Gate("none", fail=True)})
    assert snap.failures == 1 and "cannot be written" in (snap.last_error or "")
    saved(snap, 2, {"s": 2})
    snap.close()
    assert steps(tmp_path) == [2]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


@pytest.mark.parametrize(("kwargs", "said"), [
    ({}, "exactly one of every_steps and every_seconds"),
    ({"every_steps": 1, "every_seconds": 2}, "exactly one of"),
    ({"every_steps": 0}, "every_steps must be a positive"),
    ({"every_seconds": -1.0}, "every_seconds must be a positive"),
    ({"every_steps": 1, "keep": 0}, "keep must be a positive"),
    ({"every_steps": 1, "compress": "gzip"}, "compress must be None or 'zstd'"),
    ({"every_steps": 1, "remote": "bucket"}, "remote must be a URL"),
])
def test_user_mistakes_are_one_line_value_errors(tmp_path: Path, kwargs: dict[str, Any],
                                                 said: str) -> None:
    """Bad arguments: ValueError with one clear line."""
    with pytest.raises(ValueError, match=said) as e:
        Snapshotter(tmp_path, **kwargs)
    assert "\n" not in str(e.value)


def test_a_file_where_the_folder_should_be_is_one_line(tmp_path: Path) -> None:
    """dir naming a file, or a folder that cannot be made: ValueError with one line."""
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        Snapshotter(f, every_steps=1)
    with pytest.raises(ValueError, match="cannot create"):
        Snapshotter(f / "sub", every_steps=1)
