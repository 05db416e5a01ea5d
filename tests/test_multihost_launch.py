"""A job that spans hosts, launched by a real `trainwatch run --host`: its torchrun agent
gets --max-restarts=1000000 and the shared-store setting, its rank this host's name."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from conftest import Workspace, finish, free_port, missing, wait_for

# One rank: joins the group through the agent's rendezvous (gloo), says what it was given.
SCRIPT = """\
import json, os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
names = ("TORCHELASTIC_MAX_RESTARTS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TRAINWATCH_HOST",
         "WORLD_SIZE")
with open(sys.argv[1], "w") as f:
    json.dump({k: os.environ.get(k) for k in names}, f)
dist.destroy_process_group()
"""


def _torchrun() -> str:
    try:
        import torch  # noqa: F401
    except ImportError:
        missing("torch is not installed (pip install torch==2.13.0; make test installs it)")
    path = Path(sys.executable).parent / "torchrun"
    if not path.exists():
        missing(f"{path}: torchrun is not installed")
    return str(path)


def _job(ws: Workspace) -> tuple[Path, Path]:
    """A config of one nodes: 1:2 torchrun job (host: from-the-file), and its rank's report."""
    script, out = ws.root / "rank.py", ws.root / "rank.json"
    script.write_text(SCRIPT)
    command = [_torchrun(), "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=x",
               # one host is enough to start: not the default 30 s wait for a second
               "--rdzv-conf=last_call_timeout=1", str(script), str(out)]
    return ws.config({"command": command, "nodes": "1:2"}, host="from-the-file"), out


def _given(out: Path, host: str) -> None:
    assert json.loads(out.read_text()) == {
        "TORCHELASTIC_MAX_RESTARTS": "1000000", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "TRAINWATCH_HOST": host, "WORLD_SIZE": "1"}


SAID = ("trainwatch: job job: spans 1:2 hosts; torchrun gets --max-restarts=1000000"
        " (trainwatch's budget ends the job, not torchrun's) and"
        " TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n")


def test_the_torchrun_agent_of_a_spanning_job_gets_what_trainwatch_adds(ws: Workspace) -> None:
    """trainwatch run --host h1 of a nodes: 1:2 torchrun job: the rank sees
    TORCHELASTIC_MAX_RESTARTS=1000000, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and
    TRAINWATCH_HOST=h1, and the launch says what was added, once."""
    config, out = _job(ws)
    rc, said = finish(ws.run(config, "--host", "h1"), timeout=180)
    assert rc == 0, said
    _given(out, "h1")
    assert SAID in said and said.count("spans 1:2 hosts") == 1


def test_the_daemons_host_flag_names_the_host_its_jobs_see(ws: Workspace) -> None:
    """trainwatch daemon --host h2: the same job's rank sees TRAINWATCH_HOST=h2, not the
    file's host, with the same torchrun settings."""
    config, out = _job(ws)
    p = subprocess.Popen([sys.executable, "-m", "trainwatch.cli", "daemon", "--config",
                          str(config), "--host", "h2"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ws.procs.append(p)
    wait_for(lambda: ws.status().get("state") == "exited", timeout=120,
             what="the job's one attempt to exit")
    p.send_signal(signal.SIGTERM)
    rc, said = finish(p)
    assert rc == 0, said
    _given(out, "h2")
    assert SAID in said
