"""trainwatch snapshots on the daemon's side: the layout ``trainwatch`` (judged
by trainwatch.snapshot.format, recognised by ``auto``), retention of snapshot
folders with the store's chunks collected after, ``checkpoints.remote`` and
``--remote`` refused with credentials in them, and a relaunch on a fresh host
that pulls the newest snapshot from a real S3 server (moto_server) and ends
where an uninterrupted run ends."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from conftest import Workspace, finish, local_user, run_name
from trainwatch import layouts
from trainwatch.config import Checkpoints, ConfigError, from_mapping
from trainwatch.snapshot import blobs
from trainwatch.snapshot.format import MANIFEST, Leaf, Manifest
from trainwatch.state.catalog import Catalog

if TYPE_CHECKING:
    from s3server import S3Bucket

# The fixtures s3server (a moto_server process, one per session) and s3 (a fresh bucket).
pytest_plugins = ["s3server"]

SNAPJOB = Path(__file__).parent / "jobs" / "snapjob.py"


def _snapshot(root: Path, step: int, *chunks: bytes, keep: int | None = None) -> Path:
    """A published snapshot of ``chunks`` (one leaf each), through the store."""
    staging = blobs.Staging(str(root), step)
    leaves = []
    for data in chunks:
        c = staging.add(blobs.digest(data), len(data), lambda d=data: (d, None))
        leaves.append(Leaf("bytes", None, None, len(data), [c]))
    m = Manifest(step, time.time(), [{"$leaf": i} for i in range(len(chunks))], leaves, keep)
    folder, published = blobs.publish(staging, m.dumps())
    assert published
    return Path(folder)


def _chunk_file(folder: Path) -> Path:
    return next(p for p in folder.iterdir() if p.name != MANIFEST)


def _remove_chunk(folder: Path) -> None:
    _chunk_file(folder).unlink()


def _truncate_chunk(folder: Path) -> None:
    # A new file, not the shared inode: the store's copy stays whole.
    p = _chunk_file(folder)
    data = p.read_bytes()
    p.unlink()
    p.write_bytes(data[: len(data) // 2])


def _cut_manifest(folder: Path) -> None:
    p = folder / MANIFEST
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage, complete, why", [
    (None, True, "snapshot.json and 1 chunks present"),
    (_remove_chunk, False, "missing"),
    (_truncate_chunk, False, "bytes, expected"),
    (_cut_manifest, False, "not JSON"),
], ids=["complete", "chunk-missing", "chunk-truncated", "manifest-partial"])
def test_layout_judges_a_snapshot_folder_by_its_manifest_and_chunks(
        tmp_path: Path, damage: object, complete: bool, why: str) -> None:
    """A whole snapshot is complete; a chunk missing or cut short, or a manifest cut
    short, is not, and the verdict says which."""
    folder = _snapshot(tmp_path, 7, b"x" * 1000)
    if callable(damage):
        damage(folder)
    lay = layouts.get("trainwatch")
    found = lay.scan(tmp_path)
    assert [(f.step, f.complete) for f in found] == [(7, complete)]
    assert why in found[0].why
    judged = lay.judge(str(folder))
    assert judged is not None and judged.complete is complete


def test_layout_never_names_staging_deleting_or_store_folders(tmp_path: Path) -> None:
    """A save in progress (.staging-*), a deletion (.deleting-*) and blobs/ are not
    checkpoints; only snapshot-<N> is, by its step."""
    _snapshot(tmp_path, 3, b"a" * 100)
    staging = blobs.Staging(str(tmp_path), 4)  # left as a killed writer leaves it
    (Path(staging.path) / MANIFEST).write_text("{}")
    (tmp_path / ".deleting-2-1").mkdir()
    lay = layouts.get("trainwatch")
    assert [f.step for f in lay.scan(tmp_path)] == [3]
    assert lay.step_of(staging.path) is None
    assert lay.step_of(str(tmp_path / "blobs")) is None
    assert lay.step_of(str(tmp_path / "snapshot-12")) == 12


def test_auto_detects_snapshots_and_the_catalog_judges_them(tmp_path: Path) -> None:
    """detect: trainwatch for a snapshot-N holding snapshot.json, or beside blobs/; nothing
    for a bare snapshot-N folder; the auto layout's catalog lists good snapshots."""
    bare = tmp_path / "bare"
    (bare / "snapshot-1").mkdir(parents=True)
    assert layouts.detect(bare) is None
    (bare / "blobs").mkdir()
    assert layouts.detect(bare) == "trainwatch"
    root = tmp_path / "ckpt"
    root.mkdir()
    _snapshot(root, 5, b"a" * 10)
    _snapshot(root, 10, b"b" * 10)
    assert layouts.detect(root) == "trainwatch"
    cat = Catalog(Checkpoints(dir=str(root)), tmp_path / "catalog.json")
    assert [(e.step, e.good) for e in cat.entries()] == [(5, True), (10, True)]
    assert cat.layout.name == "trainwatch"


def _config(root: Path, checkpoints: dict[str, object]) -> Checkpoints:
    cfg = from_mapping({"jobs": [{"name": "j", "command": ["x"],
                                  "checkpoints": checkpoints}]}, "c.yaml")
    return cfg.jobs[0].checkpoints


@pytest.mark.parametrize("checkpoints, says", [
    ({"dir": "/d", "remote": "s3://AKIAXXX:s3cr3t@bucket/p"}, "without credentials"),
    ({"dir": "/d", "remote": "AKIAXXX:s3cr3t@bucket/p"}, "without credentials"),
    ({"dir": "/d", "remote": "s3://bucket/p?secret_access_key=s3cr3t"}, "without credentials"),
    ({"dir": "/d", "remote": "bucket/prefix"}, "a URL such as s3://bucket/prefix"),
    ({"dir": "/d", "remote": 5}, "a URL such as s3://bucket/prefix"),
    ({"remote": "s3://bucket/p"}, "checkpoints.dir: expected the local folder"),
    ({"dir": "/d", "layout": "hf", "remote": "s3://bucket/p"}, "expected trainwatch or auto"),
])
def test_remote_config_mistakes_are_one_line_and_never_echo_a_secret(
        tmp_path: Path, checkpoints: dict[str, object], says: str) -> None:
    """checkpoints.remote: credentials in the URL, a non-URL, no dir, or a layout that
    is not trainwatch's are each one line naming the field; the secret is not shown."""
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, checkpoints)
    msg = str(e.value)
    assert says in msg and "\n" not in msg and "s3cr3t" not in msg, msg


def test_remote_config_accepts_a_plain_url() -> None:
    """A URL with no credentials is taken as is, with layout trainwatch or auto."""
    cp = _config(Path("/"), {"dir": "/d", "layout": "trainwatch", "remote": "s3://b/p/q"})
    assert cp.remote == "s3://b/p/q"


def test_run_refuses_a_remote_flag_with_credentials(tmp_path: Path) -> None:
    """`trainwatch run --remote s3://KEY:SECRET@...` exits non-zero with one line and
    never prints the secret."""
    r = subprocess.run(
        [sys.executable, "-m", "trainwatch.cli", "run", "--state-dir", str(tmp_path),
         "--checkpoint-dir", str(tmp_path / "c"), "--remote", "s3://AKIA:s3cr3t@b/p",
         "--", "true"], capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "--remote" in lines[0], r.stderr
    assert "s3cr3t" not in r.stderr + r.stdout


def _store_files(root: Path) -> list[Path]:
    return [p for p in (root / "blobs").rglob("*") if p.is_file()]


def test_retention_uses_the_snapshot_keep_and_collects_unlinked_chunks(
        ws: Workspace) -> None:
    """No keep rule in the config, keep=2 in the manifests: a real run deletes all but the
    newest two snapshots (the last good among them), and no store chunk is left that no
    snapshot links."""
    cmd = [sys.executable, str(SNAPJOB), "raw", "--dir", str(ws.ckpt), "--steps", "6",
           "--keep", "2", "--pause", "0.4"]
    cfg = ws.config({"command": cmd, "checkpoints": {"dir": str(ws.ckpt),
                                                     "layout": "trainwatch"}})
    rc, out = finish(ws.run(cfg), timeout=60)
    assert rc == 0, out
    left = sorted(int(p.name.split("-")[1]) for p in ws.ckpt.glob("snapshot-*"))
    assert left[-1] == 6 and len(left) <= 3, (left, out)  # the last good, always
    assert 1 not in left and 2 not in left, left
    files = _store_files(ws.ckpt)
    assert files and all(os.stat(p).st_nlink >= 2 for p in files), \
        [(p.name, os.stat(p).st_nlink) for p in files]
    # The shared chunk and the survivors' own chunks, nothing more.
    assert len(files) == 1 + len(left), (files, left)
    assert "collected" in out


def _reference(steps: int) -> object:
    import numpy as np

    w = np.arange(64, dtype=np.float64)
    for step in range(1, steps + 1):
        w = w * 0.999 + np.sin(w + step)
    return w


def test_a_relaunch_on_an_empty_dir_pulls_the_newest_snapshot_and_resumes(
        tmp_path: Path, s3: S3Bucket) -> None:
    """Snapshots upload to S3; the job crashes at step 20 and trainwatch gives up; on a
    fresh host (no checkpoint dir, no state) `trainwatch run --remote` pulls snapshot-20,
    resumes from it, and ends with the bit-identical state of an uninterrupted run."""
    out = tmp_path / "final.npy"
    env = s3.subprocess_env()

    def run(host: str, max_restarts: str) -> tuple[int, str]:
        ckpt = tmp_path / host / "ckpt"
        cmd = [sys.executable, "-m", "trainwatch.cli", "run", "--no-passthrough",
               "--state-dir", str(tmp_path / host / "state"),
               "--run-dir", str(tmp_path / host / "run"), "--metrics-port", "0",
               "--checkpoint-dir", str(ckpt), "--layout", "trainwatch",
               "--remote", s3.url + "/job", "--max-restarts", max_restarts,
               "--backoff", "0", "--",
               sys.executable, str(SNAPJOB), "numpy", "--dir", str(ckpt), "--steps", "30",
               "--crash-at", "20", "--remote", s3.url + "/job", "--out", str(out)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env,
                           check=False)
        return p.returncode, p.stdout + p.stderr

    rc, said = run("a", "0")
    assert rc != 0 and not out.exists(), said
    assert (tmp_path / "a" / "ckpt" / "snapshot-20").is_dir(), said
    rc, said = run("b", "0")
    assert rc == 0, said
    assert "pulled the newest snapshot" in said, said
    log = (tmp_path / "final.npy.log").read_text().splitlines()
    assert log[0].startswith("attempt 0 from 0"), log
    assert log[-1].startswith("attempt 0 from 20 ("), log
    assert str(tmp_path / "b" / "ckpt" / "snapshot-20") in log[-1], log
    assert np.array_equal(np.load(out), _reference(30))


@pytest.mark.parametrize("damaged", [False, True], ids=["pulled", "pull-failed"])
def test_a_pull_runs_as_the_jobs_user_so_what_it_makes_is_theirs_and_nothing_is_chowned(
        tmp_path: Path, open_tmp: Path, s3: S3Bucket, damaged: bool,
        reachable_install: None) -> None:
    """On a fresh host the pull runs in the job's hand (privsep): the checkpoint folder,
    the store and the pulled snapshot are made by the job's user, pulled or not; a store
    swapped for a link to root's folder is the user's to follow, and root's files
    there keep their owner (the old pull chowned them to the user)."""
    from trainwatch.actions.pull import Pull
    from trainwatch.privsep import credentials
    from trainwatch.snapshot.remote import Remote, upload

    user = local_user(run_name("test1"))
    ident = credentials.resolve(user.pw_name, None)
    src = _snapshot(tmp_path / "src", 5, b"weights" * 1000)
    upload(s3.url, str(src))
    if damaged:  # the chunk on the remote rots: the pull fails after its staging began
        r = Remote(s3.url)
        name = _chunk_file(src).name
        r.fs.pipe(f"{r.root}/blobs/{name[:2]}/{name}", b"rot" * 2333)
    home = open_tmp / "home"
    home.mkdir()
    os.chown(home, user.pw_uid, user.pw_gid)
    root = home / "ckpt"
    p = Pull(s3.url, str(root), None, "test", ident, {**s3.env, "HOME": str(home)})
    p.start()
    assert p.thread is not None
    p.thread.join(120)
    assert (p.error is not None) == damaged, p.error
    owned = [root, root / "blobs", *(root / "blobs").iterdir()]
    if not damaged:
        owned += [root / "snapshot-5", *(root / "snapshot-5").iterdir()]
    assert {str(q): q.lstat().st_uid for q in owned} == {str(q): user.pw_uid for q in owned}

    # A second pull into a folder whose store the user swapped for a link to root's.
    roots = open_tmp / "roots"
    (roots / "ab").mkdir(parents=True)
    (roots / "ab" / "keep").write_bytes(b"root's")
    shutil.rmtree(root)
    root.mkdir()
    os.chown(root, user.pw_uid, user.pw_gid)
    (root / "blobs").symlink_to(roots)
    os.lchown(root / "blobs", user.pw_uid, user.pw_gid)
    p = Pull(s3.url, str(root), None, "test", ident, {**s3.env, "HOME": str(home)})
    p.start()
    assert p.thread is not None
    p.thread.join(120)
    assert [q.stat().st_uid for q in [roots, roots / "ab", roots / "ab" / "keep"]] == [0, 0, 0]
