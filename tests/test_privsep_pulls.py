"""The hands of pulls and listings (actions/pull.py), where their races were: a
listing's deadline spent on its hand's start, a hand as the job's user that
imports from an install the user cannot read, a cancel that came before the
hand was forked. Each is made deterministic here: a hand held before it serves
(a pipe the test writes), a clock the test moves, an import refused once the
hand has dropped root, a fork held on an event."""

from __future__ import annotations

import functools
import importlib.abc
import os
import select
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import pytest
from conftest import missing, pid_gone
from test_privsep import _credential_home, _give, _user
from trainwatch.actions import pull
from trainwatch.privsep import child
from trainwatch.privsep.hand import Hand
from trainwatch.snapshot import blobs, remote
from trainwatch.snapshot.format import Leaf, Manifest


def _uploaded(tmp: Path, step: int) -> str:
    """A file:// remote holding one snapshot of ``step``: its URL."""
    staging = blobs.Staging(str(tmp / "src"), step)
    data = b"weights" * 1000
    c = staging.add(blobs.digest(data), len(data), lambda: (data, None))
    m = Manifest(step, time.time(), [{"$leaf": 0}], [Leaf("bytes", None, None, len(data), [c])])
    folder, _ = blobs.publish(staging, m.dumps())
    url = f"file://{tmp / 'remote'}"
    remote.upload(url, folder)
    return url


def test_a_listings_deadline_runs_from_when_its_hand_serves_not_from_its_fork(
        open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand's start (fork, botocore's imports, the drop to the job's user) took 2-3 s
    of a rollback's 10 s listing on a loaded host, and the test that holds the listing
    for a `status` failed ("did not list its snapshots within 10s"). Here the start is
    held, and the hands' clock moved past the listing's timeout meanwhile: the listing
    still has its whole timeout once the hand serves."""
    url = _uploaded(open_tmp, 5)
    offset = [0.0]

    def clock() -> float:
        return time.monotonic() + offset[0]

    monkeypatch.setattr(pull, "Hand", functools.partial(Hand, clock=clock))
    # The start's own bound is not in question (raising=False: the old code had none).
    monkeypatch.setattr(pull, "START_MAX", 600.0, raising=False)
    forked_r, forked_w = os.pipe()
    go_r, go_w = os.pipe()
    serve = child.serve

    def held(*args: Any) -> NoReturn:
        try:  # in the forked hand, before it serves
            os.write(forked_w, b"f")
            os.read(go_r, 1)
            serve(*args)
        finally:
            os._exit(70)

    monkeypatch.setattr(child, "serve", held)
    got: list[object] = []

    def listing() -> None:
        try:
            got.append(pull.steps(url, timeout=30))
        except ValueError as e:
            got.append(e)

    t = threading.Thread(target=listing, daemon=True)
    t.start()
    try:
        assert select.select([forked_r], [], [], 60)[0], "no hand forked for the listing"
        offset[0] += 60.0  # the start took longer than the listing's 30 s
    finally:
        os.write(go_w, b"g")
        t.join(120)
        for fd in (forked_r, forked_w, go_r, go_w):
            os.close(fd)
    assert not t.is_alive()
    assert got == [[5]], got


class _Unreadable(importlib.abc.MetaPathFinder):
    """trainwatch's install as a job's user finds it when it cannot read it (a clean
    clone in a 0700 folder): nothing more can be imported once a hand has dropped root."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if os.geteuid() != 0:
            raise ModuleNotFoundError(f"No module named {name!r} (unreadable)", name=name)
        return None


def test_pulls_and_listings_as_the_jobs_user_import_nothing_after_the_drop(
        open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec imports fsspec.implementations.chained at each url_to_fs, never at its own
    import: a hand forked from a process that had not imported it yet (what earlier tests
    in the same worker did decided it) imported it as the job's user, from an install that
    user could not read, and failed before it reached the remote: a pull at once (the
    cancel test saw it done before it cancelled), a listing before its credential_process
    ran (the credential test found no uid file). Everything the hand needs is imported
    before it drops root."""
    try:
        import s3fs  # noqa: F401  (the S3 listing needs it)
    except ImportError:
        missing("s3fs is not installed (the snapshot extra)")
    ident = _user()
    url = _uploaded(open_tmp, 5)  # root's upload imports fsspec's chained module ...
    monkeypatch.delitem(sys.modules, "fsspec.implementations.chained")  # ... not yet here
    monkeypatch.setattr(sys, "meta_path", [_Unreadable(), *sys.meta_path])

    assert pull.steps(url, timeout=60, ident=ident) == [5]

    dest = open_tmp / "ckpt"
    dest.mkdir()
    _give(dest, ident)
    p = pull.Pull(url, str(dest), None, "test", ident, {})
    p.start()
    assert p.thread is not None
    p.thread.join(120)
    assert p.done and p.error is None, p.error
    assert p.result == str(dest / "snapshot-5"), p.result

    env, out = _credential_home(open_tmp, ident, "/bin/sh -c 'id -u > {out}/uid; exit 1'")
    with pytest.raises(ValueError):  # the process says no: no credentials, once it ran
        pull.steps("s3://bucket/run", timeout=60, env=env, ident=ident)
    assert (out / "uid").read_text().strip() == str(ident.uid)


def test_a_pull_cancelled_before_its_hand_is_forked_ends_all_the_same(
        open_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's runner closes (a reload removed the job) while its pull's thread is still
    forking the hand: abort finds no socket to shut. The call ends all the same, its hand
    reaped, instead of pulling on for hours into a folder nobody watches."""
    folder = open_tmp / "remote"
    folder.mkdir()
    os.mkfifo(folder / "snapshot-5.json", 0o644)  # a read that waits for a writer
    spawning, go = threading.Event(), threading.Event()
    forked: list[int | None] = []
    spawn = Hand._spawn

    def held(self: Hand) -> None:
        spawning.set()
        go.wait(60)
        spawn(self)
        forked.append(self._pid)

    monkeypatch.setattr(Hand, "_spawn", held)
    p = pull.Pull(f"file://{folder}", str(open_tmp / "ckpt"), None, "test", None, {})
    p.start()
    assert p.thread is not None
    try:
        assert spawning.wait(60), "the pull did not begin"
        p.cancel()
        go.set()
        p.thread.join(30)
        assert p.done and p.error is not None, p.error
    finally:
        go.set()
        if p.hand is not None:
            p.hand.close()
    assert forked and forked[0] is not None and pid_gone(forked[0]), forked
