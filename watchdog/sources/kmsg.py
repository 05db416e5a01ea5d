"""The kernel-log Xid source: the NVIDIA driver's ``NVRM: Xid`` lines, from
``/dev/kmsg`` or from a configured text file, as XidEvent observations.

The driver prints (open-gpu-kernel-modules, ``src/nvidia/src/kernel/gpu/rc/kernel_rc.c``)::

    NVRM: Xid (PCI:%04x:%02x:%02x): %d, pid=%s, name=%s, <message>
    NVRM: Xid (PCI:%04x:%02x:%02x GPU-I:%02u GPU-CI:%02u): %d, pid=..., name=..., <message>

where pid is a number or ``'<unknown>'``; other paths print no pid or name
(``... 48, An uncorrectable double bit error ...``, ``... 154, GPU recovery
action changed from 0x0 (None) to 0x1 (GPU Reset Required)``), older drivers
print ``pid=N`` alone, and very old ones ``Xid (0000:01:00)`` without ``PCI:``.
Tools also write the address with a function (``PCI:0000:b1:00.0``). DCGM reads
kmsg for Xid 79, 119 and 120 because NVML does not report them.

``/dev/kmsg`` hands out one record per ``read()``: ``prio,seq,usec,flags[,...];text``
then continuation lines that start with a space (``Documentation/ABI/testing/dev-kmsg``).
The sequence number is kept in a position file, with the boot id, so a restart
does not report an old Xid again. A record whose facility is not the kernel's
was written by userspace (``echo ... > /dev/kmsg``): it is counted as foreign,
never reported as the driver's. A text file is tailed by byte offset, across
truncation and rotation. Lines that look like an Xid but do not parse are
counted, never raised.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwatch.sources.kmsgparse import (
    MARKER,
    normalise_pci,
    parse_line,
    split_record,
)
from trainwatch.state.atomic import read_json, write_json
from trainwatch.types import XidEvent

log = logging.getLogger("trainwatch")

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
# A /dev/kmsg read() must be given room for a whole record or it fails with
# EINVAL; the kernel's records are at most 8 KiB with their dictionary.
_RECORD_MAX = 16384
_BATCH = 1024  # records per read() call, so a log storm cannot starve the loop
_CHUNK = 65536
_FILE_BUDGET = 1 << 22  # bytes of a text file per read() call
_LINE_MAX = 65536  # a longer "line" without a newline is dropped, not buffered forever


@dataclass
class Counters:
    lines: int = 0  # records or text lines read (old records skipped on resume excluded)
    xids: int = 0  # Xid events returned
    parse_failures: int = 0  # lines naming "NVRM: Xid" that did not parse
    skipped: int = 0  # /dev/kmsg records at or before the saved position
    lost: int = 0  # /dev/kmsg records overwritten before they were read (sequence gaps)
    overruns: int = 0  # EPIPE: the ring buffer overtook the reader
    foreign: int = 0  # Xid-looking /dev/kmsg records written by userspace, ignored
    resets: int = 0  # text file truncated or rotated: read again from 0
    errors: int = 0  # other read errors


class KernelLogError(OSError):
    """The kernel log cannot be opened or read as one."""


def _read_boot_id() -> str | None:
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip() or None
    except OSError:
        return None


class KernelLog:
    """Reads Xid events from ``/dev/kmsg`` (or any character device or FIFO
    that delivers kmsg records) or from a text file.

    ``/dev/kmsg`` is opened non-blocking: register ``fileno()`` with a selector
    and call ``read()`` when it is readable. A regular file cannot be registered
    with epoll (``selectable`` is False): call ``read()`` on a timer instead.

    The position is saved to ``position_file`` after every ``read()`` that moved
    it, before the events are returned: an Xid is reported at most once across
    restarts. Without a saved position the reader starts at the end of the log.
    """

    def __init__(
        self,
        path: str = "/dev/kmsg",
        pci_to_gpu: Mapping[str, int] | None = None,
        position_file: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        boot_id: str | None = None,
    ) -> None:
        self.path = path
        self.position_file = position_file
        self.clock = clock
        self.counters = Counters()
        self.error: str | None = None  # the last read error, None once reads succeed again
        self._gpus: dict[str, int] = {}
        self.map_gpus(pci_to_gpu or {})
        self._partial = b""
        self._offset = 0  # text: bytes consumed up to the last complete line
        self._ident: tuple[int, int] | None = None  # text: (st_dev, st_ino) of the open file
        self._last_seq: int | None = None
        self._dirty = False
        self._fd = self._open()
        st = os.fstat(self._fd)
        self.records = stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)
        if not (self.records or stat.S_ISREG(st.st_mode)):
            os.close(self._fd)
            raise KernelLogError(errno.EINVAL, f"{path}: not a character device, FIFO or file")
        saved = read_json(position_file) if position_file is not None else None
        if self.records:
            self.boot_id = boot_id if boot_id is not None else _read_boot_id()
            self._start_records(saved)
        else:
            self.boot_id = None
            self._start_file(st, saved)
        if self._dirty:
            self._save(durable=True)

    @property
    def selectable(self) -> bool:
        return self.records

    def fileno(self) -> int:
        return self._fd

    def map_gpus(self, pci_to_gpu: Mapping[str, int]) -> None:
        """Which GPU index each bus id is (NVML's ``pciInfo.busId`` -> index)."""
        self._gpus = {normalise_pci(k): v for k, v in pci_to_gpu.items()}

    # --- opening and resuming ---------------------------------------------------

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except PermissionError as e:
            raise KernelLogError(
                e.errno,
                f"{self.path}: cannot read the kernel log: {e.strerror} "
                "(it needs root or CAP_SYSLOG while kernel.dmesg_restrict=1)",
            ) from e
        except OSError as e:
            raise KernelLogError(e.errno, f"{self.path}: cannot open: {e.strerror}") from e

    def _start_records(self, saved: Any) -> None:
        if (
            isinstance(saved, dict)
            and saved.get("kind") == "kmsg"
            and saved.get("path") == self.path
            and type(saved.get("seq")) is int
        ):
            if saved.get("boot_id") == self.boot_id:
                # Read from the first record and skip what was seen before.
                self._last_seq = saved["seq"]
                return
            # Another boot: nothing in this buffer was seen. Read it all.
            log.info("kernel log: %s is from another boot; reading %s from its start",
                     self.position_file, self.path)
            return
        # First start: begin at the end. lseek(SEEK_END) would get there but
        # not tell the sequence number (it returns 0), so walk the buffer once
        # and remember the last record; then even a restart before the next
        # kernel message resumes from here.
        self._skip_all()

    def _skip_all(self) -> None:
        while True:
            try:
                data = os.read(self._fd, _RECORD_MAX)
            except (BlockingIOError, InterruptedError):
                break
            except BrokenPipeError:
                continue
            except OSError:
                with contextlib.suppress(OSError):
                    os.lseek(self._fd, 0, os.SEEK_END)
                break
            if not data:
                break
            for raw in data.split(b"\n"):
                rec = split_record(raw.decode("utf-8", "replace"))
                if rec is not None:
                    self._last_seq = rec.seq
                    self._dirty = True

    def _start_file(self, st: os.stat_result, saved: Any) -> None:
        self._ident = (st.st_dev, st.st_ino)
        if (
            isinstance(saved, dict)
            and saved.get("kind") == "file"
            and saved.get("path") == self.path
            and type(saved.get("offset")) is int
        ):
            same = (saved.get("dev"), saved.get("ino")) == self._ident
            if same and 0 <= saved["offset"] <= st.st_size:
                self._offset = saved["offset"]
            else:  # rotated or truncated while trainwatch was down
                self.counters.resets += 1
                self._offset = 0
        else:
            self._offset = st.st_size
        os.lseek(self._fd, self._offset, os.SEEK_SET)
        self._dirty = True

    # --- reading ----------------------------------------------------------------

    def read(self) -> list[XidEvent]:
        """What the log holds now -> the Xid events in it. Never raises for bad
        input or a read error: those are counted (and kept in ``error``)."""
        out: list[XidEvent] = []
        if self.records:
            self._read_records(out)
        else:
            self._read_file(out)
        if self._dirty:
            self._save(durable=bool(out))
        return out

    def _read_records(self, out: list[XidEvent]) -> None:
        c = self.counters
        for _ in range(_BATCH):
            try:
                data = os.read(self._fd, _RECORD_MAX)
            except (BlockingIOError, InterruptedError):
                break
            except BrokenPipeError:
                # Records were overwritten; the kernel moved us to the oldest
                # one left. The sequence gap counts how many were lost.
                c.overruns += 1
                continue
            except OSError as e:
                c.errors += 1
                self.error = f"{self.path}: {e.strerror}"
                break
            self.error = None
            if not data:  # a FIFO whose writer closed
                break
            for raw in data.split(b"\n"):
                if raw and not raw.startswith(b" "):  # " KEY=value": the dictionary
                    self._record(raw.decode("utf-8", "replace"), out)

    def _record(self, text: str, out: list[XidEvent]) -> None:
        c = self.counters
        rec = split_record(text)
        if rec is None:
            c.lines += 1
            self._line(text, out)
            return
        if self._last_seq is not None:
            if rec.seq <= self._last_seq:
                c.skipped += 1
                return
            c.lost += rec.seq - self._last_seq - 1
        self._last_seq = rec.seq
        self._dirty = True
        c.lines += 1
        if rec.facility != 0:
            # Userspace may write to /dev/kmsg but never as the kernel: this
            # is not the driver speaking.
            if MARKER in rec.text:
                c.foreign += 1
            return
        self._line(rec.text, out)

    def _line(self, text: str, out: list[XidEvent]) -> None:
        if MARKER not in text:
            return
        p = parse_line(text)
        if p is None:
            self.counters.parse_failures += 1
            return
        self.counters.xids += 1
        out.append(
            XidEvent(
                xid=p.xid,
                at=self.clock(),
                source="kmsg",
                gpu=self._gpus.get(p.pci),
                pci=p.pci,
                message=p.message,
                pid=p.pid,
            )
        )

    def _read_file(self, out: list[XidEvent]) -> None:
        c = self.counters
        try:
            st = os.fstat(self._fd)
            if st.st_size < self._offset + len(self._partial):  # truncated in place
                c.resets += 1
                self._offset, self._partial = 0, b""
                os.lseek(self._fd, 0, os.SEEK_SET)
                self._dirty = True
            self._drain(out)
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                return  # mid-rotation: keep the old file until a new one appears
            if (now.st_dev, now.st_ino) != self._ident:
                fd = self._open()  # rotated: the old file is drained, the new one is all new
                os.close(self._fd)
                self._fd, self._ident = fd, (now.st_dev, now.st_ino)
                self._offset, self._partial = 0, b""
                self._dirty = True
                c.resets += 1
                self._drain(out)
        except OSError as e:
            c.errors += 1
            self.error = f"{self.path}: {e.strerror}"
            return
        self.error = None

    def _drain(self, out: list[XidEvent]) -> None:
        budget = _FILE_BUDGET
        while budget > 0:
            data = os.read(self._fd, _CHUNK)
            if not data:
                return
            budget -= len(data)
            *lines, self._partial = (self._partial + data).split(b"\n")
            for raw in lines:
                self._offset += len(raw) + 1
                self._dirty = True
                self.counters.lines += 1
                self._line(raw.decode("utf-8", "replace").rstrip("\r"), out)
            if len(self._partial) > _LINE_MAX:
                self._offset += len(self._partial)
                self._partial = b""
                self.counters.parse_failures += 1

    def _save(self, durable: bool) -> None:
        if self.position_file is None:
            self._dirty = False
            return
        state: dict[str, object]
        if self.records:
            state = {"kind": "kmsg", "path": self.path, "boot_id": self.boot_id,
                     "seq": self._last_seq}
        else:
            assert self._ident is not None
            state = {"kind": "file", "path": self.path, "dev": self._ident[0],
                     "ino": self._ident[1], "offset": self._offset}
        try:
            write_json(self.position_file, {"v": 1, **state}, durable=durable)
        except OSError as e:
            self.counters.errors += 1
            self.error = f"{self.position_file}: {e.strerror}"
            return
        self._dirty = False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
