"""A real torchrun job (2 ranks, gloo, CPU) whose rank 1 is stopped mid-run:
the others block in their all-reduce, trainwatch decides nccl_stall within
seconds (not PyTorch's 10 minutes), names rank 1, keeps both ranks' stacks,
and relaunches the job from its last checkpoint to the end. With the client,
and without it (output silence and idle CPU). And ranks that finished, their
launcher still up, are no stall."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

from conftest import Workspace, finish, wait_for
from test_torchrun import _cli, _ddp


def _stopped_rank_is_named(ws: Workspace, beat: bool,
                           silence: str | None = "10s") -> dict[str, object]:
    args = ["--steps", "150", "--interval", "0.05", "--ckpt-every", "20", "--print-every", "5"]
    job: dict[str, object] = {"command": _ddp(ws, *(["--beat"] if beat else []), *args),
                              "gpus": {"devices": [0, 1]}}
    if not beat:  # no reports: the catalog judges the files (renamed into place whole)
        # Idle for half of it decides: more than a loaded host's disk stalls every
        # rank for while they import torch, silent (a second or two seen at 4 s).
        if silence is not None:
            job["stall"] = {"silence": silence}
        job["checkpoints"] = {"dir": str(ws.ckpt), "pattern": "step_{step}.pt",
                              "quiet_for": "1s"}
    p = ws.run(ws.config(job, gpu={"backend": "sim", "count": 2, "kmsg": None}))
    if beat:
        wait_for(lambda: len(ws.status().get("ranks", {})) == 2
                 and (ws.status().get("step") or 0) >= 30, timeout=90, what="both ranks beating")
    else:
        wait_for(lambda: (ws.ckpt / "step_40.pt").exists(), timeout=90, what="two checkpoints")
    r = ws.faultinject("nccl-stall", "--rank", "1")
    assert r.returncode == 0, r.stderr
    t0 = time.time()
    wait_for(lambda: ws.incidents(), timeout=60, what="the stall incident")
    print(f"client={beat} silence={silence}: incident {ws.incidents()[0]['time'] - t0:.1f}s "
          "after the stop")
    rc, out = finish(p, timeout=240)
    assert rc == 0, out
    incident = ws.incidents()[0]
    assert incident["kind"] == "nccl_stall", incident
    assert incident["rank"] == 1, (incident, incident["evidence"])
    assert incident["injected"] == 1
    assert incident["resumed_step"] is not None and incident["resumed_step"] >= 20, incident
    assert ws.transitions()[-1] == "exited"
    return incident


def test_a_stopped_rank_without_the_client_is_a_stall_by_default(ws: Workspace) -> None:
    """No beats, no stall settings (silence 5 min): the stopped rank, its output silent,
    is named by its process state within seconds, not minutes."""
    incident = _stopped_rank_is_named(ws, beat=False, silence=None)
    evidence = json.loads(str(incident["evidence"]))
    assert evidence["client"] is False and evidence["decided_by"] == "process_state", evidence
    assert evidence["stopped_for_s"] >= 5.0, evidence


def _stacks_of_both_ranks(ws: Workspace, incident: dict[str, object]) -> None:
    folder = Path(ws.state) / "jobs" / "job" / "incidents" / str(incident["id"])
    for rank in (0, 1):
        assert (folder / "stacks" / f"rank{rank}.json").exists(), sorted(folder.rglob("*"))


def test_a_stopped_rank_is_a_stall_named_and_recovered_with_the_client(ws: Workspace) -> None:
    """Beats freeze on both ranks; rank 1's process is stopped: named, stacks kept and shown
    by `trainwatch incidents --show`, the job resumed from its checkpoint to the end."""
    incident = _stopped_rank_is_named(ws, beat=True)
    evidence = json.loads(str(incident["evidence"]))
    assert evidence["decided_by"] == "process_state"
    assert incident["gpu"] == 1 and set(evidence["gpu_utilization"]) == {"0", "1"}, evidence
    _stacks_of_both_ranks(ws, incident)
    shown = _cli("incidents", "--state-dir", str(ws.state), "--show", str(incident["id"]))
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "kind: nccl_stall" in text and "verdict: rank 1" in text, text
    # Each rank's stack, or both at once when they are the same (shown once).
    both = ("  rank0:" in text and "  rank1:" in text) or "  rank0, rank1:" in text
    assert both and "state T" in text, text


def test_a_stopped_rank_is_a_stall_without_the_client(ws: Workspace) -> None:
    """No beats: output silence and idle CPU decide it; the stopped rank is found by its RANK."""
    incident = _stopped_rank_is_named(ws, beat=False)
    evidence = json.loads(str(incident["evidence"]))
    assert evidence["client"] is False and evidence["decided_by"] == "process_state", evidence
    _stacks_of_both_ranks(ws, incident)


def test_ranks_that_finished_while_their_launcher_lingers_are_no_stall(ws: Workspace) -> None:
    """Both ranks beat their last step and exit 0; their launcher stays 8 s more (torchrun's
    agent in its exit barrier, or shutting its store down on a loaded host). The ranks'
    quiet is their end, not a stall: it was one 5 s in (the floor), and a finished group
    job was restarted from its last checkpoint, a second incident at the end of the run."""
    worker = shlex.join(ws.worker("--ranks", "2", "--steps", "60", "--interval", "0.05"))
    p = ws.run(ws.config({"command": ["sh", "-c", f"{worker} && sleep 8"]}))
    rc, out = finish(p, timeout=120)
    assert rc == 0, out
    assert ws.incidents() == [], out
    assert ws.transitions()[-1] == "exited", out
    assert "stall" not in out, out


def test_a_rank_wedged_in_its_own_code_without_the_client_is_named_by_its_stacks(
        ws: Workspace) -> None:
    """No beats, default settings: rank 1 sleeps in its own code after step 40 (a
    dead file system, a deadlock: idle, not stopped), rank 0 waits in the next
    all-reduce. Every process idle, the output silent: two reads of the stacks a
    second or more apart keep rank 1 outside any collective and rank 0 inside, so
    rank 1 is named within seconds (it waited out the 5-minute silence), and the
    job resumes from its checkpoint to the end."""
    args = ["--steps", "80", "--interval", "0.05", "--ckpt-every", "20", "--print-every", "5",
            "--sleep-rank1-at", "40"]
    job = {"command": _ddp(ws, *args),
           "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}.pt", "quiet_for": "1s"}}
    p = ws.run(ws.config(job))
    log = Path(ws.state) / "jobs" / "job"
    wait_for(lambda: any("step 40 " in x.read_text(errors="replace")
                         for x in log.rglob("attempt-0-*.log")), timeout=120,
             what="rank 1 at step 40")
    t0 = time.time()
    [incident] = wait_for(lambda: ws.incidents() or None, timeout=120, what="the stall")
    print(f"wedged rank, no client: incident {incident['time'] - t0:.1f}s after step 40")
    rc, out = finish(p, timeout=240)
    assert rc == 0, out
    [incident] = ws.incidents()  # as the relaunch completed it
    evidence = json.loads(str(incident["evidence"]))
    assert (incident["kind"], incident["rank"]) == ("nccl_stall", 1), (incident, evidence)
    assert evidence["decided_by"] == "stacks" and evidence["client"] is False, evidence
    assert any("main (ddp.py)" in x for x in evidence["stack"]), evidence
    assert incident["resumed_step"] == 40, incident
    assert ws.transitions()[-1] == "exited"
