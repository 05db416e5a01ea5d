"""`trainwatch checkpoints JOB --state-dir S` with no daemon (post-mortem): the
state a real `trainwatch run` left when it was stopped (its catalog, manifests
and checkpoint folder), read back as the live command's table, as real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Workspace, wait_for

BIN = Path(sys.executable).parent


def _tw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainwatch.cli", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def _reported(ws: Workspace) -> list[int]:
    try:
        state = json.loads((ws.state / "jobs" / "job" / "catalog.json").read_text())
    except (OSError, ValueError):
        return []
    return sorted(int(s) for s in state.get("reported", {}))


@pytest.fixture
def stopped(ws: Workspace) -> Iterator[Workspace]:
    """A flags-only `trainwatch run` whose job crashed at 25 (relaunched from 20), wrote
    checkpoints up to 40 and more, and was stopped (SIGTERM) once 40 had its manifest."""
    ws.ckpt.mkdir(exist_ok=True)
    run = subprocess.Popen(
        [str(BIN / "trainwatch"), "run", "--state-dir", str(ws.state), "--run-dir",
         str(ws.root / "run"), "--metrics-port", "0", "--no-passthrough", "--backoff", "0s",
         "--checkpoint-dir", str(ws.ckpt), "--",
         *ws.worker("--steps", "100000", "--interval", "0.02", "--ckpt-every", "10",
                    "--crash-at", "25")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        manifest = ws.state / "jobs" / "job" / "manifests" / "40.json"
        wait_for(lambda: 40 in _reported(ws) and manifest.exists(), timeout=60,
                 what="checkpoint 40 reported and its manifest made")
    finally:
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=60)
    assert run.returncode is not None, err
    yield ws


def _table(lines: list[str]) -> dict[int, list[str]]:
    """The table's rows by step: [verdict, resumed by, path (why)]."""
    head = lines[0]
    cols = [head.index(c) for c in ("VERDICT", "LOSS", "RESUMED BY", "PATH")]
    rows = {}
    for line in lines[1:]:
        rows[int(line.split()[0])] = [line[cols[0]:cols[1]].strip(),
                                      line[cols[2]:cols[3]].strip(), line[cols[3]:].strip()]
    return rows


def test_checkpoints_of_a_stopped_run_are_read_from_its_state_dir(stopped: Workspace) -> None:
    """No daemon: every checkpoint with its verdict, the attempt that resumed from 20, one
    rewritten since its manifest is bad, a file never reported is incomplete, and the last
    good is the newest good one; the first line says it was read from disk."""
    ws = stopped
    reported = _reported(ws)
    newest = max(reported)
    (ws.ckpt / "step_40").write_text("rewritten after it was judged")
    (ws.ckpt / "step_990").write_text("half")
    r = _tw("checkpoints", "job", "--state-dir", str(ws.state))
    assert r.returncode == 0 and r.stderr == "", (r.stdout, r.stderr)
    first, *table = r.stdout.splitlines()
    assert first.startswith(f"read from disk ({ws.state}/jobs/job), not from a live daemon;"
                            " settings from catalog.json (layout auto, pattern step_{step}")
    rows = _table(table)
    assert set(reported) <= set(rows) and 990 in rows, rows
    assert rows[20][:2] == ["good", "1"], rows[20]
    assert rows[40][0] == "bad" and "differs from its manifest: step_40: size" in rows[40][2]
    assert rows[990][0] == "incomplete", rows[990]
    last = [s for s, row in rows.items() if row[0] == "last good"]
    assert last == [newest if newest != 40 else 30], rows
    assert all(rows[s][0] == "good" for s in reported if s not in (40, *last)), rows

    doc = json.loads(_tw("checkpoints", "job", "--state-dir", str(ws.state), "--json").stdout)
    assert doc["source"]["from"] == "disk" and doc["job"] == "job"
    assert [c["step"] for c in doc["checkpoints"] if c["last_good"]] == last


def test_a_config_names_the_settings_and_its_state_dir_is_overridden(
        stopped: Workspace) -> None:
    """--config gives the job's settings; --state-dir overrides its state_dir: the same rows."""
    ws = stopped
    config = ws.root / "elsewhere.yaml"
    config.write_text(yaml.safe_dump({
        "state_dir": str(ws.root / "not-this-one"),
        "jobs": [{"name": "job", "command": ["true"], "checkpoints": {"dir": str(ws.ckpt)}}]}))
    plain = _tw("checkpoints", "job", "--state-dir", str(ws.state))
    r = _tw("checkpoints", "job", "--state-dir", str(ws.state), "--config", str(config))
    assert r.returncode == 0, r.stderr
    first, *table = r.stdout.splitlines()
    assert first.endswith("settings from the config"), first
    assert table == plain.stdout.splitlines()[1:]


@pytest.mark.parametrize("args, said", [
    (["job", "--state-dir", "{root}/nowhere"], "--state-dir: {root}/nowhere: no such directory"),
    (["nojob", "--state-dir", "{state}"], "no job 'nojob' in {state} (expected"
                                          " {state}/jobs/nojob/; jobs there: bare, job)"),
    (["bare", "--state-dir", "{state}"], "{state}/jobs/bare/catalog.json: absent or unreadable"),
    (["job", "--state-dir", "{state}", "--plan"], "--plan: expected a live daemon"),
])
def test_bad_input_is_one_line_and_exit_2(ws: Workspace, args: list[str], said: str) -> None:
    """No such state dir, no such job, a job without catalog state (and no config), --plan:
    one line on stderr, exit 2, no traceback."""
    (ws.state / "jobs" / "job").mkdir(parents=True)
    (ws.state / "jobs" / "bare").mkdir()
    (ws.state / "jobs" / "job" / "catalog.json").write_text(
        json.dumps({"owner": f"{ws.ckpt}|step_{{step}}", "reported": {}}))
    fill: dict[str, Any] = {"root": ws.root, "state": ws.state}
    r = _tw("checkpoints", *[a.format(**fill) for a in args])
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert said.format(**fill) in r.stderr, r.stderr
