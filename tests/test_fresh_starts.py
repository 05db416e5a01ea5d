"""No recovery path starts over in silence (issue 21, items C14-C16): a mistyped
checkpoint folder is warned about at start and by check-config, every report it
refuses is counted, and every relaunch from scratch of a job that reported
checkpoints is one loud line naming the folder; a folder trainwatch cannot read
checkpoints from says so; the stall watch without the client is on by default."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import Workspace, finish, free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families
from trainwatch import cli
from trainwatch.cli import runconfig
from trainwatch.config import from_mapping

# Reports a checkpoint it writes in the folder given (attempt N: step N + 5), then
# exits 3 on attempts 0 and 1; attempt 2 stays up to be looked at.
REPORTER = """
import os, sys, time
from pathlib import Path
from trainwatch import client
hb = client.connect()
folder = Path(sys.argv[1])
folder.mkdir(exist_ok=True)
attempt = int(os.environ["TRAINWATCH_ATTEMPT"])
path = folder / f"step_{attempt + 5}"
path.write_text("x")
hb.beat(attempt + 5)
hb.checkpoint(attempt + 5, path)
time.sleep(0.5)
if attempt < 2:
    sys.exit(3)
time.sleep(120)
"""

# No client: overwrites model.pt in the folder given, exits 3 on attempt 0.
OVERWRITER = """
import os, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
folder.mkdir(exist_ok=True)
(folder / "model.pt").write_bytes(b"weights")
if os.environ["TRAINWATCH_ATTEMPT"] == "0":
    sys.exit(3)
time.sleep(120)
"""


def _sample(port: int, name: str, **labels: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


def test_a_mistyped_folder_is_said_at_start_counted_and_at_every_fresh_relaunch(
        ws: Workspace) -> None:
    """The job reports checkpoints in ckpt/, the config says ckpt_typo/: a warning at the
    first launch, each refused report counted (said once), and each of the two fresh
    relaunches one ERROR line naming ckpt_typo, counted as a fresh start."""
    typo = ws.root / "ckpt_typo"
    port = free_port()
    config = ws.config({"command": [sys.executable, "-c", REPORTER, str(ws.ckpt)],
                        "checkpoints": {"dir": str(typo)}},
                       metrics={"address": "127.0.0.1", "port": port})
    p = ws.run(config)
    wait_for(lambda: ws.status().get("attempt") == 2 and ws.status().get("state") == "running",
             timeout=60, what="attempt 2 running")
    wait_for(lambda: _sample(port, "trainwatch_job_checkpoint_reports_refused_total",
                             job="job", reason="outside_dir") == 3,
             timeout=30, what="three refused reports counted")
    assert _sample(port, "trainwatch_job_fresh_starts_with_checkpoints_total", job="job") == 2
    assert _sample(port, "trainwatch_job_checkpoint_reports_refused_total", job="job",
                   reason="not_named") == 0
    p.send_signal(signal.SIGTERM)
    _rc, out = finish(p, timeout=60)
    lines = out.splitlines()
    assert any(f"checkpoints.dir {typo} does not exist yet" in x for x in lines), out
    refused = [x for x in lines if "refused a checkpoint report" in x]
    assert len(refused) == 1 and f"not in checkpoints.dir {typo}" in refused[0], out
    loud = [x for x in lines if "relaunching from scratch although" in x]
    assert len(loud) == 2, out
    assert all(f"checkpoints.dir {typo} does not exist" in x and str(ws.ckpt / "step_") in x
               for x in loud), loud


def test_a_folder_of_unnumbered_entries_is_said_not_started_over_quietly(
        ws: Workspace) -> None:
    """A job overwriting model.pt (no step in the name): the relaunch says trainwatch cannot
    tell what to resume from, naming the folder and the entry."""
    config = ws.config({"command": [sys.executable, "-c", OVERWRITER, str(ws.ckpt)]})
    p = ws.run(config)
    wait_for(lambda: ws.status().get("attempt") == 1, timeout=60, what="attempt 1")
    p.send_signal(signal.SIGTERM)
    _rc, out = finish(p, timeout=60)
    said = [x for x in out.splitlines() if "cannot tell what to resume from" in x]
    assert len(said) == 1, out
    assert f"checkpoints.dir {ws.ckpt} holds 1 entry: model.pt" in said[0], said
    assert "its layout (auto)" in said[0], said


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainwatch.cli", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_check_config_warns_of_a_checkpoint_folder_that_does_not_exist(tmp_path: Path) -> None:
    """Exit 0 and ok, with one warning line naming the job's field and the folder; none
    when the folder is there."""
    (tmp_path / "ckpt").mkdir()
    doc = {"jobs": [{"name": "good", "command": ["true"],
                     "checkpoints": {"dir": str(tmp_path / "ckpt")}},
                    {"name": "typo", "command": ["true"],
                     "checkpoints": {"dir": str(tmp_path / "ckpt_typo")}}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    r = _check_config(path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{path}: ok (2 job(s): good, typo)"
    (line,) = r.stderr.splitlines()
    assert line == (f"trainwatch: warning: {path}: jobs.typo.checkpoints.dir: "
                    f"{tmp_path / 'ckpt_typo'} is not a folder here (mistyped? every "
                    "relaunch would start from scratch)")


@pytest.mark.parametrize("stall, silence", [
    (None, 300.0), ({"silence": "45s"}, 45.0), ({"silence": "off"}, None),
    ({"silence": False}, None), ({"silence": 0}, None), ({"silence": None}, None),
])
def test_the_stall_watch_without_the_client_is_on_by_default(stall: dict[str, object] | None,
                                                             silence: float | None) -> None:
    """A config without a stall section has stall.silence 5m; 0, off or null turn it off."""
    job: dict[str, object] = {"name": "j", "command": ["x"]}
    if stall is not None:
        job["stall"] = stall
    assert from_mapping({"jobs": [job]}, "c.yaml").jobs[0].stall.silence == silence


@pytest.mark.parametrize("flag, silence", [
    ([], 300.0), (["--stall-silence", "2m"], 120.0), (["--stall-silence", "0"], None),
    (["--stall-silence", "off"], None),
])
def test_trainwatch_run_takes_stall_silence(tmp_path: Path, flag: list[str],
                                            silence: float | None) -> None:
    """`trainwatch run --stall-silence DURATION` sets it; 0 and off turn it off."""
    args = cli.build_parser().parse_args(
        ["run", "--state-dir", str(tmp_path / "s"), "--run-dir", str(tmp_path / "r"), *flag,
         "--", "true"])
    args.command = args.command[1:]
    _config, job = runconfig.run_config(args)
    assert job.stall.silence == silence


def test_a_bad_stall_silence_flag_is_one_line() -> None:
    """--stall-silence soon: exit 2, one line naming the flag."""
    r = subprocess.run([sys.executable, "-m", "trainwatch.cli", "run", "--stall-silence",
                        "soon", "--", "true"], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--stall-silence: expected 0, off or a duration" in r.stderr, r.stderr
