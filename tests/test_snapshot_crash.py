"""The crash table: a real writer process (tests/jobs/snapshot_writer.py) is
SIGKILLed at named instants of phase 1 (staging), phase 2 (chunks, manifest,
publish, report), keep and GC, and at random instants. After each kill every
surviving snapshot judges complete and restores bit-identically, the last
snapshot known saved is still there, and a following run plus a GC leaves no
garbage: no dot-folder, no store file that no snapshot links."""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from trainwatch.snapshot import blobs, format, reader

JOB = Path(__file__).parent / "jobs" / "snapshot_writer.py"


def _job_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("snapshot_writer", JOB)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


job = _job_module()

# (crash point, extra arguments). name@k: the k-th time the point is reached in the
# run. Each save here writes 4 chunks (frozen, w, ints, raw): step 1 writes all 4,
# step 2 links frozen and writes 3; with keep=2, step 3's save deletes snapshot-1.
TABLE: list[tuple[str, tuple[str, ...]]] = [
    # phase 1: staging
    ("stage.begin@2", ()),
    ("job.stage_copy@2", ()),  # inside the deep copy of the state
    ("stage.done@2", ("--compress", "zstd")),
    # phase 2: chunks
    ("write.begin@2", ()),
    ("chunk.begin@7", ()),  # step 2, its third chunk: two already in staging
    ("chunk.linked@1", ()),  # step 2 links the frozen chunk from the store
    ("chunk.tmp_written@6", ("--compress", "zstd")),  # step 2: tmp file written, not fsynced
    ("chunk.fsynced@6", ()),  # step 2: fsynced, not renamed
    ("chunk.stored@5", ()),  # step 2: renamed and linked into the store
    ("chunk.tmp_written@5", ("--full",)),  # a full save: every chunk anew
    # phase 2: manifest and publish
    ("manifest.begin@2", ()),
    ("manifest.tmp_written@2", ("--compress", "zstd")),
    ("manifest.renamed@2", ()),
    ("staging.fsynced@2", ()),
    ("publish.renamed@2", ()),
    ("publish.fsynced@2", ()),
    ("report.sent@2", ()),
    # keep (step 3 deletes snapshot-1) and GC
    ("delete.renamed@1", ()),
    ("delete.removed@1", ()),
    ("keep.deleted@1", ()),
    ("gc.blob_unlinked@1", ()),  # step 3: a chunk only snapshot-1 held
    ("gc.folder_removed@1", ("--garbage-at", "3")),  # a dead writer's staging folder
    ("gc.done@3", ()),
]


def run_job(root: Path, *args: str, crash: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWATCH_")}
    if crash:
        env["TRAINWATCH_SNAPSHOT_CRASH_AT"] = crash
    return subprocess.run([sys.executable, str(JOB), str(root), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def saved_steps(root: Path) -> list[int]:
    p = root.parent / "progress"
    return [int(line.split()[1]) for line in p.read_text().split("\n") if line] \
        if p.exists() else []


def check_snapshots(root: Path) -> list[int]:
    """Every snapshot-* judges complete and restores to what the writer saved."""
    steps = []
    for step, folder in format.published(root):
        ok, why = format.judge(folder)
        assert ok, f"snapshot-{step}: {why}"
        got_step, state = reader.load(folder)
        assert got_step == step and job.same(job.expected(step), state), f"snapshot-{step}"
        steps.append(step)
    return steps


def check_no_garbage(root: Path) -> None:
    """After a clean run and a GC: no dot-folders; the store holds exactly the
    chunks the snapshots link."""
    blobs.collect(str(root))
    assert [n for n in os.listdir(root) if n.startswith(".")] == []
    linked = {c.name for _, f in format.published(root) for c in format.read(f).chunks().values()}
    store = root / "blobs"
    stored = {n for d in store.iterdir() for n in os.listdir(d)}
    assert stored == linked
    assert all(os.stat(blobs.store_path(str(root), n)).st_nlink >= 2 for n in stored)


def recover(root: Path, last_saved: int | None) -> None:
    """The checks after a kill, then a following run, then the checks again."""
    steps = check_snapshots(root)
    if last_saved is not None:
        assert last_saved in steps, f"the last good snapshot ({last_saved}) was lost: {steps}"
    after = run_job(root, "--steps", "2")
    assert after.returncode == 0, after.stdout + after.stderr
    start = int(after.stdout.split()[1])
    assert start == (steps[-1] if steps else 0)  # resumed from the newest
    assert check_snapshots(root)[-1] == start + 2
    check_no_garbage(root)


@pytest.mark.parametrize(("crash", "extra"), TABLE, ids=[c for c, _ in TABLE])
def test_a_kill_at_a_named_instant_loses_nothing(tmp_path: Path, crash: str,
                                                 extra: tuple[str, ...]) -> None:
    """SIGKILL at this instant: surviving snapshots whole and bit-identical, the
    last saved one kept, and the next run plus GC leaves no garbage."""
    root = tmp_path / "ckpt"
    got = run_job(root, "--steps", "4", *extra, crash=crash)
    assert got.returncode == -signal.SIGKILL, f"{crash} never reached: {got.stdout}{got.stderr}"
    saved = saved_steps(root)
    recover(root, saved[-1] if saved else None)


def test_the_table_covers_both_phases_keep_and_gc() -> None:
    """At least 18 named instants, across staging, chunks, publish, keep and GC."""
    names = {c.split("@")[0] for c, _ in TABLE}
    assert len(TABLE) >= 18
    for prefix in ("stage.", "job.stage_copy", "chunk.", "manifest.", "publish.", "report.",
                   "delete.", "keep.", "gc."):
        assert any(n.startswith(prefix) for n in names), prefix


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_kill_at_a_random_instant_loses_nothing(tmp_path: Path, seed: int) -> None:
    """A free-running writer (saves coalescing) stopped and killed at a random delay."""
    root = tmp_path / "ckpt"
    p = subprocess.Popen([sys.executable, str(JOB), str(root), "--steps", "100000",
                          "--free-running", *(("--compress", "zstd") if seed % 2 else ())],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={k: v for k, v in os.environ.items()
                              if not k.startswith("TRAINWATCH_")})
    assert p.stdout is not None
    assert p.stdout.readline().startswith("ready")
    time.sleep(random.Random(seed).uniform(0.05, 0.5))
    p.send_signal(signal.SIGSTOP)  # nothing moves while the last good is noted
    before = format.published(root)
    p.kill()
    p.communicate()
    recover(root, before[-1][0] if before else None)
