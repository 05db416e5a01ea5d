"""`faultinject nan | grad-spike` against a real `trainwatch run` whose job beats a
healthy loss and grad norm: trainwatch injects the values into the job's loss
feed, marked injected, and its policy's action really runs (a rollback, with
the skip window reaching the relaunch); a spike before the detectors have
warmed up is refused in one line."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from conftest import Workspace, finish, wait_for

# A healthy job: a falling loss, a steady grad norm with a little noise, a
# checkpoint every 5 steps; each attempt journals where it resumed and the
# skip window it was given.
_TRAINER = textwrap.dedent(
    """
    import json, os, random, sys, time
    from trainwatch import client
    ckpt, journal, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hold = sys.argv[4] if len(sys.argv) > 4 else None  # after the first beat, until it exists
    start = 0
    if client.resume_from():
        start = int(open(client.resume_from()).read())
    skip = client.skip_steps()
    with open(journal, "a") as f:
        f.write(json.dumps({"attempt": int(os.environ["TRAINWATCH_ATTEMPT"]),
                            "start": start, "skip": skip}) + "\\n")
    hb = client.connect()
    rng = random.Random(start)
    for step in range(start + 1, steps + 1):
        time.sleep(0.01)
        if skip and skip[0] <= step <= skip[1]:
            hb.beat(step)
            continue
        hb.beat(step, loss=2.0 / (1 + 0.01 * step), grad_norm=0.5 * (1 + 0.05 * rng.random()))
        while hold and not os.path.exists(hold):
            time.sleep(0.02)
        if step % 5 == 0:
            path = os.path.join(ckpt, f"step_{step}")
            with open(path + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(path + ".tmp", path)
            hb.checkpoint(step, path)
    """
)


def _start(ws: Workspace, steps: int, warmup: int = 100, hold: Path | None = None) -> Path:
    script = ws.root / "trainer.py"
    script.write_text(_TRAINER)
    journal = ws.root / "journal.jsonl"
    cfg = ws.config({"command": [sys.executable, str(script), str(ws.ckpt), str(journal),
                                 str(steps), *([str(hold)] if hold else [])],
                     "resume_args": [],
                     "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}"},
                     "anomalies": {"warmup_steps": warmup}})
    ws.procs.append(ws.run(cfg))
    return journal


def _attempts(journal: Path) -> list[dict[str, Any]]:
    if not journal.exists():
        return []
    return [json.loads(x) for x in journal.read_text().splitlines() if x]


def test_faultinject_nan_rolls_the_job_back_marked_injected(ws: Workspace) -> None:
    """`faultinject nan`: a nan_loss incident at the job's current step, injected=1,
    action rollback to a checkpoint before it, relaunched with TRAINWATCH_SKIP_STEPS
    covering that step; the job then finishes."""
    journal = _start(ws, steps=400)
    wait_for(lambda: (ws.status().get("step") or 0) >= 30, what="the job to reach step 30")
    p = ws.faultinject("nan")
    assert p.returncode == 0, p.stderr
    assert "injected a NaN loss at step" in p.stdout and "nan_loss act" in p.stdout, p.stdout
    [inc] = wait_for(lambda: [i for i in ws.incidents() if i["relaunched_at"] is not None],
                     what="the rollback's relaunch")
    assert (inc["kind"], inc["action"], inc["injected"]) == ("nan_loss", "rollback", 1), inc
    assert json.loads(inc["evidence"])["source"] == "drill"
    onset = inc["onset_step"]
    assert onset > 30 and inc["resumed_step"] < onset, inc
    runs = wait_for(lambda: [r for r in _attempts(journal) if r["attempt"] == 1],
                    what="attempt 1 to start")
    assert runs[0]["start"] == inc["resumed_step"]
    assert runs[0]["skip"] is not None and runs[0]["skip"][0] <= onset <= runs[0]["skip"][1]
    code, out = finish(ws.procs[-1], timeout=60)
    assert code == 0, out[-3000:]


def test_faultinject_grad_spike_is_refused_in_warm_up_then_acts(ws: Workspace) -> None:
    """`faultinject grad-spike` before the detectors have their statistics: refused in
    one line (exit 2); once warm, the default run of x100 grad norms is a sustained
    grad_norm_outlier: alerted, then acted on with a rollback, marked injected."""
    hold = ws.root / "go"  # the trainer waits after its first beat: still warming up
    journal = _start(ws, steps=800, hold=hold)
    wait_for(lambda: ws.status().get("state") == "running", what="the first beat")
    early = ws.faultinject("grad-spike")
    assert early.returncode == 2 and early.stdout == "", early
    assert early.stderr.count("\n") == 1 and "no grad-norm statistics yet" in early.stderr, \
        early.stderr
    hold.touch()

    def spiked() -> str | None:
        p = ws.faultinject("grad-spike", "--scale", "100")
        if p.returncode == 0:
            return p.stdout
        assert "no grad-norm statistics yet" in p.stderr, p.stderr  # still warming up
        return None

    out = wait_for(spiked, what="the detectors to warm up")
    assert "grad_norm_outlier alert" in out and "grad_norm_outlier act" in out, out
    incs = wait_for(lambda: [i for i in ws.incidents() if i["relaunched_at"] is not None],
                    what="the rollback's relaunch")
    acted = [i for i in ws.incidents() if i["action"] != "alert"]
    assert [(i["kind"], i["action"], i["injected"]) for i in acted] == \
        [("grad_norm_outlier", "rollback", 1)], acted
    onset = acted[0]["onset_step"]
    assert incs[0]["resumed_step"] < onset
    ev = json.loads(acted[0]["evidence"])
    assert ev["source"] == "drill" and ev["run"] == 10 and ev["noticed_step"] == onset + 9, ev
    runs = wait_for(lambda: [r for r in _attempts(journal) if r["attempt"] == 1],
                    what="attempt 1 to start")
    assert runs[0]["skip"] == [onset, onset + 9], runs
