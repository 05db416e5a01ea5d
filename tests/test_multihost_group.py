"""One job across two "hosts" on this machine: two trainwatch processes (each
its own state, run dir and host name), each running a torchrun agent of one
`--nnodes=2` job (c10d rendezvous on 127.0.0.1, gloo), one rank per host, a
checkpoint folder both see. A fault on one host is one group restart: every
rank resumes from the same checkpoint, each host records one incident of it
under one restart number, and the run ends with the fault-free run's weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import Workspace, finish, free_port, wait_for

STEPS = 80

# Deterministic (float64; an all-reduce of two ranks is one addition): w moves
# toward TARGET by the two ranks' gradients. Rank 0 checkpoints every step, as
# a folder renamed into place with a marker inside; every rank journals where
# it started.
_TRAINER = textwrap.dedent(
    """
    import datetime, json, os, shutil, sys, time
    import torch
    import torch.distributed as dist
    ckpt, journal, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if os.environ.get("NO_CLIENT"):  # as a loop without trainwatch's client: its tracker
        def agreed_resume():
            t = os.path.join(ckpt, ".trainwatch", "resume-from")
            return (open(t).read().strip() if os.path.exists(t) else "") or None, None
        class connect:
            def beat(self, *a, **k): pass
            def data_order(self, *a, **k): pass
    else:
        from trainwatch.client import connect
        from trainwatch.integrations.torch import agreed_resume
    bad = range(*(int(x) for x in sys.argv[4].split(":"))) if len(sys.argv) > 4 else range(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    target = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    w, start = torch.zeros(4, dtype=torch.float64), 0
    resume, skip = agreed_resume()  # every rank the same, or none trains
    if resume:
        state = torch.load(os.path.join(resume, "state.pt"))
        w, start = state["w"], state["step"]
    with open(journal, "a") as f:
        f.write(json.dumps({"rank": rank, "host": os.environ["TRAINWATCH_HOST"],
                            "pid": os.getpid(), "start": start, "skip": skip}) + "\\n")
    hb = connect()
    hb.data_order("step", "batch k is drawn from k", step=start)
    for step in range(start + 1, steps + 1):
        if skip and skip[0] <= step <= skip[1]:
            hb.beat(step)  # this step's data is skipped
            continue
        g = (w - target) * (rank + 1) * (float("nan") if step in bad else 1.0)
        dist.all_reduce(g)
        w = w - 0.05 * g / world
        # Only rank 0 says the loss (as most loops log it): only its host sees the NaN.
        hb.beat(step, loss=float(((w - target) ** 2).sum()) if rank == 0 else None)
        if rank == 0:
            d = os.path.join(ckpt, f"step_{step}")
            os.makedirs(d + ".tmp", exist_ok=True)
            torch.save({"w": w, "step": step}, os.path.join(d + ".tmp", "state.pt"))
            open(os.path.join(d + ".tmp", "done"), "w").close()
            shutil.rmtree(d, ignore_errors=True)  # written again after a restart
            os.rename(d + ".tmp", d)
        time.sleep(0.05)
    if rank == 0:
        with open(os.path.join(os.path.dirname(journal), "final.json"), "w") as f:
            json.dump({"w": w.tolist()}, f)
    dist.destroy_process_group()
    """
)


def _fault_free(skip: tuple[int, int] | None = None, world: int = 2,
                steps: int = STEPS) -> list[float]:
    """The weights a run of ``world`` ranks without faults ends with (the
    trainer's arithmetic, its all-reduce summing in rank order), the steps of
    ``skip`` skipped."""
    target = [1.0, -2.0, 0.5, 3.0]
    w = [0.0] * 4
    for step in range(1, steps + 1):
        if skip and skip[0] <= step <= skip[1]:
            continue
        g = [sum((wi - ti) * (k + 1) for k in range(world)) for wi, ti in zip(w, target,
                                                                              strict=True)]
        w = [wi - 0.05 * gi / world for wi, gi in zip(w, g, strict=True)]
    return w


def _hosts(tmp_path: Path, *args: str, n: int = 2, steps: int = STEPS,
           **job: object) -> tuple[list[Workspace], Path, Path]:
    ckpt, journal = tmp_path / "ckpt", tmp_path / "journal.jsonl"
    ckpt.mkdir()
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={n}",
               "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=tw-group", "--monitor-interval=0.1", str(script), str(ckpt),
               str(journal), str(steps), *args]
    hosts = []
    for name in ("hA", "hB", "hC")[:n]:
        ws = Workspace(tmp_path / name)
        ws.root.mkdir()
        cfg = ws.config({"command": command, "nodes": n, "resume_args": [],
                         "checkpoints": {"dir": str(ckpt), "pattern": "step_{step}",
                                         "marker": "done"}, **job},
                        host=name)
        hosts.append((ws, cfg))
    for ws, cfg in hosts:
        ws.run(cfg)
    return [ws for ws, _ in hosts], journal, ckpt


def _stop(hosts: list[Workspace]) -> list[str]:
    """Every host's trainwatch stopped (SIGTERM: its job with it); their outputs."""
    for ws in hosts:
        for p in ws.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    return [finish(p, timeout=60)[1] for ws in hosts for p in ws.procs]


def _one_restart(ws: Workspace, outs: list[str]) -> None:
    """The host recorded group restart 1 only, charged once (a failure of its own
    while the round formed, e.g. its agent losing the store: part of it)."""
    evs = [json.loads(i["evidence"]) for i in ws.incidents()]
    assert {e.get("group_restart") for e in evs} == {1}, (ws.root.name, evs, *outs)
    assert sum(e.get("charged", True) is not False and not e.get("part_of_restart")
               for e in evs) == 1, (ws.root.name, evs)


def back_and_done(tmp_path: Path, journal: Path, starts: int, t0: float) -> float:
    """Seconds from ``t0`` (monotonic) until ``starts`` ranks' starts are in the
    journal; then the run is waited for to its end (tmp_path/final.json)."""
    wait_for(lambda: len(_journal(journal)) >= starts, timeout=120,
             what="every rank to start again")
    back = time.monotonic() - t0
    wait_for(lambda: (tmp_path / "final.json").exists(), timeout=180, what="the run to finish")
    return back


def _journal(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def _drill(tmp_path: Path, sig: signal.Signals, kind: str, n: int = 2, steps: int = STEPS,
           **job: object) -> float:
    """``sig`` to host B's rank at step 12 (of ``n`` hosts): every rank resumes
    from one step, each host records one incident naming group restart 1 that
    began at B's rank (``kind`` there), each charges it once, and the run ends
    with the fault-free run's weights. Seconds from the signal until every rank
    started again."""
    hosts, journal, _ = _hosts(tmp_path, n=n, steps=steps, **job)
    b = hosts[1]
    try:
        wait_for(lambda: (b.status().get("step") or 0) >= 12, timeout=120,
                 what="host B's rank to reach step 12")
        victim, rank = next((int(e["pid"]), e["rank"])  # type: ignore[call-overload]
                            for e in _journal(journal) if e["host"] == "hB")
        os.kill(victim, sig)
        back = back_and_done(tmp_path, journal, 2 * n, time.monotonic())
    finally:
        outs = _stop(hosts)
    runs = _journal(journal)
    starts = [e["start"] for e in runs]
    assert starts[:n] == [0] * n and len(runs) == 2 * n, (runs, *(o[-3000:] for o in outs))
    assert len(set(starts[n:])) == 1 and isinstance(starts[n], int) and starts[n] >= 10, runs
    incs = {ws.root.name: ws.incidents() for ws in hosts}
    for ws in hosts:
        name, got = ws.root.name, incs[ws.root.name]
        assert len(got) == 1, (name, got, outs)
        ev = json.loads(got[0]["evidence"])
        assert (ev.get("group_restart"), ev.get("began")) == (1, f"hB rank {rank}"), (name, ev)
        assert {c["host"] for c in ev.get("claims", [])} >= {"hB"}, (name, ev)
        shown = subprocess.run([sys.executable, "-m", "trainwatch.cli", "incidents", "--state-dir",
                                str(ws.state), "--show", str(got[0]["id"])],
                               capture_output=True, text=True, timeout=60, check=False).stdout
        shown_ok = f"group restart 1: began on hB rank {rank}" in shown
        assert shown_ok, (name, shown)
    assert incs["hB"][0]["kind"] == kind, incs
    if kind == "hang":  # its evidence taken before the group restart ended the workers
        ev_b = json.loads(incs["hB"][0]["evidence"])
        assert ev_b.get("evidence_dir") and ev_b.get("stacks"), ev_b
        for ws in hosts:  # every host's stacks judged together, on every host
            ev = json.loads(incs[ws.root.name][0]["evidence"])
            across = ev.get("stacks_across_hosts") or {}
            assert (across.get("hosts"), across.get("suspects")) == (n, [f"hB:{rank}"]), ev
    tracker = (tmp_path / "ckpt" / ".trainwatch" / "resume-from").read_text()  # no client: this
    assert tracker == f"{tmp_path / 'ckpt' / f'step_{starts[n]}'}\n", tracker
    final = json.loads((tmp_path / "final.json").read_text())["w"]
    want = _fault_free(world=n, steps=steps)
    if n == 2:  # two ranks: one addition per all-reduce, the same bits in any order
        assert final == want, (final, want)
    else:  # three: gloo's ring may add in another order than rank order; the last bits
        assert all(abs(x - y) <= 1e-12 * max(1.0, abs(y)) for x, y in zip(final, want,
                                                                          strict=True))
    print(f"{kind}, {n} hosts: group back in {back:.1f}s from step {starts[n]}")
    return back


def test_a_rank_killed_on_one_host_restarts_the_group_once_from_one_checkpoint(
        tmp_path: Path) -> None:
    """SIGKILL of host B's rank: one group restart, begun at B's rank, from one step."""
    _drill(tmp_path, signal.SIGKILL, "crash")


def test_a_rank_stopped_on_one_host_is_named_there_and_restarts_the_group_once(
        tmp_path: Path) -> None:
    """SIGSTOP of host B's rank: B names it (a hang), A's ranks, waiting for it in
    the all-reduce, are not named; one group restart from one step."""
    # Long enough after the restart for every host's stacks to be judged together.
    _drill(tmp_path, signal.SIGSTOP, "hang", steps=240, heartbeat={"timeout": "3s"})


def test_a_nan_seen_on_rank_0s_host_rolls_the_whole_group_back_with_one_skip_window(
        tmp_path: Path) -> None:
    """Steps 30-31 make the loss NaN, which only rank 0 says: its host rolls back
    (quarantine, skip window) and records the group restart; the other host
    follows it. The anomaly comes back at 31 once: the window widens, a second
    group restart that neither host charges. After each restart both ranks
    resume from one step and skip one window; the final weights are those of a
    fault-free run that skips the last window."""
    (a, b), journal, _ = _hosts(tmp_path, "30:32")
    try:
        wait_for(lambda: (tmp_path / "final.json").exists(), timeout=240,
                 what="the run to finish")
    finally:
        outs = _stop([a, b])
    runs = _journal(journal)
    lead = next(e["host"] for e in runs if e["rank"] == 0)
    assert len(runs) >= 4 and len(runs) % 2 == 0, (runs, outs)
    pairs = [runs[i:i + 2] for i in range(2, len(runs), 2)]
    for x, y in pairs:
        assert (x["start"], x["skip"]) == (y["start"], y["skip"]), runs
    start, skip = pairs[-1][0]["start"], pairs[-1][0]["skip"]
    assert isinstance(start, int) and start < 30 and skip[0] <= 30 and skip[1] >= 31, runs
    for name, ws in (("hA", a), ("hB", b)):
        got = ws.incidents()
        gens = [json.loads(i["evidence"]).get("group_restart") for i in got]
        assert gens == list(range(1, len(pairs) + 1)), (name, got, outs)
        assert all(i["kind"] == "nan_loss" or json.loads(i["evidence"]).get("began", "")
                   .startswith(f"{lead} rank") for i in got), (name, got)
        charged = [i for i in got if "not charged" not in i["decision"]
                   and json.loads(i["evidence"]).get("charged", True)]
        assert len(charged) == 1, (name, [(i["kind"], i["decision"]) for i in got])
    final = json.loads((tmp_path / "final.json").read_text())["w"]
    assert final == _fault_free((skip[0], skip[1])), (final, skip)


def test_ranks_that_disagree_on_where_to_resume_refuse_to_train(tmp_path: Path) -> None:
    """agreed_resume() on two real ranks (torchrun, gloo): the same answer is
    returned on both; different answers raise on both, naming them."""
    script = tmp_path / "agree.py"
    script.write_text(textwrap.dedent(
        """
        import os, sys
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        os.environ["TRAINWATCH_RESUME_FROM"] = sys.argv[1] if rank == 0 else sys.argv[2]
        from trainwatch.integrations.torch import agreed_resume
        try:
            print(f"rank {rank} AGREED {agreed_resume()[0]}", flush=True)
        except RuntimeError as e:
            print(f"rank {rank} REFUSED {e}", flush=True)
        dist.destroy_process_group()
        """))

    def run(a: str, b: str) -> str:
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node=2", str(script), a, b],
                           capture_output=True, text=True, timeout=120, check=False)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout

    same = run("/ck/step_9", "/ck/step_9")
    assert same.count("AGREED /ck/step_9") == 2, same
    differ = run("/ck/step_9", "/ck/step_7")
    assert differ.count("REFUSED trainwatch: the ranks disagree on where to resume") == 2, differ
    assert "'/ck/step_7'" in differ, differ


def test_three_hosts_restart_as_one_group_from_one_checkpoint(tmp_path: Path) -> None:
    """Three hosts, SIGKILL of host B's rank: one group restart on all three, every
    rank resuming from one step (the final weights: as the fault-free run's where
    two ranks sum, which the 2-host drills check bit for bit)."""
    _drill(tmp_path, signal.SIGKILL, "crash", n=3)


def test_a_host_whose_agent_is_killed_kills_its_workers_and_rejoins_the_group(
        tmp_path: Path) -> None:
    """SIGKILL of host B's torchrun agent: its worker (in a session of its own,
    orphaned) is killed with the attempt's tree, B relaunches its agent into the
    same group restart, and every rank resumes from one step."""
    hosts, journal, _ = _hosts(tmp_path)
    b = hosts[1]
    try:
        wait_for(lambda: (b.status().get("step") or 0) >= 12, timeout=120,
                 what="host B's rank to reach step 12")
        agent = int(b.status()["pid"])
        worker = next(int(e["pid"]) for e in _journal(journal)  # type: ignore[call-overload]
                      if e["host"] == "hB")
        os.kill(agent, signal.SIGKILL)
        wait_for(lambda: not Path(f"/proc/{worker}").exists()
                 or Path(f"/proc/{worker}/stat").read_text().split(") ")[1][0] == "Z",
                 timeout=30, what="host B's orphaned worker to be killed")
        wait_for(lambda: len(_journal(journal)) >= 4, timeout=120,
                 what="every rank to start again")
        wait_for(lambda: (tmp_path / "final.json").exists(), timeout=180,
                 what="the run to finish")
    finally:
        outs = _stop(hosts)
    runs = _journal(journal)
    assert len(runs) == 4 and runs[2]["start"] == runs[3]["start"], (runs, *outs)
    for ws in hosts:
        _one_restart(ws, outs)
    final = json.loads((tmp_path / "final.json").read_text())["w"]
    assert final == _fault_free(), (final, _fault_free())


def test_a_job_without_the_client_resumes_every_rank_from_the_groups_tracker(
        tmp_path: Path) -> None:
    """The same trainer without trainwatch's client (no beats; it resumes from
    <checkpoints.dir>/.trainwatch/resume-from when that names a checkpoint):
    SIGKILL of host B's rank, seen by its exit, is one group restart, and every
    rank resumes from the tracker's checkpoint; the fault-free weights."""
    hosts, journal, ckpt = _hosts(tmp_path, env={"NO_CLIENT": "1"})
    try:
        wait_for(lambda: (ckpt / "step_12").exists(), timeout=120,
                 what="the run to reach step 12")
        victim = next(int(e["pid"]) for e in _journal(journal)  # type: ignore[call-overload]
                      if e["host"] == "hB")
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: (tmp_path / "final.json").exists(), timeout=180,
                 what="the run to finish")
    finally:
        outs = _stop(hosts)
    runs = _journal(journal)
    assert len(runs) == 4 and runs[2]["start"] == runs[3]["start"] >= 12, (runs, *outs)
    tracker = (ckpt / ".trainwatch" / "resume-from").read_text().strip()
    assert tracker == str(ckpt / f"step_{runs[2]['start']}"), tracker
    for ws in hosts:
        _one_restart(ws, outs)
    final = json.loads((tmp_path / "final.json").read_text())["w"]
    assert final == _fault_free(), (final, _fault_free())
