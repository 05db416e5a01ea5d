"""Checkpoints kept honest under a real `trainwatch run`: one corrupted after it
was judged good is caught by its manifest before the relaunch resumes from it
(the one before is used), and retention deletes only what `checkpoints.keep`
allows, each deletion a ledger row, the last good one never."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from conftest import Workspace, finish, wait_for


def _deletions(ws: Workspace) -> list[dict[str, object]]:
    con = sqlite3.connect(f"file:{ws.state / 'ledger.db'}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute("SELECT * FROM deletions ORDER BY id")]
    finally:
        con.close()


def test_a_checkpoint_corrupted_after_it_was_judged_good_is_not_resumed_from(
        ws: Workspace) -> None:
    """step_20 rots (one byte, same size and mtime) after its manifest was made; the crash at
    step 25 relaunches from step_10, and step_20 is marked bad with why."""
    cfg = ws.config({"command": ws.worker("--steps", "30", "--crash-at", "25",
                                          "--interval", "0.3")})
    p = ws.run(cfg)
    manifest = ws.state / "jobs" / "job" / "manifests" / "20.json"
    wait_for(manifest.exists, timeout=30, what="step 20's manifest")
    ckpt = ws.ckpt / "step_20"
    st = ckpt.stat()
    ckpt.write_text("21")  # bit rot: same size
    os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same mtime
    rc, out = finish(p, timeout=60)
    assert rc == 0, out
    starts = [e for e in ws.events() if e["event"] == "start"]
    assert [(e["attempt"], e["step"]) for e in starts] == [(0, 0), (1, 10)], starts
    catalog = json.loads((ws.state / "jobs" / "job" / "catalog.json").read_text())
    assert catalog["bad"]["20"].startswith("verification failed: "), catalog["bad"]
    assert "failed verification" in out


def test_retention_keeps_the_newest_two_and_records_each_deletion(ws: Workspace) -> None:
    """keep.last 2 with 8 checkpoints written: the 6 oldest are deleted, each a ledger row,
    and the newest two (the last good among them) survive."""
    cfg = ws.config({"command": ws.worker("--steps", "80", "--interval", "0.05"),
                     "checkpoints": {"dir": str(ws.ckpt), "keep": {"last": 2}}})
    rc, out = finish(ws.run(cfg), timeout=60)
    assert rc == 0, out
    left = sorted(int(p.name.split("_")[1]) for p in ws.ckpt.glob("step_*"))
    rows = _deletions(ws)
    deleted = sorted(int(str(r["step"])) for r in rows if r["outcome"] is None)
    assert 80 in left and 70 in left, left
    assert set(deleted) | set(left) == {10, 20, 30, 40, 50, 60, 70, 80}
    assert not set(deleted) & set(left)
    assert all(r["outcome"] is None for r in rows), rows


def test_the_plan_shows_what_would_go_and_deletes_nothing(ws: Workspace, tmp_path: Path) -> None:
    """`trainwatch checkpoints JOB --plan` on a job observed only: the plan says delete, and
    every checkpoint is still there afterwards."""
    for step in (10, 20, 30):
        (ws.ckpt / f"step_{step}").write_text(str(step))
    cfg = ws.config({"command": [sys.executable, "-c", "import time; time.sleep(60)"],
                     "checkpoints": {"dir": str(ws.ckpt), "quiet_for": "0.1s",
                                     "keep": {"last": 1, "pinned": [10]}}},
                    observe_only=True)
    ws.run(cfg)
    wait_for(lambda: ws.status().get("state") in ("starting", "running"), timeout=20,
             what="the job started")
    r = subprocess.run([sys.executable, "-m", "trainwatch.cli", "checkpoints", "job", "--plan",
                        "--run-dir", str(ws.root / "run")],
                       capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()[1:] if ln.strip()}
    assert "delete" in lines["20"] and "pinned" in lines["10"] and "last good" in lines["30"], \
        r.stdout
    assert sorted(p.name for p in ws.ckpt.iterdir()) == ["step_10", "step_20", "step_30"]
    assert _deletions(ws) == []


def test_a_checkpoint_retention_may_not_delete_is_said_once_not_at_every_refresh(
        ws: Workspace, tmp_path: Path) -> None:
    """Three checkpoints that are links (refused: never followed) while the job writes
    and reports a checkpoint every few hundred ms: each refusal is one log line, not one
    per retention pass (before, every report said all three again)."""
    for step in (1, 2, 3):
        target = tmp_path / f"t{step}"
        target.write_text(str(step))  # what the worker writes: it resumes from step_3
        (ws.ckpt / f"step_{step}").symlink_to(target)
    cfg = ws.config({"command": ws.worker("--steps", "150", "--interval", "0.03"),
                     "checkpoints": {"dir": str(ws.ckpt), "layout": "generic",
                                     "quiet_for": "0.1s", "verify": False,
                                     "keep": {"last": 1}}})
    rc, out = finish(ws.run(cfg), timeout=90)
    assert rc == 0, out
    lines = out.splitlines()
    ended = next(i for i, ln in enumerate(lines) if "-> exited" in ln)
    said = [(i, ln.split("checkpoint step ")[1].split(":")[0]) for i, ln in enumerate(lines)
            if "could not delete checkpoint step" in ln]
    steps = [s for _, s in said]
    assert sorted(set(steps)) == sorted(steps), said  # each refusal said once
    # step_3 is what the job resumed from: kept while that attempt lives, never tried. The
    # last pass, after the job ended, may try it (on a loaded host the newest checkpoint is
    # judged only then): no attempt resumes from it any more, and its refusal is said once.
    assert {"1", "2"} <= set(steps) <= {"1", "2", "3"}, said
    assert all(i > ended for i, s in said if s == "3"), said
    assert all((ws.ckpt / f"step_{s}").is_symlink() for s in (1, 2, 3))
