"""What trainwatch trusts of a remote snapshot store and of a first run (issue 21):
a malicious remote's manifest and chunks are checked against caps and the
objects' real sizes before anything is allocated (B12); the pull uses the job's
own credentials, a failed pull never starts a run that uploads over a remote
holding snapshots, and a damaged newest snapshot falls back to an older intact
one (C13); the Snapshotter's keep holds from the first snapshot (C20). Against
a real S3 server over HTTP (moto_server, tests/s3server.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from conftest import Workspace, finish
from test_snapshot_remote import files, leaf_bytes, make_snapshot
from trainwatch.snapshot import limits
from trainwatch.snapshot.format import CHUNK, Chunk, Leaf, Manifest, read
from trainwatch.snapshot.remote import Remote, RemoteError, pull, steps, upload

if TYPE_CHECKING:
    from s3server import S3Bucket

# The fixtures s3server (a moto_server process, one per session) and s3 (a fresh bucket).
pytest_plugins = ["s3server"]

SNAPJOB = Path(__file__).parent / "jobs" / "snapjob.py"


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("snapshot-*"))


# -- C20: the Snapshotter's keep from the first snapshot --------------------------


def test_snapshotter_keep_holds_from_the_first_run_under_the_default_layout(
        ws: Workspace) -> None:
    """A first run under the default layout (auto) with the real Snapshotter(keep=3) and no
    keep rule in the config: the daemon keeps the newest three snapshots, not all twelve,
    and no store chunk is left that no snapshot links."""
    cmd = [sys.executable, str(SNAPJOB), "numpy", "--dir", str(ws.ckpt), "--steps", "60",
           "--out", str(ws.root / "final")]
    cfg = ws.config({"command": cmd, "checkpoints": {"dir": str(ws.ckpt)}})
    rc, out = finish(ws.run(cfg), timeout=60)
    assert rc == 0, out
    left = _steps(ws.ckpt)
    # The last good always stays; the plan after the final report leaves the newest three
    # (one more, the resumed-from or not yet judged, is allowed on a busy machine).
    assert left[-1] == 60 and len(left) <= 4, (left, out)
    assert "keeping the newest 3 good snapshots" in out, out
    files = [p for p in (ws.ckpt / "blobs").rglob("*") if p.is_file()]
    assert all(p.stat().st_nlink >= 2 for p in files), files


# -- B12: a malicious remote's claims, refused in bounded memory ------------------

# Runs one pull in a process of its own and prints its outcome and the growth of its
# resident memory during the pull (peak RSS reset first: /proc/self/clear_refs 5).
PULL_MEASURED = """
import json, sys
from trainwatch.snapshot import remote

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith(field + ":"))

url, root = sys.argv[1:3]
remote.steps(url)  # the client set up and its libraries loaded before measuring
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = kib("VmRSS")
try:
    said = "pulled " + str(remote.pull(url, root).folder)
except remote.RemoteError as e:
    said = str(e)
print(json.dumps({"said": said, "growth_mb": (kib("VmHWM") - before) / 1024}))
"""


def _pull_measured(s3: S3Bucket, root: Path) -> tuple[str, float]:
    """(what the pull said, its RSS growth in MB), from a process of its own."""
    r = subprocess.run([sys.executable, "-c", PULL_MEASURED, s3.url, str(root)],
                       env=s3.subprocess_env(), capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return str(out["said"]), float(out["growth_mb"])


def _put_manifest(s3: S3Bucket, step: int, chunks: list[Chunk]) -> None:
    """A manifest of one bytes leaf made of ``chunks``, put as snapshot-<step>.json."""
    leaf = Leaf("bytes", None, None, sum(c.size for c in chunks), chunks)
    m = Manifest(step, time.time(), {"$leaf": 0}, [leaf])
    r = Remote(s3.url)
    r.fs.pipe_file(f"{r.root}/snapshot-{step}.json", m.dumps())


def _big_object(s3: S3Bucket, key: str, mib: int) -> None:
    """An object of ``mib`` MiB made on the server (multipart copies of one 8 MiB part):
    nothing that large passes through this process."""
    import boto3  # moto's own dependency

    c = boto3.client("s3", endpoint_url=s3.server.endpoint, region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing")
    c.put_object(Bucket=s3.name, Key="part", Body=bytes(8 << 20))
    up = c.create_multipart_upload(Bucket=s3.name, Key=key)["UploadId"]
    parts = []
    for n in range(1, mib // 8 + 1):
        got = c.upload_part_copy(Bucket=s3.name, Key=key, UploadId=up, PartNumber=n,
                                 CopySource={"Bucket": s3.name, "Key": "part"})
        parts.append({"PartNumber": n, "ETag": got["CopyPartResult"]["ETag"]})
    c.complete_multipart_upload(Bucket=s3.name, Key=key, UploadId=up,
                                MultipartUpload={"Parts": parts})
    c.delete_object(Bucket=s3.name, Key="part")


def test_a_chunk_claiming_3gib_stored_as_16_bytes_is_refused_before_allocating(
        s3: S3Bucket, tmp_path: Path) -> None:
    """A manifest whose zstd chunk claims 3 GiB raw, stored as 16 bytes: the pull is refused
    with one line naming the claim, and memory grows by far less than 100 MB."""
    h = "ab" * 16
    c = Chunk(h, 3 << 30, 16, "zstd")
    r = Remote(s3.url)
    r.fs.pipe_file(f"{r.root}/blobs/{h[:2]}/{c.name}", b"\x28\xb5\x2f\xfd" + bytes(12))
    _put_manifest(s3, 160, [c])
    said, growth = _pull_measured(s3, tmp_path / "fresh")
    assert f"chunk {c.name} claims {3 << 30} bytes, more than a chunk holds" in said, said
    assert "\n" not in said
    assert growth < 100, growth
    assert not list((tmp_path / "fresh").glob("snapshot-*"))


def test_a_chunk_declared_16_bytes_but_stored_as_120mib_is_refused_unread(
        s3: S3Bucket, tmp_path: Path) -> None:
    """A chunk declared 16 bytes whose object holds 120 MiB: its real size is compared
    before a byte is read; one line says both sizes, and memory stays bounded."""
    h = "cd" * 16
    c = Chunk(h, 16, 16, None)
    _big_object(s3, f"blobs/{h[:2]}/{h}", 120)
    _put_manifest(s3, 160, [c])
    said, growth = _pull_measured(s3, tmp_path / "fresh")
    assert f"chunk {h} is {120 << 20} bytes on the remote, its manifest declares 16" in said, \
        said
    assert growth < 100, growth
    assert not list((tmp_path / "fresh").glob("snapshot-*"))


def _manifest_of(*chunks: Chunk) -> Manifest:
    return Manifest(1, 0.0, [{"$leaf": i} for i in range(len(chunks))],
                    [Leaf("bytes", None, None, c.size, [c]) for c in chunks])


@pytest.mark.parametrize("chunks, says", [
    ([Chunk("ab" * 16, CHUNK + 1, CHUNK + 1, None)], "more than a chunk holds"),
    ([Chunk("ab" * 16, 100, 50, None)], "stored raw as 50 bytes but claims 100"),
    ([Chunk("ab" * 16, 1000, 5000, "zstd")], "not a zstd frame of them"),
    ([Chunk("ab" * 16, 1000, 0, "zstd")], "not a zstd frame of them"),
    ([Chunk("ab" * 16, 100, 100, None), Chunk("ab" * 16, 100, 90, "zstd")],
     "named twice with different sizes or codecs"),
    ([Chunk("ab" * 16, 100, 100, None), Chunk("ab" * 16, 200, 200, None)],
     "named twice with different sizes or codecs"),
], ids=["chunk-too-large", "raw-size-lie", "zstd-larger-than-bound", "zstd-empty",
        "two-codecs", "two-sizes"])
def test_a_manifest_whose_claims_exceed_the_caps_is_refused_in_one_line(
        chunks: list[Chunk], says: str) -> None:
    """Each claim no writer makes (a chunk past CHUNK, a raw chunk stored at another size,
    a zstd frame larger than zstd's bound, one hash under two sizes) is one line."""
    with pytest.raises(limits.Damaged, match=says) as e:
        limits.check(_manifest_of(*chunks))
    assert "\n" not in str(e.value)


def test_a_manifest_naming_more_chunks_than_the_cap_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """More distinct chunks than MAX_CHUNKS is refused (the cap lowered to keep the test small)."""
    monkeypatch.setattr(limits, "MAX_CHUNKS", 3)
    ok = [Chunk(f"{i:032x}", 10, 10, None) for i in range(3)]
    limits.check(_manifest_of(*ok))
    with pytest.raises(limits.Damaged, match="more than 3 distinct chunks"):
        limits.check(_manifest_of(*ok, Chunk(f"{9:032x}", 10, 10, None)))


def test_a_manifest_object_past_the_cap_is_refused_before_it_is_read(
        s3: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A remote manifest larger than MAX_MANIFEST (lowered here) is skipped as damaged by its
    size, not read; the older intact snapshot is pulled instead."""
    upload(s3.url, make_snapshot(tmp_path / "src", 1, [leaf_bytes(1)]))
    r = Remote(s3.url)
    r.fs.pipe_file(f"{r.root}/snapshot-2.json", b" " * 5000)
    monkeypatch.setattr(limits, "MAX_MANIFEST", 4096)
    got = pull(s3.url, str(tmp_path / "fresh"))
    assert got.step == 1, got
    assert got.skipped == ((2, "snapshot-2.json: the manifest is 5000 bytes, more than 4096"),)


# -- C13: a damaged newest remote snapshot falls back to an older intact one -------


def _blob_path(r: Remote, folder: str, index: int) -> str:
    """The remote object of the ``index``-th chunk of the local snapshot ``folder``."""
    name = read(folder).leaves[index].chunks[0].name
    return f"{r.root}/blobs/{name[:2]}/{name}"


def _rot(r: Remote, folder: str) -> None:
    path = _blob_path(r, folder, 1)
    data = bytearray(r.fs.cat_file(path))
    data[7] ^= 1  # same size: only the hash tells
    r.fs.pipe_file(path, bytes(data))


def _drop(r: Remote, folder: str) -> None:
    r.fs.rm_file(_blob_path(r, folder, 1))


def _grow(r: Remote, folder: str) -> None:
    path = _blob_path(r, folder, 1)
    r.fs.pipe_file(path, bytes(r.fs.cat_file(path)) + b"tail")


def _garble(r: Remote, folder: str) -> None:
    r.fs.pipe_file(f"{r.root}/snapshot-{read(folder).step}.json", b'{"format": "trainw')


@pytest.mark.parametrize("damage, why", [
    (_rot, "content does not match its hash"),
    (_drop, "is missing from the remote"),
    (_grow, "its manifest declares"),
    (_garble, "snapshot.json is not JSON"),
], ids=["chunk-rotted", "chunk-missing", "chunk-size-lie", "manifest-garbled"])
def test_a_damaged_newest_snapshot_falls_back_to_the_next_older_intact_one(
        s3: S3Bucket, tmp_path: Path, damage: Callable[[Remote, str], None], why: str) -> None:
    """The newest remote snapshot damaged (a chunk rotted, missing or longer than declared,
    or its manifest garbled): the pull brings the one before it, bit-identical, and says
    which it skipped and why; nothing of the damaged one is published."""
    src = tmp_path / "src"
    shared = leaf_bytes(0)
    folders = [make_snapshot(src, step, [shared, leaf_bytes(step)]) for step in (20, 40, 60)]
    for folder in folders:
        upload(s3.url, folder)
    damage(Remote(s3.url), folders[-1])
    fresh = tmp_path / "fresh"
    got = pull(s3.url, str(fresh))
    assert got.folder == str(fresh / "snapshot-40") and got.step == 40, got
    assert files(got.folder) == files(folders[1])
    assert [s for s, _ in got.skipped] == [60] and why in got.skipped[0][1], got.skipped
    assert sorted(p.name for p in fresh.iterdir()) == ["blobs", "snapshot-40"]


def test_when_every_snapshot_is_damaged_the_pull_fails_in_one_line(
        s3: S3Bucket, tmp_path: Path) -> None:
    """A rotted chunk every snapshot shares: no intact snapshot, one line naming the newest's
    damage; nothing is published."""
    src = tmp_path / "src"
    shared = leaf_bytes(0)
    folders = [make_snapshot(src, step, [leaf_bytes(step), shared]) for step in (1, 2)]
    for folder in folders:
        upload(s3.url, folder)
    _rot(Remote(s3.url), folders[0])  # the shared chunk
    with pytest.raises(RemoteError, match=r"no intact snapshot among the newest 2 \(step 2: "
                       r"chunk [0-9a-f]{32} is damaged on the remote") as e:
        pull(s3.url, str(tmp_path / "fresh"))
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "fresh").glob("snapshot-*"))


# -- C13: the pull uses the job's credentials; a failed pull never starts over a remote --


def _daemon_env(tmp: Path) -> dict[str, str]:
    """trainwatch's own environment without any AWS credential or endpoint, and a HOME
    without ~/.aws: only the job's env can reach the server."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and not k.startswith("TRAINWATCH_")}
    home = tmp / "daemon-home"
    home.mkdir(exist_ok=True)
    return {**env, "HOME": str(home), "AWS_EC2_METADATA_DISABLED": "true"}


def _snapjob(ws: Workspace, s3: S3Bucket, steps: int, on_pull_failure: str | None = None,
             ) -> tuple[int, str]:
    """`trainwatch run --config` of the numpy Snapshotter job, the S3 credentials and
    endpoint only in the job's ``env:``; (exit code, output)."""
    out = ws.root / "final"
    cmd = [sys.executable, str(SNAPJOB), "numpy", "--dir", str(ws.ckpt), "--steps", str(steps),
           "--remote", s3.url, "--out", str(out)]
    cp: dict[str, object] = {"dir": str(ws.ckpt), "layout": "trainwatch", "remote": s3.url}
    if on_pull_failure is not None:
        cp["on_pull_failure"] = on_pull_failure
    cfg = ws.config({"command": cmd, "env": dict(s3.env), "checkpoints": cp},
                    {"max_restarts": 0})
    p = subprocess.Popen([sys.executable, "-m", "trainwatch.cli", "run", "--config", str(cfg),
                          "--no-passthrough"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=_daemon_env(ws.root))
    ws.procs.append(p)
    return finish(p, timeout=90)


def _attempts(ws: Workspace) -> list[str]:
    log = ws.root / "final.log"
    return log.read_text().splitlines() if log.exists() else []


def test_the_pull_uses_the_credentials_in_the_jobs_env(ws: Workspace, s3: S3Bucket) -> None:
    """S3 credentials and endpoint only in the job's `env:` (trainwatch's own environment
    has none): the pull reaches the server with them, and the job resumes from step 20."""
    src = ws.root / "src"
    r = subprocess.run([sys.executable, str(SNAPJOB), "numpy", "--dir", str(src), "--steps",
                        "20", "--remote", s3.url, "--out", str(ws.root / "first")],
                       env=s3.subprocess_env(), capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert steps(s3.url)[-1] == 20
    rc, out = _snapjob(ws, s3, 30)
    assert rc == 0, out
    assert "pulled the newest snapshot" in out, out
    assert _attempts(ws)[0].startswith("attempt 0 from 20 ("), (_attempts(ws), out)


def _old_run(s3: S3Bucket, tmp: Path) -> list[str]:
    """An older run's snapshots of steps 100 and 200 on the remote, every manifest
    damaged; the names of the remote's objects at the top."""
    src = tmp / "old-run"
    for step in (100, 200):
        upload(s3.url, make_snapshot(src, step, [leaf_bytes(step)]))
    r = Remote(s3.url)
    for step in (100, 200):
        r.fs.pipe_file(f"{r.root}/snapshot-{step}.json", b'{"format": "trainw')
    return _top(s3)


def _top(s3: S3Bucket) -> list[str]:
    r = Remote(s3.url)
    r.fs.invalidate_cache()
    return sorted(str(p).rsplit("/", 1)[-1] for p in r.fs.ls(r.root, detail=False)
                  if not str(p).endswith("/blobs"))


def test_a_failed_pull_stops_the_job_rather_than_start_over_the_remote(
        ws: Workspace, s3: S3Bucket) -> None:
    """Every remote snapshot damaged (the pull fails), on_pull_failure unset (stop): the job
    never starts, trainwatch says why in one loud line, and the remote keeps only the old
    run's manifests, none replaced or added."""
    before = _old_run(s3, ws.root)
    rc, out = _snapjob(ws, s3, 30)
    assert rc != 0, out
    assert _attempts(ws) == [], out
    assert "not starting fresh over a remote that may hold snapshots" in out, out
    assert "-> fatal" in out, out
    assert _top(s3) == before == ["snapshot-100.json", "snapshot-200.json"]


def test_a_failed_pull_with_retire_retires_the_remote_then_starts_fresh(
        ws: Workspace, s3: S3Bucket) -> None:
    """on_pull_failure: retire: the old run's manifests are renamed *.json.retired first, then
    the job starts fresh; the remote lists only the new run's snapshots, never a mix."""
    _old_run(s3, ws.root)
    rc, out = _snapjob(ws, s3, 30, on_pull_failure="retire")
    assert rc == 0, out
    assert "retired the remote's snapshots of steps [100, 200]" in out, out
    assert _attempts(ws)[0].startswith("attempt 0 from 0"), _attempts(ws)
    listed = steps(s3.url)  # the uploader's newest-wins may skip some of the new run's
    assert listed[-1] == 30 and set(listed) <= {5, 10, 15, 20, 25, 30}, listed
    assert {"snapshot-100.json.retired", "snapshot-200.json.retired"} <= set(_top(s3))


def test_on_pull_failure_accepts_stop_or_retire_only(tmp_path: Path) -> None:
    """checkpoints.on_pull_failure: anything but stop or retire is one line naming the field."""
    from trainwatch.config import ConfigError, from_mapping

    def cp(value: object) -> object:
        return from_mapping({"jobs": [{"name": "j", "command": ["x"], "checkpoints": {
            "dir": "/d", "remote": "s3://b/p", "on_pull_failure": value}}]}, "c.yaml"
        ).jobs[0].checkpoints.on_pull_failure

    assert cp("retire") == "retire"
    with pytest.raises(ConfigError, match=r"checkpoints\.on_pull_failure: expected stop or "
                       "retire") as e:
        cp("start_over")
    assert "\n" not in str(e.value)
