"""Every recipe of docs/checkpoints.md (once the README's), run as written (`trainwatch
run` with flags only, no config file): the job is crashed once after step 7 and
must resume from its newest good checkpoint (step 6), not from scratch."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import Workspace, missing, wait_for

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def recipes() -> dict[str, list[str]]:
    """The `trainwatch run` lines of the recipes block, by the example they run."""
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    block = text.split("\n## Recipes", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    out = {}
    for line in block.splitlines():
        if line.startswith("trainwatch run"):
            argv = shlex.split(line)
            name = Path(next(a for a in argv if a.startswith("examples/"))).stem
            flavour = next((f for f in ("--dcp", "--snapshot") if f in argv), "")
            out[name + flavour.replace("--", "_")] = argv
    return out


# The crash drill and a short run, per example (its own flags, appended to the job).
DRILL = {
    "torch_train": ["--steps", "9", "--ckpt-every", "3", "--crash-at", "7"],
    "torch_train_dcp": ["--steps", "9", "--ckpt-every", "3", "--crash-at", "7"],
    # Slow enough steps that the save at 3 is written before 6 is due (one due while
    # one is in flight is coalesced: skipped, by design).
    "torch_train_snapshot": ["--steps", "9", "--ckpt-every", "3", "--crash-at", "7",
                             "--step-time", "0.3"],
    "snapshot_train": ["--epochs", "9", "--save-every", "3", "--crash-at", "7"],
    "hf_train": ["--steps", "9", "--ckpt-every", "3", "--crash-at", "7"],
    "lightning_train": ["--steps", "9", "--ckpt-every", "3", "--crash-at", "7"],
    # No client: step_N.pt found in the folder by name, handed back through --resume-from.
    "plain_train": ["--steps", "9", "--ckpt-every", "3", "--crash-at", "7"],
}
NEEDS = {"hf_train": ("transformers", "accelerate"), "lightning_train": ("lightning",)}


def test_the_docs_have_a_recipe_per_framework() -> None:
    """Plain PyTorch, torchrun's snapshot.pt, HF Trainer, Lightning, DCP, trainwatch.snapshot,
    and a torchrun job without the client."""
    assert set(recipes()) == set(DRILL)


def _as_written(ws: Workspace, name: str, out: Path) -> list[str]:
    """The recipe's `trainwatch run` line, with this workspace's folders."""
    cmd: list[str] = [str(BIN / "trainwatch"), "run", "--state-dir", str(ws.state),
                      "--run-dir", str(ws.root / "run"), "--metrics-port", "0",
                      "--no-passthrough", "--backoff", "0s"]
    for a in recipes()[name][2:]:
        a = {"python": sys.executable, "torchrun": str(BIN / "torchrun")}.get(a, a)
        if a.startswith("examples/"):
            a = str(ROOT / a)
        cmd.append(str(out) + a[3:] if a == "out" or a.startswith("out/") else a)
    return cmd


@pytest.mark.parametrize("name", sorted(DRILL))
def test_recipe_crashed_once_resumes_from_its_newest_good_checkpoint(ws: Workspace,
                                                                    name: str) -> None:
    """Run as written; after the crash at 7 the next attempt starts at 7 (checkpoint 6)."""
    for module in ("torch", *NEEDS.get(name, ())):
        if importlib.util.find_spec(module) is None:
            missing(f"{module} is not installed (make test installs the dev extra)")
    out = ws.root / "out"
    cmd = _as_written(ws, name, out) + DRILL[name]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    events = [json.loads(x) for x in (out / "progress.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start"]
    first = [e.get("first_step", e.get("first_epoch")) for e in starts]
    assert first == [1, 7], events
    assert "none good" not in r.stderr
    (incident,) = ws.incidents()
    assert incident["kind"] == "crash" and incident["resumed_step"] == 6, incident
    ends = [e for e in events if e["event"] == "end"]
    assert len(ends) == 1 and ends[0]["attempt"] == 1, events


@pytest.mark.parametrize("flags, said", [
    (["--layout", "fixed"], "--layout fixed: expected --checkpoint-pattern"),
    (["--layout", "fixed", "--checkpoint-pattern", "snap_{step}.pt"], "without {step}"),
    (["--layout", "orbax"], "invalid choice"),
    (["--checkpoint-pattern", "ckpt.pt"], "one {step}"),
    (["--backoff", "10s", "--backoff-max", "1s"], "--backoff-max: expected at least"),
    (["--kill-grace", "soon"], "--kill-grace"),
])
def test_bad_checkpoint_and_policy_flags_are_one_line(tmp_path: Path, flags: list[str],
                                                      said: str) -> None:
    """Each mistake in the new flags: exit 2, one line naming the flag, nothing started."""
    r = subprocess.run([str(BIN / "trainwatch"), "run", "--state-dir", str(tmp_path / "s"),
                        "--checkpoint-dir", str(tmp_path), *flags, "--", "true"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and said in r.stderr, r.stderr
    assert not (tmp_path / "s" / "ledger.db").exists()


def test_the_no_client_recipe_with_rank_1_killed_10s_after_a_checkpoint_resumes_from_it(
        ws: Workspace) -> None:
    """The no-client recipe as written, default settings (quiet_for 60 s): a
    checkpoint every 14 s or so, rank 1 SIGKILLed 10 s after step_25.pt was
    written, so that no checkpoint is 60 s unchanged and none newer is begun. It
    resumes from step_25 (no older than one interval before the newest), never
    from scratch, and trains to its end."""
    out = ws.root / "out"
    cmd = [*_as_written(ws, "plain_train", out),
           "--steps", "60", "--ckpt-every", "25", "--step-time", "0.55"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ckpt = out / "ckpt" / "step_25.pt"
    try:
        # The drill's own terms: 10 s after the checkpoint's last write (the next is
        # 14 s of sleeps away, later still on a busy machine).
        wait_for(lambda: ckpt.exists() and time.time() - ckpt.stat().st_mtime >= 10,
                 timeout=120, what="step_25.pt 10 s old")
        rank1 = next(c for c in psutil.Process(p.pid).children(recursive=True)
                     if c.environ().get("RANK") == "1")
        rank1.kill()
        newest = max(int(f.stem[5:]) for f in (out / "ckpt").glob("step_*.pt"))
        said, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, said[-3000:]
    assert "starting from scratch" not in said and "none good" not in said, said[-3000:]
    (incident,) = ws.incidents()
    assert newest == 25 and incident["resumed_step"] == 25, (newest, incident)
    events = [json.loads(x) for x in (out / "progress.jsonl").read_text().splitlines()]
    assert [e["first_step"] for e in events if e["event"] == "start"] == [1, 26], events
    assert [e["last_step"] for e in events if e["event"] == "end"] == [60], events
