"""Heartbeat rings (trainwatch.sources.ring) with real files and real processes:
every record the reader accepts is one the writer wrote, whole; what it misses
is counted; a file that is not a ring is refused at open in one line."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from trainwatch.sources import ring
from trainwatch.sources.ring import RingWriter, scan
from trainwatch.sources.ringreader import Record, RingError, RingReader


def _writer(
    d: Path, rank: int = 0, slots: int = ring.SLOTS, fence: bool | None = None
) -> RingWriter:
    w = RingWriter(str(d), rank, slots=slots, fence=fence)
    assert w.ok, w.error
    return w


def test_reader_returns_each_record_once_in_order(tmp_path: Path) -> None:
    """Records come back once each, in order, with the writer's rank, pid and values."""
    w = _writer(tmp_path, rank=3)
    t0 = time.monotonic()
    for step in range(10):
        assert w.write(step, step * 2.0, None if step % 2 else step + 0.5)
    r = RingReader(w.path)
    assert (r.rank, r.pid, r.uid, r.slots) == (3, os.getpid(), os.geteuid(), ring.SLOTS)
    got = r.read()
    assert [x.step for x in got] == list(range(10))
    for x in got:
        assert (x.rank, x.pid, x.loss) == (3, os.getpid(), x.step * 2.0)
        assert x.grad_norm == (None if x.step % 2 else x.step + 0.5)
        assert t0 <= x.t <= time.monotonic()
    assert r.read() == []
    w.write(10, 1.0, 2.0)
    assert [x.step for x in r.read()] == [10]
    assert r.lapped == 0 and r.bad == 0
    r.close()
    w.close()


def test_reader_after_lapping_counts_what_it_missed(tmp_path: Path) -> None:
    """A reader that falls a ring behind gets the newest records but one (the slot the writer
    may be rewriting) and counts the rest; one less behind, it loses none."""
    w = _writer(tmp_path, slots=16)
    r = RingReader(w.path)
    for step in range(100):
        w.write(step, float(step), None)
    got = r.read()
    assert [x.step for x in got] == list(range(85, 100))
    assert r.lapped == 85
    for step in range(100, 115):
        w.write(step, float(step), None)
    assert [x.step for x in r.read()] == list(range(100, 115))
    assert r.lapped == 85


def test_skip_existing_starts_at_the_current_head(tmp_path: Path) -> None:
    """A reader opened with skip_existing (a daemon re-adopting a job) sees only new records."""
    w = _writer(tmp_path)
    for step in range(5):
        w.write(step, 1.0, 1.0)
    r = RingReader(w.path, skip_existing=True)
    w.write(5, 1.0, 1.0)
    assert [x.step for x in r.read()] == [5]
    assert r.lapped == 0


_NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_1234))[0]


@pytest.mark.parametrize("fence", [False, True], ids=["plain", "fenced"])
def test_real_nan_and_inf_are_delivered_as_such_and_none_as_none(
    tmp_path: Path, fence: bool
) -> None:
    """NaN (any sign or payload) and ±inf arrive as NaN and ±inf; only an omitted value is None."""
    w = _writer(tmp_path, fence=fence)
    values: list[tuple[float | None, float | None]] = [
        (math.nan, math.inf), (-math.nan, -math.inf), (_NAN_PAYLOAD, None), (None, math.nan),
        (None, None), (0.1 + 0.2, 1e-300), (-0.0, 5e-324),
    ]
    for step, (loss, gn) in enumerate(values):
        assert w.write(step, loss, gn)
    got = RingReader(str(w.path), fence=fence).read()
    assert len(got) == len(values)
    for rec, sent in zip(got, values, strict=True):
        for v, s in ((rec.loss, sent[0]), (rec.grad_norm, sent[1])):
            if s is None:
                assert v is None
            elif math.isnan(s):
                assert v is not None and math.isnan(v)
            else:
                assert v == s and math.copysign(1.0, v) == math.copysign(1.0, s)


def test_values_a_datagram_would_convert_are_converted_and_others_refused(tmp_path: Path) -> None:
    """A float step or a numeric string is stored as int()/float() would; a step beyond
    int64 is refused."""
    w = _writer(tmp_path)
    assert w.write(12.0, "1.5", 2)  # type: ignore[arg-type]
    assert not w.write(2**63, 1.0, 1.0)
    assert not w.write(13, "not a number", 1.0)  # type: ignore[arg-type]
    w.write(14, 1.0, None)
    got = RingReader(w.path).read()
    assert [(x.step, x.loss, x.grad_norm) for x in got] == [(12, 1.5, 2.0), (14, 1.0, None)]


_WRITER = textwrap.dedent("""
    import sys
    from trainwatch.sources.ring import RingWriter
    d, rank, n, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    w = RingWriter(d, rank, slots=slots)
    assert w.ok, w.error
    print(w.path, flush=True)
    sys.stdin.readline()  # go
    for step in range(n):
        w.write(step, step * 2.0, step * 3.0 + 0.5)
""")


def test_writers_at_full_speed_and_a_lapped_reader_never_yield_a_torn_record(
    tmp_path: Path,
) -> None:
    """Three processes write flat out into small rings while a sleeping reader falls behind:
    every accepted record is whole (loss = 2*step, grad norm = 3*step+0.5), steps only
    go up, and accepted + lapped accounts for every record written."""
    n, slots, writers = 300_000, 64, 3
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(rank), str(n),
                          str(slots)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for rank in range(writers)
    ]
    try:
        paths = [p.stdout.readline().strip() for p in procs if p.stdout is not None]
        readers = [RingReader(path) for path in paths]
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("\n")
            p.stdin.flush()
        accepted = [0] * writers
        last = [-1] * writers
        reads = 0

        def check(i: int, recs: list[Record]) -> None:
            for x in recs:
                assert x.rank == i
                assert x.loss == x.step * 2.0, x
                assert x.grad_norm == x.step * 3.0 + 0.5, x
                assert x.step > last[i], (x, last[i])
                last[i] = x.step
            accepted[i] += len(recs)

        while any(p.poll() is None for p in procs):
            for i, r in enumerate(readers):
                check(i, r.read())
                reads += 1
            time.sleep(0.0002)  # slow enough to be lapped, often enough to catch writes
        for p in procs:
            assert p.wait(timeout=60) == 0
        for i, r in enumerate(readers):
            check(i, r.read())  # the rest, after the writers finished
            assert r.bad == 0
            assert accepted[i] + r.lapped == n, (i, accepted[i], r.lapped)
            assert last[i] == n - 1
        assert sum(r.lapped for r in readers) > 0, "the reader was never lapped: test too slow?"
        assert reads > 100
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("writer", ["finished", "begun"])
def test_a_record_rewritten_while_it_was_copied_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """A copy that got the fields of the record reusing a slot but the seq of the one before
    (the writer lapped it mid-copy, and has finished that record or only begun it) is not
    accepted."""
    w = _writer(tmp_path, slots=4)
    for step in range(4):
        w.write(step, step * 2.0, None)
    r = RingReader(w.path)
    real = os.pread

    def torn(fd: int, n: int, off: int) -> bytes:
        data = real(fd, n, off)
        if n == 4 * ring.SLOT_SIZE:  # the slots: the writer overtakes the copy after slot 0's seq
            if writer == "finished":
                w.write(4, 8.0, None)  # record 4 reuses slot 0, and head becomes 5
            else:  # record 4 begun: its fields stored, head still 4
                os.pwrite(w_fd, struct.pack("<qdddQ", 4, 0.0, 8.0, 0.0, 0), ring.HEADER_SIZE)
            seq_at = ring.SLOT_SIZE - 8  # the copy: record 4's fields, record 0's seq
            data = real(fd, n, off)[:seq_at] + data[seq_at:]
        return data

    w_fd = os.open(w.path, os.O_RDWR)
    try:
        monkeypatch.setattr(os, "pread", torn)
        got = r.read()
    finally:
        os.close(w_fd)
    # Record 0 is refused; after a finished record 4 the writer may be at work on record 5,
    # which reuses record 1's slot, so that one is not trusted either.
    kept = [(1, 2.0), (2, 4.0), (3, 6.0)] if writer == "begun" else [(2, 4.0), (3, 6.0)]
    assert [(x.step, x.loss) for x in got] == kept
    assert r.lapped == 4 - len(kept)


def test_garbage_files_are_refused_at_open_with_one_clear_line(tmp_path: Path) -> None:
    """Empty, short, foreign, wrong-sized, symlinked, FIFO and directory paths raise RingError,
    one line naming the path; a good ring beside them opens."""
    (tmp_path / "good").mkdir()
    good = _writer(tmp_path / "good")
    header = Path(good.path).read_bytes()[:64]
    cases: dict[str, bytes | None] = {
        "empty": b"",
        "short": b"TWR1",
        "foreign": b"\x7fELF" + b"\0" * (64 + ring.SLOTS * 40 - 4),
        "wrong-size": header + b"\0" * 40,
        "bad-version": header[:4] + struct.pack("<I", 9) + header[8:] + b"\0" * (ring.SLOTS * 40),
        "bad-slots": header[:16] + struct.pack("<I", 3) + header[20:] + b"\0" * (3 * 40),
    }
    for name, data in cases.items():
        assert data is not None
        (tmp_path / name).write_bytes(data)
    os.symlink(good.path, tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name in [*cases, "link", "fifo", "dir", "absent"]:
        path = str(tmp_path / name)
        t0 = time.monotonic()
        with pytest.raises(RingError) as e:
            RingReader(path)
        assert time.monotonic() - t0 < 5.0  # a FIFO does not block the open
        msg = str(e.value)
        assert msg.startswith(path + ":") and "\n" not in msg, msg
    RingReader(good.path).close()


def test_a_ring_truncated_or_rewound_after_open_is_counted_never_raised(tmp_path: Path) -> None:
    """If the file shrinks or its head goes backwards under the reader, read() returns []
    and counts it."""
    w = _writer(tmp_path)
    for step in range(3):
        w.write(step, 1.0, 1.0)
    r = RingReader(w.path)
    assert len(r.read()) == 3
    with open(w.path, "r+b") as f:
        f.seek(ring.HEAD_OFFSET)
        f.write(struct.pack("<Q", 1))  # head rewound
    assert r.read() == [] and r.bad == 1
    w.close()  # the mapping goes first: truncating a mapped file would SIGBUS its writer
    os.truncate(w.path, 10)
    assert r.read() == [] and r.bad == 2


def test_a_writer_that_cannot_make_its_file_is_off_and_never_raises(tmp_path: Path) -> None:
    """A missing folder, or a folder that is a file: ok is False, error says why, write()
    is False."""
    (tmp_path / "file").write_text("")
    for d in (tmp_path / "absent", tmp_path / "file"):
        w = RingWriter(str(d), 0)
        assert not w.ok and w.error and str(d) in w.error
        assert w.write(1, 1.0, 1.0) is False


def test_a_writer_that_cannot_reserve_its_space_is_off_and_leaves_no_file(tmp_path: Path) -> None:
    """With no room for the file (RLIMIT_FSIZE stands in for a full disk) the writer is off at
    creation, not killed by SIGBUS at a later write, and leaves nothing behind."""
    code = textwrap.dedent("""
        import resource, signal, sys
        from trainwatch.sources.ring import RingWriter
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        w = RingWriter(sys.argv[1], 0)
        print(w.ok, w.write(1, 1.0, 1.0))
        print(w.error)
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()
    assert out[0] == "False False", out
    assert str(tmp_path) in out[1]
    assert os.listdir(tmp_path) == []


def test_scan_lists_ring_files_and_ignores_other_names(tmp_path: Path) -> None:
    """scan() returns (rank, pid, path) of ring files only, sorted; an absent folder is empty."""
    for name in ("rank-1-200", "rank-0-100", "rank-10-5", ".rank-2-300.tmp", "rank-x-1",
                 "rank-1-2-3", "rank--1-4", "rank-٣-7", "notes.txt"):
        (tmp_path / name).write_text("")
    (tmp_path / "rank-3-400").mkdir()
    os.symlink(tmp_path / "rank-0-100", tmp_path / "rank-4-500")
    assert scan(str(tmp_path)) == [
        (0, 100, str(tmp_path / "rank-0-100")),
        (1, 200, str(tmp_path / "rank-1-200")),
        (10, 5, str(tmp_path / "rank-10-5")),
    ]
    assert scan(str(tmp_path / "absent")) == []


def test_writer_file_is_private_and_complete_when_it_appears(tmp_path: Path) -> None:
    """The ring file is 0600, named rank-<rank>-<pid>, and already a valid ring when scan()
    sees it."""
    w = _writer(tmp_path, rank=7)
    assert os.path.basename(w.path) == f"rank-7-{os.getpid()}"
    assert os.stat(w.path).st_mode & 0o777 == 0o600
    assert scan(str(tmp_path)) == [(7, os.getpid(), w.path)]
    assert os.listdir(tmp_path) == [f"rank-7-{os.getpid()}"]
    assert RingReader(w.path).read() == []


def test_a_ring_folder_of_planted_names_is_scanned_bounded(tmp_path: Path) -> None:
    """20,000 empty files named like rings (the job's user may plant 600,000): a scan
    reads at most MAX_SCAN names, keeps no more, and says it stopped."""
    for i in range(20_000):
        (tmp_path / ring.file_name(i, 4242)).touch()
    cut = ring.scans_cut
    found = scan(str(tmp_path))
    assert 0 < len(found) <= ring.MAX_SCAN
    assert ring.scans_cut == cut + 1
