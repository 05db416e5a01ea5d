"""Remote sync killed at named instants (trainwatch.snapshot.crashpoint): a real
process uploads to or pulls from a real S3 server (moto_server over HTTP) and
is SIGKILLed there. Afterwards the remote lists no snapshot whose blobs are
missing or damaged, a re-run finishes the job, and the local snapshots are as
they were."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from test_snapshot_remote import files, make_snapshot
from trainwatch.snapshot import blobs
from trainwatch.snapshot.format import judge, published
from trainwatch.snapshot.remote import Remote, pull, steps, upload

if TYPE_CHECKING:
    from s3server import S3Bucket

pytest_plugins = ["s3server"]

PIECE = 16 * 1024  # the child's transfer piece: "partial" is mid-blob with little test data
CHILD = f"""
import sys
from trainwatch.snapshot import chunkfile, remote
remote.PIECE = chunkfile.PIECE = {PIECE}
op, url, path, step = sys.argv[1:5]
if op == "upload":
    remote.upload(url, path)
else:
    remote.pull(url, path, int(step))
"""

# Shared by both snapshots, then the second's own: a blob of several transfer
# pieces (so "partial" is mid-blob) and a small one.
SHARED = [random.Random(i).randbytes(64 * 1024) for i in range(2)]
BIG = random.Random(100).randbytes(3 * PIECE + 100)
SMALL = random.Random(101).randbytes(4096)


def snapshots(root: Path) -> tuple[str, str]:
    one = make_snapshot(root, 1, [*SHARED, random.Random(7).randbytes(1000)])
    two = make_snapshot(root, 2, [*SHARED, BIG, SMALL])
    return one, two


def killed_at(point: str, s3: S3Bucket, op: str, url: str, path: str, step: int = 0) -> None:
    """Run the child until the crash point kills it; fail if it was never reached."""
    r = subprocess.run(
        [sys.executable, "-c", CHILD, op, url, path, str(step)],
        env=s3.subprocess_env(TRAINWATCH_SNAPSHOT_CRASH_AT=point),
        capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == -signal.SIGKILL, f"{point} not reached (rc {r.returncode}): {r.stderr}"


def fingerprint(root: Path) -> dict[str, bytes]:
    """Every published snapshot's files."""
    return {f"{step}/{n}": b for step, folder in published(root) for n, b in files(folder).items()}


def every_listed_snapshot_pulls_whole(url: str, local: Path, scratch: Path,
                                      skip: tuple[int, ...] = ()) -> list[int]:
    """Pull each step the remote lists (but `skip`) into an empty dir: all
    complete and identical to the local snapshot; the steps listed."""
    listed = steps(url)
    for step in set(listed) - set(skip):
        got = pull(url, str(scratch / f"check-{step}"), step).folder
        assert got is not None and judge(got)[0]
        assert files(got) == files(local / f"snapshot-{step}")
    return listed


UPLOAD_POINTS = [
    ("upload.blob.partial", [1]),  # part of BIG written, the upload not finished
    ("upload.blob.done", [1]),  # BIG up, SMALL not yet
    ("upload.blobs.done", [1]),  # every blob up, no manifest yet
    ("upload.manifest.partial", [1]),  # half the manifest written
    ("upload.manifest.done", [1, 2]),  # the manifest up
]
# file:// where its temp-name-then-rename matters: a file cut short by the kill.
CASES = [(p, listed, "s3") for p, listed in UPLOAD_POINTS] + [
    (p, listed, "file") for p, listed in UPLOAD_POINTS if p.endswith(".partial")]


@pytest.mark.parametrize(("point", "listed", "scheme"), CASES,
                         ids=[f"{p}-{scheme}" for p, _, scheme in CASES])
def test_an_upload_killed_at_any_instant_lists_only_whole_snapshots(
        point: str, listed: list[int], scheme: str, s3: S3Bucket, tmp_path: Path) -> None:
    """A killed upload never leaves a listed snapshot with missing blobs; a re-run completes it."""
    local = tmp_path / "ckpt"
    one, two = snapshots(local)
    url = s3.url if scheme == "s3" else f"file://{tmp_path}/remote"
    upload(url, one)
    before = fingerprint(local)
    killed_at(point, s3, "upload", url, two)
    if scheme == "file" and point == "upload.blob.partial":  # killed mid-blob, truly
        torn = [p for p in (tmp_path / "remote").rglob("*.tmp-*") if p.is_file()]
        assert len(torn) == 1 and 0 < torn[0].stat().st_size < len(BIG)
    assert every_listed_snapshot_pulls_whole(url, local, tmp_path / "a") == listed
    assert fingerprint(local) == before
    again = upload(url, two)
    assert again["blobs_present"] >= 2
    assert every_listed_snapshot_pulls_whole(url, local, tmp_path / "b", skip=(1,)) == [1, 2]
    assert fingerprint(local) == before


PULL_POINTS = [
    ("chunk.linked", False),  # a shared chunk linked from the local store
    ("pull.blob.partial", False),  # one piece of BIG read from the remote
    ("chunk.tmp_written", False),  # BIG written to its temp name in staging
    ("pull.blob.done@3", False),  # BIG in staging, SMALL not yet
    ("pull.publish.before", False),  # every chunk in staging, no manifest
    ("manifest.tmp_written", False),  # the manifest's temp file in staging
    ("publish.renamed", True),  # the staging folder renamed: published
]


@pytest.mark.parametrize(("point", "lands"), PULL_POINTS, ids=[p for p, _ in PULL_POINTS])
def test_a_pull_killed_at_any_instant_leaves_the_old_and_a_rerun_completes(
        point: str, lands: bool, s3: S3Bucket, tmp_path: Path) -> None:
    """A killed pull publishes nothing torn; pulling again yields the complete snapshot."""
    local = tmp_path / "ckpt"
    one, two = snapshots(local)
    upload(s3.url, one)
    upload(s3.url, two)
    host = tmp_path / "host"  # a host that has snapshot 1 and pulls snapshot 2
    assert pull(s3.url, str(host), 1).folder is not None
    before = fingerprint(host)
    killed_at(point, s3, "pull", s3.url, str(host), 2)
    after = fingerprint(host)
    assert [s for s, _ in published(host)] == ([1, 2] if lands else [1])
    assert {k: v for k, v in after.items() if k.startswith("1/")} == before
    for _, folder in published(host):
        assert judge(folder)[0]
    got = pull(s3.url, str(host), 2).folder
    assert got is not None and files(got) == files(two)
    blobs.collect(str(host))  # the killed pull's staging folder goes; nothing else
    assert not [n for n in os.listdir(host) if n.startswith(".")]
    assert fingerprint(host) == {**before, **{f"2/{n}": b for n, b in files(two).items()}}
    assert Remote(s3.url).index()  # the remote is untouched by pulls
