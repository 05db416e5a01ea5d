"""One group decision from what every host knows (multihost/known.py): a job of
two "hosts" on this machine (two trainwatch processes, one torchrun agent each,
one rank per host), checkpoints every 10 steps with nothing in them that says
they are complete, reported by the rank on one host only. The other host's
judgement alone holds the newest unfinished for ``quiet_for`` (60 s); it must not
decide from that: whichever host decides, every rank resumes from the newest
checkpoint reported to any host, and the run ends with the fault-free weights."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

from conftest import Workspace, free_port, wait_for
from test_multihost_group import _fault_free, _journal, _stop, back_and_done

STEPS = 80
EVERY = 10
KILL_AT = 45

# Deterministic, as test_multihost_group's trainer; the rank on REPORT_ON's host
# writes step_N/ (renamed into place, no marker) every EVERY steps and reports it;
# host B's rank waits at step PAUSE_AT of its first run for the drill's signal.
_TRAINER = textwrap.dedent(
    """
    import datetime, json, os, shutil, sys, time
    import torch
    import torch.distributed as dist
    from trainwatch.client import connect
    from trainwatch.integrations.torch import agreed_resume
    ckpt, journal, steps, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    host = os.environ["TRAINWATCH_HOST"]
    writer = host == os.environ["REPORT_ON"]
    target = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    w, start = torch.zeros(4, dtype=torch.float64), 0
    resume, _ = agreed_resume()
    if resume:
        state = torch.load(os.path.join(resume, "state.pt"))
        w, start = state["w"], state["step"]
    with open(journal, "a") as f:
        f.write(json.dumps({"rank": rank, "host": host,
                            "pid": os.getpid(), "start": start}) + "\\n")
    hb = connect()
    for step in range(start + 1, steps + 1):
        g = (w - target) * (rank + 1)
        dist.all_reduce(g)
        w = w - 0.05 * g / world
        hb.beat(step)
        if start == 0 and step == int(os.environ["PAUSE_AT"]) and host == "hB":
            p = os.path.join(os.path.dirname(journal), "paused")
            open(p + ".tmp", "w").write(str(os.getpid()))
            os.rename(p + ".tmp", p)
            time.sleep(600)  # here until the drill's signal: the fault at a known step
        if writer and step % every == 0:
            d = os.path.join(ckpt, f"step_{step}")
            os.makedirs(d + ".tmp", exist_ok=True)
            torch.save({"w": w, "step": step}, os.path.join(d + ".tmp", "state.pt"))
            shutil.rmtree(d, ignore_errors=True)  # written again after a restart
            os.rename(d + ".tmp", d)
            hb.checkpoint(step, d)
        time.sleep(0.05)
    if writer:
        with open(os.path.join(os.path.dirname(journal), "final.json"), "w") as f:
            json.dump({"w": w.tolist()}, f)
    dist.destroy_process_group()
    """
)


def _reported(ws: Workspace) -> dict[str, str]:
    try:
        return dict(json.loads((ws.state / "jobs" / "job" / "catalog.json").read_text())
                    .get("reported") or {})
    except (OSError, ValueError):
        return {}


def two_hosts(tmp_path: Path, trainer: str, report_on: str, **job: object) -> list[Workspace]:
    """``trainer`` run as one torchrun job of two hosts, hA and hB (one trainwatch
    each, one rank each), writing tmp_path/ckpt and tmp_path/journal.jsonl."""
    ckpt, journal = tmp_path / "ckpt", tmp_path / "journal.jsonl"
    ckpt.mkdir()
    script = tmp_path / "trainer.py"
    script.write_text(trainer)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=tw-known",
               "--monitor-interval=0.1", str(script), str(ckpt), str(journal), str(STEPS),
               str(EVERY)]
    hosts = []
    for name in ("hA", "hB"):
        ws = Workspace(tmp_path / name)
        ws.root.mkdir()
        hosts.append(ws)
        ws.run(ws.config({"command": command, "nodes": 2, "resume_args": [],
                          "env": {"REPORT_ON": report_on, "PAUSE_AT": str(KILL_AT)},
                          "checkpoints": {"dir": str(ckpt), "pattern": "step_{step}"}, **job},
                         host=name))
    return hosts


def _drill(tmp_path: Path, report_on: str, sig: signal.Signals, **job: object) -> None:
    """``sig`` to host B's rank at step KILL_AT, with step KILL_AT // EVERY * EVERY
    reported to ``report_on``'s host: every rank resumes from that step."""
    journal = tmp_path / "journal.jsonl"
    hosts = two_hosts(tmp_path, _TRAINER, report_on, **job)
    told = hosts[0 if report_on == "hA" else 1]
    newest = KILL_AT // EVERY * EVERY
    try:
        paused = tmp_path / "paused"
        wait_for(lambda: paused.exists() and str(newest) in _reported(told), timeout=120,
                 what=f"host B's rank at step {KILL_AT}, step {newest} reported to {report_on}")
        victim = int(paused.read_text())
        assert victim in [e["pid"] for e in _journal(journal) if e["host"] == "hB"]
        os.kill(victim, sig)
        back = back_and_done(tmp_path, journal, 4, time.monotonic())
    finally:
        outs = _stop(hosts)
    runs = _journal(journal)
    assert [e["start"] for e in runs] == [0, 0, newest, newest], (runs, *(o[-4000:] for o in outs))
    for ws in hosts:
        evs = [json.loads(i["evidence"]) for i in ws.incidents()]
        assert {e.get("group_restart") for e in evs} == {1}, (ws.root.name, evs)
    final = json.loads((tmp_path / "final.json").read_text())["w"]
    assert final == _fault_free(), (final, _fault_free())
    if sig is signal.SIGSTOP:
        [inc] = hosts[1].incidents()
        ev = json.loads(inc["evidence"])
        states = {p["state"] for p in (ev.get("processes") or {}).values()}
        assert (inc["kind"], states) == ("hang", {"T"}), (inc, ev)
    print(f"reports to {report_on}, {sig.name} on hB: back in {back:.1f}s from step {newest}")


def test_a_crash_on_the_host_never_told_of_the_newest_checkpoint_resumes_from_it(
        tmp_path: Path) -> None:
    """Reports to host A, SIGKILL on host B: B decides, from A's reports."""
    _drill(tmp_path, "hA", signal.SIGKILL)


def test_a_crash_on_the_host_told_of_the_newest_checkpoint_resumes_every_rank_from_it(
        tmp_path: Path) -> None:
    """Reports to host B, SIGKILL on host B: whichever host decides first (A sees its
    rank's collective fail), every rank resumes from B's newest report."""
    _drill(tmp_path, "hB", signal.SIGKILL)


def test_a_stopped_rank_on_the_host_never_told_resumes_from_the_newest_checkpoint(
        tmp_path: Path) -> None:
    """Reports to host A, SIGSTOP on host B: B names its one rank, stopped, a hang
    after the stall timeout (the default settings: the heartbeat's is 300 s), and
    decides from A's reports."""
    _drill(tmp_path, "hA", signal.SIGSTOP)


def test_a_stopped_rank_on_the_host_told_resumes_from_the_newest_checkpoint(
        tmp_path: Path) -> None:
    """Reports to host B, SIGSTOP on host B: B names its one rank and decides from its
    own reports; host A, whose rank waits in the all-reduce, names no one first."""
    _drill(tmp_path, "hB", signal.SIGSTOP)
