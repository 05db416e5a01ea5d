"""A one-host torchrun job under ``nodes: 1``: its agent restarts its workers in
place, through torchrun's rendezvous. Its GPU throws Xid 79: the workers must
leave that GPU, and only a new agent gets a new CUDA_VISIBLE_DEVICES, so the
whole tree is relaunched without it. A rank stuck in its own code: the stall is
acted on at once, with no other host to wait for. A corrupt newest checkpoint:
the rounds that die loading it mark it bad, as separate launches would."""

from __future__ import annotations

import dataclasses
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from conftest import Workspace, finish, free_port, wait_for
from test_gpu_e2e import XID79_GPU1
from test_torchrun import DDP

if TYPE_CHECKING:
    from trainwatch.actions.attempt import Attempt
    from trainwatch.lifecycle.job import JobRunner


def _visible(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"CUDA_VISIBLE_DEVICES="):
            return kv.split(b"=", 1)[1].decode()
    return None


def _workers(ws: Workspace) -> dict[int, str | None]:
    """Each beating rank's pid -> its CUDA_VISIBLE_DEVICES."""
    ranks = ws.status().get("ranks", {})
    return {int(pid): _visible(int(pid)) for pid in ranks.values()}


def _command(ws: Workspace, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
            "--nproc-per-node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=tw-one-host",
            "--monitor-interval=0.1", str(DDP), "--ckpt-dir", str(ws.ckpt), "--beat",
            "--steps", "200", "--interval", "0.05", "--ckpt-every", "20", *args]


def _runner(ws: Workspace, now: float) -> JobRunner:
    """A nodes: 1 job's runner, not started, on a clock stopped at ``now``."""
    import selectors

    from trainwatch.config import load
    from trainwatch.lifecycle.job import JobRunner
    from trainwatch.state.ledger import Ledger

    cfg = load(ws.config({"command": _command(ws), "nodes": 1,
                          "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}.pt"}}))
    return JobRunner(cfg, cfg.jobs[0], Ledger(ws.state), selectors.DefaultSelector(),
                     clock=lambda: now)


def _one_incident(ws: Workspace, out: str) -> None:
    incs = ws.incidents()
    if len(incs) != 1:  # in full on failure (pytest cuts an assertion's message short)
        print(*(f"incident {i['id']}: {i['kind']} {i['evidence']}" for i in incs),
              out[-6000:], sep="\n")
    assert len(incs) == 1, [i["kind"] for i in incs]


def test_an_xid_in_a_group_job_relaunches_its_agent_without_the_gpu(ws: Workspace) -> None:
    """Xid 79 on GPU 1 of GPUs 0-2 (2 needed): a new agent, its workers on 0,2."""
    kern = ws.root / "kern.log"
    kern.write_text("")
    command = _command(ws)
    cfg = ws.config({"command": command, "nodes": 1, "gpus": {"devices": [0, 1, 2], "min": 2},
                     "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}.pt"}},
                    {"max_restarts": 3},
                    gpu={"backend": "sim", "count": 3, "kmsg": str(kern),
                         "poll_interval": "0.2s"})
    p = ws.run(cfg)
    before = wait_for(lambda: len(w := _workers(ws)) == 2 and (ws.status().get("step") or 0)
                      >= 30 and w, timeout=120, what="both ranks beating")
    assert set(before.values()) == {"0,1,2"}, before
    with open(kern, "a") as f:
        f.write(XID79_GPU1)
    wait_for(lambda: ws.incidents(), timeout=60, what="the Xid incident")
    after = wait_for(lambda: len(w := _workers(ws)) == 2 and not set(w) & set(before) and w,
                     timeout=120, what="the relaunched ranks beating")
    assert set(after.values()) == {"0,2"}, after
    code, out = finish(p, timeout=240)
    assert code == 0, out[-3000:]
    _one_incident(ws, out)
    [inc] = ws.incidents()
    assert (inc["kind"], inc["action"], inc["gpu"]) == ("gpu_xid", "restart_exclude_gpu", 1), inc
    starts = [e for e in ws.transitions()]
    assert starts.count("starting") == 2, starts


def test_a_stall_in_a_one_host_group_is_acted_on_without_waiting_for_other_hosts(
        ws: Workspace) -> None:
    """Rank 1 sleeps inside its step (not stopped): the stall restarts the workers in
    place as soon as it is decided; the hold for another host's daemon (a group across
    hosts waits 5 s for the host whose rank is stuck) is not for a group of one."""
    cfg = ws.config({"command": _command(ws, "--sleep-rank1-at", "60"), "nodes": 1,
                     "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}.pt"}},
                    {"max_restarts": 3})
    p = ws.run(cfg)
    wait_for(lambda: ws.incidents(), timeout=120, what="the stall incident")
    code, out = finish(p, timeout=240)
    assert code == 0, out[-3000:]
    _one_incident(ws, out)
    [inc] = ws.incidents()
    assert inc["kind"] == "nccl_stall", inc
    assert "waiting 5s for the host" not in out, out[-3000:]
    assert "group restart 1" in out and ws.transitions().count("starting") == 2, out[-3000:]
    # The round counts as running at its first beat, or 10 s after it began (its workers
    # slow to start), not at once: its agent is old, the round is new.
    lines = out.splitlines()
    began = next(i for i, x in enumerate(lines) if "running -> starting: group restart 1" in x)
    ran = next(x for x in lines[began:] if "starting -> running" in x)
    waited = (datetime.fromisoformat(ran.split()[0])
              - datetime.fromisoformat(lines[began].split()[0])).total_seconds()
    assert "first heartbeat" in ran or waited >= 9.9, (waited, ran)


def test_rounds_that_die_loading_a_corrupt_checkpoint_mark_it_bad_and_resume_before_it(
        ws: Workspace) -> None:
    """The newest checkpoint is overwritten with garbage and a rank exits: the group's
    decision is verified (the file no longer matches what was hashed when it was
    reported), so it resumes from the one before; had the check been slow, the rounds'
    deaths loading it would mark it bad after checkpoints.bad_after (3). Either way the
    job ends well, not in a crash loop until the budget is spent."""
    cfg = ws.config({"command": _command(ws, "--corrupt-at", "45"), "nodes": 1,
                     "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}.pt"}},
                    {"max_restarts": 6})
    code, out = finish(ws.run(cfg), timeout=300)
    assert code == 0, out[-3000:]
    assert ("checkpoint step 40 failed verification" in out
            or "checkpoint step 40 marked bad" in out), out[-3000:]
    resumed = [i["resumed_step"] for i in ws.incidents()]
    assert resumed[-1] == 20, (resumed, out[-3000:])



def test_a_round_waiting_for_its_evidence_is_looked_at_again_within_a_twentieth_of_a_second(
        ws: Workspace) -> None:
    """The workers of a hung round are kept until their stacks are taken (tens of ms),
    then killed, and only then does the agent restart them: the loop must look again
    soon, not at the job's next whole second (up to 1 s more of every hang's recovery)."""
    from trainwatch.evidence.capture import Capture
    from trainwatch.multihost.state import Pending
    from trainwatch.types import JobState

    now = 100.5
    r = _runner(ws, now)
    try:
        r.state = JobState.RUNNING
        assert r.group is not None and r.next_wake(now) == 101.0  # the job's own grid
        cap = Capture(ws.root / "ev", [], None, timeout=5.0)
        r.group.pending = Pending(cap, None, 1, "hang", now, now + 5.0, peers=False)
        assert r.next_wake(now) == pytest.approx(now + 0.05)  # while the capture runs
        cap.start()
        assert cap.wait(30)
        assert r.next_wake(now) == pytest.approx(now + 0.05)  # done: begun at the next look
    finally:
        r.intake.close()


def test_workers_the_agent_started_after_the_fault_are_not_ended_as_the_rounds_before() -> None:
    """A decision slower than the agent's own restart (0.55 and 0.66 s, twice in one
    goodput drill run; 4-100 ms otherwise), or a hang declared while the agent restarts
    its workers, meets the agent's next round already started: its workers, started
    after the fault, are not the old round's to end. psutil's create_time() read
    0.96 s early on issue 25's VM (the boot's epoch time is truncated to the second), which
    took them for old ones and killed them: the crash cost the group a second round."""
    import os
    import subprocess
    import time

    from trainwatch.actions.tree import start_time
    from trainwatch.multihost import rounds

    old = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.3)
        new = subprocess.Popen(["sleep", "60"])  # the agent's next round
        # The fault just before it: past new_round's 50 ms margin by a tick. psutil read
        # the start early by the boot time's fraction of a second (0.05 s on this VM,
        # 0.96 s on issue 25's), so the old code fails wherever that is over 11 ms.
        ticks = start_time(new.pid)
        assert ticks is not None
        started = time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME)
                                 - ticks / os.sysconf("SC_CLK_TCK"))
        onset = started - 0.061
        try:
            # new_round's own margin: a start within 50 ms of the fault is the old round's
            assert rounds._older({old.pid, new.pid}, onset + 0.05) == {old.pid}
        finally:
            new.kill()
            new.wait()
    finally:
        old.kill()
        old.wait()


def test_a_hang_in_a_round_where_a_rank_exited_is_held_for_that_exits_crash(
        ws: Workspace) -> None:
    """torchrun's agent may reap a crashed rank before trainwatch reads its status: the
    exit is judged UNKNOWN_GRACE (2 s) later, and a hang timeout of 1 s would name the
    crash a hang (1 of 32 crashes in a goodput drill). A hang or stall in a round where
    a rank exited is held until that exit is judged: the incident is the crash."""
    from trainwatch.multihost import group
    from trainwatch.sources.rankexits import RankExit
    from trainwatch.types import Fault, FaultKind

    now = 100.0
    r = _runner(ws, now)
    try:
        assert r.group is not None
        hang = Fault(FaultKind.HANG, "job", now, rank=0)
        assert not group.held(r, hang, now)  # nodes: 1, no rank exited: acted on at once
        r.first_failure.exits.exits.append(RankExit(1, 2**22 + 1, now - 0.5, None))
        assert group.held(r, hang, now)
        assert group.held(r, dataclasses.replace(hang, kind=FaultKind.NCCL_STALL), now)
        r.group.before = {2**22 + 1}  # the exit of a round before: not this round's
        assert not group.held(r, hang, now)
        r.group.before = set()
        r.group.exits_seen = 1  # judged (check(): its crash, or an exit 0 at the run's end)
        assert not group.held(r, hang, now)
    finally:
        r.intake.close()


# A torchrun agent as far as a round's end goes: a worker (RANK 0) at once; once the
# file named by argv[1] exists, the next round's worker; each pid printed as it starts.
_AGENT = ("import os, subprocess, sys, time\n"
          "env = {**os.environ, 'RANK': '0'}\n"
          "def worker():\n"
          "    w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
          "                         env=env)\n"
          "    print(w.pid, flush=True)\n"
          "worker()\n"
          "while not os.path.exists(sys.argv[1]):\n"
          "    time.sleep(0.01)\n"
          "worker()\n"
          "time.sleep(120)\n")


def _pids(a: Attempt) -> list[int]:
    """The workers' pids the agent printed, in its log."""
    log = Path(a.log_path)
    return [int(x) for x in log.read_text().split()] if log.exists() else []


def test_a_join_admitted_late_ends_only_the_workers_of_before_the_join(ws: Workspace) -> None:
    """A peer's join is recorded; the agent ends this host's worker and starts the new
    round's at once; a loaded loop sees the end 3 s later (a whole-suite run under load)
    and takes it as the admission. The new round's worker, started after the join, is
    not the old round's to end: killing it crashed the newcomer's rank with it, a third
    group restart charged to the budget. The old round's worker is ended."""
    import signal
    import time

    from trainwatch.actions.attempt import Attempt
    from trainwatch.actions.launch import begin_attempt
    from trainwatch.multihost import leave, records
    from trainwatch.multihost.state import Joining
    from trainwatch.sources.procstat import proc_stat

    r = _runner(ws, 0.0)
    r.clock = time.monotonic  # type: ignore[misc]
    go = ws.root / "next-round"
    agent = dataclasses.replace(r.job, command=(sys.executable, "-c", _AGENT, str(go)))
    a = Attempt(agent, 0, r.socket_path, None, None, r.dir / "logs", passthrough=False)
    try:
        begin_attempt(r, a, None, "start")
        assert r.group is not None
        old = wait_for(lambda: [*_pids(a), 0][0], what="the old round's worker")
        joined = time.time() + 0.2  # the peer's join, recorded after the old worker began
        wait_for(lambda: time.time() > joined + 0.1, what="the join to be past")
        go.touch()  # the agent ends nothing here (the test does below); it starts the new
        new = wait_for(lambda: [*_pids(a), 0, 0][1], what="the new round's worker")
        rec = records.Restart(2, "hB", 20, None, None, "gpu_xid", "hB", None, joined,
                              charged=False, joins="hB")
        r.group.joining = Joining(rec, None, r.clock() + 60.0)
        assert leave.admitted(r, a, r.clock(), ended=time.time())  # the end, seen late
        wait_for(lambda: (proc_stat(old) or ("Z",))[0] in ("Z", "X"),
                 what="the old round's worker ended")
        assert (proc_stat(new) or ("Z",))[0] not in ("Z", "X"), "the new round's worker ended"
    finally:
        a.tree.signal(signal.SIGKILL, a.tree.scan())
        a.close()
        r.intake.close()


def test_a_reload_that_changes_nodes_says_what_restarts_the_job_stays_until_a_restart(
        ws: Workspace, caplog: pytest.LogCaptureFixture) -> None:
    """What restarts a job is chosen once, from its config as trainwatch started it: a
    reload that drops ``nodes:`` says so in one line, and torchrun's agent still does."""
    from trainwatch.multihost.engine import Torchrun

    r = _runner(ws, 0.0)
    try:
        r.reconfigure(r.config, dataclasses.replace(r.job, nodes=None))
        assert isinstance(r.engine, Torchrun)
        assert any("nodes changed: what restarts it stays as it was until trainwatch "
                   "restarts" in m for m in caplog.messages), caplog.messages
    finally:
        r.intake.close()


def _forge(ws: Workspace, path: str, step: int) -> int:
    """A group decision written by the job's user into its checkpoint folder (no host
    made it): the next restart's number, resuming from ``path``, charged to nothing."""
    import time

    base = ws.ckpt / ".trainwatch"
    gens = [int(p.name.split("-")[1]) for p in base.glob("restart-*")] if base.exists() else []
    gen = max(gens, default=0) + 1
    d = base / f"restart-{gen:08d}"
    d.mkdir(parents=True)
    (d / "decision.json").write_text(json.dumps({
        "resume_step": step, "resume_path": path, "skip": None, "kind": "crash",
        "at": time.time(), "charged": False, "host": "forger", "gen": gen}))
    return gen


def test_a_group_decision_the_user_wrote_is_a_claim_never_an_order(
        ws: Workspace, tmp_path: Path) -> None:
    """A decision in the job's shared folder naming a checkpoint outside checkpoints.dir:
    the ranks resumed from it (ended within 0.5 s). Now this host says so in one line and
    decides the restart itself, from its own good checkpoint, in a record after it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cfg = ws.config({"command": _command(ws, "--steps", "300"), "nodes": 1,
                     "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}.pt"}},
                    {"max_restarts": 3})
    p = ws.run(cfg)
    wait_for(lambda: len(_workers(ws)) == 2 and (ws.status().get("step") or 0) >= 45,
             timeout=120, what="both ranks past step 40")
    forged = _forge(ws, str(elsewhere / "step_40.pt"), 40)
    wait_for(lambda: ws.incidents(), timeout=60, what="the incident")
    code, out = finish(p, timeout=240)
    assert code == 0, out[-3000:]
    assert f"group restart {forged}, made by forger, resumes from step 40 (" \
           f"{elsewhere}/step_40.pt): {elsewhere}/step_40.pt is not in checkpoints.dir" in out, \
        out[-3000:]
    [inc] = ws.incidents()
    assert json.loads(inc["evidence"])["group_restart"] == forged + 1, inc
    ours = json.loads((ws.ckpt / ".trainwatch" / f"restart-{forged + 1:08d}" /
                       "decision.json").read_text())
    assert ours["resume_path"].startswith(f"{ws.ckpt}/"), ours
    assert inc["resumed_step"] == ours["resume_step"] >= 20, inc


def test_a_burst_of_user_written_decisions_spends_the_budget_and_ends_loudly(
        ws: Workspace) -> None:
    """Decisions written one after another, each `charged: false` and naming a good
    checkpoint: 31 restarts were charged to nothing. Each is charged here as this host
    sees it, and the budget (3) ends the job: fatal, said, not a restart loop."""
    cfg = ws.config({"command": _command(ws, "--steps", "2000"), "nodes": 1,
                     "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}.pt"}},
                    {"max_restarts": 3})
    p = ws.run(cfg)
    for n in range(1, 5):
        wait_for(lambda: (ws.ckpt / "step_20.pt").exists() and len(_workers(ws)) == 2,
                 timeout=120, what="both ranks beating")
        _forge(ws, str(ws.ckpt / "step_20.pt"), 20)
        wait_for(lambda n=n: len(ws.incidents()) >= n or p.poll() is not None, timeout=60,
                 what=f"restart {n}")
        if p.poll() is not None:
            break
    code, out = finish(p, timeout=120)
    assert code == 1 and ws.transitions()[-1] == "fatal", out[-3000:]
    assert "restart budget spent: 3 of 3" in out, out[-3000:]
    assert len(ws.incidents()) == 4, [i["kind"] for i in ws.incidents()]
