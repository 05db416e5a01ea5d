"""The catalog with each kind of layout on real files: a fixed path overwritten
in place (versioned by content and the reported step, never counted twice),
reports a layout does not name refused, auto recognising a framework's folder,
and a catalog whose work per report does not grow with the checkpoints on disk."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from trainwatch.config import Checkpoints
from trainwatch.state.catalog import Catalog


def _catalog(tmp_path: Path, **spec: object) -> Catalog:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    return Catalog(Checkpoints(dir=str(ckpt), **spec), tmp_path / "state" / "catalog.json")  # type: ignore[arg-type]


def _rewrite(path: Path, data: bytes) -> None:
    """torch.save onto the same path: new content, new mtime, same inode."""
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(0)
        f.write(data)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_a_fixed_path_is_one_checkpoint_per_version_never_counted_twice(tmp_path: Path) -> None:
    """snapshot.pt reported four times with one content is one checkpoint, at its first step."""
    cat = _catalog(tmp_path, layout="fixed", pattern="snapshot.pt")
    snap = tmp_path / "ckpt" / "snapshot.pt"
    _rewrite(snap, b"epoch 10")
    for step in (10, 11, 12, 13):  # the job reports again without rewriting
        assert cat.report(step, str(snap))
    entries = cat.entries()
    assert [(e.step, e.good) for e in entries] == [(10, True)], entries
    _rewrite(snap, b"epoch 20 is longer")
    assert cat.report(20, str(snap))
    assert [(e.step, e.good) for e in cat.entries()] == [(20, True)]


def test_a_fixed_path_rewritten_since_its_report_is_not_good(tmp_path: Path) -> None:
    """Being overwritten (or torn by a crash mid-write) is not the version reported."""
    cat = _catalog(tmp_path, layout="fixed", pattern="snapshot.pt")
    snap = tmp_path / "ckpt" / "snapshot.pt"
    _rewrite(snap, b"epoch 10")
    cat.report(10, str(snap))
    _rewrite(snap, b"half of epo")
    (e,) = cat.entries()
    assert not e.good and "rewritten since the report of step 10" in e.why
    assert cat.last_good() is None


def test_a_fixed_path_without_reports_is_good_once_quiet(tmp_path: Path) -> None:
    """A job without the client: the file, still for quiet_for, is the checkpoint (step unknown)."""
    cat = _catalog(tmp_path, layout="fixed", pattern="snapshot.pt", quiet_for=0.01)
    snap = tmp_path / "ckpt" / "snapshot.pt"
    _rewrite(snap, b"epoch 3")
    time.sleep(0.05)
    good = cat.last_good()
    assert good is not None and good.path == str(snap) and "step unknown" in good.why


def test_fixed_versions_survive_a_new_catalog(tmp_path: Path) -> None:
    """The versions are saved with the catalog: a restarted daemon knows the step on disk."""
    cat = _catalog(tmp_path, layout="fixed", pattern="snapshot.pt")
    snap = tmp_path / "ckpt" / "snapshot.pt"
    _rewrite(snap, b"epoch 10")
    cat.report(10, str(snap))
    cat.flush(force=True)
    again = _catalog(tmp_path, layout="fixed", pattern="snapshot.pt")
    good = again.last_good()
    assert good is not None and good.step == 10


def test_a_report_the_layout_does_not_name_is_refused(tmp_path: Path) -> None:
    """snapshot.pt reported under step_{step}: refused, not a checkpoint counted per report."""
    cat = _catalog(tmp_path)
    snap = tmp_path / "ckpt" / "snapshot.pt"
    snap.write_bytes(b"x")
    assert not cat.report(10, str(snap))
    assert not cat.report(11, str(tmp_path / "ckpt" / "step_12"))  # the name says 12
    assert cat.entries() == []


def test_auto_recognises_a_hugging_face_folder(tmp_path: Path) -> None:
    """auto: generic until checkpoint-N/ appears; then complete only with trainer_state.json."""
    cat = _catalog(tmp_path, layout="auto")
    assert cat.entries() == []
    d = tmp_path / "ckpt" / "checkpoint-5"
    d.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    (e,) = cat.entries()
    assert cat.layout.name == "hf" and e.step == 5 and not e.complete
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    cat2 = _catalog(tmp_path, layout="auto")
    (e,) = cat2.entries()
    assert e.good, e.why


def test_reports_do_not_list_the_folder_again(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With 2,000 checkpoints on disk, 200 reports cost no listing of the folder and
    judge only the new ones: the cost of a report does not grow with history."""
    from trainwatch.state import catalog

    monkeypatch.setattr(catalog, "LOOKS_BURST", 1e9)  # each is looked for (a bound of its own)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for step in range(2000):
        (ckpt / f"step_{step}").write_bytes(b"w")
    cat = _catalog(tmp_path, quiet_for=0.0)  # complete when still (the reports are bounded)
    for step in range(2000):
        cat.report(step, str(ckpt / f"step_{step}"))
    cat.summary()
    listed = cat.disk.listings
    judged: list[int] = []
    judge = cat.layout.judge
    cat.layout.judge = lambda root, step, *more: (  # type: ignore[method-assign]
        judged.append(step), judge(root, step, *more))[1]
    for step in range(2000, 2200):
        (ckpt / f"step_{step}").write_bytes(b"w")
        cat.report(step, str(ckpt / f"step_{step}"))
        cat.summary()
    assert cat.disk.listings == listed
    assert sorted(judged) == list(range(2000, 2200))
    assert cat.summary().counts["good"] == 2200


def test_auto_learns_the_pattern_from_the_first_report(tmp_path: Path) -> None:
    """`trainwatch run --checkpoint-dir` with step_6.pt reported: auto names step_{step}.pt;
    a fixed name reported is still refused."""
    cat = _catalog(tmp_path, layout="auto")
    for step in (3, 6):
        p = tmp_path / "ckpt" / f"step_{step}.pt"
        p.write_bytes(b"w")
        assert cat.report(step, str(p))
    good = cat.last_good()
    assert good is not None and good.step == 6
    snap = tmp_path / "ckpt" / "snapshot.pt"
    snap.write_bytes(b"x")
    assert not cat.report(9, str(snap))
    cat.flush(force=True)
    again = _catalog(tmp_path, layout="auto")  # learned again from the saved reports
    assert [e.step for e in again.entries()] == [3, 6]
