"""A real torchrun DDP job (gloo, CPU) under a real `trainwatch run`, as a new
user meets it: without the client it is never judged by silence it never
promised; drills act on every rank and are recorded as injected; every
incident field is measured or explicitly unknown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Workspace, finish, missing, wait_for

DDP = Path(__file__).parent / "jobs" / "ddp.py"


def _torchrun() -> str:
    try:
        import torch  # noqa: F401
    except ImportError:
        missing("torch is not installed (pip install torch==2.13.0; make test installs it)")
    path = Path(sys.executable).parent / "torchrun"
    if not path.exists():
        missing(f"{path}: torchrun is not installed")
    return str(path)


def _ddp(ws: Workspace, *args: str) -> list[str]:
    return [_torchrun(), "--standalone", "--nproc-per-node=2", str(DDP),
            "--ckpt-dir", str(ws.ckpt), *args]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainwatch.cli", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def test_startup_timeout_without_required_heartbeat_is_refused(ws: Workspace) -> None:
    """A startup timeout on a job not declared to beat is a usage error, before anything runs."""
    r = _cli("run", "--name", "j", "--state-dir", str(ws.state), "--run-dir",
             str(ws.root / "run"), "--metrics-port", "0", "--startup-timeout", "20s", "--",
             *_ddp(ws))
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert "--require-heartbeat" in r.stderr or "heartbeat.required" in r.stderr
    assert not (ws.state / "ledger.db").exists()


def test_torchrun_job_without_client_is_never_killed_for_silence(ws: Workspace) -> None:
    """A DDP job that never beats trains to the end under a 1 s heartbeat timeout: no incident."""
    config = ws.config({"command": _ddp(ws, "--steps", "12", "--interval", "0.3"),
                        "heartbeat": {"timeout": "1s"}})
    rc, out = finish(ws.run(config), timeout=120)
    assert rc == 0, out
    assert ws.incidents() == []
    assert ws.transitions()[-1] == "exited"


def test_hang_drill_without_rank_stops_every_rank_and_is_injected(ws: Workspace) -> None:
    """`faultinject hang --job J` stops the agent and both workers, names their pids, and the
    hang is detected, recorded as injected, and relaunched."""
    job = {"command": _ddp(ws, "--beat", "--steps", "100000", "--interval", "0.05"),
           "heartbeat": {"timeout": "3s"}}
    p = ws.run(ws.config(job))
    s = wait_for(lambda: (st := ws.status()).get("state") == "running"
                 and len(st.get("ranks", {})) == 2 and (st.get("step") or 0) >= 3 and st,
                 timeout=90, what="both ranks beating")
    ranks = {int(pid) for pid in s["ranks"].values()}
    r = ws.faultinject("hang")
    assert r.returncode == 0, r.stderr
    said = {int(x) for x in r.stdout.split("pids ", 1)[1].split(";")[0].split()}
    assert ranks <= said and int(s["pid"]) in said, r.stdout
    incident = wait_for(lambda: ws.incidents(), timeout=30, what="the hang incident")[0]
    assert incident["kind"] == "hang" and incident["injected"] == 1
    wait_for(lambda: ws.status().get("attempt") == 1 and ws.status().get("state") == "running",
             timeout=90, what="the relaunch running")
    assert p.poll() is None


def test_injected_crash_is_measured_and_steps_lost_unknown_without_client(ws: Workspace) -> None:
    """A crash drill on a job without the client: injected, detection measured from the drill,
    steps lost unknown (null), and the CLI shows it as unknown."""
    job = {"command": _ddp(ws, "--steps", "100000", "--interval", "0.05")}
    ws.run(ws.config(job))
    wait_for(lambda: ws.status().get("state") == "running", timeout=60, what="running")
    wait_for(lambda: (ws.ckpt / "step_10.pt").exists(), timeout=90, what="a checkpoint")
    r = ws.faultinject("crash")
    assert r.returncode == 0, r.stderr
    assert "trainwatch was not told" not in r.stderr
    incident = wait_for(lambda: [i for i in ws.incidents() if i["relaunched_at"]], timeout=60,
                        what="the crash relaunched")[0]
    assert incident["kind"] == "crash" and incident["injected"] == 1
    assert incident["detection_latency_s"] is not None and incident["detection_latency_s"] >= 0
    assert incident["steps_lost"] is None
    rows = json.loads(_cli("incidents", "--state-dir", str(ws.state), "--json").stdout)
    assert rows[0]["steps_lost"] is None
    table = _cli("incidents", "--state-dir", str(ws.state)).stdout.splitlines()
    assert table[1].split()[-1] == "-"  # lost: unknown


@pytest.mark.parametrize("rank", [0, 1])
def test_hang_of_one_rank_is_recorded_as_that_rank(ws: Workspace, rank: int) -> None:
    """DDP ranks block together when one stops; the incident still names the stopped rank."""
    job = {"command": _ddp(ws, "--beat", "--steps", "100000", "--interval", "0.05"),
           "heartbeat": {"timeout": "3s"}}
    ws.run(ws.config(job))
    wait_for(lambda: len(ws.status().get("ranks", {})) == 2 and (ws.status().get("step") or 0)
             >= 3, timeout=90, what="both ranks beating")
    r = ws.faultinject("hang", "--rank", str(rank))
    assert r.returncode == 0, r.stderr
    incident = wait_for(lambda: ws.incidents(), timeout=30, what="the hang incident")[0]
    assert incident["kind"] == "hang"
    assert incident["rank"] == rank
    assert incident["injected"] == 1
