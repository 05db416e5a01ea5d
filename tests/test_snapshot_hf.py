"""A real CPU training run of a tiny transformers GPT-2 saving with
trainwatch.snapshot under a real `trainwatch run`: crashed once, relaunched with
TRAINWATCH_RESUME_FROM, restored from the newest snapshot, it ends with exactly
the weights and optimizer state of a run that was never interrupted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Workspace, missing

JOB = Path(__file__).parent / "jobs" / "hf_snapshot_train.py"
BIN = Path(sys.executable).parent
STEPS, EVERY, CRASH_AT = 10, 3, 7


@pytest.fixture(autouse=True)
def _need_torch_and_transformers() -> None:
    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            missing(f"{module} is not installed (make test installs the dev extra)")


def _progress(out: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in (out / "progress.jsonl").read_text().splitlines()]


def test_crashed_run_resumed_from_its_newest_snapshot_ends_bit_identical(ws: Workspace) -> None:
    """Crash after step 7 (snapshots at 3 and 6): attempt 1 restores step 6 and ends equal."""
    import torch

    job = [sys.executable, str(JOB), "--steps", str(STEPS), "--every", str(EVERY), "--wait-saves"]
    ref_out, out = ws.root / "ref", ws.root / "out"
    # The uninterrupted run, alongside (not under trainwatch: a standalone Snapshotter).
    ref = subprocess.Popen([*job, "--ckpt-dir", str(ws.root / "ref-ckpt"), "--out", str(ref_out)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ws.procs.append(ref)
    r = subprocess.run(
        [str(BIN / "trainwatch"), "run", "--state-dir", str(ws.state),
         "--run-dir", str(ws.root / "run"), "--metrics-port", "0", "--no-passthrough",
         "--backoff", "0s", "--checkpoint-dir", str(ws.ckpt), "--",
         *job, "--ckpt-dir", str(ws.ckpt), "--out", str(out), "--crash-at", str(CRASH_AT)],
        capture_output=True, text=True, timeout=120, check=False)
    ref_log, _ = ref.communicate(timeout=120)
    assert ref.returncode == 0, ref_log.decode(errors="replace")[-3000:]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    starts = [e for e in _progress(out) if e["event"] == "start"]
    assert [e["first_step"] for e in starts] == [1, 7], starts
    assert starts[1]["resume_from"] == str(ws.ckpt / "snapshot-6"), starts
    (incident,) = ws.incidents()
    assert incident["kind"] == "crash" and incident["resumed_step"] == 6, incident
    assert [e["first_step"] for e in _progress(ref_out) if e["event"] == "start"] == [1]

    got = torch.load(out / "final.pt", weights_only=True)
    want = torch.load(ref_out / "final.pt", weights_only=True)
    assert got["model"].keys() == want["model"].keys()
    differ = [k for k in want["model"] if not torch.equal(got["model"][k], want["model"][k])]
    assert not differ, f"weights differ from the uninterrupted run's: {differ}"
    for p, (a, b) in enumerate(zip(got["optim"]["state"].values(),
                                   want["optim"]["state"].values(), strict=True)):
        for k in b:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), (p, k)
