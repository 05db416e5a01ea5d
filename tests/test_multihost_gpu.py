"""A host of a job across hosts whose GPU failed leaves the group and joins it
again once a pre-flight of its GPUs passes: which pre-flight a host runs and
what its answer means (a table), the simulated GPU's, and the whole drill
with two "hosts" on this machine (two trainwatch processes, one torchrun agent
each, `--nnodes=1:2`, c10d on 127.0.0.1, gloo, one simulated GPU each)."""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import Workspace, finish, free_port, pid_gone, wait_for
from trainwatch.config import Gpu
from trainwatch.multihost import preflight
from trainwatch.multihost.preflight import Check, judge
from trainwatch.watch.gpuwatch import GpuWatch

_NONE = Check("none", "")
_DCGMI = Check("dcgmi", "", ("dcgmi", "diag", "-r", "1"))
_TORCH = Check("torch", "", ("python", "-c", "..."))


@pytest.mark.parametrize(("backend", "dcgmi", "python", "kind"), [
    ("sim", "/usr/bin/dcgmi", "/usr/bin/python3", "sim"),  # the sim backend's own, first
    ("nvml", "/usr/bin/dcgmi", "/usr/bin/python3", "dcgmi"),  # DCGM where installed
    ("auto", None, "/usr/bin/python3", "torch"),  # else torch in the job's Python
    ("nvml", None, None, "none"),  # else the operator decides
])
def test_a_host_chooses_the_sim_then_dcgmi_then_torch_then_no_pre_flight(
        backend: str, dcgmi: str | None, python: str | None, kind: str) -> None:
    """The pre-flight chosen for each backend and what is installed."""
    check = preflight.choose(backend, which=lambda _: dcgmi, python=python)
    assert check.kind == kind
    if kind == "dcgmi":
        assert check.argv == ("/usr/bin/dcgmi", "diag", "-r", "1")
    if kind == "torch":
        assert check.argv[:2] == ("/usr/bin/python3", "-c")
    if kind == "none":
        assert "trainwatch clear-gpu" in check.what


@pytest.mark.parametrize(("check", "rc", "out", "passed", "said"), [
    (_DCGMI, 0, "| Deployment | Pass |", True, "passed"),
    (_DCGMI, 0, "| Memory | Fail - GPU 0 |", False, "Fail - GPU 0"),  # a failed test, exit 0
    (_DCGMI, 226, "error", False, "exit 226"),
    (_DCGMI, None, "", False, "no answer within"),  # timed out: a hung GPU is not healthy
    (_TORCH, 0, "1 GPU(s): matmul and all-reduce passed", True, "passed"),
    (_TORCH, 1, "GPU 0: a matmul came out wrong", False, "came out wrong"),
    (_TORCH, None, "", False, "no answer within"),
    (_TORCH, preflight.NO_TORCH, "torch cannot be imported", None, "waiting for the operator"),
    (_TORCH, preflight.NO_CUDA, "torch sees no GPU", None, "waiting for the operator"),
    (_NONE, 0, "", None, "waiting for the operator"),
])
def test_a_pre_flight_passes_fails_or_leaves_it_to_the_operator(
        check: Check, rc: int | None, out: str, passed: bool | None, said: str) -> None:
    """What a check's exit status and output mean."""
    got = judge(check, rc, out)
    assert (got.passed, said in got.detail) == (passed, True), got


def test_the_torch_pre_flight_without_a_gpu_is_no_pre_flight(tmp_path: Path) -> None:
    """Run for real here (torch without CUDA): none is available, not a failure."""
    check = preflight.choose("nvml", which=lambda _: None, python=sys.executable)
    got = preflight.run(check, [0], None, {}, timeout=120)
    assert got.passed is None and "torch sees no GPU" in got.detail, got


def test_a_dcgmi_that_hangs_or_fails_fails_the_pre_flight(tmp_path: Path) -> None:
    """A stand-in dcgmi (no GPU here): a failed diag and a hung one both fail."""
    fake = tmp_path / "dcgmi"
    fake.write_text("#!/bin/sh\necho \"| Memory | Fail - GPU $5 |\"\n"
                    "[ -e \"$(dirname $0)/hang\" ] && sleep 30\nexit 0\n")
    fake.chmod(0o755)
    check = preflight.choose("nvml", which=lambda _: str(fake))
    got = preflight.run(check, [0], None, {}, timeout=20)
    assert got.passed is False and "Fail - GPU 0" in got.detail, got
    (tmp_path / "hang").touch()
    t0 = time.monotonic()
    got = preflight.run(check, [0], None, {}, timeout=1)
    assert got.passed is False and "no answer" in got.detail and time.monotonic() - t0 < 20


def test_the_jobs_python_is_found_from_its_command(tmp_path: Path) -> None:
    """python -m torch.distributed.run: that Python; torchrun: the one its script names."""
    runner = tmp_path / "torchrun"
    runner.write_text("#!/opt/venv/bin/python3.11\nimport sys\n")
    assert preflight.python_of([sys.executable, "-m", "torch.distributed.run"]) == sys.executable
    assert preflight.python_of([str(runner), "--nnodes=2"]) == "/opt/venv/bin/python3.11"
    assert preflight.python_of(["bash", "-c", "x"]) is None


def test_the_sim_pre_flight_fails_until_an_injected_xid_79_is_cleared(tmp_path: Path) -> None:
    """Xid 79 injected on a simulated GPU leaves it broken until cleared."""
    w = GpuWatch(Gpu(backend="sim", count=2, kmsg=None, poll_interval=0.05), str(tmp_path),
                 lambda: None)
    w.start()
    try:
        wait_for(lambda: w.drain() is not None and w.health.source_up, what="a sample")
        assert preflight.sim(w, [0, 1]).passed
        w.inject_xid(1, 13)  # an application's error: the GPU is fine
        assert preflight.sim(w, [1]).passed
        w.inject_xid(1, 79)
        got = preflight.sim(w, [0, 1])
        assert got.passed is False and "GPU 1: injected Xid 79" in got.detail, got
        w.exclude(1, "gpu_xid 79")
        w.clear(1)  # what trainwatch clear-gpu does
        assert preflight.sim(w, [0, 1]).passed
    finally:
        w.close()


# --- the drill: two hosts, B's GPU fails, B leaves, A goes on alone, B rejoins -------

# Each rank journals where it started and the world it started in; rank 0
# checkpoints every step (a folder renamed into place, with a marker).
_TRAINER = textwrap.dedent(
    """
    import datetime, json, os, shutil, sys, time
    import torch
    import torch.distributed as dist
    from trainwatch import client
    ckpt, journal = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    w, start = torch.zeros(4, dtype=torch.float64), 0
    if client.resume_from():
        state = torch.load(os.path.join(client.resume_from(), "state.pt"))
        w, start = state["w"], state["step"]
    with open(journal, "a") as f:
        f.write(json.dumps({"rank": rank, "host": os.environ["TRAINWATCH_HOST"],
                            "pid": os.getpid(), "start": start, "world": world}) + "\\n")
    hb = client.connect()
    for step in range(start + 1, 1000000):
        g = w - 1.0
        dist.all_reduce(g)
        w = w - 0.01 * g / world
        hb.beat(step)
        if rank == 0:
            d = os.path.join(ckpt, f"step_{step}")
            os.makedirs(d + ".tmp", exist_ok=True)
            torch.save({"w": w, "step": step}, os.path.join(d + ".tmp", "state.pt"))
            open(os.path.join(d + ".tmp", "done"), "w").close()
            shutil.rmtree(d, ignore_errors=True)  # written again after a restart
            os.rename(d + ".tmp", d)
        time.sleep(0.1)
    """
)


def _journal(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _reasons(ws: Workspace, state: str) -> list[str]:
    con = sqlite3.connect(f"file:{ws.state / 'ledger.db'}?mode=ro", uri=True)
    try:
        return [r[0] for r in con.execute(
            "SELECT reason FROM transitions WHERE to_state=? ORDER BY id", (state,))]
    finally:
        con.close()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_a_host_whose_gpu_fails_leaves_the_group_and_rejoins_after_its_pre_flight(
        tmp_path: Path) -> None:
    """Xid 79 on host B's GPU (nodes 1:2, gpus.min 1): B leaves (its tree gone,
    waiting for a pre-flight), A's rank trains alone (world 1); once B's GPU is
    cleared its pre-flight passes, B rejoins, both ranks train together from one
    checkpoint; each host's incidents are the leave and the join (not charged). B's
    trainwatch restarts while B is out: B stays out until its pre-flight passes."""
    ckpt, journal, script = tmp_path / "ckpt", tmp_path / "journal.jsonl", tmp_path / "t.py"
    ckpt.mkdir()
    script.write_text(_TRAINER)
    port = free_port()
    # last_call 10 s: B's agent, started once A's store listens, joins A's first
    # round; a host gone is given up after its heartbeats expire (~15 s) + 10 s.
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
               "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=tw-gpu", "--rdzv-conf=last_call_timeout=10", "--monitor-interval=0.1",
               str(script), str(ckpt), str(journal)]
    hosts: dict[str, tuple[Workspace, Path]] = {}
    for name in ("hA", "hB"):
        ws = Workspace(tmp_path / name)
        ws.root.mkdir()
        hosts[name] = ws, ws.config(
            {"command": command, "nodes": "1:2", "resume_args": [],
             "checkpoints": {"dir": str(ckpt), "pattern": "step_{step}", "marker": "done"},
             "gpus": {"devices": [0], "min": 1, "preflight_every": "1s"}},
            host=name, gpu={"backend": "sim", "count": 1, "kmsg": None, "poll_interval": "0.2s"})
    (a, cfg_a), (b, cfg_b) = hosts["hA"], hosts["hB"]
    try:
        a.run(cfg_a)  # A's agent hosts the rendezvous store: B's leaving must not end it
        wait_for(lambda: _listening(port), timeout=60, what="A's rendezvous store")
        b.run(cfg_b)
        wait_for(lambda: len({e["host"] for e in _journal(journal) if e["world"] == 2}) == 2
                 and (b.status().get("step") or 0) >= 5, timeout=90,
                 what="both ranks to train together")
        b_pids = [int(e["pid"]) for e in _journal(journal)  # type: ignore[call-overload]
                  if e["host"] == "hB"]
        b_agent = b.status()["pid"]
        p = _cli("faultinject.cli", "gpu-xid", "--gpu", "0", "--xid", "79",
                 "--run-dir", str(b.root / "run"))
        assert p.returncode == 0, p.stderr
        wait_for(lambda: b.status().get("state") == "backoff", timeout=60, what="B to leave")
        assert all(pid_gone(x) for x in [b_agent, *b_pids])  # its whole tree is gone
        assert any("left the group: waiting for a pre-flight of GPUs 0" in x
                   for x in _reasons(b, "backoff")), _reasons(b, "backoff")
        alone = wait_for(lambda: next((e for e in _journal(journal)
                                       if e["host"] == "hA" and e["world"] == 1), None),
                         timeout=90, what="A's rank to train alone")
        wait_for(lambda: (a.status().get("step") or 0) >= int(alone["start"]) + 5,  # type: ignore[call-overload]
                 timeout=60, what="A's steps to advance alone")
        assert b.status().get("state") == "backoff"  # its pre-flight fails meanwhile
        # B's trainwatch restarts while B is out (SIGKILL, then started again): its GPU's
        # exclusion outlives it, so it stays out and waits for its pre-flight, never
        # going FATAL for want of a GPU (nor launching on an unchecked one).
        b.procs[0].send_signal(signal.SIGKILL)
        b.procs[0].wait(timeout=60)
        b.run(cfg_b)
        wait_for(lambda: sum(x.startswith("left the group: waiting for a pre-flight of GPUs 0")
                             for x in _reasons(b, "backoff")) == 2, timeout=60,
                 what="B's restarted trainwatch to keep it out")
        time.sleep(3)  # pre-flights every 1 s meanwhile, each failing on the broken GPU
        assert b.status().get("state") == "backoff" and "fatal" not in b.transitions()
        before = len(_journal(journal))
        clear = _cli("trainwatch.cli", "clear-gpu", "0", "--run-dir", str(b.root / "run"))
        assert clear.returncode == 0, clear.stderr
        both = wait_for(lambda: (lambda j: j[before:] if len(j) >= before + 2
                                 and {e["host"] for e in j[before:]} == {"hA", "hB"}
                                 else None)(_journal(journal)),
                        timeout=90, what="both ranks to start together again")
        wait_for(lambda: all((ws.status().get("step") or 0) >= int(both[0]["start"]) + 5
                             for ws in (a, b)), timeout=60, what="both to train on")
    finally:
        for ws in (a, b):
            for proc in ws.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        outs = {n: finish(ws.procs[-1], timeout=60)[1] for n, (ws, _) in hosts.items()}
    runs = _journal(journal)
    # torchrun may start a rank twice while the round with the newcomer forms (a busy
    # machine): each host's last start is the one that trains.
    last = {e["host"]: e for e in runs[before:]}
    assert sorted(last) == ["hA", "hB"], runs
    assert {(e["world"], e["start"]) for e in last.values()} == {(2, last["hA"]["start"])}, runs
    assert int(last["hA"]["start"]) >= int(alone["start"]), runs  # type: ignore[call-overload]
    assert "pre-flight of GPUs 0: sim: GPU 0: injected Xid 79" in outs["hB"], outs["hB"][-3000:]
    for name, ws in (("hA", a), ("hB", b)):
        everything = ws.incidents()
        # A rank that torchrun's agent stops while the round with the newcomer forms
        # (SIGTERM, seen under load) is recorded as part of that group restart, not
        # charged: an incident of its own, not a third restart.
        aftermath = [i for i in everything if json.loads(i["evidence"]).get("part_of_restart")]
        assert all(json.loads(i["evidence"]).get("group_restart") == 2
                   and json.loads(i["evidence"]).get("charged") is False
                   for i in aftermath), (name, aftermath)
        got = [i for i in everything if i not in aftermath]
        evs = [json.loads(i["evidence"]) for i in got]
        if [e.get("group_restart") for e in evs] != [1, 2]:
            # Printed whole (pytest shortens an assertion's message).
            print("\n".join([name, *(json.dumps([i["kind"], i["decision"], e]) for i, e in
                                     zip(got, evs, strict=True)), outs[name][-12000:]]))
        assert [e.get("group_restart") for e in evs] == [1, 2], name
        assert evs[0].get("leaves") == "hB" and "go on without it" in evs[0]["group"], \
            (name, got[0])
        assert evs[1].get("joins") == "hB" and evs[1].get("charged") is False, (name, evs[1])
        assert "not charged" in got[1]["decision"], (name, got[1])
    print(f"A alone from step {alone['start']}; both again from step {both[0]['start']}")
