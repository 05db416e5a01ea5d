"""The checkpoint catalog on real files and directories in tmp_path: which
checkpoints are complete and good, what it remembers across instances, and that
it never touches a checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from trainwatch.config import Checkpoints
from trainwatch.state.catalog import Catalog

NOW = 1_700_000_000.0  # the injected wall clock


def _clock() -> float:
    return NOW


def _make(root: Path, name: str, kind: str, age: float = 3600.0, data: bytes = b"w") -> Path:
    """A checkpoint (a file, or a directory with one file), last modified ``age`` ago."""
    path = root / name
    if kind == "file":
        path.write_bytes(data)
        os.utime(path, (NOW - age, NOW - age))
    else:
        path.mkdir()
        inner = path / "model.pt"
        inner.write_bytes(data)
        os.utime(inner, (NOW - age, NOW - age))
        os.utime(path, (NOW - age, NOW - age))
    return path


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state" / "catalog.json"


def _catalog(
    ckpt_dir: Path,
    state: Path,
    marker: str | None = None,
    quiet_for: float | None = None,
    bad_after: int = 3,
) -> Catalog:
    spec = Checkpoints(
        dir=str(ckpt_dir),
        pattern="step_{step}",
        marker=marker,
        quiet_for=quiet_for,
        bad_after=bad_after,
    )
    return Catalog(spec, state, clock=_clock)


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_finds_checkpoints_matching_pattern(ckpt_dir: Path, state: Path, kind: str) -> None:
    """Entries named by the pattern are found oldest first; other names are ignored."""
    for step in (100, 20, 3):
        _make(ckpt_dir, f"step_{step}", kind)
    (ckpt_dir / "notes.txt").write_text("x")
    (ckpt_dir / "step_x").write_text("x")
    (ckpt_dir / "step_5.tmp").write_text("x")
    cat = _catalog(ckpt_dir, state, quiet_for=60.0)
    entries = cat.entries()
    assert [e.step for e in entries] == [3, 20, 100]
    assert [e.path for e in entries] == [str(ckpt_dir / f"step_{s}") for s in (3, 20, 100)]
    assert all(e.good for e in entries)


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_newest_complete_is_last_good(ckpt_dir: Path, state: Path, kind: str) -> None:
    """last_good() is the newest complete checkpoint."""
    for step in (10, 30, 20):
        _make(ckpt_dir, f"step_{step}", kind)
    good = _catalog(ckpt_dir, state, quiet_for=60.0).last_good()
    assert good is not None
    assert good.step == 30
    assert good.path == str(ckpt_dir / "step_30")


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_half_written_newest_is_skipped(ckpt_dir: Path, state: Path, kind: str) -> None:
    """A newest checkpoint not reported, without marker and still changing is passed over."""
    _make(ckpt_dir, "step_10", kind, age=3600.0)
    _make(ckpt_dir, "step_20", kind, age=5.0)  # being written
    cat = _catalog(ckpt_dir, state, quiet_for=60.0, marker="COMPLETE")
    newest = cat.entries()[-1]
    assert (newest.step, newest.complete, newest.why) == (
        20, False, "changed within 60s (complete once unchanged that long)")
    good = cat.last_good()
    assert good is not None and good.step == 10


def test_without_evidence_nothing_is_complete(ckpt_dir: Path, state: Path) -> None:
    """Layout generic with no report, marker or quiet_for: nothing is complete, however old
    (auto judges a job that never reports by quiet time: test_numbered.py)."""
    _make(ckpt_dir, "step_10", "file", age=1e6)
    cat = Catalog(Checkpoints(dir=str(ckpt_dir), layout="generic"), state, clock=_clock)
    assert cat.last_good() is None
    assert [e.complete for e in cat.entries()] == [False]


def test_marker_inside_directory_makes_it_complete(ckpt_dir: Path, state: Path) -> None:
    """A directory checkpoint is complete once its marker file exists inside it."""
    path = _make(ckpt_dir, "step_10", "dir", age=0.0)
    cat = _catalog(ckpt_dir, state, marker="COMPLETE")
    assert cat.last_good() is None
    (path / "COMPLETE").touch()
    good = cat.last_good()
    assert good is not None and good.step == 10
    assert good.why == "marker COMPLETE"


def test_marker_beside_file_makes_it_complete(ckpt_dir: Path, state: Path) -> None:
    """A file checkpoint is complete once <name><marker> exists beside it."""
    _make(ckpt_dir, "step_10", "file", age=0.0)
    cat = _catalog(ckpt_dir, state, marker=".done")
    assert cat.last_good() is None
    (ckpt_dir / "step_10.done").touch()
    good = cat.last_good()
    assert good is not None and good.step == 10
    assert [e.step for e in cat.entries()] == [10]  # the marker is not a checkpoint


@pytest.mark.parametrize("kind", ["file", "dir"])
@pytest.mark.parametrize(("age", "complete"), [(59.0, False), (60.0, True), (600.0, True)])
def test_quiet_for_uses_mtime(
    ckpt_dir: Path, state: Path, kind: str, age: float, complete: bool
) -> None:
    """A checkpoint unchanged (by mtime) for quiet_for seconds of the clock is complete."""
    _make(ckpt_dir, "step_10", kind, age=age)
    (entry,) = _catalog(ckpt_dir, state, quiet_for=60.0).entries()
    assert entry.complete is complete


def test_recent_file_deep_in_directory_keeps_it_incomplete(ckpt_dir: Path, state: Path) -> None:
    """A directory with one recently changed file inside, even nested, is not yet quiet."""
    path = _make(ckpt_dir, "step_10", "dir", age=3600.0)
    (path / "shards").mkdir()
    shard = path / "shards" / "part-7"
    shard.write_bytes(b"x")
    os.utime(shard, (NOW - 1.0, NOW - 1.0))
    os.utime(path / "shards", (NOW - 3600.0, NOW - 3600.0))
    os.utime(path, (NOW - 3600.0, NOW - 3600.0))
    (entry,) = _catalog(ckpt_dir, state, quiet_for=60.0).entries()
    assert not entry.complete


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_empty_checkpoint_is_not_good(ckpt_dir: Path, state: Path, kind: str) -> None:
    """An empty file or directory is never good, even when reported or marked."""
    empty = ckpt_dir / "step_20"
    if kind == "file":
        empty.touch()
        (ckpt_dir / "step_20.done").touch()
    else:
        empty.mkdir()
    os.utime(empty, (NOW - 3600.0, NOW - 3600.0))
    _make(ckpt_dir, "step_10", kind)
    cat = _catalog(ckpt_dir, state, marker=".done", quiet_for=60.0)
    cat.report(20, str(empty))
    newest = cat.entries()[-1]
    assert (newest.step, newest.good, newest.why) == (20, False, "empty")
    good = cat.last_good()
    assert good is not None and good.step == 10


def test_reported_checkpoints_persist_across_instances(ckpt_dir: Path, state: Path) -> None:
    """A checkpoint the job reported is complete, also for a new Catalog on the same state file."""
    _make(ckpt_dir, "step_10", "file", age=0.0)
    _make(ckpt_dir, "step_20", "dir", age=0.0)
    cat = _catalog(ckpt_dir, state)
    assert cat.last_good() is None
    cat.report(20, str(ckpt_dir / "step_20"))
    assert state.exists()
    again = _catalog(ckpt_dir, state)
    good = again.last_good()
    assert good is not None
    assert (good.step, good.why) == (20, "reported by the job")
    assert again.reported == {20: str(ckpt_dir / "step_20")}


def test_reported_checkpoint_outside_dir_is_not_trusted(
    tmp_path: Path, ckpt_dir: Path, state: Path
) -> None:
    """With checkpoints.dir set, a report of a path elsewhere is not a checkpoint of this job."""
    elsewhere = tmp_path / "scratch"
    elsewhere.mkdir()
    path = _make(elsewhere, "step_40", "file", age=0.0)
    cat = _catalog(ckpt_dir, state)
    cat.report(40, str(path))
    assert cat.last_good() is None


def test_without_a_dir_reported_checkpoints_are_the_catalog(tmp_path: Path, state: Path) -> None:
    """With no checkpoints.dir, the job's reports are what the catalog knows, while they exist."""
    path = _make(tmp_path, "step_40", "file", age=0.0)
    cat = Catalog(Checkpoints(dir=None), state)
    cat.report(40, str(path))
    good = cat.last_good()
    assert good is not None and good.path == str(path)
    path.unlink()
    assert cat.last_good() is None


def test_state_saved_for_another_owner_is_set_aside(ckpt_dir: Path, state: Path) -> None:
    """A job of the same name in another project does not inherit this one's reports."""
    path = _make(ckpt_dir, "step_100", "file", age=0.0)
    mine = Catalog(Checkpoints(dir=str(ckpt_dir)), state, owner="project-a")
    mine.report(100, str(path))
    assert mine.last_good() is not None
    theirs = Catalog(Checkpoints(dir=str(ckpt_dir)), state, owner="project-b", clock=_clock)
    assert theirs.reported == {} and theirs.last_good() is None  # fresh: not reported, no marker


def test_failed_starts_mark_bad_and_fall_back(ckpt_dir: Path, state: Path) -> None:
    """bad_after failed starts mark a checkpoint bad (persisted); last_good falls back past it."""
    _make(ckpt_dir, "step_10", "file")
    _make(ckpt_dir, "step_20", "file")
    cat = _catalog(ckpt_dir, state, quiet_for=60.0, bad_after=3)
    assert cat.start_failed(20) is False
    assert cat.start_failed(20) is False
    still = cat.last_good()
    assert still is not None and still.step == 20
    assert cat.start_failed(20) is True
    assert cat.start_failed(20) is False  # already bad: not newly so
    good = cat.last_good()
    assert good is not None and good.step == 10
    bad = cat.entries()[-1]
    assert (bad.step, bad.bad, bad.good) == (20, True, False)
    assert bad.why.startswith("bad: ")

    again = _catalog(ckpt_dir, state, quiet_for=60.0, bad_after=3)
    assert 20 in again.bad
    good = again.last_good()
    assert good is not None and good.step == 10


def test_failed_start_count_persists_across_instances(ckpt_dir: Path, state: Path) -> None:
    """Failed starts are counted across daemon restarts, not only within one Catalog."""
    _make(ckpt_dir, "step_10", "file")
    _catalog(ckpt_dir, state, quiet_for=60.0, bad_after=2).start_failed(10)
    assert _catalog(ckpt_dir, state, quiet_for=60.0, bad_after=2).start_failed(10) is True


def test_start_succeeded_resets_the_count(ckpt_dir: Path, state: Path) -> None:
    """A successful start clears the failed-start count, so failures must again be in a row."""
    _make(ckpt_dir, "step_10", "file")
    cat = _catalog(ckpt_dir, state, quiet_for=60.0, bad_after=2)
    assert cat.start_failed(10) is False
    cat.start_succeeded(10)
    assert cat.failed_starts == {}
    assert _catalog(ckpt_dir, state, quiet_for=60.0, bad_after=2).failed_starts == {}
    assert cat.start_failed(10) is False
    assert cat.last_good() is not None


@pytest.mark.parametrize(
    ("before", "expected"),
    [(None, 30), (31, 30), (30, 20), (21, 20), (20, 10), (11, 10), (10, None), (0, None)],
)
def test_last_good_before_step_is_strictly_before(
    ckpt_dir: Path, state: Path, before: int | None, expected: int | None
) -> None:
    """last_good(before_step=s) is the newest good checkpoint with step strictly below s."""
    for step in (10, 20, 30):
        _make(ckpt_dir, f"step_{step}", "file")
    good = _catalog(ckpt_dir, state, quiet_for=60.0).last_good(before_step=before)
    assert (good.step if good else None) == expected


def test_missing_directory_means_no_checkpoints(tmp_path: Path, state: Path) -> None:
    """A checkpoint dir that does not exist yet gives no entries rather than an error."""
    cat = _catalog(tmp_path / "not-yet", state, quiet_for=60.0)
    assert cat.entries() == []
    assert cat.last_good() is None


def test_corrupt_state_file_is_survived(ckpt_dir: Path, state: Path) -> None:
    """An unreadable state file starts the catalog empty instead of raising."""
    state.parent.mkdir(parents=True)
    state.write_text("{not json")
    _make(ckpt_dir, "step_10", "file")
    cat = _catalog(ckpt_dir, state, quiet_for=60.0)
    assert cat.reported == {} and cat.bad == {}
    assert cat.last_good() is not None


def _snapshot(root: Path) -> dict[str, tuple[bytes | None, int, int]]:
    out: dict[str, tuple[bytes | None, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.stat()
            content = p.read_bytes() if p.is_file() else None
            out[str(p.relative_to(root))] = (content, st.st_mtime_ns, st.st_mode)
    return out


def test_catalog_never_deletes_or_modifies_checkpoints(ckpt_dir: Path, state: Path) -> None:
    """No catalog operation changes a checkpoint file's name, content, mtime or mode."""
    _make(ckpt_dir, "step_10", "dir", data=b"ten")
    _make(ckpt_dir, "step_20", "dir", data=b"twenty")
    _make(ckpt_dir, "step_30", "dir", age=1.0, data=b"thirty")  # half-written
    (ckpt_dir / "step_40").mkdir()  # empty
    (ckpt_dir / "step_10" / "COMPLETE").touch()
    before = _snapshot(ckpt_dir)

    cat = _catalog(ckpt_dir, state, marker="COMPLETE", quiet_for=60.0, bad_after=2)
    cat.entries()
    cat.report(20, str(ckpt_dir / "step_20"))
    cat.last_good()
    cat.last_good(before_step=15)
    cat.start_failed(20)
    cat.start_failed(20)  # now bad: quarantined, not removed
    cat.start_failed(10)
    cat.start_succeeded(10)
    again = _catalog(ckpt_dir, state, marker="COMPLETE", quiet_for=60.0, bad_after=2)
    again.entries()
    again.last_good()

    assert _snapshot(ckpt_dir) == before
    assert not state.is_relative_to(ckpt_dir)


def test_a_flood_of_reports_is_bounded_and_written_once_a_second(
    ckpt_dir: Path, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4,000 reports: the refused ones (outside the dir, too long) are said so, the newest
    MAX_REPORTS are kept, and the state file is rewritten once per SAVE_EVERY, not per report."""
    from trainwatch.state import catalog
    from trainwatch.state.catalog import MAX_PATH, MAX_REPORTS

    monkeypatch.setattr(catalog, "LOOKS_BURST", 1e9)  # each looked for: that bound is below
    cat = _catalog(ckpt_dir, state)
    assert not cat.report(1, "/elsewhere/step_1")
    assert not cat.report(1, str(ckpt_dir / ("x" * MAX_PATH)))
    for step in range(4000):
        (ckpt_dir / f"step_{step}").touch()  # a report is looked for
    for step in range(4000):
        assert cat.report(step, str(ckpt_dir / f"step_{step}"))
    assert len(cat.reported) == MAX_REPORTS and min(cat.reported) == 4000 - MAX_REPORTS
    on_disk = Catalog(Checkpoints(dir=str(ckpt_dir)), state, owner=cat.owner)
    assert list(on_disk.reported) == [0]  # only the first write happened within the second
    cat.flush(force=True)
    on_disk = Catalog(Checkpoints(dir=str(ckpt_dir)), state, owner=cat.owner)
    assert on_disk.reported == cat.reported


def test_reports_are_looked_for_at_a_bounded_rate_and_one_with_nothing_there_refused(
    ckpt_dir: Path, state: Path
) -> None:
    """A report with nothing at its path is refused as missing (it was taken, and logged
    as a complete checkpoint); past LOOKS_BURST at once, reports are refused unlooked
    (each look is a call to the job's hand), and looked for again as time passes."""
    from trainwatch.state import catalog

    now = [100.0]
    cat = Catalog(Checkpoints(dir=str(ckpt_dir)), state, clock=lambda: now[0])
    assert not cat.report(1, str(ckpt_dir / "step_1")) and cat.refusal == "missing"
    (ckpt_dir / "step_2").touch()
    took = [cat.report(2, str(ckpt_dir / "step_2")) for _ in range(200)]
    assert took.count(True) == catalog.LOOKS_BURST - 1 and cat.refusal == "too_many"
    now[0] += 1.0
    took = [cat.report(2, str(ckpt_dir / "step_2")) for _ in range(200)]
    assert took.count(True) == catalog.LOOKS_PER_S


def test_a_report_is_written_without_fsync_and_a_bad_mark_or_resume_with_it(
    ckpt_dir: Path, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reports alone skip the fsyncs (a power loss costs a report, learned again from the
    folder); a bad mark, a failed start and a resume are written durably, as is the close."""
    from trainwatch.state import atomic
    from trainwatch.state import catalog as catalog_module

    writes: list[bool] = []
    real = atomic.write_json

    def spy(path: Path, obj: object, durable: bool = True, mode: int = atomic.FILE_MODE) -> None:
        writes.append(durable)
        real(path, obj, durable=durable, mode=mode)  # the real write, recorded

    monkeypatch.setattr(catalog_module.atomic, "write_json", spy)
    _make(ckpt_dir, "step_10", "file", age=0.0)
    cat = _catalog(ckpt_dir, state)
    assert cat.report(10, str(ckpt_dir / "step_10"))
    assert writes == [False]
    cat.mark_bad(10, "changed since its manifest")
    cat.start_failed(10)
    assert writes == [False, True, True]
    cat.used_by(10, 3)
    cat.flush(force=False)  # within SAVE_EVERY of the last flush: waits
    cat.close()
    assert writes[-1] is True
    again = _catalog(ckpt_dir, state)
    assert again.reported == {10: str(ckpt_dir / "step_10")} and again.used == {10: [3]}
    assert again.bad[10] == "changed since its manifest"
