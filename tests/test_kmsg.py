"""The kernel-log Xid source: the parser over real-format driver lines, PCI
normalisation, and KernelLog on real files, a real FIFO carrying /dev/kmsg
records, and the machine's own /dev/kmsg.

Where each line comes from:
  [drv]  the driver's format strings in NVIDIA/open-gpu-kernel-modules:
         src/nvidia/src/kernel/gpu/rc/kernel_rc.c (krcReportXid: pid=, name=,
         GPU-I/GPU-CI) and the 94/95 examples in
         src/nvidia/src/kernel/gpu/arch/ampere/kern_gpu_error_cont_ga100.c.
  [dcgm] NVIDIA/DCGM dcgmlib/src/tests/DcgmKmsgReaderTests.cpp (kmsg records, 119, 79).
  [nvs]  NVIDIA/NVSentinel syslog-health-monitor parser tests and XIDPattern (154, 46, .0).
  [op]   a user's dmesg from an OpenShift gpu-operator node (Xid 119, nv-hostengine).
  [ecc]  a dmesg excerpt of a real DBE (pid='<unknown>', physAddr ...).
  [tkt]  a vendor fault ticket (Xid 95, "Uncontained: FBHUB").
  [gpud] leptonai/gpud xid README (dmesg --ctime output).
  [old]  pastebin.com/gn6mYmM4: a 2012 driver without "PCI:".
  [abi]  Linux Documentation/ABI/testing/dev-kmsg.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from trainwatch.sources.kmsg import KernelLog, KernelLogError
from trainwatch.sources.kmsgparse import (
    ParsedXid,
    normalise_pci,
    parse_line,
    recovery_action,
    split_record,
)

L79 = "NVRM: Xid (PCI:0000:06:00): 79, pid=1234, name=python, GPU has fallen off the bus."
L48 = ("NVRM: Xid (PCI:0000:3b:00): 48, An uncorrectable double bit error (DBE) has been "
       "detected on GPU in the framebuffer at partition 1, subpartition 0.")
L154 = ("NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x0 (None) "
        "to 0x1 (GPU Reset Required)")

# (line, xid, NVML bus id, pid, message)
PARSED = [
    pytest.param(L79, 79, "00000000:06:00.0", 1234, "GPU has fallen off the bus.", id="79"),
    pytest.param(
        "NVRM: Xid (PCI:0000:2a:00): 79, pid='<unknown>', name=<unknown>, "
        "GPU has fallen off the bus",
        79, "00000000:2A:00.0", None, "GPU has fallen off the bus", id="79-unknown-pid-dcgm"),
    pytest.param(
        "Okt 06 17:59:27 balrog kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=1122, "
        "GPU has fallen off the bus.",
        79, "00000000:01:00.0", 1122, "GPU has fallen off the bus.", id="79-journal-pid-only"),
    pytest.param(L48, 48, "00000000:3B:00.0", None,
                 "An uncorrectable double bit error (DBE) has been detected on GPU in the "
                 "framebuffer at partition 1, subpartition 0.", id="48-no-pid"),
    pytest.param(
        "[430954.509105] NVRM: Xid (PCI:0000:52:00): 48, pid='<unknown>', name=<unknown>, "
        "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
        "at physAddr 0x18f31d80 partition 16, subpartition 3.",
        48, "00000000:52:00.0", None,
        "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
        "at physAddr 0x18f31d80 partition 16, subpartition 3.", id="48-dmesg-ecc"),
    pytest.param(
        "NVRM: Xid (PCI:0000:01:00): 94, pid=7062, Contained: CE User Channel (0x9). "
        "RST: No, D-RST: No",
        94, "00000000:01:00.0", 7062, "Contained: CE User Channel (0x9). RST: No, D-RST: No",
        id="94-drv"),
    pytest.param(
        "NVRM: Xid (PCI:0000:37:00): 95, pid=5171, Uncontained: FBHUB. RST: Yes, D-RST: No",
        95, "00000000:37:00.0", 5171, "Uncontained: FBHUB. RST: Yes, D-RST: No", id="95"),
    pytest.param(
        "[ 3947.590120] NVRM: Xid (PCI:0000:61:00): 119, pid=123417, name=nv-hostengine, "
        "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 10 "
        "(FREE) (0xc0000005 0x0).",
        119, "00000000:61:00.0", 123417,
        "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 10 "
        "(FREE) (0xc0000005 0x0).", id="119-op"),
    pytest.param(
        "NVRM: Xid (PCI:0000:00:16): 119, pid=36055, name=dcgm-exporter, Timeout after 6s of "
        "waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) "
        "(0x90cc0301 0xc).",
        119, "00000000:00:16.0", 36055,
        "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 "
        "(GSP_RM_CONTROL) (0x90cc0301 0xc).", id="119-gsp-rm-control-dcgm"),
    pytest.param(L154, 154, "00000008:01:00.0", None,
                 "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
                 id="154-nvs"),
    pytest.param(
        "4,1227,437812449,c;NVRM: Xid (PCI:0000:01:00): 43, pid=1814139, "
        "name=cuda_assert_64b, Ch 00000018",
        43, "00000000:01:00.0", 1814139, "Ch 00000018", id="kmsg-record-dcgm"),
    pytest.param(
        "4,1227,437812449,c,1,-;NVRM: Xid (PCI:0000:01:00): 43, pid=1814139, "
        "name=cuda_assert_64b, Ch 00000018\n SUBSYSTEM=pci\n DEVICE=+pci:0000:01:00.0",
        43, "00000000:01:00.0", 1814139, "Ch 00000018", id="kmsg-record-extra-fields-dict"),
    pytest.param(
        "[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, "
        "name=pt_main_thread, Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
        109, "00000000:CB:00.0", 1797828,
        "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005", id="dmesg-ctime-gpud"),
    pytest.param(
        "[  812.346123] NVRM: Xid (PCI:0000:3b:00.0): 79, pid=1234, name=process, Ch 00000001",
        79, "00000000:3B:00.0", 1234, "Ch 00000001", id="dmesg-with-function-nvs"),
    pytest.param("NVRM: Xid (PCI:0000:3f:00): 46", 46, "00000000:3F:00.0", None, "",
                 id="bare-number-nvs"),
    pytest.param(
        "May  6 00:38:27 alex kernel: [ 4909.922970] NVRM: Xid (0000:01:00): 13, "
        "0005 00000000 0000502d 00000104 00000000 00000100",
        13, "00000000:01:00.0", None, "0005 00000000 0000502d 00000104 00000000 00000100",
        id="old-driver-no-PCI-prefix"),
]

NOT_XID = [
    pytest.param("6,339,5140900,-;NET: Registered protocol family 10", id="kmsg-non-nvrm-abi"),
    pytest.param("[Wed Dec 11 13:23:01 2024] Linux version 5.15.0-117-generic", id="dmesg"),
    pytest.param("NVRM: GPU at PCI:0000:66:00: GPU-12345678-1234-5678-9abc-def012345678",
                 id="nvrm-not-xid-nvs"),
    pytest.param("[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0", id="nvrm-fallen-no-xid"),
    pytest.param("[123] nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): 28006, Non-fatal, Link 46 "
                 "MC TS crumbstore MCTO (First)", id="nvswitch-sxid"),
    pytest.param(" SUBSYSTEM=acpi", id="kmsg-continuation"),
    pytest.param(" DEVICE=+acpi:PNP0A03:00", id="kmsg-continuation-device"),
    pytest.param("", id="empty"),
]

MALFORMED = [
    pytest.param("NVRM: Xid (PCI:0000:66:00): abc, pid=2280636", id="number-not-a-number-nvs"),
    pytest.param("NVRM: Xid : 32, pid=2280636", id="no-pci-nvs"),
    pytest.param("4,1227,437812449932,c;NVRM: Xid PCI:0000:01:00: 43, pid=1814139, "
                 "name=cuda_assert_64b, Ch 00000018", id="no-parentheses-dcgm"),
    pytest.param("NVRM: Xid (PCI:0000:06:ff): 79, GPU has fallen off the bus.",
                 id="device-out-of-range"),
    pytest.param("NVRM: Xid (PCI:0000:06:00): 79 GPU has fallen off the bus.", id="no-comma"),
]


@pytest.mark.parametrize(("line", "xid", "pci", "pid", "message"), PARSED)
def test_parse_line_reads_real_formats(
    line: str, xid: int, pci: str, pid: int | None, message: str
) -> None:
    """Each real-format Xid line yields its number, NVML bus id, pid and driver text."""
    p = parse_line(line)
    assert p is not None
    assert (p.xid, p.pci, p.pid, p.message) == (xid, pci, pid, message)


@pytest.mark.parametrize("line", NOT_XID)
def test_parse_line_ignores_other_lines(line: str) -> None:
    """Kernel lines that report no Xid (other NVRM text, SXid, kmsg dictionary) give None."""
    assert parse_line(line) is None


@pytest.mark.parametrize("line", MALFORMED)
def test_parse_line_rejects_malformed_xid_lines(line: str) -> None:
    """A line that names an Xid but does not follow the driver's format gives None."""
    assert parse_line(line) is None


def test_parse_line_keeps_process_mig_attribution_and_kmsg_seq() -> None:
    """The process name, the MIG GPU/compute instance and the kmsg sequence number are kept."""
    p = parse_line("6,77,123,-;NVRM: Xid (PCI:0000:01:00 GPU-I:02 GPU-CI:01): 43, pid=99, "
                   "name=python3, Ch 00000018")
    assert p == ParsedXid(xid=43, pci="00000000:01:00.0", message="Ch 00000018", pid=99,
                          process="python3", gpu_instance=2, compute_instance=1, seq=77)
    mig = parse_line("NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, "
                     "Contained: CE User Channel (0x9). RST: No, D-RST: No")
    assert mig is not None and (mig.xid, mig.gpu_instance, mig.compute_instance) == (94, 5, None)


def test_split_record_reads_the_kmsg_prefix() -> None:
    """A /dev/kmsg record splits into facility, level, sequence, timestamp and text."""
    r = split_record("30,340,5690716,-;udevd[80]: starting version 181")
    assert r is not None
    assert (r.facility, r.level, r.seq, r.usec, r.text) == (3, 6, 340, 5690716,
                                                            "udevd[80]: starting version 181")
    assert split_record("[ 12.3] NVRM: Xid (PCI:0000:01:00): 79, x") is None


@pytest.mark.parametrize(
    ("text", "action"),
    [
        (L154, (1, "GPU Reset Required")),
        ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
         (2, "Node Reboot Required")),
        ("GPU has fallen off the bus.", None),
    ],
)
def test_recovery_action_reads_xid_154_text(text: str, action: tuple[int, str] | None) -> None:
    """Xid 154's message names the driver's new recovery action; other text names none."""
    assert recovery_action(text) == action


@pytest.mark.parametrize(
    ("given", "nvml"),
    [
        ("0000:06:00", "00000000:06:00.0"),
        ("0000:b1:00.0", "00000000:B1:00.0"),
        ("PCI:0008:01:00", "00000008:01:00.0"),
        ("00000000:3B:00.0", "00000000:3B:00.0"),
        ("0000:3B:00.0", "00000000:3B:00.0"),  # NVML's busIdLegacy
        ("3b:00.0", "00000000:3B:00.0"),
        ("10000:e1:00", "00010000:E1:00.0"),  # a VMD domain, wider than four digits
    ],
)
def test_normalise_pci_gives_nvml_bus_id(given: str, nvml: str) -> None:
    """Kernel and tool PCI spellings map to NVML's 8-hex-digit-domain busId."""
    assert normalise_pci(given) == nvml


@pytest.mark.parametrize("bad", ["", "gpu0", "0000:06", "0000:06:20", "0000:06:00.8",
                                 "0000:106:00", "000000000:06:00.0"])
def test_normalise_pci_rejects_non_addresses(bad: str) -> None:
    """Anything that is not a PCI address raises ValueError."""
    with pytest.raises(ValueError):
        normalise_pci(bad)


# --- KernelLog on a text file ----------------------------------------------------

GPUS = {"00000000:06:00.0": 1, "00000000:3B:00.0": 4}


def _append(path: Path, *lines: str) -> None:
    with path.open("a") as f:
        f.writelines(line + "\n" for line in lines)


@pytest.fixture
def logfile(tmp_path: Path) -> Path:
    p = tmp_path / "kern.log"
    _append(p, "[  1.0] Linux version 6.8.0", "[  2.0] " + L79)  # history before the start
    return p


@pytest.fixture
def reader(logfile: Path, tmp_path: Path) -> Iterator[KernelLog]:
    k = KernelLog(str(logfile), GPUS, tmp_path / "kmsg.pos", clock=lambda: 7.5)
    yield k
    k.close()


def test_file_starts_at_the_end(reader: KernelLog) -> None:
    """On a first start the Xids already in the file are not reported."""
    assert reader.read() == []
    assert reader.counters.lines == 0
    assert not reader.selectable


def test_file_reports_appended_xids(reader: KernelLog, logfile: Path) -> None:
    """Appended Xid lines become XidEvents; noise is counted, a malformed Xid is a failure."""
    _append(logfile, "[ 10.0] e1000e: eth0 NIC Link is Up", "[ 11.0] " + L79,
            "[ 12.0] NVRM: Xid (PCI:0000:06:00): abc, pid=1")
    [ev] = reader.read()
    assert (ev.xid, ev.source, ev.gpu, ev.pci, ev.pid, ev.at) == (
        79, "kmsg", 1, "00000000:06:00.0", 1234, 7.5)
    assert ev.message == "GPU has fallen off the bus."
    c = reader.counters
    assert (c.lines, c.xids, c.parse_failures) == (3, 1, 1)
    assert reader.read() == []


def test_file_maps_pci_to_gpu_and_leaves_unknown_none(reader: KernelLog, logfile: Path) -> None:
    """A known bus id maps to its GPU index; an unknown one leaves gpu None."""
    _append(logfile, L48, L154)
    ev48, ev154 = reader.read()
    assert (ev48.xid, ev48.gpu) == (48, 4)
    assert (ev154.xid, ev154.gpu, ev154.pci) == (154, None, "00000008:01:00.0")
    reader.map_gpus({"0008:01:00": 6})  # any spelling; NVML found another GPU
    _append(logfile, L154)
    [again] = reader.read()
    assert again.gpu == 6


def test_file_waits_for_the_end_of_a_line(reader: KernelLog, logfile: Path) -> None:
    """A line still being written is read once, when its newline arrives."""
    with logfile.open("a") as f:
        f.write(L79[:30])
    assert reader.read() == []
    with logfile.open("a") as f:
        f.write(L79[30:] + "\n")
    assert [e.xid for e in reader.read()] == [79]
    assert reader.read() == []


def test_file_survives_truncation(reader: KernelLog, logfile: Path) -> None:
    """A file truncated in place is read again from its start."""
    _append(logfile, "[ 10.0] filler " + "x" * 200)
    assert reader.read() == []
    logfile.write_text(L48 + "\n")  # shorter than what was read
    assert [e.xid for e in reader.read()] == [48]
    assert reader.counters.resets == 1


def test_file_follows_rotation(reader: KernelLog, logfile: Path) -> None:
    """After a rename-and-recreate the old file's tail and all the new file are read."""
    logfile.rename(logfile.with_suffix(".log.1"))
    _append(logfile.with_suffix(".log.1"), L79)  # written just before the rotation
    assert [e.xid for e in reader.read()] == [79]  # no new file yet: keep the old one
    _append(logfile, L48)
    assert [e.xid for e in reader.read()] == [48]
    assert reader.counters.resets == 1


def test_file_position_survives_a_restart(logfile: Path, tmp_path: Path) -> None:
    """A new instance resumes from the saved offset: no Xid twice, none missed."""
    pos = tmp_path / "kmsg.pos"
    a = KernelLog(str(logfile), GPUS, pos)
    _append(logfile, L79)
    assert [e.xid for e in a.read()] == [79]
    a.close()
    _append(logfile, L48)  # while trainwatch was down
    b = KernelLog(str(logfile), GPUS, pos)
    assert [e.xid for e in b.read()] == [48]
    b.close()
    c = KernelLog(str(logfile), GPUS, pos)
    assert c.read() == []
    saved = json.loads(pos.read_text())
    assert saved["kind"] == "file" and saved["offset"] == logfile.stat().st_size
    c.close()


def test_file_rotated_while_down_is_read_from_its_start(logfile: Path, tmp_path: Path) -> None:
    """A saved position for a file that was since replaced restarts at the new file's start."""
    pos = tmp_path / "kmsg.pos"
    KernelLog(str(logfile), GPUS, pos).close()
    logfile.rename(logfile.with_suffix(".log.1"))
    _append(logfile, L154)
    k = KernelLog(str(logfile), GPUS, pos)
    assert [e.xid for e in k.read()] == [154]
    assert k.counters.resets == 1
    k.close()


@pytest.mark.parametrize("saved", ["{not json", json.dumps({"v": 1, "kind": "kmsg", "seq": 3}),
                                   json.dumps({"v": 1, "kind": "file", "path": "/elsewhere",
                                               "dev": 1, "ino": 2, "offset": 0})])
def test_file_ignores_a_foreign_or_corrupt_position(
    logfile: Path, tmp_path: Path, saved: str
) -> None:
    """A position file that is corrupt or about another log is a first start: from the end."""
    pos = tmp_path / "kmsg.pos"
    pos.write_text(saved)
    k = KernelLog(str(logfile), GPUS, pos)
    assert k.read() == []
    k.close()


@pytest.mark.parametrize("make", ["missing", "directory"])
def test_unusable_path_is_one_clear_error(tmp_path: Path, make: str) -> None:
    """A missing path or a directory raises KernelLogError naming the path."""
    path = tmp_path / "nope"
    if make == "directory":
        path.mkdir()
    with pytest.raises(KernelLogError, match=str(path)):
        KernelLog(str(path))


# --- KernelLog on a FIFO carrying /dev/kmsg records ---------------------------------

BOOT = "4f1f2c55-0d2e-4b8e-9a53-7c1b0c0e8d11"


def _rec(seq: int, text: str, prio: int = 4) -> str:
    return f"{prio},{seq},{1000 + seq},-;{text}\n"


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    p = tmp_path / "kmsg.fifo"
    os.mkfifo(p)
    return p


def _writer(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_NONBLOCK)


def _write(fd: int, text: str) -> None:
    data = text.encode()
    assert os.write(fd, data) == len(data)


def test_records_report_kernel_xids_and_ignore_userspace_fakes(fifo: Path, tmp_path: Path) -> None:
    """kmsg records become events; dictionary lines are skipped; a userspace-written Xid is not."""
    k = KernelLog(str(fifo), GPUS, tmp_path / "pos", clock=lambda: 3.0, boot_id=BOOT)
    assert k.selectable
    w = _writer(fifo)
    _write(w, _rec(1, "pci 0000:06:00.0: enabling device")
             + " SUBSYSTEM=pci\n DEVICE=+pci:0000:06:00.0\n"
             + _rec(2, L79)
             + _rec(3, L48, prio=(1 << 3) | 4))  # facility user: echo ... > /dev/kmsg
    sel = selectors.DefaultSelector()
    sel.register(k, selectors.EVENT_READ)
    assert sel.select(timeout=5)
    sel.close()
    [ev] = k.read()
    assert (ev.xid, ev.gpu, ev.at) == (79, 1, 3.0)
    c = k.counters
    assert (c.lines, c.xids, c.foreign, c.lost) == (3, 1, 1, 0)
    os.close(w)
    k.close()


def test_records_count_sequence_gaps_as_lost(fifo: Path, tmp_path: Path) -> None:
    """A jump in sequence numbers counts the records the ring buffer overwrote."""
    k = KernelLog(str(fifo), GPUS, tmp_path / "pos", boot_id=BOOT)
    w = _writer(fifo)
    _write(w, _rec(10, "a") + _rec(11, "b") + _rec(15, L79))
    assert [e.xid for e in k.read()] == [79]
    assert k.counters.lost == 3
    os.close(w)
    k.close()


def _replay(fifo: Path) -> int:
    """A writer that has the buffer's records 1..3 ready, as /dev/kmsg does on open."""
    w = _writer(fifo)
    _write(w, _rec(1, "boot noise") + _rec(2, L79) + _rec(3, "more noise"))
    return w


def test_records_first_start_skips_what_is_in_the_buffer(fifo: Path, tmp_path: Path) -> None:
    """On a first start the records already buffered are skipped and the last seq is saved."""
    pos = tmp_path / "pos"
    hold = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer open before us
    w = _replay(fifo)
    k = KernelLog(str(fifo), GPUS, pos, boot_id=BOOT)
    assert json.loads(pos.read_text())["seq"] == 3
    _write(w, _rec(4, L48))
    assert [e.xid for e in k.read()] == [48]
    for fd in (w, hold):
        os.close(fd)
    k.close()


def test_records_resume_skips_seen_sequence_numbers(fifo: Path, tmp_path: Path) -> None:
    """After a restart in the same boot, records at or before the saved seq are not reported."""
    pos = tmp_path / "pos"
    pos.write_text(json.dumps({"v": 1, "kind": "kmsg", "path": str(fifo), "boot_id": BOOT,
                               "seq": 2}))
    k = KernelLog(str(fifo), GPUS, pos, boot_id=BOOT)
    w = _replay(fifo)  # the whole buffer again, from its first record
    _write(w, _rec(4, L154))
    assert [e.xid for e in k.read()] == [154]
    assert (k.counters.skipped, k.counters.lines) == (2, 2)
    assert json.loads(pos.read_text())["seq"] == 4
    os.close(w)
    k.close()


def test_records_after_a_reboot_read_the_new_buffer(fifo: Path, tmp_path: Path) -> None:
    """A position saved in another boot says nothing about this buffer: all of it is new."""
    pos = tmp_path / "pos"
    pos.write_text(json.dumps({"v": 1, "kind": "kmsg", "path": str(fifo), "boot_id": "old",
                               "seq": 900}))
    k = KernelLog(str(fifo), GPUS, pos, boot_id=BOOT)
    w = _replay(fifo)
    assert [e.xid for e in k.read()] == [79]
    assert k.counters.skipped == 0
    os.close(w)
    k.close()


# --- the machine's own /dev/kmsg -----------------------------------------------------


def test_real_dev_kmsg_reads_or_says_why_not(tmp_path: Path) -> None:
    """/dev/kmsg is read without error and yields no invented Xids, or the error says why."""
    pos = tmp_path / "pos"
    try:
        k = KernelLog("/dev/kmsg", GPUS, pos)
    except KernelLogError as e:
        assert "/dev/kmsg" in str(e)
        if isinstance(e.__cause__, PermissionError):
            assert "CAP_SYSLOG" in str(e)
        return
    assert k.selectable  # a character device: the daemon's selector can wait on it
    events = k.read()  # read only: a test does not write to the host's kernel log
    k.close()
    saved = json.loads(pos.read_text())
    # Read the whole buffer through the real parser: from before its first record.
    pos.write_text(json.dumps({**saved, "seq": -1}))
    whole = KernelLog("/dev/kmsg", GPUS, pos)
    events += whole.read()
    c = whole.counters
    assert c.lines > 0 and c.errors == 0 and whole.error is None
    if not Path("/proc/driver/nvidia").exists():  # no NVIDIA driver: nothing can be an Xid
        assert events == [] and c.parse_failures == 0
    whole.close()


_UNPRIVILEGED = """
import os
from trainwatch.sources.kmsg import KernelLog, KernelLogError
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
try:
    KernelLog("/dev/kmsg").close()
    print("opened")
except KernelLogError as e:
    print(e)
"""


def test_dev_kmsg_without_privilege_says_what_it_needs() -> None:
    """Unprivileged under dmesg_restrict=1, opening /dev/kmsg is one line naming CAP_SYSLOG."""
    out = subprocess.run([sys.executable, "-c", _UNPRIVILEGED], capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip()
    restrict = Path("/proc/sys/kernel/dmesg_restrict")
    if not Path("/dev/kmsg").exists():
        assert out.endswith("/dev/kmsg: cannot open: No such file or directory")
    elif restrict.exists() and restrict.read_text().strip() == "1":
        assert "/dev/kmsg: cannot read the kernel log" in out and "CAP_SYSLOG" in out
    else:
        assert out == "opened"
