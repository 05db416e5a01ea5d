"""The kernel log's records and the NVIDIA driver's Xid lines in them, parsed:
pure functions of text (kmsg.py reads the log). The line format is the driver's
(``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., name=..., GPU has fallen off the
bus.``); a record is /dev/kmsg's ``prio,seq,usec,flags;text``."""

from __future__ import annotations

import re
from dataclasses import dataclass

MARKER = "NVRM: Xid"


_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?"
    r"(?P<pci>[0-9a-fA-F]{1,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)"
    r"(?: GPU-I:(?P<gi>\d+))?(?: GPU-CI:(?P<ci>\d+))?"
    r"\): (?P<xid>\d{1,5})(?:,\s*(?P<rest>.*?))?\s*$"
)


_PID = re.compile(r"pid=(?:(?P<pid>\d+)|'?<unknown>'?)(?:,\s*|$)")


_NAME = re.compile(r"name=(?P<name>[^,]*)(?:,\s*|$)")


_CONTINUATION = re.compile(r" [A-Z0-9_]+=")


_RECORD = re.compile(r"(?P<prio>\d+),(?P<seq>\d+),(?P<usec>\d+),[^;]*;")


_PCI = re.compile(
    r"(?:PCI:)?(?:(?P<dom>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):"
    r"(?P<dev>[0-9a-fA-F]{1,2})(?:\.(?P<fn>[0-7]))?"
)


_ACTION = re.compile(
    r"recovery action changed from 0x[0-9a-fA-F]+ \([^)]*\) to "
    r"0x(?P<code>[0-9a-fA-F]+) \((?P<name>[^)]*)\)"
)


@dataclass(frozen=True)
class ParsedXid:
    """One ``NVRM: Xid`` line, parsed."""

    xid: int
    pci: str  # as NVML spells it: "00000000:06:00.0"
    message: str  # the driver's text after pid= and name=
    pid: int | None = None
    process: str | None = None
    gpu_instance: int | None = None  # MIG attribution ("GPU-I:05")
    compute_instance: int | None = None  # "GPU-CI:01"
    seq: int | None = None  # the /dev/kmsg sequence number, for a kmsg record


@dataclass(frozen=True)
class KmsgRecord:
    """The first line of a /dev/kmsg record."""

    facility: int  # 0 is the kernel; userspace writes cannot use it
    level: int
    seq: int
    usec: int  # the kernel's monotonic timestamp, microseconds since boot
    text: str


def normalise_pci(s: str) -> str:
    """A PCI address as the kernel or a tool writes it (``0000:06:00``,
    ``0000:b1:00.0``, ``PCI:0000:06:00``) -> NVML's ``pciInfo.busId`` form,
    ``00000000:06:00.0`` (``NVML_DEVICE_PCI_BUS_ID_FMT``, ``%08X:%02X:%02X.0``).
    Raises ValueError if it is not one."""
    m = _PCI.fullmatch(s.strip())
    if m is None:
        raise ValueError(f"not a PCI address: {s!r}")
    dom = int(m["dom"] or "0", 16)
    dev = int(m["dev"], 16)
    if dev > 0x1F:
        raise ValueError(f"PCI device number out of range: {s!r}")
    return f"{dom:08X}:{int(m['bus'], 16):02X}:{dev:02X}.{int(m['fn'] or '0'):X}"


def split_record(line: str) -> KmsgRecord | None:
    """``prio,seq,usec,flags[,...];text`` -> its fields, or None if the line is
    not a /dev/kmsg record. Only the first line counts; the continuation lines
    after it are the record's dictionary."""
    first = line.split("\n", 1)[0]
    m = _RECORD.match(first)
    if m is None:
        return None
    prio = int(m["prio"])
    return KmsgRecord(
        facility=prio >> 3,
        level=prio & 7,
        seq=int(m["seq"]),
        usec=int(m["usec"]),
        text=first[m.end():].rstrip("\r"),
    )


def parse_line(line: str) -> ParsedXid | None:
    """One kernel-log line (a /dev/kmsg record, a ``dmesg`` or journal line with
    any timestamp prefix, or the bare driver text) -> the Xid it reports, or None
    when it reports none or is malformed."""
    rec = split_record(line)
    text = rec.text if rec is not None else line.split("\n", 1)[0]
    if _CONTINUATION.match(text):  # a /dev/kmsg dictionary line: " KEY=value"
        return None
    m = _XID.search(text)
    if m is None:
        return None
    try:
        pci = normalise_pci(m["pci"])
    except ValueError:
        return None
    rest = m["rest"] or ""
    pid: int | None = None
    process: str | None = None
    pm = _PID.match(rest)
    if pm is not None:
        pid = int(pm["pid"]) if pm["pid"] else None
        rest = rest[pm.end():]
        nm = _NAME.match(rest)
        if nm is not None:
            name = nm["name"].strip().strip("'")
            process = None if name in ("", "<unknown>") else name
            rest = rest[nm.end():]
    return ParsedXid(
        xid=int(m["xid"]),
        pci=pci,
        message=rest.strip(),
        pid=pid,
        process=process,
        gpu_instance=int(m["gi"]) if m["gi"] else None,
        compute_instance=int(m["ci"]) if m["ci"] else None,
        seq=rec.seq if rec is not None else None,
    )


def recovery_action(message: str) -> tuple[int, str] | None:
    """Xid 154's text -> the driver's new recovery action, e.g.
    ``(1, "GPU Reset Required")``; None if the text names none."""
    m = _ACTION.search(message)
    if m is None:
        return None
    return int(m["code"], 16), m["name"]
