"""What every layout shares: the verdict on one checkpoint (`Found`), and the
file checks that need no framework: a torch.save archive whose central
directory reads, a safetensors file as long as its header says, a JSON file
that parses. Only os.stat, os.scandir and small reads: nothing is unpickled
and torch is never imported."""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import stat
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO


@dataclass(frozen=True)
class Found:
    step: int
    path: str  # the checkpoint's file or folder (absolute)
    complete: bool  # the framework itself would load it
    why: str  # what marked it complete, or what is missing


# A header this long is not a real safetensors file (the library caps it at 100 MB).
_MAX_HEADER = 100 * 1024 * 1024
# Small control files (trackers, JSON state) are read whole only below this size.
MAX_SMALL = 16 * 1024 * 1024


def open_regular(path: str) -> BinaryIO:
    """``path`` opened for reading only if it is a regular file itself: never
    through a link (a tracker pointing at /proc/kmsg), never a FIFO or device,
    and O_NONBLOCK so that no open or read waits (the job's hand has a deadline
    too; this is the second line). Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def size(path: str) -> int | None:
    """The size of a regular file, or None when it is absent or not a file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size if os.path.isfile(path) else None


def torch_archive(path: str) -> str | None:
    """None when ``path`` is a torch.save file whose zip central directory reads
    (torch >= 1.6 writes a zip: torch/serialization.py ``_save`` via
    ``PyTorchFileWriter``, holding ``<archive>/data.pkl``); else what is wrong.
    The central directory is the last thing written, so a file cut short or
    still being written fails here. The legacy (non-zip) format is refused."""
    n = size(path)
    if n is None:
        return f"{os.path.basename(path)} missing"
    if n == 0:
        return f"{os.path.basename(path)} empty"
    try:
        with open_regular(path) as f:
            if not zipfile.is_zipfile(f):
                return f"{os.path.basename(path)} truncated (no zip directory)"
            with zipfile.ZipFile(f) as z:
                names = z.namelist()
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return f"{os.path.basename(path)} unreadable zip"
    if not any(name.endswith("data.pkl") for name in names):
        return f"{os.path.basename(path)} holds no data.pkl"
    return None


def safetensors_file(path: str) -> str | None:
    """None when ``path`` is as long as its safetensors header says (8-byte
    little-endian header length, a JSON header, then the tensors' bytes up to
    the largest ``data_offsets`` end); else what is wrong."""
    name = os.path.basename(path)
    n = size(path)
    if n is None:
        return f"{name} missing"
    try:
        with open_regular(path) as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{name} truncated"
            (hlen,) = struct.unpack("<Q", head)
            if hlen > min(_MAX_HEADER, n - 8):
                return f"{name} truncated"
            header = json.loads(f.read(hlen))
    except (OSError, ValueError, UnicodeDecodeError):
        return f"{name} unreadable header"
    if not isinstance(header, dict):
        return f"{name} unreadable header"
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets)):
            return f"{name} unreadable header"
        end = max(end, offsets[1])
    want = 8 + hlen + end
    if n < want:
        return f"{name} truncated"
    if n > want:
        return f"{name} longer than its header says"
    return None


def json_file(path: str) -> tuple[Any, str | None]:
    """The parsed content of a small JSON file, or (None, what is wrong)."""
    name = os.path.basename(path)
    n = size(path)
    if n is None:
        return None, f"no {name}"
    if n > MAX_SMALL:
        return None, f"{name} too large"
    try:
        with open_regular(path) as f:
            return json.loads(f.read()), None
    except (OSError, ValueError, UnicodeDecodeError):
        return None, f"{name} partial or not JSON"


def small_text(path: str) -> str | None:
    """The stripped text of a small file (a tracker), None when absent or unreadable."""
    n = size(path)
    if n is None or n > 4096:
        return None
    try:
        with open_regular(path) as f:
            return f.read().decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


# A folder is read at most this far (the job's user fills it: 800,000 names would
# cost seconds at every listing); entries_cut counts the listings cut short.
MAX_ENTRIES = 200_000
entries_cut = 0


def entries(root: Path | str) -> Iterator[os.DirEntry[str]]:
    """The first ``MAX_ENTRIES`` entries of ``root``; nothing when it is absent or
    unreadable."""
    global entries_cut
    try:
        with os.scandir(root) as it:
            got = list(itertools.islice(it, MAX_ENTRIES + 1))
    except OSError:
        return
    if len(got) > MAX_ENTRIES:
        entries_cut += 1
        del got[MAX_ENTRIES:]
    yield from got


def is_dir(e: os.DirEntry[str]) -> bool:
    try:
        return e.is_dir(follow_symlinks=False)
    except OSError:
        return False


def step_regex(pattern: str) -> re.Pattern[str]:
    """The catalog's ``pattern`` (one ``{step}``) as an anchored regex."""
    if pattern.count("{step}") != 1:
        raise ValueError(f"pattern {pattern!r} must contain {{step}} exactly once")
    head, _, tail = pattern.partition("{step}")
    return re.compile(rf"^{re.escape(head)}(\d+){re.escape(tail)}$")


def basename_step(regex: re.Pattern[str], path: str) -> int | None:
    m = regex.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def scan_dirs(root: Path, regex: re.Pattern[str],
              judge: Callable[[int, str], Found]) -> list[Found]:
    """Judge every folder of ``root`` named by ``regex``, oldest step first."""
    out = []
    for e in entries(root):
        m = regex.match(e.name)
        if m and is_dir(e):
            out.append(judge(int(m.group(1)), os.path.abspath(e.path)))
    out.sort(key=lambda f: f.step)
    return out


class Tracked:
    """A layout of folders named ``regex`` that a tracker file in the root
    completes (Megatron's latest_checkpointed_iteration.txt, DeepSpeed's
    ``latest``): ``tracker(root)`` reads the step it names, ``verdict(step, path,
    tracked)`` judges one folder against it."""

    name: str
    regex: re.Pattern[str]

    def tracker(self, root: str | Path) -> int | None:
        raise NotImplementedError

    def verdict(self, step: int, path: str, tracked: int | None) -> Found:
        raise NotImplementedError

    def step_of(self, path: str) -> int | None:
        return basename_step(self.regex, path)

    def judge(self, path: str) -> Found | None:
        step = self.step_of(path)
        if step is None:
            return None
        path = os.path.abspath(path)
        return self.verdict(step, path, self.tracker(os.path.dirname(path)))

    def scan(self, root: Path) -> list[Found]:
        tracked = self.tracker(root)
        return scan_dirs(root, self.regex, lambda step, path: self.verdict(step, path, tracked))
