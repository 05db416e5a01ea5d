"""Checkpoint retention (issue 13 item 3): the planner over a table of cases,
fault storms included, with the protections checked on every case; and
deletions carried out on real files and folders."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import missing, need_root
from trainwatch.config.schema import Keep
from trainwatch.state import retention
from trainwatch.state.retention import (
    Candidate,
    Plan,
    candidate,
    delete,
    free_bytes,
    plan,
    size_of,
)


def good(step: int, size: int = 10, path: str | None = None) -> Candidate:
    return Candidate(step, path or f"/ck/step_{step}", True, True, False, size)


def unjudged(step: int, size: int = 10) -> Candidate:
    return Candidate(step, f"/ck/step_{step}", False, False, False, size)


def bad(step: int, size: int = 10) -> Candidate:
    return Candidate(step, f"/ck/step_{step}", False, True, False, size)


def quarantined(step: int, size: int = 10) -> Candidate:
    return Candidate(step, f"/ck/step_{step}", False, True, True, size)


def goods(*steps: int, size: int = 10) -> list[Candidate]:
    return [good(s, size) for s in steps]


@dataclass(frozen=True)
class Case:
    name: str
    cands: list[Candidate]
    keep: Keep
    deleted: set[int]
    resumed_from: int | None = None
    free: int | None = None


G5 = goods(100, 200, 300, 400, 500)
BIG = 10**12

CASES = [
    Case("no rule: nothing goes", [*G5, unjudged(50), bad(60)], Keep(), set()),
    Case("pinned alone is a protection, not a rule", G5, Keep(pinned=(100,)), set()),
    Case("last 2 keeps the two newest good ones", G5, Keep(last=2), {100, 200, 300}),
    Case("last 1: older incomplete and bad ones are clutter",
         [good(100), unjudged(150), bad(200), good(300)], Keep(last=1), {100, 150, 200}),
    Case("last larger than the history deletes nothing", G5, Keep(last=10), set()),
    Case("every 1000 keeps the multiples of 1000",
         goods(500, 1000, 1500, 2000, 2500), Keep(every=1000), {500, 1500}),
    Case("every: a bad one at a multiple is clutter",
         [good(1000), bad(2000), good(2500)], Keep(every=1000), {2000}),
    Case("last and every combine",
         goods(500, 1000, 1500, 2000, 2500, 3000), Keep(last=2, every=1000), {500, 1500}),
    Case("pinned survives last", G5, Keep(last=1, pinned=(200,)), {100, 300, 400}),
    Case("pinned and last good the same", G5, Keep(last=1, pinned=(500,)),
         {100, 200, 300, 400}),
    Case("a pinned step not on disk changes nothing", G5, Keep(last=1, pinned=(999,)),
         {100, 200, 300, 400}),
    Case("resumed from an older one keeps it", G5, Keep(last=1), {100, 300, 400},
         resumed_from=200),
    Case("crash loop while checkpoints are written: unjudged newer ones and the bad one stay",
         [*goods(100, 200), bad(300), *(unjudged(s) for s in range(400, 1300, 100))],
         Keep(last=1), {100}, resumed_from=200),
    Case("crash loop that has judged every checkpoint bad: nothing goes",
         [bad(100), bad(200), bad(300), unjudged(400), unjudged(500)],
         Keep(last=1, min_free_bytes=BIG), set(), free=0),
    Case("rollback in flight: newer ones quarantined, resumed from the older good one",
         [*goods(100, 200, 300), *(quarantined(s) for s in range(400, 1000, 100))],
         Keep(last=1), {100, 200}, resumed_from=300),
    Case("rollback in flight, resumed from before the newest N",
         [*G5, quarantined(600), quarantined(700)], Keep(last=2), {200, 300},
         resumed_from=100),
    Case("full disk: everything deletable goes, protected ones stay though short",
         [quarantined(50), *G5, unjudged(600)],
         Keep(last=1, pinned=(200,), min_free_bytes=BIG), {100, 300, 400}, free=0),
    Case("full disk with only protected checkpoints: nothing goes",
         [good(500), quarantined(600), unjudged(700)], Keep(last=1, min_free_bytes=BIG),
         set(), free=0),
    Case("min_free_bytes alone: oldest first, only until enough is freed",
         goods(100, 200, 300, 400, 500, size=30), Keep(min_free_bytes=100), {100, 200},
         free=50),
    Case("free space above min_free_bytes: nothing goes",
         goods(100, 200, 300, 400, 500, size=30), Keep(min_free_bytes=100), set(), free=100),
    Case("free space unknown: nothing goes", G5, Keep(last=1, min_free_bytes=100), set()),
    Case("min_free_bytes with last: beyond the newest N, and only while short",
         goods(100, 200, 300, 400, 500, size=30), Keep(last=2, min_free_bytes=100), {100},
         free=80),
    Case("no good checkpoint at all: nothing goes",
         [unjudged(100), bad(200), unjudged(300)], Keep(last=1, every=100), set()),
    Case("no checkpoints", [], Keep(last=1), set()),
    Case("an unjudged one older than the last good is clutter",
         [good(100), unjudged(150), good(200)], Keep(last=2), {150}),
    Case("fixed layout: versions of one file are never deleted",
         [good(s, path="/ck/snapshot.pt") for s in (100, 200, 300)], Keep(last=1), set()),
]


def _protected(case: Case) -> set[int]:
    """The steps no plan may delete, from the issue's rules."""
    usable = [c.step for c in case.cands if c.good and not c.quarantined]
    last = max(usable, default=None)
    keep = set(case.keep.pinned)
    keep |= {c.step for c in case.cands if c.quarantined}
    keep |= {c.step for c in case.cands if not c.judged and (last is None or c.step > last)}
    if last is not None:
        keep.add(last)
    if case.resumed_from is not None:
        keep.add(case.resumed_from)
    return keep


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan_deletes_exactly_the_expected_and_never_a_protected_one(case: Case) -> None:
    """Each case deletes its expected set; last good, quarantined, pinned, resumed-from
    and unjudged newer checkpoints survive; every checkpoint is accounted for once."""
    p = plan(case.cands, case.keep, resumed_from=case.resumed_from, free_bytes=case.free)
    gone = {c.step for c in p.delete}
    assert gone == case.deleted
    assert not gone & _protected(case)
    assert sorted([*(c.step for c in p.delete), *(s for s, _ in p.kept)]) == sorted(
        c.step for c in case.cands)
    assert all(why for _, why in p.kept)
    assert [c.step for c in p.delete] == sorted(gone)  # oldest first
    if not case.keep.deletes or not any(c.good for c in case.cands):
        assert not p.delete
    if case.keep.min_free_bytes is not None and p.delete:
        # Stopped as soon as enough was freed: without the last one it was still short.
        assert case.free is not None
        assert case.free + p.freed_bytes - p.delete[-1].size < case.keep.min_free_bytes


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan_is_the_same_for_any_order_of_candidates(case: Case) -> None:
    """The plan depends on the candidates, not on the order the catalog lists them."""
    expect = plan(case.cands, case.keep, resumed_from=case.resumed_from, free_bytes=case.free)
    shuffled = list(case.cands)
    random.Random(13).shuffle(shuffled)
    for order in (shuffled, list(reversed(case.cands))):
        again = plan(order, case.keep, resumed_from=case.resumed_from, free_bytes=case.free)
        assert again == expect


def _why(p: Plan) -> dict[int, str]:
    return dict(p.kept)


def test_plan_explains_why_each_checkpoint_is_kept() -> None:
    """Every kept checkpoint names the rule or protection that keeps it."""
    cands = [quarantined(50), *goods(100, 200, 300, 1000, 1100), bad(1150), unjudged(1200)]
    p = plan(cands, Keep(last=2, every=1000, pinned=(1100,)), resumed_from=200,
             free_bytes=None)
    assert [c.step for c in p.delete] == [100, 300]
    assert _why(p) == {
        50: "quarantined",
        200: "resumed from by the running attempt",
        1000: "newest 2, every 1000",
        1100: "last good, pinned",  # a protection says why first; rules only when none
        1150: "bad, but newer than the last good",
        1200: "not judged yet",
    }


def test_plan_explains_no_rule_no_good_and_free_space() -> None:
    """Nothing deleted says why: no rule, no good checkpoint, enough or unknown free space."""
    assert _why(plan(G5[:2], Keep(), resumed_from=None, free_bytes=0)) == {
        100: "no keep rule", 200: "last good"}
    assert _why(plan([bad(100)], Keep(last=1), resumed_from=None, free_bytes=0)) == {
        100: "no good checkpoint yet"}
    assert _why(plan(G5[:2], Keep(min_free_bytes=5), resumed_from=None, free_bytes=5)) == {
        100: "free space above min_free_bytes", 200: "last good"}
    assert _why(plan(G5[:2], Keep(min_free_bytes=5), resumed_from=None, free_bytes=None)) == {
        100: "free space unknown", 200: "last good"}
    shared = plan([good(1, path="/ck/x"), good(2, path="/ck/x")], Keep(last=1),
                  resumed_from=None, free_bytes=None)
    assert _why(shared)[1] == "shares its path with another checkpoint"


@pytest.mark.parametrize("keep, says", [
    (dict(last=0), "checkpoints.keep.last must be a whole number >= 1, not 0"),
    (dict(every=-5), "checkpoints.keep.every must be a whole number >= 1, not -5"),
    (dict(min_free_bytes=-1), "checkpoints.keep.min_free_bytes must be a whole number >= 0"),
    (dict(last=True), "checkpoints.keep.last must be a whole number >= 1, not True"),
    (dict(pinned=(100, -1)), "checkpoints.keep.pinned must hold steps"),
])
def test_keep_refuses_nonsense_in_one_line(keep: dict[str, object], says: str) -> None:
    """A keep rule that cannot mean anything (every 0 would divide by zero) is one clear error."""
    with pytest.raises(ValueError, match=says.replace("(", r"\(")) as e:
        Keep(**keep)  # type: ignore[arg-type]
    assert "\n" not in str(e.value)


def test_candidate_reads_a_catalog_entry() -> None:
    """Good, unjudged, bad and quarantined catalog entries map to the planner's view."""
    from trainwatch.state.entry import Entry

    assert candidate(Entry(1, "/ck/step_1", True, False, "marker x"), 7) == Candidate(
        1, "/ck/step_1", True, True, False, 7)
    assert candidate(Entry(2, "/ck/step_2", False, False, "incomplete")) == Candidate(
        2, "/ck/step_2", False, False, False, 0)
    assert candidate(Entry(3, "/ck/step_3", True, True, "bad: the job died")) == Candidate(
        3, "/ck/step_3", False, True, False, 0)
    assert candidate(Entry(4, "/ck/step_4", False, True, "bad: quarantined: rollback")) == (
        Candidate(4, "/ck/step_4", False, True, True, 0))


# --- deleting, on real files ------------------------------------------------


def _tree(root: Path, name: str) -> Path:
    d = root / name
    (d / "shards" / "deep").mkdir(parents=True)
    (d / "shards" / "deep" / "0.bin").write_bytes(b"x" * 100)
    (d / "model.safetensors").write_bytes(b"y" * 50)
    return d


def _at(path: Path) -> Candidate:
    return good(1, path=str(path))


def test_delete_removes_a_folder_tree_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """A checkpoint folder goes with everything in it, and no tombstone is left."""
    d = _tree(tmp_path, "step_1")
    (tmp_path / "step_2").mkdir()
    assert delete(_at(d), root=str(tmp_path)) is None
    assert sorted(os.listdir(tmp_path)) == ["step_2"]


def test_delete_removes_a_file(tmp_path: Path) -> None:
    """A one-file checkpoint (Lightning's .ckpt) is unlinked."""
    f = tmp_path / "epoch=1-step=100.ckpt"
    f.write_bytes(b"z")
    assert delete(_at(f), root=str(tmp_path) + "/") is None
    assert not f.exists()


def test_delete_refuses_a_path_outside_root(tmp_path: Path) -> None:
    """A path elsewhere, deeper, or root itself is refused and left alone."""
    root = tmp_path / "ckpt"
    root.mkdir()
    outside = _tree(tmp_path, "elsewhere")
    deeper = _tree(root / "step_1", "inner")
    for path in (outside, deeper, root):
        why = delete(_at(path), root=str(root))
        assert why is not None and "not directly under" in why
    assert (outside / "model.safetensors").exists()
    assert (deeper / "model.safetensors").exists()


@pytest.mark.parametrize("trick", ["ckpt/../elsewhere", "ckpt/step_1/../../elsewhere",
                                   "ckpt/../ckpt/step_1", "ckpt/step_1/.."])
def test_delete_refuses_dot_dot_tricks(tmp_path: Path, trick: str) -> None:
    """Any '..' in the path is refused, even one that would land back under root."""
    root = tmp_path / "ckpt"
    root.mkdir()
    _tree(root, "step_1")
    _tree(tmp_path, "elsewhere")
    why = delete(_at(tmp_path / trick), root=str(root))
    assert why is not None and "'..'" in why
    assert (root / "step_1" / "model.safetensors").exists()
    assert (tmp_path / "elsewhere" / "model.safetensors").exists()


def test_delete_refuses_a_symlink_and_does_not_follow_it(tmp_path: Path) -> None:
    """A checkpoint name that is a symlink is refused: the link and its target stay."""
    root = tmp_path / "ckpt"
    root.mkdir()
    target = _tree(tmp_path, "precious")
    (root / "step_1").symlink_to(target)
    why = delete(_at(root / "step_1"), root=str(root))
    assert why is not None and "symlink" in why
    assert (root / "step_1").is_symlink()
    assert (target / "model.safetensors").exists()


def test_delete_does_not_follow_a_symlink_inside_the_tree(tmp_path: Path) -> None:
    """A symlink inside a checkpoint folder is removed as a link; what it points to stays."""
    root = tmp_path / "ckpt"
    root.mkdir()
    target = _tree(tmp_path, "precious")
    d = _tree(root, "step_1")
    (d / "shards" / "link").symlink_to(target)
    assert delete(_at(d), root=str(root)) is None
    assert not d.exists()
    assert (target / "shards" / "deep" / "0.bin").exists()


def test_delete_of_a_vanished_checkpoint_says_why(tmp_path: Path) -> None:
    """A checkpoint removed meanwhile (by the job, by hand) gives a reason, not an exception."""
    why = delete(_at(tmp_path / "step_9"), root=str(tmp_path))
    assert why is not None and "No such file" in why


def _as_nobody(open_tmp: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` as uid 65534 with retention.py importable (it needs only the
    standard library, so a copy of it alone: not the whole package)."""
    need_root("acting as uid 65534")
    site = open_tmp / "site"
    site.mkdir(mode=0o755)
    shutil.copy(retention.__file__, site / "retention.py")
    (site / "retention.py").chmod(0o644)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (f"/usr/bin/{version}", f"/usr/local/bin/{version}",
                   os.path.realpath(sys.executable)):
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            python, "-c", script, *args],
                           env={"PATH": os.defpath, "PYTHONPATH": str(site)},
                           capture_output=True, text=True, timeout=60, check=False)
        if r.returncode == 0:
            return r
    missing(f"no {version} that uid 65534 may run: {r.stderr.strip()[-300:]}")
    raise AssertionError  # missing() does not return


def test_delete_in_a_read_only_folder_says_why(open_tmp: Path) -> None:
    """Without write permission on the checkpoint folder, the deletion is a reason and
    the checkpoint is intact (as uid 65534: root ignores permission bits)."""
    root = open_tmp / "ckpt"
    root.mkdir(mode=0o755)
    d = _tree(root, "step_1")
    for p in (d, d / "shards", d / "shards" / "deep"):
        p.chmod(0o755)
    script = ("import sys; from retention import Candidate, delete; "
              "print(delete(Candidate(1, sys.argv[1], True, True, False, 0), root=sys.argv[2]))")
    r = _as_nobody(open_tmp, script, str(d), str(root))
    assert "Permission denied" in r.stdout
    assert (d / "shards" / "deep" / "0.bin").exists()


def test_delete_cut_short_leaves_no_checkpoint_under_its_name(open_tmp: Path) -> None:
    """A folder whose removal fails partway is already renamed aside: the catalog never
    sees a half-deleted checkpoint under its own name, and the reason names the leftover."""
    root = open_tmp / "ckpt"
    root.mkdir(mode=0o755)
    d = _tree(root, "step_1")
    for p in (root, d):
        os.chown(p, 65534, 65534)  # nobody may rename step_1 and empty its top...
    d.chmod(0o755)
    (d / "shards").chmod(0o755)  # ...but not what root owns inside it
    script = ("import sys; from retention import Candidate, delete; "
              "print(delete(Candidate(1, sys.argv[1], True, True, False, 0), root=sys.argv[2]))")
    r = _as_nobody(open_tmp, script, str(d), str(root))
    assert "removing it failed" in r.stdout and "Permission denied" in r.stdout
    assert os.listdir(root) == [".step_1.trainwatch-deleting"]


def test_size_of_counts_files_and_not_what_symlinks_point_to(tmp_path: Path) -> None:
    """A checkpoint's size is the bytes of its own files; a symlink to a big file adds nothing."""
    d = _tree(tmp_path, "step_1")
    big = tmp_path / "big"
    big.write_bytes(b"b" * 1000)
    (d / "link").symlink_to(big)
    assert size_of(str(d)) == 150
    assert size_of(str(big)) == 1000
    assert size_of(str(tmp_path / "missing")) == 0


def test_free_bytes_reads_the_filesystem(tmp_path: Path) -> None:
    """Free space is what statvfs says an unprivileged writer may use; None when unreadable."""
    st = os.statvfs(tmp_path)
    assert free_bytes(str(tmp_path)) == st.f_bavail * st.f_frsize
    assert free_bytes(str(tmp_path / "missing")) is None
