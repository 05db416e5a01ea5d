"""Layout auto for a job that never reports (state/numbered.py), on real files: the
names' pattern inferred from the folder alone, and completeness judged by a marker
the job writes, a file's own format, or quiet time, never the newest while it is
still being written."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
from trainwatch.config import Checkpoints
from trainwatch.state.catalog import Catalog
from trainwatch.state.numbered import infer

NOW = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def _aged(path: Path, age: float) -> Path:
    for p in [*path.rglob("*"), path] if path.is_dir() else [path]:
        os.utime(p, (NOW - age, NOW - age))
    return path


def _zip(path: Path, age: float = 0.0, whole: bool = True) -> Path:
    """A torch.save-like archive (a zip holding data.pkl), or one cut short."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"x" * 4096)
    if not whole:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 30])  # the central directory's end is gone
    return _aged(path, age)


def _folder(path: Path, age: float, *marker: str) -> Path:
    path.mkdir()
    (path / "weights.bin").write_bytes(b"w" * 100)
    for m in marker:
        (path / m).write_text("")
    return _aged(path, age)


def _catalog(tmp_path: Path, clock: Clock, **spec: object) -> Catalog:
    return Catalog(Checkpoints(dir=str(tmp_path / "ckpt"), **spec),  # type: ignore[arg-type]
                   tmp_path / "state" / "catalog.json", clock=clock)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


@pytest.mark.parametrize("names, shown, steps", [
    (["step_3.pt", "step_6.pt", "step_6.pt.tmp", "log.txt"], "step_{step}.pt", [3, 6]),
    (["step-3", "step-6", "step-6.done"], "step-{step}", [3, 6]),
    (["ckpt_3.pt", "ckpt_12.pt"], "ckpt_{step}.pt", [3, 12]),
    (["checkpoint-3.pt", "checkpoint-12.pt"], "checkpoint-{step}.pt", [3, 12]),
    (["iter_3", "iter_6", "metrics_2024.json"], "iter_{step}", [3, 6]),
    (["epoch=0-step=30.pt", "epoch=1-step=60.pt"], "epoch=*-step={step}.pt", [30, 60]),
    (["3.pt", "6.pt", "config.yaml"], "{step}.pt", [3, 6]),
    (["model_v2_3.pt", "model_v2_6.pt", "notes_1.md"], "model_v*_{step}.pt", [3, 6]),
])
def test_the_pattern_is_inferred_from_the_names_in_the_folder(names: list[str], shown: str,
                                                               steps: list[int]) -> None:
    """The shape most numbered entries share, its step the slot after a step word or the
    one that varies; temporary, text and marker files beside another are not entries."""
    naming = infer(names)
    assert naming is not None and naming.shown() == shown
    found = sorted(int(m.group(1)) for n in names if (m := naming.regex.match(n)))
    assert found == steps


def test_nothing_numbered_is_no_pattern() -> None:
    """model.pt and latest hold no step: nothing is guessed."""
    assert infer(["model.pt", "latest", ".hidden_3"]) is None


def test_a_job_that_never_reports_resumes_from_its_newest_whole_torch_save(
        ckpt: Path, tmp_path: Path) -> None:
    """step_N.pt files found by name; a whole zip is complete at once, one cut short
    (the crash mid-save) is passed over, whatever its age."""
    clock = Clock()
    _zip(ckpt / "step_3.pt")
    _zip(ckpt / "step_6.pt")
    _zip(ckpt / "step_9.pt", age=3600.0, whole=False)
    cat = _catalog(tmp_path, clock)
    entries = {e.step: e for e in cat.entries()}
    assert sorted(entries) == [3, 6, 9]
    assert entries[6].good and "whole zip" in entries[6].why
    assert not entries[9].complete and "without its directory" in entries[9].why
    good = cat.last_good()
    assert good is not None and good.step == 6 and good.path == str(ckpt / "step_6.pt")


def test_folders_are_complete_once_quiet_never_the_newest_still_changing(
        ckpt: Path, tmp_path: Path) -> None:
    """Without a marker or a format to read, 60 s unchanged is complete; the newest,
    changed 5 s ago, is not taken until it has been quiet that long."""
    clock = Clock()
    _folder(ckpt / "iter_100", 3600.0)
    _folder(ckpt / "iter_200", 5.0)
    cat = _catalog(tmp_path, clock)
    good = cat.last_good()
    assert good is not None and good.step == 100
    (newest,) = [e for e in cat.entries() if e.step == 200]
    assert not newest.complete and "changed within 60s" in newest.why, newest.why
    clock.now += 60.0
    good = cat.last_good()
    assert good is not None and good.step == 200


def test_a_marker_the_job_writes_is_needed_by_every_entry(ckpt: Path, tmp_path: Path) -> None:
    """Once one folder holds COMPLETE, an old folder without it (cut short) is not good."""
    clock = Clock()
    _folder(ckpt / "step_10", 3600.0, "COMPLETE")
    _folder(ckpt / "step_20", 3600.0)
    cat = _catalog(tmp_path, clock)
    entries = {e.step: e for e in cat.entries()}
    assert entries[10].good and entries[10].why == "marker COMPLETE"
    assert not entries[20].complete and "no marker COMPLETE" in entries[20].why
    good = cat.last_good()
    assert good is not None and good.step == 10


def test_a_pattern_the_user_set_is_kept(ckpt: Path, tmp_path: Path) -> None:
    """--checkpoint-pattern model_{step}.bin: other numbered names are not checkpoints."""
    clock = Clock()
    _zip(ckpt / "step_3.pt")
    _zip(ckpt / "step_6.pt")
    (ckpt / "model_4.bin").write_bytes(b"m")
    _aged(ckpt / "model_4.bin", 3600.0)
    cat = _catalog(tmp_path, clock, pattern="model_{step}.bin")
    assert [(e.step, e.good) for e in cat.entries()] == [(4, True)]


def test_a_reporting_job_is_judged_by_its_reports_not_the_folder(ckpt: Path,
                                                                 tmp_path: Path) -> None:
    """Once the job reports, an unreported entry is not taken on its format alone."""
    clock = Clock()
    _zip(ckpt / "step_3.pt")
    _zip(ckpt / "step_6.pt")
    cat = _catalog(tmp_path, clock)
    assert cat.report(3, str(ckpt / "step_3.pt"))
    good = cat.last_good()
    assert good is not None and good.step == 3


def _written(path: Path, *ages: float) -> Path:
    """A folder whose files were last written ``ages`` seconds ago, one file each."""
    path.mkdir()
    for i, age in enumerate(ages):
        f = path / f"shard_{i}.bin"
        f.write_bytes(b"w" * 100)
        os.utime(f, (NOW - age, NOW - age))
    os.utime(path, (NOW - min(ages), NOW - min(ages)))
    return path


@pytest.mark.parametrize(("older", "newer", "complete"), [
    # (ages of the older one's files, ages of the newer one's files or None): is the older complete?
    ((20.0, 18.0), (10.0, 5.0), True),   # the job began the newer one after the older's last write
    ((20.0, 4.0), (10.0, 5.0), False),   # the older was still written while the newer began
    ((20.0, 10.0), (10.0, 5.0), False),  # at the same second: not after
    ((20.0, 18.0), None, False),         # nothing newer: only the quiet time says so
    ((3600.0,), (10.0,), True),          # quiet anyway
], ids=["moved-past", "written-alongside", "same-time", "newest", "quiet"])
def test_a_checkpoint_the_job_moved_past_is_complete_without_the_quiet_time(
        ckpt: Path, tmp_path: Path, older: tuple[float, ...], newer: tuple[float, ...] | None,
        complete: bool) -> None:
    """A job writes one checkpoint after another: one whose next was begun after its last
    change is whole, without waiting 60 s; the newest waits its quiet time."""
    _written(ckpt / "step_10", *older)
    if newer is not None:
        _written(ckpt / "step_20", *newer)
    cat = _catalog(tmp_path, Clock())
    (e,) = [e for e in cat.entries() if e.step == 10]
    assert e.complete is complete, e.why
    if newer is not None and complete and max(older) < 60:
        assert e.why.startswith("moved past (the job began step_20 after"), e.why
    if newer is not None:
        (n,) = [e for e in cat.entries() if e.step == 20]
        assert not n.complete and "changed within 60s" in n.why, n.why


@pytest.mark.parametrize(("spec", "complete", "why"), [
    ({"layout": "generic", "quiet_for": 60.0}, True, "moved past"),
    ({"layout": "generic", "marker": "COMPLETE"}, False, "incomplete"),  # only the marker says
    ({"layout": "auto", "marker": "COMPLETE"}, False, "incomplete"),
], ids=["generic-quiet", "generic-marker", "auto-marker"])
def test_moved_past_applies_where_time_is_what_says_complete(
        ckpt: Path, tmp_path: Path, spec: dict[str, object], complete: bool, why: str) -> None:
    """Where the user named a marker and no quiet time, the marker alone completes one."""
    _written(ckpt / "step_10", 20.0)
    _written(ckpt / "step_20", 10.0)
    cat = _catalog(tmp_path, Clock(), **spec)
    (e,) = [e for e in cat.entries() if e.step == 10]
    assert (e.complete, e.why.split(" (")[0]) == (complete, why), e.why
