"""Rollback past a loss anomaly, end to end with a real trainer (torch on CPU)
under a real `trainwatch run`: its learning rate is blown up at a known step,
the loss goes non-finite, and trainwatch relaunches it from a checkpoint from
before the onset, with the newer checkpoints quarantined (still on disk) and
the anomalous steps' data skipped; the job then trains to its end."""

from __future__ import annotations

import json
import sys
import textwrap

from conftest import Workspace, finish

# A linear model fit by SGD; a checkpoint (and its report) after every step.
# On attempt 0 the update of step BLOW uses a learning rate of 1e30: the
# checkpoint of that step holds the ruined weights, and the loss of the next
# step is inf. Every attempt journals where it resumed and what it was told
# to skip.
_TRAINER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from trainwatch import client
    ckpt, journal, steps, blow = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    attempt = int(os.environ["TRAINWATCH_ATTEMPT"])
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    w = torch.zeros(4, requires_grad=True)
    start = 0
    if client.resume_from():
        state = torch.load(client.resume_from())
        w.data.copy_(state["w"])
        start = state["step"]
    skip = client.skip_steps()
    with open(journal, "a") as f:
        f.write(json.dumps({"attempt": attempt, "start": start, "skip": skip}) + "\\n")
    hb = client.connect()
    for step in range(start + 1, steps + 1):
        if skip and skip[0] <= step <= skip[1]:
            continue  # this step's data is skipped
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()
        lr = 1e30 if attempt == 0 and step == blow else 0.05
        with torch.no_grad():
            w -= lr * w.grad
            w.grad.zero_()
        hb.beat(step, loss=loss.item())
        path = os.path.join(ckpt, f"step_{step}")
        torch.save({"w": w.detach().clone(), "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
        hb.checkpoint(step, path)
        time.sleep(0.01)
    """
)


def test_a_blown_learning_rate_is_rolled_back_to_before_its_onset(ws: Workspace) -> None:
    """LR blown at the update of step 40: the loss of step 41 is inf (onset 41);
    relaunched from step 39 (the checkpoint of step 40 holds the ruined weights:
    the default margin of 1 step excludes it), 40 and later quarantined yet on
    disk, TRAINWATCH_SKIP_STEPS covering 41; the job finishes."""
    script = ws.root / "trainer.py"
    script.write_text(_TRAINER)
    journal = ws.root / "journal.jsonl"
    cfg = ws.config({"command": [sys.executable, str(script), str(ws.ckpt), str(journal), "80",
                                 "40"],
                     "resume_args": [],
                     "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}"}})
    code, out = finish(ws.run(cfg), timeout=120)
    assert code == 0, out
    incs = ws.incidents()
    assert len(incs) == 1, ([(i["attempt"], i["kind"], i["action"], i["onset_step"],
                              i["resumed_step"], i["evidence"]) for i in incs],
                            journal.read_text(), out[-3000:])
    [inc] = incs
    assert (inc["kind"], inc["action"], inc["onset_step"]) == ("nan_loss", "rollback", 41), inc
    runs = [json.loads(x) for x in journal.read_text().splitlines()]
    assert [r["attempt"] for r in runs] == [0, 1], runs
    assert runs[1]["start"] == 39, runs
    start, end = runs[1]["skip"]
    assert start == 41 <= end, runs
    assert inc["resumed_step"] == 39, inc
    # Quarantined: what attempt 0 wrote from step 40 on; the relaunch wrote 40 anew
    # (good again), and skipped 41..end, whose ruined checkpoints stay on disk.
    catalog = json.loads((ws.state / "jobs" / "job" / "catalog.json").read_text())
    bad = {int(k): v for k, v in catalog["bad"].items()}
    assert all(v.startswith("quarantined") for v in bad.values()), bad
    assert 40 not in bad and set(bad) <= set(range(41, end + 1)), (bad, end)
    assert all((ws.ckpt / f"step_{s}").exists() for s in bad)
