"""A group restart decided while the job's hand does not answer (a machine too busy to
run it: one call past its deadline keeps it down for its cooldown) can neither judge
the checkpoints nor write the decision every rank resumes from. It waits, says so, and
decides once the hand answers: the ranks resume from the newest checkpoint, never from
scratch (the stalled rank would stall again, a second incident)."""

from __future__ import annotations

from conftest import Workspace, finish, wait_for
from test_group_one_host import _command
from test_hand_unanswered import _Stopper


def test_a_group_restart_waits_for_its_hand_rather_than_resume_every_rank_from_scratch(
        ws: Workspace) -> None:
    cfg = ws.config({"command": _command(ws, "--sleep-rank1-at", "60"), "nodes": 1,
                     "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}.pt"}},
                    {"max_restarts": 3})
    p = ws.run(cfg)
    wait_for(lambda: (ws.status().get("step") or 0) >= 50, timeout=120, what="step 50")
    stopper = _Stopper(p.pid)  # from here until the stall's incident: no hand answers
    try:
        wait_for(lambda: ws.incidents(), timeout=120, what="the stall incident")
    finally:
        stopper.release()
    code, out = finish(p, timeout=300)
    assert code == 0, out[-3000:]
    incs = ws.incidents()
    assert [i["kind"] for i in incs] == ["nccl_stall"], out[-6000:]
    [inc] = incs
    assert inc["resumed_step"] in (40, 60), (inc, out[-4000:])
    assert "resumes from scratch" not in out, out[-4000:]
    assert "waits: the job's hand did not answer" in out, out[-4000:]
    print(*(ln for ln in out.splitlines() if "group restart" in ln or "hand" in ln), sep="\n")
