"""Checkpoint manifests (trainwatch.state.manifest) and the background verifier
(trainwatch.state.verifier), on real files in temp folders. Large inputs are
sparse files: gigabytes to hash that take no disk."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for
from trainwatch.state import manifest
from trainwatch.state.manifest import ChangedWhileHashed, Manifest, Store, check, check_sizes, make
from trainwatch.state.verifier import Verifier

MB = 1 << 20


@pytest.fixture(params=list(manifest.ALGOS))
def algo(request: pytest.FixtureRequest) -> str:
    """Every hash backend installed here (sha256 always; xxh3_128 with xxhash)."""
    return str(request.param)


def ckpt(root: Path, name: str = "step_10", big: int = 20 * MB) -> Path:
    """A checkpoint folder as a framework writes one: weights, optimizer, config, nested shards."""
    d = root / name
    (d / "shards" / "rank0").mkdir(parents=True)
    (d / "weights.bin").write_bytes(os.urandom(big))
    (d / "optimizer.pt").write_bytes(os.urandom(4096))
    (d / "config.json").write_text('{"lr": 0.1}')
    (d / "shards" / "rank0" / "0.distcp").write_bytes(os.urandom(1000))
    return d


def sparse(path: Path, size: int) -> Path:
    """A file of ``size`` zero bytes that takes no disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.fixture
def verifier(tmp_path: Path) -> Iterator[Verifier]:
    v = Verifier(Store(tmp_path / "state" / "manifests"), chunk=256 << 10)
    yield v
    v.close()


# --- manifests ----------------------------------------------------------------


def test_default_hash_is_xxh3_when_xxhash_is_installed_else_sha256() -> None:
    """The fastest installed backend is the default; sha256 is always there."""
    try:
        import xxhash  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
        want = "xxh3_128"
    except ImportError:
        want = "sha256"
    assert want == manifest.DEFAULT_ALGO
    assert "sha256" in manifest.ALGOS


def test_manifest_lists_every_file_of_nested_folders_and_roundtrips(tmp_path: Path,
                                                                    algo: str) -> None:
    """Each regular file (nested ones by relative path), its size and hash; stored and read back."""
    d = ckpt(tmp_path, big=3 * MB)
    m = make(10, str(d), algo=algo)
    assert [f[0] for f in m.files] == ["config.json", "optimizer.pt", "shards/rank0/0.distcp",
                                       "weights.bin"]
    assert dict((f[0], f[1]) for f in m.files)["weights.bin"] == 3 * MB
    assert m.algo == algo and m.step == 10 and m.path == str(d) and m.size == 3 * MB + 5107
    store = Store(tmp_path / "jobs" / "j" / "manifests")
    store.put(m)
    assert store.get(10) == m
    assert json.loads((store.folder / "10.json").read_text())["algo"] == algo
    assert check(m) is None and check_sizes(m) is None


def test_one_flipped_byte_in_the_middle_of_20mb_is_caught(tmp_path: Path, algo: str) -> None:
    """Bit rot: same size, same name, one byte differs: content changed."""
    d = ckpt(tmp_path)
    m = make(10, str(d), algo=algo)
    with open(d / "weights.bin", "r+b") as f:
        f.seek(10 * MB)
        b = f.read(1)
        f.seek(10 * MB)
        f.write(bytes([b[0] ^ 0x01]))
    assert check_sizes(m) is None  # the cheap check cannot see it
    assert check(m) == "weights.bin: content changed"


def test_a_truncated_copy_is_caught_by_the_cheap_check(tmp_path: Path, algo: str) -> None:
    """A file cut short (a copy interrupted): its size names both numbers."""
    d = ckpt(tmp_path)
    m = make(10, str(d), algo=algo)
    os.truncate(d / "weights.bin", 5 * MB)
    assert check_sizes(m) == f"weights.bin: size {5 * MB} != {20 * MB}"
    assert check(m) == f"weights.bin: size {5 * MB} != {20 * MB}"


def test_a_file_rewritten_in_place_with_the_same_size_is_caught(tmp_path: Path,
                                                                algo: str) -> None:
    """Rewritten in place (a later attempt wrote the same step): content changed."""
    d = ckpt(tmp_path, big=MB)
    m = make(10, str(d), algo=algo)
    (d / "optimizer.pt").write_bytes(os.urandom(4096))
    assert check(m) == "optimizer.pt: content changed"


def test_a_hard_linked_chunk_is_read_once_for_every_manifest_that_holds_it(
        tmp_path: Path) -> None:
    """Snapshot folders share chunks by hard link: with ``known``, the second
    manifest takes the linked file's digest from the first (the file is not read:
    its bytes changed behind an unchanged mtime, and the old digest is used), files
    of one link are always read, and a check still reads every byte."""
    a, b = tmp_path / "snapshot-1", tmp_path / "snapshot-2"
    a.mkdir()
    b.mkdir()
    (a / "shared").write_bytes(os.urandom(MB))
    os.link(a / "shared", b / "shared")
    (a / "own").write_bytes(b"a")
    (b / "own").write_bytes(b"b")
    known: manifest.Known = {}
    first = make(1, str(a), known=known)
    assert len(known) == 1  # the linked file only
    st = os.stat(a / "shared")
    with open(a / "shared", "r+b") as f:  # rot: new bytes, the same size and mtime
        f.write(b"rot")
    os.utime(a / "shared", ns=(st.st_atime_ns, st.st_mtime_ns))
    second = make(2, str(b), known=known)
    assert dict((f[0], f[2]) for f in second.files)["shared"] == \
        dict((f[0], f[2]) for f in first.files)["shared"]
    assert make(2, str(b)).files != second.files  # without known: read, new digest
    assert check(second) == "shared: content changed"


def test_a_deleted_file_or_checkpoint_is_missing(tmp_path: Path, algo: str) -> None:
    """A listed file gone, nested or not, or the whole checkpoint gone: "missing"."""
    d = ckpt(tmp_path, big=MB)
    m = make(10, str(d), algo=algo)
    (d / "shards" / "rank0" / "0.distcp").unlink()
    assert check(m) == "shards/rank0/0.distcp: missing"
    (d / "config.json").unlink()
    assert check_sizes(m) == "config.json: missing"
    for p in sorted(d.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    d.rmdir()
    assert check(m) == "step_10: missing"


def test_an_extra_file_is_a_mismatch_only_when_strict(tmp_path: Path) -> None:
    """Files beside the listed ones (.nfs*, notes) change nothing a loader reads, unless strict."""
    d = ckpt(tmp_path, big=MB)
    m = make(10, str(d))
    (d / "extra.bin").write_bytes(b"x")
    assert check(m) is None
    assert check(m, strict=True) == "extra.bin: not in the manifest"
    assert check_sizes(m, strict=True) == "extra.bin: not in the manifest"


def test_a_single_file_checkpoint_is_named_by_its_file(tmp_path: Path, algo: str) -> None:
    """A Lightning .ckpt or torchrun snapshot.pt: one entry, named by its file in a why."""
    f = tmp_path / "epoch=1-step=20.ckpt"
    f.write_bytes(os.urandom(MB))
    m = make(20, str(f), algo=algo)
    assert m.files[0][:2] == ("", MB)
    f.write_bytes(os.urandom(MB))
    assert check(m) == "epoch=1-step=20.ckpt: content changed"


def test_symlinks_are_not_followed_out_of_the_checkpoint(tmp_path: Path) -> None:
    """Links to a file or a folder outside are neither listed nor read; a listed file
    swapped for a link to a copy of itself is missing, not followed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s" * 100)
    d = ckpt(tmp_path, big=MB)
    (d / "to_file").symlink_to(outside / "secret")
    (d / "to_dir").symlink_to(outside)
    m = make(10, str(d))
    assert [f[0] for f in m.files] == ["config.json", "optimizer.pt", "shards/rank0/0.distcp",
                                       "weights.bin"]
    (outside / "secret").write_bytes(b"t" * 5)
    assert check(m, strict=True) is None
    (outside / "config.json").write_bytes((d / "config.json").read_bytes())
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(outside / "config.json")
    assert check(m) == "config.json: missing"


def test_a_file_written_while_hashed_raises_instead_of_a_wrong_manifest(tmp_path: Path) -> None:
    """A checkpoint still being written is not given a manifest its final content would fail."""
    d = ckpt(tmp_path, big=2 * MB)
    calls = 0

    def append_once() -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            with open(d / "config.json", "ab") as f:
                f.write(b" ")
        return False

    with pytest.raises(ChangedWhileHashed):
        make(10, str(d), should_stop=append_once)


def test_make_of_an_absent_checkpoint_raises_oserror(tmp_path: Path) -> None:
    """Unreadable or absent: OSError, for the caller to count."""
    with pytest.raises(OSError):
        make(1, str(tmp_path / "nope"))


def test_store_ignores_a_damaged_manifest_and_drop_removes_it(tmp_path: Path) -> None:
    """A manifest file that is not JSON or not a manifest is None (logged), never a crash."""
    store = Store(tmp_path / "m")
    assert store.get(3) is None
    store.put(Manifest(3, "/x", "sha256", (("a", 1, "00"),), 1.0))
    (store.folder / "4.json").write_text("{not json")
    (store.folder / "5.json").write_text(json.dumps({"version": 1, "step": 5, "files": 3}))
    assert store.get(4) is None and store.get(5) is None
    assert store.get(3) is not None
    store.drop(3)
    store.drop(3)
    assert store.get(3) is None


# --- the verifier ---------------------------------------------------------------


def test_verify_of_an_unknown_checkpoint_makes_its_manifest_then_checks_it(
        tmp_path: Path, verifier: Verifier) -> None:
    """First judgement makes and trusts the manifest; the next verify checks against it."""
    d = ckpt(tmp_path, big=MB)
    assert verifier.verify(10, str(d), timeout=30) == (True, "manifest made now")
    assert verifier.store.get(10) is not None
    assert verifier.verify(10, str(d), timeout=30) == (True, "verified")


def test_a_checkpoint_corrupted_after_its_manifest_fails_verification(
        tmp_path: Path, verifier: Verifier) -> None:
    """Submitted when complete, bit rot afterwards: verify says False and why."""
    d = ckpt(tmp_path)
    verifier.submit(10, str(d))
    wait_for(lambda: verifier.store.get(10), 30, "the manifest")
    with open(d / "weights.bin", "r+b") as f:
        f.seek(7 * MB)
        f.write(b"\0\1\2")
    assert verifier.verify(10, str(d), timeout=30) == (False, "weights.bin: content changed")
    assert verifier.counts()["mismatches"] == 1


class _PausedPut(Store):
    """A store whose worker pauses just after a manifest is stored (before the
    make is finished), the moment a busy machine may deschedule it."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.stored = threading.Event()
        self.go = threading.Event()

    def put(self, m: Manifest) -> None:
        super().put(m)
        self.stored.set()
        self.go.wait(30)


def test_a_verify_after_the_manifest_is_stored_checks_it_not_the_make_in_flight(
        tmp_path: Path) -> None:
    """A verify that starts once the manifest is visible checks the files against it, even
    while the worker is still finishing that make: a corruption made since is caught."""
    store = _PausedPut(tmp_path / "m")
    v = Verifier(store, chunk=256 << 10)
    try:
        d = ckpt(tmp_path, big=2 * MB)
        v.submit(10, str(d))
        assert store.stored.wait(30) and store.get(10) is not None
        with open(d / "weights.bin", "r+b") as f:
            f.write(b"\0\1\2")
        got: list[object] = []
        t = threading.Thread(target=lambda: got.append(v.verify(10, str(d), timeout=60)))
        t.start()
        # Joining the make in flight would take its verdict, from bytes read before.
        wait_for(lambda: v.counts()["pending"] == 1, 30, "the verify queued as a check")
        store.go.set()
        t.join(60)
        assert got == [(False, "weights.bin: content changed")]
    finally:
        store.go.set()
        v.close()


def test_verify_waits_only_for_the_checkpoint_it_asks_about(tmp_path: Path,
                                                            verifier: Verifier) -> None:
    """Eight 512 MB checkpoints submitted first do not delay the verify of a small one,
    and are all hashed afterwards (the one set aside included)."""
    for step in range(8):
        sparse(tmp_path / f"step_{step}" / "w.bin", 512 * MB)
        verifier.submit(step, str(tmp_path / f"step_{step}"))
    small = ckpt(tmp_path, "step_100", big=MB)
    assert verifier.verify(100, str(small), timeout=60) == (True, "manifest made now")
    assert verifier.counts()["pending"] >= 6
    wait_for(lambda: verifier.counts()["made"] == 9, 120, "every manifest")
    assert all(verifier.store.get(s) is not None for s in range(8))


def test_a_checkpoint_deleted_while_hashed_is_survived_and_counted(tmp_path: Path) -> None:
    """The worker counts the OSError, a verify of it says False, and the next one works."""
    started = threading.Event()
    go = threading.Event()

    def clock() -> float:  # called by the worker as it starts each job
        started.set()
        go.wait(30)
        return time.monotonic()

    v = Verifier(Store(tmp_path / "m"), clock=clock)
    try:
        d = tmp_path / "step_5"
        sparse(d / "a.bin", 64 * MB)
        sparse(d / "b.bin", 64 * MB)
        v.submit(5, str(d))
        assert started.wait(30)
        (d / "a.bin").unlink()
        (d / "b.bin").unlink()
        d.rmdir()
        go.set()
        wait_for(lambda: v.counts()["errors"] == 1, 30, "the error counted")
        ok, why = v.verify(5, str(d), timeout=30)
        assert ok is False and "No such file" in why
        good = ckpt(tmp_path, "step_6", big=MB)
        assert v.verify(6, str(good), timeout=30) == (True, "manifest made now")
    finally:
        go.set()
        v.close()


def test_submit_is_idempotent_and_the_queue_is_bounded(tmp_path: Path) -> None:
    """The same step twice is one job; past max_pending the oldest submission is dropped."""
    started = threading.Event()
    go = threading.Event()

    def clock() -> float:  # the worker's first job waits: none of the ten is taken early
        if not started.is_set():
            started.set()
            go.wait(30)
        return time.monotonic()

    v = Verifier(Store(tmp_path / "m"), clock=clock, max_pending=3)
    try:
        v.submit(100, str(ckpt(tmp_path, "step_100", big=MB)))
        assert started.wait(30)
        paths = [str(sparse(tmp_path / f"s{i}" / "w", 256 * MB).parent) for i in range(10)]
        for i, p in enumerate(paths):
            v.submit(i, p)
            v.submit(i, p)
        c = v.counts()
        assert c["pending"] == 3 and c["dropped"] == 7
        go.set()
        wait_for(lambda: v.counts()["pending"] == 0 and v.counts()["busy"] == 0, 60, "idle")
        made = v.counts()["made"]
        assert made == 4 and v.store.get(9) is not None and v.store.get(0) is None
        v.submit(9, paths[9])  # its manifest exists: nothing to make
        wait_for(lambda: v.counts()["pending"] == 0 and v.counts()["busy"] == 0, 60, "idle")
        assert v.counts()["made"] == made
    finally:
        go.set()
        v.close()


def test_a_verify_out_of_time_leaves_its_manifest_to_be_made(tmp_path: Path,
                                                             verifier: Verifier) -> None:
    """No verdict in time is None, not False; the manifest is still made in the background."""
    d = sparse(tmp_path / "step_3" / "w.bin", 512 * MB).parent
    assert verifier.verify(3, str(d), timeout=0) == (None, "not verified in time")
    wait_for(lambda: verifier.store.get(3), 60, "the manifest")


def test_close_joins_the_worker_even_while_it_hashes(tmp_path: Path) -> None:
    """close() gives up the file it hashes at its next chunk and joins; later calls do nothing."""
    v = Verifier(Store(tmp_path / "m"))
    d = sparse(tmp_path / "step_1" / "w.bin", 4096 * MB).parent
    v.submit(1, str(d))
    wait_for(lambda: v.counts()["busy"], 10, "hashing")
    t0 = time.monotonic()
    v.close()
    assert not v._thread.is_alive()
    assert time.monotonic() - t0 < 10
    assert v.store.get(1) is None
    assert v.verify(1, str(d), timeout=1) == (None, "verifier closed")
    v.submit(2, str(d))


def test_forget_drops_the_manifest_of_a_replaced_checkpoint(tmp_path: Path,
                                                            verifier: Verifier) -> None:
    """A step written anew (after a rollback) is judged afresh, not failed against the old one."""
    d = ckpt(tmp_path, big=MB)
    assert verifier.verify(10, str(d), timeout=30)[0] is True
    (d / "weights.bin").write_bytes(os.urandom(MB))
    verifier.forget(10)
    assert verifier.store.get(10) is None
    assert verifier.verify(10, str(d), timeout=30) == (True, "manifest made now")
