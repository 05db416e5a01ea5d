"""Privilege separation: what trainwatch does in a job's folders it does in the
job's hand, a process as the job's user, bounded in time, bytes and entries
(issue 21, part A). Real users, real files, a real FIFO whose read blocks."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import gc
import os
import pwd
import selectors
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    Workspace,
    finish,
    local_user,
    missing,
    need_root,
    pid_gone,
    run_name,
    wait_for,
)
from trainwatch.actions import background, prune, pull, ringfolder
from trainwatch.config import Checkpoints, Job, from_mapping
from trainwatch.evidence import flightrecorder
from trainwatch.host.supervisor import Supervisor
from trainwatch.layouts import base as layouts_base
from trainwatch.layouts import megatron
from trainwatch.privsep import child, jobhands
from trainwatch.privsep.credentials import Identity, resolve
from trainwatch.privsep.hand import Hand, HandDown, HandTimeout, OpFailed
from trainwatch.snapshot import blobs
from trainwatch.snapshot import format as snapshot_format
from trainwatch.sources import ring, ringreader
from trainwatch.state import checkpointlist, handdisk, numbered, ondisk, retention
from trainwatch.state.catalog import Catalog
from trainwatch.state.handdisk import HandDisk
from trainwatch.state.manifest import Store
from trainwatch.state.verifier import Verifier
from trainwatch.watch.intake import RING_BUDGET, RING_POLL, Intake

USER = run_name("hand")  # this run's own user (conftest)


def _user() -> Identity:
    need_root("a hand as another user")
    local_user(USER)
    ident = resolve(USER, None)
    assert ident is not None
    return ident


def _give(path: Path, ident: Identity) -> None:
    for top, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(top, name), ident.uid, ident.gid)
    os.chown(path, ident.uid, ident.gid)

def _credential_home(tmp: Path, ident: Identity, process: str) -> tuple[dict[str, str], Path]:
    """A HOME of ``ident``'s whose AWS config runs ``process`` (``{out}``: a folder of
    theirs, returned) for credentials; the environment of a listing with it."""
    home, out = tmp / "home", tmp / "out"
    (home / ".aws").mkdir(parents=True)
    out.mkdir()
    (home / ".aws" / "config").write_text(
        f"[default]\ncredential_process = {process.replace('{out}', str(out))}\n")
    _give(home, ident)
    _give(out, ident)
    return {"HOME": str(home), "PATH": "/usr/bin:/bin", "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
            "AWS_MAX_ATTEMPTS": "1"}, out



def _ls_fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def _environ() -> dict[str, str]:
    return dict(os.environ)


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_hand_runs_as_the_jobs_user_so_the_kernel_refuses_roots_files(
        open_tmp: Path) -> None:
    """A file only root may read is refused to the hand by the kernel (EACCES)."""
    ident = _user()
    secret = open_tmp / "secret"
    secret.write_text("root only")
    secret.chmod(0o600)
    hand = Hand("t", ident)
    try:
        assert hand.call(os.getuid, timeout=30) == ident.uid
        assert sorted(hand.call(os.getgroups, timeout=30)) == sorted(ident.groups)
        with pytest.raises(OpFailed) as e:
            hand.call(Path.read_text, secret, timeout=30)
        assert e.value.errno == 13
    finally:
        hand.close()


def test_the_hand_holds_none_of_roots_descriptors_or_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Root's open files and its secrets never reach the job user's process."""
    ident = _user()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "root's")
    held = os.open("/etc/hostname", os.O_RDONLY)
    hand = Hand("t", ident, env={"AWS_PROFILE": "job's"})
    try:
        fds = hand.call(_ls_fds, timeout=30)
        env = hand.call(_environ, timeout=30)
    finally:
        hand.close()
        os.close(held)
    # stdin, stdout, stderr, its socket and the listing's own descriptor: nothing else.
    assert len(fds) <= 5, fds
    assert "AWS_SECRET_ACCESS_KEY" not in env and env["AWS_PROFILE"] == "job's"


def _comm() -> str:
    return Path("/proc/self/comm").read_text().strip()


def test_a_hand_is_named_as_one_in_ps_not_as_another_daemon() -> None:
    """Its argv is the daemon's (a fork): its name (comm, what ps and top show
    and a test or an operator can tell it by) says what it is."""
    hand = Hand("t", _user())
    try:
        assert hand.call(_comm, timeout=30) == "trainwatch-hand"
    finally:
        hand.close()


def test_a_read_that_blocks_is_killed_at_its_deadline_and_the_hand_cools_down(
        open_tmp: Path) -> None:
    """A FIFO opened for reading blocks forever: the call ends at its deadline, the
    hand is killed, and until the cooldown ends calls fail at once."""
    ident = _user()
    fifo = open_tmp / "fifo"
    os.mkfifo(fifo, 0o666)
    hand = Hand("t", ident, cooldown=2.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(HandTimeout):
            hand.call(Path.read_bytes, fifo, timeout=1.0)
        assert time.monotonic() - t0 < 20
        t1 = time.monotonic()
        with pytest.raises(HandDown):
            hand.call(os.getuid, timeout=30)
        assert time.monotonic() - t1 < 1.0
        deadline = time.monotonic() + 30
        while True:
            try:
                assert hand.call(os.getuid, timeout=30) == ident.uid
                break
            except HandDown:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert hand.counts["timeouts"] == 1 and hand.counts["spawns"] == 2
    finally:
        hand.close()


def _big(n: int) -> str:
    return "x" * n


def test_a_reply_past_its_cap_is_refused_and_never_read_whole() -> None:
    """The hand's reply is the job user's bytes: one past the cap is refused."""
    hand = Hand("t", None)
    try:
        assert hand.call(_big, 10, timeout=30) == "x" * 10
        with pytest.raises(HandDown):
            hand.call(_big, 1 << 20, timeout=30, max_reply=1 << 16)
    finally:
        hand.close()


def _megatron(root: Path) -> None:
    it = root / "iter_0000010"
    it.mkdir(parents=True)
    (it / "metadata.json").write_text("{}")
    os.mkfifo(root / megatron.TRACKER, 0o644)


def _blocking_tracker(root: Path | str) -> int | None:
    """A tracker read that blocks, as the old reader's did on a link to /proc/kmsg:
    a plain open() of a FIFO waits for a writer that never comes."""
    with open(os.path.join(root, megatron.TRACKER), "rb") as f:
        return int(f.read())


def test_a_tracker_read_that_blocks_costs_that_job_its_verdict_not_the_caller(
        open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's tracker read blocks forever in one job's hand: its catalog answers at
    the hand's deadline with no checkpoint good, at once while the hand cools down,
    and another job's catalog is untouched."""
    ident = _user()
    monkeypatch.setattr(megatron, "tracker", _blocking_tracker)  # inherited by the fork
    bad, good = open_tmp / "bad", open_tmp / "good"
    _megatron(bad)
    good.mkdir()
    (good / "step_5").write_bytes(b"w")
    _give(bad, ident)
    _give(good, ident)
    hands = [Hand("bad", ident), Hand("good", ident)]
    try:
        cat_bad = Catalog(Checkpoints(dir=str(bad), layout="megatron"), open_tmp / "b.json",
                          hand=hands[0])
        cat_bad.disk.timeout = 2.0  # type: ignore[union-attr]
        cat_good = Catalog(Checkpoints(dir=str(good)), open_tmp / "g.json", hand=hands[1])
        cat_good.report(5, str(good / "step_5"))
        t0 = time.monotonic()
        assert cat_bad.last_good() is None
        assert time.monotonic() - t0 < 30
        assert hands[0].counts["timeouts"] == 1
        t1 = time.monotonic()
        assert cat_bad.last_good() is None  # cooling down: at once
        assert time.monotonic() - t1 < 1.0
        e = cat_good.last_good()
        assert e is not None and e.step == 5
    finally:
        for h in hands:
            h.close()


def test_a_tracker_that_links_to_proc_kmsg_is_not_read(open_tmp: Path) -> None:
    """The second line, in any process: a tracker that is a link (to /proc/kmsg, whose
    read blocks and consumes the kernel's messages) is never opened."""
    root = open_tmp / "ckpt"
    root.mkdir()
    (root / megatron.TRACKER).symlink_to("/proc/kmsg")
    got: list[int | None] = []
    t = threading.Thread(target=lambda: got.append(megatron.tracker(root)), daemon=True)
    t.start()
    t.join(30)
    assert got == [None]


def test_a_checkpoint_that_is_a_symlink_is_not_hashed_through_it(open_tmp: Path) -> None:
    """The verifier, as the job's user, refuses a top-level symlink to root's file:
    no manifest holds the size or digest of a file outside the folder."""
    ident = _user()
    ckpt = open_tmp / "ckpt"
    ckpt.mkdir()
    target = open_tmp / "root-only"
    target.write_bytes(b"secret" * 100)
    target.chmod(0o644)  # readable even: a link is still not the job's checkpoint
    (ckpt / "step_1").symlink_to(target)
    _give(ckpt, ident)
    hand = Hand("t", ident)
    v = Verifier(Store(open_tmp / "manifests"), hand=hand)
    try:
        ok, why = v.verify(1, str(ckpt / "step_1"), timeout=30)
    finally:
        v.close()
        hand.close()
    assert ok is False, why
    assert not (open_tmp / "manifests" / "1.json").exists()


def test_the_stores_collection_through_a_symlinked_store_deletes_nothing_of_roots(
        open_tmp: Path) -> None:
    """``blobs`` swapped for a link to root's folder: collected as the job's user,
    root's single-link files all stay."""
    ident = _user()
    ckpt = open_tmp / "ckpt"
    ckpt.mkdir()
    roots = open_tmp / "roots"
    (roots / "ab").mkdir(parents=True)
    for i in range(3):
        (roots / "ab" / f"ab{i:062d}").write_bytes(b"root's")
    (ckpt / blobs.STORE).symlink_to(roots)
    _give(ckpt, ident)
    hand = Hand("t", ident)
    try:
        with contextlib.suppress(OpFailed):  # refused outright is as good
            hand.call(blobs.collect, str(ckpt), timeout=60)
    finally:
        hand.close()
    assert len(list((roots / "ab").iterdir())) == 3


def test_a_folder_of_many_names_is_listed_in_the_hand_bounded_and_root_does_not_grow(
        open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """120,000 planted step_N files: the hand reads at most MAX_NAMES of them and keeps
    the newest MAX_CHECKPOINTS, and root's memory stays where it was."""
    ident = _user()
    ckpt = open_tmp / "ckpt"
    ckpt.mkdir()
    for i in range(120_000):
        (ckpt / f"step_{i}").touch()
    _give(ckpt, ident)
    monkeypatch.setattr(ondisk, "MAX_NAMES", 100_000)
    hand = Hand("t", ident)
    try:
        spec = dataclasses.replace(Checkpoints(dir=str(ckpt)), quiet_for=None)
        cat = Catalog(spec, open_tmp / "c.json", hand=hand)
        cat.disk.timeout = 120.0  # type: ignore[union-attr]
        before = _rss()
        entries = cat.entries()
        grew = _rss() - before
    finally:
        hand.close()
    assert 0 < len(entries) <= handdisk.MAX_CHECKPOINTS
    # The mirror of the 2,000 newest checkpoints is ~1.5 MiB of root's (its reply
    # parsed); what the module imported before moves that by a MiB either way. The
    # 120,000 names themselves, mirrored, would be ~90 MiB.
    assert grew < 16 << 20, f"root grew {grew >> 20} MiB"


def test_a_user_that_cannot_be_taken_on_is_never_run_as_root(open_tmp: Path) -> None:
    """Dropping to the job's user failing (here: not root, asked for another uid) ends
    the hand; nothing runs with the caller's rights instead."""
    if os.geteuid() == 0:
        ident = _user()
        nobody = pwd.getpwnam("nobody")
        # As nobody, asked to become the test user: refused, never runs as nobody.
        outer = Hand("outer", Identity(nobody.pw_uid, nobody.pw_gid, (), "nobody", None))
        try:
            got = outer.call(_become_other, ident, timeout=60)
        finally:
            outer.close()
        assert got == "refused", got
    else:
        pytest.fail("needs root")  # need_root fails in CI; here root is given


def _become_other(ident: Identity) -> str:
    inner = Hand("inner", ident)
    try:
        inner.call(os.getuid, timeout=30)
    except HandDown:
        return "refused"
    finally:
        inner.close()
    return "ran"


def _sparse_dumps(open_tmp: Path, ident: Identity, size: int, data: int) -> tuple[
        list[str], dict[str, Any], Path, Path]:
    """Eight sparse dumps of ``size`` bytes with ``data`` bytes written 1 MiB in, read
    as the job's user and written into root's folder: (copied, the hand's reply, the
    job's folder, root's)."""
    fr = open_tmp / "fr"
    fr.mkdir()
    for i in range(8):
        with open(fr / f"nccl_trace_rank_{i}", "wb") as f:
            f.truncate(size)
            f.seek(1 << 20)
            f.write(os.urandom(data))
    _give(fr, ident)
    dest = open_tmp / "state" / "flight-recorder"
    hand = Hand("t", ident)
    try:
        got, blobs = hand.call_blobs(flightrecorder.dumps, str(fr), [], 1.0, timeout=120,
                                     max_reply=flightrecorder.MAX_TOTAL + (1 << 20))
    finally:
        hand.close()
    copied, _ = flightrecorder.write(dest, got, blobs)
    return copied, got, fr, dest


def test_sparse_dumps_are_copied_as_their_data_and_bounded_per_incident(open_tmp: Path) -> None:
    """Eight sparse 12 MiB dump files with 1 MiB of data each: read as the job's user,
    written into root's folder as sparse files (1 MiB of disk each), at most 64 MiB of
    apparent size in all (five of them), and the limit hit is said for the others."""
    copied, got, fr, dest = _sparse_dumps(open_tmp, _user(), 12 << 20, 1 << 20)
    assert len(copied) == 5 and got["limited"] == 3, got["errors"]
    assert all("holes count" in e for e in got["errors"]), got["errors"]
    assert sorted(p.name for p in dest.iterdir()) == sorted(copied)
    assert all(p.stat().st_size == 12 << 20 and p.stat().st_blocks * 512 <= 2 << 20
               for p in dest.iterdir())
    assert (dest / copied[0]).read_bytes() == (fr / copied[0]).read_bytes()


def test_sparse_dumps_of_a_huge_apparent_size_are_not_copied(open_tmp: Path) -> None:
    """Eight sparse 255 MiB dumps with 9 MiB of data each: copied sparse, they were 7 MiB
    of disk but 1.8 GiB of apparent size, which a backup that does not keep holes writes
    out in full. Not one is copied now, and each is said."""
    copied, got, _, dest = _sparse_dumps(open_tmp, _user(), 255 << 20, 9 << 20)
    assert copied == [] and got["limited"] == 8, got
    assert not dest.exists() or not any(dest.iterdir())


def _leave() -> None:
    os._exit(0)


def test_a_catalog_whose_hand_died_starts_a_new_one_from_a_full_listing(open_tmp: Path) -> None:
    """The hand exits between two refreshes (as one that grew past its bound does): the
    next refresh forks a new one, which lists the folder anew; nothing is lost or said."""
    ident = _user()
    ckpt = open_tmp / "ckpt"
    ckpt.mkdir()
    (ckpt / "step_5").write_bytes(b"w")
    _give(ckpt, ident)
    hand = Hand("t", ident)
    try:
        cat = Catalog(Checkpoints(dir=str(ckpt)), open_tmp / "c.json", hand=hand)
        cat.report(5, str(ckpt / "step_5"))
        assert [e.step for e in cat.entries()] == [5]
        with contextlib.suppress(HandDown):
            hand.call(_leave, timeout=10)
        (ckpt / "step_9").write_bytes(b"w")
        os.chown(ckpt / "step_9", ident.uid, ident.gid)
        cat.report(9, str(ckpt / "step_9"))
        assert [e.step for e in cat.entries()] == [5, 9]
        assert cat.disk.unanswered == 0  # type: ignore[union-attr]
        assert hand.counts["spawns"] == 2
    finally:
        hand.close()


def test_roots_mirror_of_a_listing_holds_each_path_and_reason_once(open_tmp: Path) -> None:
    """Root's mirror of the hand's listing shares the listing's path and int in each
    verdict, and one string per reason: fewer small objects for a large listing to
    leave behind in the interpreter's arenas once it is forgotten (issue 21)."""
    ident = _user()
    ckpt = open_tmp / "ckpt"
    ckpt.mkdir()
    for i in range(40):
        (ckpt / f"step_{1000 + i}").write_bytes(b"w")
    _give(ckpt, ident)
    hand = Hand("t", ident)
    try:
        cat = Catalog(Checkpoints(dir=str(ckpt)), open_tmp / "c.json", hand=hand)
        assert len(cat.entries()) == 40
        disk = cat.disk
        assert isinstance(disk, HandDisk) and len(disk.verdicts) == 40
        assert all(v[0] is disk.paths[s] for s, v in disk.verdicts.items())
        keys = {id(s) for s in disk.paths}
        assert all(id(s) in keys for s in disk.verdicts)
        whys = [v[2] for v in disk.verdicts.values()]
        assert len({id(w) for w in whys}) == len(set(whys))
    finally:
        hand.close()


def test_listing_a_remote_for_a_rollback_runs_the_jobs_credential_process_as_its_user(
        open_tmp: Path) -> None:
    """The job's HOME names a credential_process in .aws/config: listing the remote's
    snapshots (a rollback to a step only it holds) runs it as the job's user, never
    as root."""
    try:
        import s3fs  # noqa: F401  (the listing needs it)
    except ImportError:
        missing("s3fs is not installed (the snapshot extra)")
    ident = _user()
    creds = '{"Version": 1, "AccessKeyId": "a", "SecretAccessKey": "b"}'
    env, out = _credential_home(open_tmp, ident, "/bin/sh -c \"id -u > {out}/uid; echo '"
                                + creds + "'\"")
    with pytest.raises(ValueError):  # nothing listens there
        pull.steps("s3://bucket/run", timeout=60, env=env, ident=ident)
    assert (out / "uid").read_text().strip() == str(ident.uid)


class _Catalog:
    def __init__(self, folder: str) -> None:
        self.spec = Checkpoints(dir=folder)

    def last_good(self, before_step: int | None = None, fresh: bool = True) -> None:
        return None


class _Runner:
    """What pull.begin reads of a job's runner."""

    def __init__(self, job: Job) -> None:
        self.job, self.die_with_parent = job, False
        self.catalog = _Catalog(str(job.checkpoints.dir))


def test_a_pull_for_a_user_that_cannot_be_resolved_fails_and_never_runs_as_root(
        open_tmp: Path) -> None:
    """The job's user is gone (a directory service down): its pull fails with one line
    naming the user; no hand runs, so nothing is written in its folder as root."""
    need_root("a pull that would otherwise run as root")
    folder = open_tmp / "ckpt"
    job = Job(name="gone", command=("true",), user="twnosuchuser",
              checkpoints=Checkpoints(dir=str(folder), remote=f"file://{open_tmp}/remote"))
    r = _Runner(job)
    pull.begin(r, None, "test")  # type: ignore[arg-type]
    p = pull._pulls.pop(r)  # type: ignore[call-overload]
    assert p.thread is not None
    p.thread.join(60)
    assert p.error is not None and "twnosuchuser" in p.error, p.error
    assert not folder.exists()  # the pull's hand makes the folder: none ran


def test_a_reload_that_gives_a_root_job_a_user_moves_its_hands_to_that_user(
        ws: Workspace) -> None:
    """A job run as root is given a user by a reload: its hands, which act in its folders,
    run as that user from their next call on, never as root any more."""
    ident = _user()
    doc: dict[str, Any] = {
        "state_dir": str(ws.state), "run_dir": str(ws.root / "run"), "metrics": {"port": 0},
        "gpu": {"backend": "off"}, "jobs": [{"name": "j", "command": ["/bin/true"]}]}
    sup = Supervisor(from_mapping(doc))
    try:
        r = sup.runners[0]
        assert r.hands.quick.call(os.getuid, timeout=30) == 0
        doc["jobs"][0]["user"] = USER
        new = from_mapping(doc)
        r.reconfigure(new, new.jobs[0])
        for h in r.hands.all():
            assert h.call(os.getuid, timeout=30) == ident.uid
    finally:
        sup.close()


def test_hands_whose_new_user_cannot_be_resolved_run_nothing_until_it_can() -> None:
    """A reload names a user that cannot be resolved: the job's hands refuse every call
    (never going on as the former user, root here), and run again once it resolves."""
    hands = jobhands.for_job("j", None)
    try:
        pid = hands.quick.call(os.getpid, timeout=30)
        hands.follow("j", "twnosuchuser", None)
        with pytest.raises(HandDown):
            hands.quick.call(os.getpid, timeout=30)
        assert not os.path.exists(f"/proc/{pid}")  # killed and reaped
        hands.follow("j", None, None)
        assert hands.quick.call(os.getuid, timeout=30) == os.getuid()
    finally:
        hands.close()


def test_a_daemons_checkpoint_listing_reads_sizes_as_the_jobs_user(open_tmp: Path) -> None:
    """``trainwatch checkpoints`` on a daemon: sizes and times are read in the job's hand,
    as its user: a folder inside the checkpoint that only root may enter is not walked."""
    ident = _user()
    ckpt = open_tmp / "ckpt"
    step = ckpt / "step_5"
    (step / "private").mkdir(parents=True)
    (step / "weights").write_bytes(b"w" * 1000)
    (step / "private" / "big").write_bytes(b"x" * 100_000)
    _give(ckpt, ident)
    os.chown(step / "private", 0, 0)
    (step / "private").chmod(0o700)
    hand = Hand("t", ident)
    try:
        cat = Catalog(Checkpoints(dir=str(ckpt)), open_tmp / "c.json", hand=hand)
        assert cat.report(5, str(step))
        got = checkpointlist.listing("j", cat, hand=hand)
    finally:
        hand.close()
    [row] = got["checkpoints"]
    assert row["size"] == 1000 and isinstance(row["time"], float), row


class _Hands:
    def __init__(self, hand: Hand) -> None:
        self.quick = hand


class _Folder:
    """What prune.free_space reads of a job's runner."""

    def __init__(self, folder: str, hand: Hand) -> None:
        self.catalog, self.hands = _Catalog(folder), _Hands(hand)


def test_free_space_of_a_jobs_folder_is_read_as_its_user(open_tmp: Path) -> None:
    """The free space retention and ``retention`` report is read in the job's hand: a
    folder under one only root may enter is unknown, not root's statvfs of it."""
    ident = _user()
    hidden = open_tmp / "private"
    (hidden / "ckpt").mkdir(parents=True)
    hidden.chmod(0o700)
    mine = open_tmp / "mine"
    mine.mkdir()
    _give(mine, ident)
    hand = Hand("t", ident)
    try:
        assert prune.free_space(_Folder(str(hidden / "ckpt"), hand)) is None  # type: ignore[arg-type]
        assert isinstance(prune.free_space(_Folder(str(mine), hand)), int)  # type: ignore[arg-type]
    finally:
        hand.close()


def test_the_auto_layout_reads_a_folder_of_many_names_only_so_far(
        open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``auto`` (the default), 3,000 planted names with a bound of 1,000: the
    hand's listing (detection and numbered names) reads at most 1,000 and says so, as
    generic's does (800,000 names took 3.6 s of the loop at every listing)."""
    ident = _user()
    ckpt = open_tmp / "ckpt"
    ckpt.mkdir()
    for i in range(3000):
        (ckpt / f"ckpt-{i}.pt").touch()
    _give(ckpt, ident)
    monkeypatch.setattr(ondisk, "MAX_NAMES", 1000)
    monkeypatch.setattr(layouts_base, "MAX_ENTRIES", 1000)
    hand = Hand("t", ident)
    try:
        cat = Catalog(Checkpoints(dir=str(ckpt), layout="auto"), open_tmp / "c.json",
                      hand=hand)
        entries = cat.entries()
    finally:
        hand.close()
    assert 0 < len(entries) <= 1000
    assert cat.disk.names_cut == 1  # type: ignore[union-attr]


_DAEMON = """
import os, sys, time
from trainwatch.privsep.credentials import resolve
from trainwatch.privsep.hand import Hand
hand = Hand("t", resolve(sys.argv[1], None))
print(hand.call(os.getpid, timeout=30), flush=True)
hand.call(time.sleep, 300, timeout=600)
"""


def test_a_hand_in_the_middle_of_a_call_ends_with_a_killed_daemon() -> None:
    """The daemon is SIGKILLed while its hand runs a long call (a pull, a hash): the hand
    ends at once, never going on for hours for a daemon that is gone."""
    _user()
    p = subprocess.Popen([sys.executable, "-c", _DAEMON, USER], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout is not None
        pid = int(p.stdout.readline())
        time.sleep(0.5)  # into the long call
        assert not pid_gone(pid)
    finally:
        p.kill()
        p.wait(30)
    wait_for(lambda: pid_gone(pid), timeout=30, what="the hand ended with its daemon")


def test_closing_a_hand_ends_its_call_in_flight_instead_of_waiting_for_it() -> None:
    """A long call runs in another thread (a hash, a capture): close returns at once,
    the call raises HandDown, and the hand is gone."""
    hand = Hand("t", None)
    pid = hand.call(os.getpid, timeout=30)
    raised: list[BaseException] = []

    def long_call() -> None:
        try:
            hand.call(time.sleep, 300, timeout=600)
        except BaseException as e:
            raised.append(e)

    t = threading.Thread(target=long_call, daemon=True)
    t.start()
    time.sleep(0.5)  # into the call
    closer = threading.Thread(target=hand.close, daemon=True)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "close waited for the call"
    t.join(30)
    assert raised and isinstance(raised[0], HandDown), raised
    assert not os.path.exists(f"/proc/{pid}")


def _writer(fifo: Path) -> int | None:
    """The FIFO's write end, once a reader has it open (ENXIO before: no side effect)."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno != errno.ENXIO:
            raise
        return None


def test_a_pull_cancelled_mid_way_ends_its_hand(open_tmp: Path) -> None:
    """The job of a pull blocked on the remote is removed: cancel ends the pull's hand,
    and the pull fails at once instead of going on for hours."""
    ident = _user()
    remote = open_tmp / "remote"
    remote.mkdir()
    fifo = remote / "snapshot-5.json"
    os.mkfifo(fifo, 0o644)  # a read that waits for a writer
    (open_tmp / "ckpt").mkdir()
    _give(open_tmp / "ckpt", ident)
    p = pull.Pull(f"file://{remote}", str(open_tmp / "ckpt"), None, "test", ident, {})
    p.start()
    wait_for(lambda: p.hand is not None and p.hand.counts["spawns"] == 1, timeout=30,
             what="the pull's hand")
    assert p.hand is not None
    pid = p.hand._pid
    # Mid-way: the hand has the manifest (the FIFO) open, not still starting (its imports
    # take seconds on a loaded host). Our write end, held open, leaves its read waiting.
    held: list[int] = []

    def opened() -> bool:
        fd = _writer(fifo)
        if fd is not None:
            held.append(fd)
        return fd is not None or p.done

    wait_for(opened, timeout=60, what="the pull to open the manifest")
    try:
        assert held and not p.done, p.error
        p.cancel()
        assert p.thread is not None
        p.thread.join(30)
    finally:
        for fd in held:
            os.close(fd)
    assert p.done and p.error is not None, p.error
    assert pid is not None and pid_gone(pid), f"the pull's hand {pid} is still alive"


class _Job:
    name = "j"


class _Rings:
    """What ringfolder.remove reads of a job's runner."""

    def __init__(self, hand: Hand) -> None:
        self.job, self.hands = _Job(), jobhands.JobHands(hand, hand, hand, hand)


def test_an_ended_attempts_ring_folder_is_emptied_as_the_jobs_user(open_tmp: Path) -> None:
    """The ring folder of an ended attempt is emptied in the job's hand (20,000 planted
    names and a link to root's file go; a folder of root's inside stays, and the ring
    folder with it), never removed whole with root's rights."""
    ident = _user()
    rings = open_tmp / "j.attempt-0.rings"
    rings.mkdir()
    for i in range(20_000):
        (rings / f"rank-{i}-1").touch()
    roots = open_tmp / "roots"
    roots.write_text("root's")
    (rings / "link").symlink_to(roots)
    _give(rings, ident)
    (rings / "theirs").mkdir()  # root's, inside: not the job's user's to empty
    (rings / "theirs" / "f").write_text("x")
    hand = Hand("t", ident)
    try:
        t = ringfolder.remove(_Rings(hand), str(rings))  # type: ignore[arg-type]
        t.join(120)
        assert not t.is_alive()
    finally:
        hand.close()
    assert sorted(os.listdir(rings)) == ["theirs"]
    assert (rings / "theirs" / "f").exists() and roots.read_text() == "root's"
    hand2 = Hand("t", ident)
    try:
        shutil.rmtree(rings / "theirs")
        t = ringfolder.remove(_Rings(hand2), str(rings))  # type: ignore[arg-type]
        t.join(120)
    finally:
        hand2.close()
    assert not rings.exists()  # emptied, then removed by root from its own folder


_LOGGING_DAEMON = """
import logging, sys
from trainwatch.cli import _setup_logging
from trainwatch.privsep.hand import Hand
from trainwatch.actions.passthrough import flush_all
_setup_logging()
logging.getLogger("trainwatch").warning("root's own line")  # its writer thread runs
hand = Hand("t", None)
hand.call(logging.getLogger("trainwatch").warning, "a line from the hand", timeout=30)
hand.close()
flush_all(10)
"""


def test_a_line_the_hand_logs_reaches_the_daemons_stderr() -> None:
    """The daemon logs through a writer thread: a line logged in its hand (a forked
    process without that thread) still reaches stderr, never queued forever."""
    p = subprocess.run([sys.executable, "-c", _LOGGING_DAEMON], capture_output=True,
                       text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    assert "root's own line" in p.stderr
    assert "a line from the hand" in p.stderr, p.stderr


class _Finalized:
    """Garbage of root's in a cycle, whose finalizer says which process ran it."""

    def __init__(self, path: Path) -> None:
        self.path, self.me = path, self

    def __del__(self) -> None:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def test_roots_garbage_is_never_finalized_in_a_hand(open_tmp: Path) -> None:
    """A cycle of root's garbage not yet collected at the fork: the hand's collections
    never run its finalizer (one closing a socket would close a descriptor number of
    the hand's own); root's own collection does, once."""
    said = open_tmp / "finalized"
    gc.disable()
    try:
        _Finalized(said)  # unreachable from here on, left to the cycle collector
        hand = Hand("t", None)
        try:
            pid = hand.call(os.getpid, timeout=30)
            hand.call(gc.collect, timeout=30)
        finally:
            hand.close()
    finally:
        gc.enable()
    gc.collect()
    assert said.read_text().split() == [str(os.getpid())], (pid, said.read_text())


def test_a_catalog_whose_hand_stays_down_keeps_one_change_per_step_and_catches_up(
        open_tmp: Path) -> None:
    """Reports of the same few steps while the hand gives no answer: what waits for it is
    at most a drop, an add and a rejudge per step (not one per report), and once it
    answers the catalog holds what a fresh one holds."""
    ckpt = open_tmp / "ckpt"
    ckpt.mkdir()
    for s in (1, 2, 3):
        (ckpt / f"step_{s}").write_bytes(b"w")
    hand = Hand("t", None)
    try:
        spec = dataclasses.replace(Checkpoints(dir=str(ckpt)), quiet_for=None)
        cat = Catalog(spec, open_tmp / "c.json", hand=hand)
        hand.refuse("down for the test")
        cat.mark_bad(2, "changed since its manifest")
        for _ in range(300):
            for s in (1, 2, 3):
                cat.report(s, str(ckpt / f"step_{s}"))
            cat.disk.rejudge(2)
            cat.entries()  # a refresh that gets no answer
        waiting = [op for ops in cat.disk._changes.values() for op in ops]  # type: ignore[union-attr]
        assert len(waiting) <= 4, waiting
        hand.rebind(None)
        got = [(e.step, e.good, e.bad) for e in cat.entries()]
        cat.flush(force=True)
    finally:
        hand.close()
    fresh = Catalog(spec, open_tmp / "c.json")
    assert got == [(e.step, e.good, e.bad) for e in fresh.entries()] and len(got) == 3


def _slow_removal(grave: str, shown: str | None = None) -> str | None:
    time.sleep(300)  # a folder of a million files on a network file system
    return None


def test_retention_waits_only_for_a_rename_and_removes_the_folder_in_the_background(
        ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention deletes a checkpoint folder whose removal takes minutes: the loop's
    pass returns once it is renamed to its tombstone (gone under its name, forgotten,
    recorded), the removal goes on in a thread, and the next pass waits for it."""
    ckpt = ws.root / "ckpt"
    for s in (1, 2):
        (ckpt / f"step_{s}").mkdir(parents=True)
        (ckpt / f"step_{s}" / "w").write_bytes(b"w")
    doc: dict[str, Any] = {
        "state_dir": str(ws.state), "run_dir": str(ws.root / "run"), "metrics": {"port": 0},
        "gpu": {"backend": "off"},
        "jobs": [{"name": "j", "command": ["/bin/true"],
                  "checkpoints": {"dir": str(ckpt), "keep": {"last": 1}}}]}
    monkeypatch.setattr(retention, "remove_grave", _slow_removal)  # inherited by the hand
    monkeypatch.setattr(background, "CLOSE_WAIT", 0.5)
    sup = Supervisor(from_mapping(doc))
    try:
        r = sup.runners[0]
        for s in (1, 2):
            assert r.catalog.report(s, str(ckpt / f"step_{s}"))
        r.checkpoints = r.catalog.summary()
        t0 = time.monotonic()
        prune.after_refresh(r)
        assert time.monotonic() - t0 < 20  # not the removal's 300 s (nor a 30 s deadline)
        assert sorted(os.listdir(ckpt)) == [".step_1.trainwatch-deleting", "step_2"]
        assert [e.step for e in r.catalog.known()] == [2]
        assert background.busy(r, "trainwatch-retention")
        (ckpt / "step_3").mkdir()
        (ckpt / "step_3" / "w").write_bytes(b"w")
        assert r.catalog.report(3, str(ckpt / "step_3"))
        r.checkpoints = r.catalog.summary()
        prune.after_refresh(r)  # waits for the last pass's removal: step_2 stays
        assert (ckpt / "step_2").exists()
    finally:
        sup.close()


def test_a_dump_reply_that_reuses_its_data_is_written_within_roots_own_bound(
        open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand's reply is the job user's: eight dumps that all point at the same
    512 KiB of data are written only up to root's per-incident bound, each byte of
    data once, whatever the reply claims."""
    monkeypatch.setattr(flightrecorder, "MAX_TOTAL", 1 << 20)
    blob = os.urandom(512 << 10)
    got = {"files": [{"name": f"nccl_trace_rank_{i}", "size": 1 << 20,
                      "segments": [[0, len(blob), 0], [len(blob), len(blob), 0]]}
                     for i in range(8)]}
    dest = open_tmp / "flight-recorder"
    copied, errors = flightrecorder.write(dest, got, [blob])
    data = sum(p.stat().st_blocks * 512 for p in dest.iterdir())
    assert data <= (1 << 20) + (64 << 10), data
    assert len(copied) <= 1 and errors and sorted(os.listdir(dest)) == sorted(copied)


def test_an_ended_attempts_flight_recorder_folder_goes_with_it(ws: Workspace) -> None:
    """With the flight recorder on, each attempt's dump folder in run_dir (the job's
    user's, on a tmpfs) is emptied and removed when the attempt ends, as its ring
    folder is, rather than left behind, one per attempt."""
    cfg = ws.config({"command": ["/bin/sh", "-c", 'echo dump > "$TORCH_FR_DUMP_TEMP_FILE"0'],
                     "evidence": {"flight_recorder": True}})
    code, out = finish(ws.run(cfg))
    assert code == 0, out
    left = sorted(os.listdir(ws.root / "run" / "jobs"))
    assert not [n for n in left if n.endswith((".fr", ".rings"))], left


def _dumpable() -> int:
    return int(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))  # PR_GET_DUMPABLE


def test_a_hand_is_never_dumpable(open_tmp: Path) -> None:
    """Whatever fs.suid_dumpable says (1 keeps a process that changed its uid dumpable):
    the hand is not, so the job's user can neither ptrace it nor read its
    /proc/<pid>/environ (root's environment at exec) or /proc/<pid>/mem."""
    ident = _user()
    for who in (ident, None):
        hand = Hand("t", who)
        try:
            assert hand.call(_dumpable, timeout=30) == 0, who
        finally:
            hand.close()


def test_a_ring_of_a_million_slots_kept_full_is_read_only_so_far(tmp_path: Path) -> None:
    """A ring is the job's file: one of 2^16 slots, every slot written, is read up to
    the client's ring size (4,096 records) per read, the rest counted as lapped, never
    65,535 records parsed in the daemon's loop (2^20 slots took it 1.2 s a read)."""
    w = ring.RingWriter(str(tmp_path), 0, slots=1 << 16)
    assert w.ok, w.error
    with ringreader.RingReader(w.path, skip_existing=True) as rd:
        for i in range(1 << 16):
            w.write(i, 1.0, 1.0)
        got = rd.read()
        assert len(got) <= ring.SLOTS and rd.lapped >= (1 << 16) - ring.SLOTS - 1
        assert got[-1].step == (1 << 16) - 1  # the newest are the ones read
    w.close()


def test_one_jobs_rings_are_read_within_a_budget_per_turn(tmp_path: Path) -> None:
    """40 full rings of one job: a turn reads at most RING_BUDGET records from them,
    and the rings a turn left are read at the next ones: every ring is read."""
    beats: list[Any] = []
    now = [0.0]
    intake = Intake("j", str(tmp_path / "s.sock"), selectors.DefaultSelector(),
                    lambda pid, uid: True, lambda: now[0], None,
                    lambda b: beats.extend(b), lambda r: None)
    rings = tmp_path / "rings"
    rings.mkdir()
    writers = [ring.RingWriter(str(rings), rank) for rank in range(40)]
    try:
        intake.new_attempt(str(rings))
        intake.drain()  # opens them all, nothing written yet
        for w in writers:
            for i in range(ring.SLOTS - 1):
                w.write(i, 1.0, 1.0)
        intake.drain()
        assert 0 < len(beats) <= RING_BUDGET, len(beats)
        for _ in range(3):
            now[0] += RING_POLL
            intake.drain()
        assert {b.rank for b in beats} == set(range(40))
    finally:
        for w in writers:
            w.close()
        intake.close()


def test_a_hand_stuck_before_it_serves_ends_at_once_not_at_its_calls_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new hand that blocks while it becomes the job's user (an import whose lock a
    thread of root's held at the fork) ends by its own alarm: the call fails in
    seconds, not at its deadline (an hour for a hash)."""
    (tmp_path / "twblocks.py").write_text("import time\ntime.sleep(3600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(child, "BECOME_MAX", 2)
    hand = Hand("t", None, preload=("twblocks",))
    try:
        t0 = time.monotonic()
        with pytest.raises(HandDown):
            hand.call(os.getpid, timeout=120)
        assert time.monotonic() - t0 < 60
    finally:
        hand.close()


def test_retention_under_min_free_reads_sizes_in_one_bounded_call(
        ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below min_free_bytes, 50 checkpoints' sizes are read in one call of the job's
    hand within a budget (one call per checkpoint, each with a 30 s deadline, held the
    loop as long as the folders took); sizes it did not reach delete nothing."""
    ckpt = ws.root / "ckpt"
    for s in range(50):
        (ckpt / f"step_{s}").mkdir(parents=True)
        (ckpt / f"step_{s}" / "w").write_bytes(b"w")
    doc: dict[str, Any] = {
        "state_dir": str(ws.state), "run_dir": str(ws.root / "run"), "metrics": {"port": 0},
        "gpu": {"backend": "off"},
        "jobs": [{"name": "j", "command": ["/bin/true"],
                  "checkpoints": {"dir": str(ckpt), "keep": {"min_free_bytes": 1 << 62}}}]}
    sup = Supervisor(from_mapping(doc))
    try:
        r = sup.runners[0]
        for s in range(50):
            assert r.catalog.report(s, str(ckpt / f"step_{s}"))
        calls = r.hands.quick.counts["calls"]
        p = prune.plan(r)
        assert r.hands.quick.counts["calls"] - calls <= 3  # the listing, free space, sizes
        assert len(p.delete) == 49 and p.freed_bytes == 49
        monkeypatch.setattr(prune, "SIZES_BUDGET", 0.0)
        p = prune.plan(r)
        assert p.delete == () and "size not known" in dict(p.kept)[0]
    finally:
        sup.close()


def test_a_snapshot_manifest_that_is_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    """snapshot.json swapped for a FIFO after its snapshot was judged good: reading the
    Snapshotter's keep from it (retention, in the loop's hand) is refused at once, never
    an open that waits for a writer until the hand's deadline."""
    folder = tmp_path / "snapshot-5"
    folder.mkdir()
    os.mkfifo(folder / snapshot_format.MANIFEST)
    said: list[str] = []

    def read() -> None:
        try:
            snapshot_format.read(folder)
        except ValueError as e:
            said.append(str(e))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and said and "not a regular file" in said[0], said


def test_a_numbered_checkpoint_that_is_a_fifo_is_judged_at_once(tmp_path: Path) -> None:
    """Under auto, ckpt_5.pt planted as a FIFO: judging whether the file is whole
    returns at once (it says nothing of itself), never an open that waits for a writer
    until the job's listing passes its deadline (the loop waits that long)."""
    os.mkfifo(tmp_path / "ckpt_5.pt")
    said: list[object] = []
    t = threading.Thread(target=lambda: said.append(numbered._structure(
        str(tmp_path / "ckpt_5.pt"))), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and said == [None], said


def test_an_install_other_users_cannot_reach_is_found(tmp_path: Path) -> None:
    """A folder on the way to trainwatch's install that others may not traverse is the
    one named (the daemon says so loudly: a hand as a job's user cannot load from it)."""
    from trainwatch.privsep.jobhands import unreadable

    shut = tmp_path / "shut"
    (shut / "lib").mkdir(parents=True)
    shut.chmod(0o700)
    (tmp_path / "open" / "lib").mkdir(parents=True)
    tmp_path.chmod(0o755)
    (tmp_path / "open").chmod(0o755)
    (tmp_path / "open" / "lib").chmod(0o755)
    assert unreadable((str(shut / "lib"),)) == str(shut)
    above = unreadable((str(tmp_path / "open" / "lib"),))  # pytest's own 0700 folders, maybe
    assert above is None or not above.startswith(str(tmp_path)), above
