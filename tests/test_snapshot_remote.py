"""Remote snapshots (trainwatch.snapshot.remote) against a real S3 server over
HTTP (moto_server, tests/s3server.py), and against file:// where the
filesystem's own semantics matter."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from conftest import wait_for
from trainwatch.snapshot import blobs, codec
from trainwatch.snapshot.format import Leaf, Manifest, judge, read
from trainwatch.snapshot.remote import Remote, RemoteError, pull, steps, upload
from trainwatch.snapshot.uploader import Uploader

if TYPE_CHECKING:
    from s3server import S3Bucket, S3Server

# The fixtures s3server (a moto_server process) and s3 (a fresh bucket).
pytest_plugins = ["s3server"]

KIB = 1024


def leaf_bytes(seed: int, n: int = 64 * KIB) -> bytes:
    """Incompressible bytes, different per seed."""
    return random.Random(seed).randbytes(n)


def make_snapshot(root: Path, step: int, leaves: list[bytes], zstd: bool = False) -> str:
    """Publish root/snapshot-<step> holding each of `leaves` as one bytes leaf
    (one chunk each), through the store as a save does; the folder."""
    staging = blobs.Staging(str(root), step)
    out = []
    for data in leaves:
        def produce(d: bytes = data) -> tuple[Any, str | None]:
            return codec.compress(d) if zstd else (d, None)

        c = staging.add(blobs.digest(data), len(data), produce)
        out.append(Leaf("bytes", None, None, len(data), [c]))
    m = Manifest(step, 1.7e9, [{"$leaf": i} for i in range(len(out))], out, None, {}, {})
    folder, published = blobs.publish(staging, m.dumps())
    assert published
    return folder


def files(folder: str | Path) -> dict[str, bytes]:
    """Every file of a snapshot folder, by name."""
    return {p.name: p.read_bytes() for p in Path(folder).iterdir()}


def remote_blobs(s3: S3Bucket) -> dict[str, int]:
    return Remote(s3.url).index()


@pytest.fixture
def local(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


def test_upload_sends_only_the_blobs_the_remote_lacks(s3: S3Bucket, local: Path) -> None:
    """A second snapshot sharing three of four chunks uploads one chunk and its manifest."""
    a = [leaf_bytes(i) for i in range(4)]
    first = upload(s3.url, make_snapshot(local, 1, a))
    assert first["blobs_uploaded"] == 4 and first["blobs_present"] == 0
    b = [*a[:3], leaf_bytes(99)]
    folder = make_snapshot(local, 2, b)
    second = upload(s3.url, folder)  # a new Remote: lists the remote store afresh
    manifest = Path(folder, "snapshot.json").stat().st_size
    assert second == {"blobs_uploaded": 1, "blobs_present": 3,
                      "bytes_uploaded": 64 * KIB + manifest}
    assert len(remote_blobs(s3)) == 5


def test_the_manifest_goes_up_after_every_blob(s3: S3Bucket, local: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """upload writes every blob first and the manifest last."""
    order: list[str] = []
    put = Remote._put

    def spy(self: Remote, rpath: str, pieces: Any, point: str) -> None:
        put(self, rpath, pieces, point)
        order.append(rpath.rsplit("/", 1)[-1])

    monkeypatch.setattr(Remote, "_put", spy)
    upload(s3.url, make_snapshot(local, 7, [leaf_bytes(i) for i in range(3)]))
    assert order[-1] == "snapshot-7.json" and len(order) == 4


def test_steps_lists_remote_manifests_oldest_first(s3: S3Bucket, local: Path) -> None:
    """steps() names each uploaded snapshot once, oldest first, ignoring other objects."""
    assert steps(s3.url) == []
    for step in (30, 4, 100):
        upload(s3.url, make_snapshot(local, step, [leaf_bytes(step)]))
    r = Remote(s3.url)
    r.fs.pipe_file(f"{r.root}/snapshot-5.json.tmp-host-1", b"{}")
    r.fs.pipe_file(f"{r.root}/notes.json", b"{}")
    assert steps(s3.url) == [4, 30, 100]


def test_steps_under_a_prefix_and_of_an_empty_prefix(s3: S3Bucket, local: Path) -> None:
    """A URL with a prefix keeps its snapshots apart from the bucket's other prefixes."""
    upload(s3.url + "/job-a", make_snapshot(local, 1, [leaf_bytes(1)]))
    assert steps(s3.url + "/job-a") == [1]
    assert steps(s3.url + "/job-b") == []
    assert pull(s3.url + "/job-b", str(local / "x")).folder is None


def test_pull_into_an_empty_dir_restores_bit_identically(s3: S3Bucket, local: Path,
                                                         tmp_path: Path) -> None:
    """A fresh host's empty dir receives the newest snapshot, every file identical."""
    make_snapshot(local, 1, [leaf_bytes(1)])
    newest = make_snapshot(local, 2, [leaf_bytes(i) for i in range(3)], zstd=True)
    for folder in (local / "snapshot-1", newest):
        upload(s3.url, str(folder))
    fresh = tmp_path / "fresh"
    got = pull(s3.url, str(fresh)).folder
    assert got == str(fresh / "snapshot-2")
    assert judge(got) == (True, "snapshot.json and 3 chunks present")
    assert files(got) == files(newest)
    assert not [n for n in os.listdir(fresh) if n.startswith(".staging")]


def test_pull_of_a_compressible_snapshot_checks_the_raw_hash(s3: S3Bucket, local: Path,
                                                             tmp_path: Path) -> None:
    """zstd chunks come back as stored, checked against the hash of their raw bytes."""
    folder = make_snapshot(local, 3, [bytes(256 * KIB), b"ab" * 40000], zstd=True)
    assert {c.codec for c in read(folder).chunks().values()} == {"zstd"}
    upload(s3.url, folder)
    got = pull(s3.url, str(tmp_path / "fresh")).folder
    assert got is not None and files(got) == files(folder)


def test_pull_of_a_given_step(s3: S3Bucket, local: Path, tmp_path: Path) -> None:
    """pull(step=N) brings that snapshot; a step the remote lacks is None."""
    for step in (1, 2, 3):
        upload(s3.url, make_snapshot(local, step, [leaf_bytes(step)]))
    fresh = tmp_path / "fresh"
    got = pull(s3.url, str(fresh), step=2).folder
    assert got == str(fresh / "snapshot-2")
    assert files(got) == files(local / "snapshot-2")
    assert pull(s3.url, str(fresh), step=9).folder is None
    assert sorted(os.listdir(fresh)) == ["blobs", "snapshot-2"]


def test_pull_links_what_the_local_store_holds_and_downloads_the_rest(
        s3: S3Bucket, local: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks the local store already has are hard-linked, only the others downloaded."""
    a = [leaf_bytes(i) for i in range(4)]
    upload(s3.url, make_snapshot(local, 1, a))
    upload(s3.url, make_snapshot(local, 2, [*a[:3], leaf_bytes(42)]))
    fresh = tmp_path / "fresh"
    first = pull(s3.url, str(fresh), step=1).folder
    assert first is not None
    r = Remote(s3.url)
    downloads: list[str] = []
    open_ = r.fs.open

    def counting_open(path: str, mode: str = "rb", **kw: Any) -> Any:
        if "/blobs/" in path:
            downloads.append(path.rsplit("/", 1)[-1])
        return open_(path, mode, **kw)

    monkeypatch.setattr(r.fs, "open", counting_open)
    second = r.pull(str(fresh), step=2).folder
    assert second is not None
    assert downloads == [blobs.digest(leaf_bytes(42))]
    shared = set(files(first)) & set(files(second)) - {"snapshot.json"}
    assert len(shared) == 3
    for name in shared:  # the same inode: linked, not downloaded
        assert os.stat(os.path.join(first, name)).st_ino == os.stat(
            os.path.join(second, name)).st_ino
    assert files(second) == files(local / "snapshot-2")


def test_a_damaged_local_store_copy_is_replaced_by_the_remote_one(
        s3: S3Bucket, local: Path, tmp_path: Path) -> None:
    """A store chunk whose bytes no longer match its hash is not linked into a pull."""
    a = [leaf_bytes(i) for i in range(2)]
    upload(s3.url, make_snapshot(local, 1, a))
    fresh = tmp_path / "fresh"
    make_snapshot(fresh, 5, a[:1])  # the store now holds a[0]
    name = blobs.digest(a[0])
    store = Path(blobs.store_path(str(fresh), name))
    damaged = bytearray(store.read_bytes())
    damaged[100] ^= 0xFF
    store.write_bytes(bytes(damaged))  # in place: snapshot-5's link sees it too
    got = pull(s3.url, str(fresh), step=1).folder
    assert got is not None and files(got) == files(local / "snapshot-1")


def test_a_damaged_remote_blob_is_one_clear_error_and_nothing_is_published(
        s3: S3Bucket, local: Path, tmp_path: Path) -> None:
    """A remote chunk whose bytes do not match its hash stops the pull: nothing lands."""
    folder = make_snapshot(local, 1, [leaf_bytes(i) for i in range(3)])
    upload(s3.url, folder)
    r = Remote(s3.url)
    name = blobs.digest(leaf_bytes(1))
    path = f"{r.root}/blobs/{name[:2]}/{name}"
    data = bytearray(r.fs.cat_file(path))
    data[5] ^= 1  # same size: only the hash can tell
    r.fs.pipe_file(path, bytes(data))
    fresh = tmp_path / "fresh"
    with pytest.raises(RemoteError, match=f"chunk {name} is damaged on the remote"):
        pull(s3.url, str(fresh))
    assert sorted(os.listdir(fresh)) == ["blobs"]  # no snapshot, no staging left
    r.fs.rm_file(path)
    with pytest.raises(RemoteError, match=f"chunk {name} is missing from the remote"):
        pull(s3.url, str(fresh))
    assert sorted(os.listdir(fresh)) == ["blobs"]


def test_a_damaged_remote_manifest_is_one_clear_error(s3: S3Bucket, tmp_path: Path) -> None:
    """A remote manifest that does not parse is named in one line."""
    r = Remote(s3.url)
    r.fs.pipe_file(f"{r.root}/snapshot-3.json", b"{not json")
    with pytest.raises(RemoteError, match=r"snapshot-3\.json: snapshot\.json is not JSON"):
        pull(s3.url, str(tmp_path / "fresh"))


def test_pull_returns_the_local_snapshot_when_it_is_there(s3: S3Bucket, local: Path) -> None:
    """Pulling a step the local dir already holds downloads nothing and keeps it."""
    folder = make_snapshot(local, 4, [leaf_bytes(4)])
    upload(s3.url, folder)
    before = {n: os.stat(os.path.join(folder, n)).st_ino for n in os.listdir(folder)}
    assert pull(s3.url, str(local)).folder == folder
    assert {n: os.stat(os.path.join(folder, n)).st_ino for n in os.listdir(folder)} == before


def test_file_url_round_trip_leaves_no_temp_files(local: Path, tmp_path: Path) -> None:
    """file:// works the same, and a finished upload leaves only final names."""
    url = f"file://{tmp_path}/remote"
    a = [leaf_bytes(i) for i in range(3)]
    upload(url, make_snapshot(local, 1, a))
    assert upload(url, make_snapshot(local, 2, [*a[:2], leaf_bytes(9)]))["blobs_uploaded"] == 1
    assert steps(url) == [1, 2]
    names = [p.name for p in (tmp_path / "remote").rglob("*") if p.is_file()]
    assert sorted(n for n in names if not n.startswith("snapshot-")) == sorted(
        {blobs.digest(x) for x in [*a, leaf_bytes(9)]})
    got = pull(url, str(tmp_path / "fresh")).folder
    assert got is not None and files(got) == files(local / "snapshot-2")


def test_a_failed_blob_upload_leaves_nothing_under_its_name(local: Path, tmp_path: Path) -> None:
    """A local file cut short after its snapshot was published is refused, not half-sent."""
    url = f"file://{tmp_path}/remote"
    folder = make_snapshot(local, 1, [leaf_bytes(1, 3 * 8 * 1024 * KIB // 2)])
    name = blobs.digest(leaf_bytes(1, 3 * 8 * 1024 * KIB // 2))
    with open(os.path.join(folder, name), "r+b") as f:
        f.truncate(8 * 1024 * KIB + 5)
    with pytest.raises(RemoteError, match="bytes, the manifest says"):
        upload(url, folder)
    assert [p for p in (tmp_path / "remote").rglob("*") if p.is_file()] == []
    assert steps(url) == []


def test_without_s3fs_an_s3_url_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    """s3:// without s3fs installed: one clear error naming the snapshot extra."""
    code = ("import sys; sys.modules['s3fs'] = None\n"
            "from trainwatch.snapshot import remote\n"
            "try:\n    remote.steps('s3://bucket/x')\n"
            "except remote.RemoteError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert "\n" not in line and "/path/to/trainwatch[snapshot]" in line and "s3fs" in line


def test_an_unknown_protocol_is_one_line() -> None:
    """A URL fsspec does not know is refused with one line naming it."""
    with pytest.raises(RemoteError, match=r"^nosuch://b/p: Protocol not known: nosuch$"):
        steps("nosuch://b/p")


@pytest.fixture
def paused(s3server: S3Server) -> Iterator[Any]:
    """SIGSTOP/SIGCONT the S3 server: uploads to it hang until it resumes."""
    stopped = []

    def pause() -> None:
        s3server.proc.send_signal(signal.SIGSTOP)
        stopped.append(1)

    def resume() -> None:
        if stopped:
            s3server.proc.send_signal(signal.SIGCONT)
            stopped.clear()

    yield pause, resume
    resume()


def test_uploader_newest_wins_while_one_is_in_flight(s3: S3Bucket, local: Path,
                                                     paused: Any) -> None:
    """Folders submitted during an upload are superseded by the newest; close drains it."""
    pause, resume = paused
    folders = [make_snapshot(local, step, [leaf_bytes(step)]) for step in (1, 2, 3, 4)]
    up = Uploader(s3.url)
    pause()  # the first upload starts and hangs on the server
    up.submit(folders[0])
    wait_for(lambda: up.in_flight is not None, what="upload 1 in flight")
    for f in folders[1:]:
        up.submit(f)
    assert up.superseded == 2
    resume()
    assert up.close(timeout=60)
    assert (up.uploaded, up.failures) == (2, 0)
    assert steps(s3.url) == [1, 4]
    up.submit(folders[1])  # after close: ignored
    assert steps(s3.url) == [1, 4]


def test_uploader_counts_failures_logs_once_per_kind_and_never_raises(
        local: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A remote that refuses every write is counted, logged once, retried, never raised."""
    target = tmp_path / "remote"
    target.write_text("a file where the remote folder should be")
    folder = make_snapshot(local, 1, [leaf_bytes(1)])
    up = Uploader(f"file://{target}", backoff=0.01, max_backoff=0.02)
    with caplog.at_level(logging.DEBUG, logger="trainwatch.snapshot"):
        up.submit(folder)
        wait_for(lambda: up.failures >= 3, what="three failed tries")
        assert up.close(timeout=30)
    assert up.uploaded == 0 and sum(up.failures_by_kind.values()) == up.failures
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "snapshot upload" in warned[0].getMessage()


def test_uploader_counts_a_vanished_folder_and_does_not_retry_it(s3: S3Bucket,
                                                                 tmp_path: Path) -> None:
    """A folder deleted before its upload (retention) is one 'vanished' failure."""
    up = Uploader(s3.url, backoff=0.01)
    up.submit(str(tmp_path / "snapshot-8"))
    assert up.close(timeout=30)
    assert up.failures_by_kind == {"vanished": 1}


def test_a_run_resumed_under_trainwatch_retires_the_remotes_newer_snapshots(
        s3: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resumed from 2 (trainwatch rolled back past 3 and 4), the Snapshotter retires the
    remote's manifests of 3 and 4 before any upload, so that a relaunch on a fresh host
    pulls 2, not the abandoned 4; its own new 3 goes up and is listed."""
    from trainwatch.snapshot import Snapshotter

    run = tmp_path / "run"
    for step in (1, 2, 3, 4):
        upload(s3.url, make_snapshot(run, step, [leaf_bytes(step)]))
    assert steps(s3.url) == [1, 2, 3, 4]
    monkeypatch.setenv("TRAINWATCH_JOB", "job")
    monkeypatch.setenv("TRAINWATCH_RESUME_FROM", str(run / "snapshot-2"))
    snap = Snapshotter(run, every_steps=1, remote=s3.url)
    restored = snap.restore()
    assert restored is not None and restored[0] == 2
    wait_for(lambda: steps(s3.url) == [1, 2], what="the remote's 3 and 4 retired")
    got = pull(s3.url, str(tmp_path / "fresh-host")).folder
    assert got == str(tmp_path / "fresh-host" / "snapshot-2")
    assert snap.maybe_save(3, {"new": b"three"})
    snap.close(timeout=60)
    assert steps(s3.url) == [1, 2, 3]
    fresh = pull(s3.url, str(tmp_path / "another-host"), 3).folder
    assert fresh is not None and read(fresh).step == 3
    r = Remote(s3.url)
    names = {str(p).rsplit("/", 1)[-1] for p in r.fs.ls(r.root, detail=False)}
    assert {"snapshot-3.json.retired", "snapshot-4.json.retired"} <= names  # kept to read


def test_an_upload_outlives_keep_deleting_its_snapshot(s3: S3Bucket, local: Path,
                                                       paused: Any) -> None:
    """A snapshot deleted (by keep, or the daemon's retention) while it waits behind a slow
    upload still goes up whole: the uploader holds hard links of its own (a pin)."""
    pause, resume = paused
    first, second = (make_snapshot(local, step, [leaf_bytes(step)]) for step in (1, 2))
    up = Uploader(s3.url)
    pause()
    up.submit(first)
    wait_for(lambda: up.in_flight is not None, what="upload 1 in flight")
    up.submit(second)
    assert blobs.delete(str(local), second)  # what keep=1 does next
    resume()
    assert up.close(timeout=60)
    assert (up.uploaded, up.failures) == (2, 0), up.failures_by_kind
    assert steps(s3.url) == [1, 2]
    assert pull(s3.url, str(local / "elsewhere"), 2).folder is not None
    blobs.collect(str(local))  # the pins are gone with the upload: nothing left to collect
    assert sorted(n for n in os.listdir(local) if n.startswith(".")) == []


def test_a_rotted_local_snapshot_is_repaired_from_the_remote(s3: S3Bucket, local: Path) -> None:
    """pull() of a step whose local folder fails its hashes takes the remote's copy in its
    place (the local store's intact chunks linked, the rotted one downloaded)."""
    folder = make_snapshot(local, 3, [leaf_bytes(3), leaf_bytes(30)])
    upload(s3.url, folder)
    m = read(folder)
    name = sorted(m.chunks())[0]
    path = os.path.join(folder, name)
    data = bytearray(Path(path).read_bytes())
    os.unlink(path)  # a copy of its own, rotted (the store keeps the shared inode)
    data[100] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)
    assert judge(folder)[0]  # sizes alone do not see it
    assert pull(s3.url, str(local), 3).folder == folder
    stored = {n: Path(blobs.store_path(str(local), n)) for n in m.chunks()}
    assert all(Path(folder, n).read_bytes() == p.read_bytes() for n, p in stored.items())
    assert Path(folder, name).stat().st_ino == stored[name].stat().st_ino  # the intact one
