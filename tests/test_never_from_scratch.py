"""A job without the client, crashed seconds after a checkpoint, through `trainwatch
run`: every checkpoint is younger than the quiet time, yet it resumes from one
(the job moved past it, or the newest is waited for), never from step 0. The job
is tests/jobs/worker.py writing ``step_N`` files renamed into place, as
docs/checkpoints.md's no-client recipe does."""

from __future__ import annotations

import pytest
from conftest import Workspace, finish
from trainwatch.actions.fresh import reasons
from trainwatch.state.entry import Entry


def _starts(ws: Workspace) -> list[tuple[int, int, str | None]]:
    return [(e["attempt"], e["step"], e["resume"]) for e in ws.events() if e["event"] == "start"]


def test_a_crash_after_a_checkpoint_resumes_from_the_one_the_job_moved_past(
        ws: Workspace) -> None:
    """step_10 and step_20 written a fraction of a second apart, the job crashed at 25: no
    checkpoint is 60 s old, but the job began step_20 after step_10's last change."""
    cfg = ws.config({"command": ws.worker("--steps", "30", "--crash-at", "25", "--no-report")})
    rc, out = finish(ws.run(cfg))
    assert rc == 0, out
    assert _starts(ws) == [(0, 0, None), (1, 10, str(ws.ckpt / "step_10"))], out
    assert "starting from scratch" not in out, out
    [inc] = ws.incidents()
    assert (inc["resumed_step"], inc["steps_lost"]) == (10, 15)


def test_with_only_the_newest_unsettled_the_relaunch_waits_for_it(ws: Workspace) -> None:
    """One checkpoint, changed within the quiet time (3 s here) when the job crashed:
    the relaunch waits for its verdict, says so, and resumes from it."""
    cfg = ws.config({"command": ws.worker("--steps", "20", "--crash-at", "15", "--no-report"),
                     "checkpoints": {"dir": str(ws.ckpt), "quiet_for": "3s"}})
    rc, out = finish(ws.run(cfg), timeout=60.0)
    assert rc == 0, out
    assert _starts(ws) == [(0, 0, None), (1, 10, str(ws.ckpt / "step_10"))], out
    assert "the relaunch waits for its verdict (at most 3s)" in out, out
    assert "starting from scratch" not in out, out


@pytest.mark.parametrize(("entries", "said"), [
    ([(10, "empty")], "step 10: empty"),
    ([(10, "no marker"), (20, "no marker"), (30, "changed within 60s (...)")],
     "step 30: changed within 60s (...); steps 20, 10: no marker"),
    ([(s, "empty") for s in range(1, 8)], "steps 7, 6, 5, 4, 3 and 2 more: empty"),
    ([(s, f"why {s}") for s in range(1, 11)],
     "; ".join(f"step {s}: why {s}" for s in range(10, 2, -1)) + "; 2 more reasons"),
], ids=["one", "grouped", "many-steps", "many-reasons"])
def test_a_start_from_scratch_names_each_reason_with_its_steps(
        entries: list[tuple[int, str]], said: str) -> None:
    assert reasons([Entry(s, f"/c/step_{s}", False, False, why) for s, why in entries]) == said
