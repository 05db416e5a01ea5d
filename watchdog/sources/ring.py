"""Heartbeat rings: every step's beat, from every rank, through shared memory.

A datagram per beat costs the job a syscall and the daemon a wake-up; at
1 kHz the kernel's 10-datagram queue also drops most of them. Instead each
(rank, pid) of the job writes its beats into a file of its own in a
per-attempt folder (env ``TRAINWATCH_RING_DIR``, made by the daemon, owned by
the job's user, 0700), and the daemon reads every file at its own pace.

Standard library only: the training-side client imports this module.

Layout (little-endian, fixed; a C or Rust reader may rely on it)::

    header, 64 bytes
      0  magic b"TWR1"    4  version u32 (1)   8  header size u32 (64)
     12  slot size u32 (40)  16  slots u32 (a power of two)   20  pid u32
     24  rank i64         32  head u64: records written so far   40..64 zero
    slots, 40 bytes each; record i lives in slot i % slots
      0  step i64   8  t f64 (the writer's CLOCK_MONOTONIC, host-wide)
     16  loss f64  24  grad_norm f64
     32  seq u64 (i + 1 once complete; 0 while being written)

"Not given" (None) is one signalling-NaN bit pattern, MISSING_BITS. IEEE 754
arithmetic never yields a signalling NaN (an operation on one delivers a
quiet NaN), so a real NaN loss, whatever its sign or payload, is delivered
as a NaN and never mistaken for None.

Publication: the writer stores the slot (one struct.pack_into: the fields,
then seq=i+1), then head=i+1 (one aligned 8-byte store). The reader reads
head, copies records [max(last, head-slots), head) with pread, and reads head
again (``after``); it accepts record j only if its seq is j+1 and j + slots >
after: every store of record j+slots, the one that reuses j's slot, comes
after head=j+slots, so if that head was not yet visible neither was any of
them when the copy was taken. Records it could not accept were overwritten
before they were read and are counted as ``lapped``; a reader less than a
ring behind loses none. On x86-64 stores and loads keep program order (TSO),
so this is exact; on weakly ordered CPUs (aarch64, e.g. Grace) a lock release
and acquire stands in for the fence Python does not offer.

Two C calls a beat: after a sleep (caches cold, as between training steps)
each costs about a microsecond here, so their number is what a beat costs.
(The seq is not needed for ordering; it names the record a slot holds, which
catches a garbage file and a head read while it changed.)

The reader uses pread, not mmap: the file belongs to the job's user, who may
truncate it, and a read through a mapping past the end of a file is SIGBUS,
which would kill the daemon. The writer preallocates its file
(posix_fallocate) so that a full disk fails at creation, not as SIGBUS at a
later write.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import struct
import sys
import threading
import time

__all__ = [
    "ENV",
    "MISSING_BITS",
    "SLOTS",
    "RingWriter",
    "file_name",
    "parse_name",
    "scan",
]

ENV = "TRAINWATCH_RING_DIR"
MAGIC = b"TWR1"
VERSION = 1
HEADER_SIZE = 64
SLOT_SIZE = 40
# 4096 slots (160 KiB a file): 4 s of steps at 1 kHz, 40 s at 100 Hz, so a
# daemon that stalls for a second or two (a GC pass, an fsync) loses nothing.
SLOTS = 4096
MAX_SLOTS = 1 << 20
HEAD_OFFSET = 32
_HEAD_WORD = HEAD_OFFSET // 8
MISSING_BITS = 0x7FF4_5457_4E4F_4E45  # signalling NaN (quiet bit 51 clear), payload "TWNONE"

HEADER = struct.Struct("<4sIIIIIq")  # magic .. rank; head follows at HEAD_OFFSET
U64 = struct.Struct("<Q")
SLOT = struct.Struct("<qdddQ")  # step, t, loss, grad_norm, seq
SEQ_AT = 32  # seq's offset in a slot
_MISSING: float = struct.unpack("<d", struct.pack("<Q", MISSING_BITS))[0]
MISSING_RAW = struct.pack("<Q", MISSING_BITS)
# Does a float keep this bit pattern through struct on this machine (an x87
# FPU would quiet it)? If not, None could not be told from NaN: no rings.
SUPPORTED = sys.byteorder == "little" and (
    SLOT.pack(0, 0.0, _MISSING, 0.0, 0)[16:24] == struct.pack("<Q", MISSING_BITS)
    )
ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

_pack_slot = SLOT.pack_into
_monotonic = time.monotonic


class Fence:
    """A full memory barrier for CPUs that reorder memory accesses (not x86):
    releasing and re-acquiring a held lock is a store-release then a
    load-acquire, which keep every access before them ahead of every access
    after them. The writer fences before a slot and between its fields and its
    seq; the reader between head and slots and between slots and head again."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def __call__(self) -> None:
        self._lock.release()
        self._lock.acquire()


def file_name(rank: int, pid: int) -> str:
    return f"rank-{rank}-{pid}"


def parse_name(name: str) -> tuple[int, int] | None:
    """``rank-<rank>-<pid>`` -> (rank, pid); None for any other name."""
    parts = name.split("-")
    if len(parts) != 3 or parts[0] != "rank":
        return None
    r, p = parts[1], parts[2]
    if not (r.isdigit() and p.isdigit() and r.isascii() and p.isascii()):
        return None
    if len(r) > 19 or len(p) > 10:
        return None
    return int(r), int(p)


# A ring folder is the job user's to fill: a scan reads at most this many names
# (a job has a ring per local rank and process, a few dozen), so a folder of
# 600,000 planted names costs one bounded pass, never memory to match.
MAX_SCAN = 4096


def scan(directory: str, limit: int = MAX_SCAN) -> list[tuple[int, int, str]]:
    """(rank, pid, path) of the ring files among the first ``limit`` names of
    ``directory``, sorted; names that do not parse (temporary files among
    them) are ignored; [] if the folder is absent. Other OSErrors (EACCES)
    propagate. ``scans_cut`` counts the scans that stopped at ``limit``."""
    global scans_cut
    out: list[tuple[int, int, str]] = []
    try:
        with os.scandir(directory) as it:
            for n, e in enumerate(it):
                if n >= limit:
                    scans_cut += 1
                    break
                rp = parse_name(e.name)
                if rp is not None and e.is_file(follow_symlinks=False):
                    out.append((rp[0], rp[1], e.path))
    except FileNotFoundError:
        return []
    out.sort()
    return out


scans_cut = 0


class RingWriter:
    """The writing end for one (rank, this process). Creates its file at once;
    never raises: if the file cannot be made (missing folder, full disk),
    ``ok`` is False, ``error`` says why and ``write`` returns False.

    One process, one writer per rank: two writers for the same rank in one
    process would both own ``rank-<rank>-<pid>`` (the client keeps one per rank).
    """

    __slots__ = ("_buf", "_fence", "_mask", "_next", "_words", "announce_at", "announced", "error",
                 "path", "pid", "rank", "slots")

    def __init__(self, directory: str, rank: int, slots: int = SLOTS,
                 fence: bool | None = None) -> None:
        self.rank = rank
        self.pid = os.getpid()
        self.slots = slots
        self.path = os.path.join(directory, file_name(rank, self.pid))
        self.error: str | None = None
        # For the client: has the daemon been told of this ring (a datagram
        # sent), and if not, when to try again.
        self.announced = False
        self.announce_at = 0.0
        self._mask = slots - 1
        self._next = 0
        self._buf: mmap.mmap | None = None
        # The same memory as u64 words: head is stored through it, one aligned
        # 8-byte store. (struct.pack_into zeroes its target before writing it,
        # so a reader could catch a head of 0 in between.)
        self._words: memoryview | None = None
        self._fence = Fence() if ((not ORDERED) if fence is None else fence) else None
        if not SUPPORTED:
            self.error = "this CPU does not keep NaN payloads: rings are off"
        elif slots < 2 or slots > MAX_SLOTS or slots & (slots - 1):
            self.error = f"slots must be a power of two in 2..{MAX_SLOTS}, not {slots}"
        else:
            try:
                self._buf = self._create(directory)
                self._words = memoryview(self._buf).cast("Q")
            except (OSError, ValueError, OverflowError, struct.error) as e:
                self.error = f"{self.path}: {e}"

    def _create(self, directory: str) -> mmap.mmap:
        size = HEADER_SIZE + self.slots * SLOT_SIZE
        # Made complete under a temporary name, then renamed: a reader never
        # finds a file without its header. The name holds our pid, so one left
        # by a dead process with the same pid is replaced.
        tmp = os.path.join(directory, "." + file_name(self.rank, self.pid) + ".tmp")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileExistsError:
            os.unlink(tmp)  # a dead process's, with our pid
            fd = os.open(tmp, flags, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on a later write
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                HEADER.pack_into(buf, 0, MAGIC, VERSION, HEADER_SIZE, SLOT_SIZE, self.slots,
                                  self.pid, self.rank)
                os.rename(tmp, self.path)
            except BaseException:
                buf.close()
                raise
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)  # the mapping keeps the file
        return buf

    @property
    def ok(self) -> bool:
        return self._buf is not None

    @property
    def written(self) -> int:
        return self._next

    def write(self, step: int, loss: float | None, grad_norm: float | None) -> bool:
        """Record one beat; no syscall. False (nothing written) if the writer
        is off or the values cannot be stored (a step outside int64)."""
        buf = self._buf
        if buf is None:
            return False
        i = self._next
        off = HEADER_SIZE + (i & self._mask) * SLOT_SIZE
        fence = self._fence
        if fence is not None:
            fence()  # the last head before this slot's new contents
        try:
            _pack_slot(buf, off, step, _monotonic(), _MISSING if loss is None else loss,
                       _MISSING if grad_norm is None else grad_norm, i + 1)
        except Exception:  # a float step, a str loss: convert as a datagram would, or give up
            try:
                _pack_slot(buf, off, int(step), _monotonic(),
                           _MISSING if loss is None else float(loss),
                           _MISSING if grad_norm is None else float(grad_norm), i + 1)
            except Exception:
                return False  # pack_into checks every value before it stores any
        if fence is not None:
            fence()  # the slot before the head
        self._words[_HEAD_WORD] = i + 1  # type: ignore[index]  # set whenever _buf is
        self._next = i + 1
        return True

    def close(self) -> None:
        """Unmap (the file stays for the daemon to read)."""
        buf, self._buf = self._buf, None
        if self._words is not None:
            self._words.release()
            self._words = None
        if buf is not None:
            with contextlib.suppress(BufferError, OSError):
                buf.close()


