"""Numbered checkpoints from the folder alone: layout ``auto`` for a job that
never reports its checkpoints (no client), where no framework is recognised.

- Which entries: every file or folder whose name carries a number (``step_6.pt``,
  ``step-6``, ``ckpt_6.pt``, ``checkpoint-6.pt``, ``iter_6``,
  ``epoch=2-step=6.pt``, ``6.pt``), less hidden, temporary and text files, and
  less a name that extends another numbered entry's (``step_6.pt.done``,
  ``step_6.pt.tmp``). A name's *shape* is its text with every run of digits a
  slot; the shape most entries share is the job's (``checkpoints.pattern`` when
  it names any entry, or when it was set), and its step is the slot after a word
  that names one (step, iter, it, ckpt, checkpoint), else the last slot whose
  number differs between entries, else the last slot.
- Complete: with ``checkpoints.marker`` or ``quiet_for`` set, as the generic
  layout says (the marker, or that long unchanged). Else by a marker when the
  job writes one (one of ``MARKERS_INSIDE``/``MARKERS_BESIDE`` found with any
  entry: from then on every entry needs it); else a file whose format says
  where it ends by that, at once (a zip: ``torch.save`` and numpy's ``savez``,
  whose central directory is written last; safetensors, as long as its header
  says); else unchanged for ``QUIET_FOR``, so the newest entry is never taken
  while it is still being written, or moved past: the next newer entry was begun
  after its last change (ondisk.moved_past).
"""

from __future__ import annotations

import itertools
import os
import re
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from trainwatch.config import Checkpoints
from trainwatch.layouts.base import open_regular, safetensors_file
from trainwatch.state.ondisk import (
    Generic,
    moved_past,
    names_of,
    newest_mtime,
    nonempty,
    settling,
)

QUIET_FOR = 60.0  # unchanged this long, with no marker and no format to read: complete
DEFAULT_PATTERN = Checkpoints().pattern
MARKERS_INSIDE = ("COMPLETE", "DONE", "_SUCCESS", ".complete", ".done", "complete", "done")
MARKERS_BESIDE = (".done", ".complete", ".ok")
_MARKER_PROBES = 8  # the newest folders whose insides are probed for a marker, per listing
_TEMP = (".tmp", ".temp", ".part", ".partial", ".incomplete", ".lock", ".swp", "~")
_NOT_CHECKPOINTS = (".log", ".txt", ".json", ".jsonl", ".yaml", ".yml", ".csv", ".tsv",
                    ".md", ".out", ".err", ".png", ".jpg", ".jpeg", ".svg", ".html", ".py",
                    ".sh", ".toml", ".ini", ".cfg", ".pid", ".sock")
_RUN = re.compile(r"\d+")
_STEP_WORD = re.compile(r"(?:step|iter|iteration|it|ckpt|checkpoint)[_=.-]?$", re.IGNORECASE)
_ZIP = b"PK\x03\x04"
_MAX_DIGITS = 18  # a step fits int64


@dataclass(frozen=True)
class Naming:
    """Names of one shape: the text around each digit slot, and the slot of the step."""

    parts: tuple[str, ...]  # len(parts) == slots + 1
    slot: int

    @classmethod
    def of_pattern(cls, pattern: str) -> Naming:
        head, _, tail = pattern.partition("{step}")
        return cls((head, tail), 0)

    @cached_property
    def regex(self) -> re.Pattern[str]:
        body = ""
        for i, part in enumerate(self.parts[:-1]):
            body += re.escape(part) + (r"(\d+)" if i == self.slot else r"\d+")
        return re.compile(f"^{body}{re.escape(self.parts[-1])}$")

    def shown(self) -> str:
        """As the user would write it: ``epoch=*-step={step}.pt``."""
        out = ""
        for i, part in enumerate(self.parts[:-1]):
            out += part + ("{step}" if i == self.slot else "*")
        return out + self.parts[-1]


def _kept(names: Iterable[str]) -> list[str]:
    """The names that may be checkpoints (see the module's docstring)."""
    numbered = {n for n in names if _RUN.search(n) and not n.startswith(".")
                and not n.endswith(_TEMP) and not n.lower().endswith(_NOT_CHECKPOINTS)}

    def extends_another(name: str) -> bool:
        return any(name[i] in "._-~" and name[:i] in numbered for i in range(1, len(name)))

    return sorted(n for n in numbered if not extends_another(n))


def infer(names: Iterable[str]) -> Naming | None:
    """The naming most of ``names`` share; None when none carries a number."""
    shapes: dict[tuple[str, ...], list[list[str]]] = {}
    for name in _kept(names):
        runs = _RUN.findall(name)
        if all(len(r) <= _MAX_DIGITS for r in runs):
            shapes.setdefault(tuple(_RUN.split(name)), []).append(runs)
    if not shapes:
        return None

    def rank(item: tuple[tuple[str, ...], list[list[str]]]) -> tuple[int, bool, tuple[str, ...]]:
        parts, seen = item
        return len(seen), any(_STEP_WORD.search(p) for p in parts[:-1]), parts

    parts, seen = max(shapes.items(), key=rank)
    slots = range(len(parts) - 1)
    worded = [i for i in slots if _STEP_WORD.search(parts[i])]
    varying = [i for i in slots if len({int(runs[i]) for runs in seen}) > 1]
    slot = (worded or varying or list(slots))[-1]
    return Naming(parts, slot)


def _structure(path: str) -> tuple[bool, str] | None:
    """A file's own word on whether it is whole; None when its format says nothing."""
    name = os.path.basename(path)
    try:
        # A regular file itself, opened without waiting (a FIFO named ckpt_5.pt
        # held the job's listing to its deadline), read through this one open.
        with open_regular(path) as f:
            head = f.read(4)
            if head != _ZIP:
                whole = None
            else:
                try:
                    f.seek(0)
                    with zipfile.ZipFile(f) as z:
                        whole = bool(z.namelist())
                except (OSError, zipfile.BadZipFile, ValueError, EOFError):
                    whole = False
    except OSError:
        return None
    if whole is not None:
        return (True, "a whole zip (torch.save, numpy)") if whole else (
            False, f"{name}: a zip without its directory (cut short, or being written)")
    if name.endswith(".safetensors"):
        err = safetensors_file(path)
        return (False, err) if err else (True, "as long as its safetensors header says")
    return None


class Numbered:
    """The catalog's layout (ondisk.Layout) for numbered names found in the folder."""

    name = "generic"
    volatile = False

    def __init__(self, spec: Checkpoints, clock: Callable[[], float] = time.time) -> None:
        given = spec.pattern != DEFAULT_PATTERN  # a pattern set by the user is kept
        self.given = Naming.of_pattern(spec.pattern) if given else None
        self.default = Naming.of_pattern(spec.pattern)
        self.naming: Naming | None = self.given
        self.found_marker: tuple[str, str] | None = None  # ("inside" | "beside", name)
        self.quiet_for = spec.quiet_for if spec.quiet_for is not None else QUIET_FOR
        # A marker or quiet time the user set is judged as the generic layout does.
        self.explicit = (Generic(spec.pattern, spec.marker, spec.quiet_for, clock)
                         if spec.marker is not None or spec.quiet_for is not None else None)
        self.clock = clock

    def candidates(self, root: Path) -> dict[int, str]:
        try:
            names = sorted(names_of(root))  # bounded: the folder is the job's to fill
        except OSError:
            return {}
        naming = self.given
        if naming is None:
            named = any(self.default.regex.match(n) for n in names)
            naming = self.default if named else infer(names)
        self.naming = naming
        found: dict[int, str] = {}
        for n in names:
            m = naming.regex.match(n) if naming is not None else None
            if m:
                found[int(m.group(1))] = os.path.join(root, n)
        if self.explicit is None and self.found_marker is None:
            self._find_marker(names, found)
        return found

    def _find_marker(self, names: list[str], found: dict[int, str]) -> None:
        """The job's own completion marker, if it writes one (sticky once seen)."""
        have = set(names)
        for path in found.values():
            base = os.path.basename(path)
            for suffix in MARKERS_BESIDE:
                if base + suffix in have:
                    self.found_marker = ("beside", suffix)
                    return
        for step in sorted(found)[-_MARKER_PROBES:]:
            path = found[step]
            for name in MARKERS_INSIDE:
                if os.path.isdir(path) and os.path.exists(os.path.join(path, name)):
                    self.found_marker = ("inside", name)
                    return

    def _marked(self, path: Path) -> tuple[bool, str] | None:
        if self.found_marker is None:
            return None
        how, name = self.found_marker
        where = path / name if how == "inside" else Path(f"{path}{name}")
        if not where.exists():
            return False, f"no marker {where.name} (the job marks the others with it)"
        return (True, f"marker {where.name}") if nonempty(path) else (False, "empty")

    def judge(self, root: Path, step: int, path: str, newer: str | None = None
              ) -> tuple[bool, str]:
        if self.explicit is not None:  # the user's marker or quiet time: as generic's
            return self.explicit.judge(root, step, path, newer)
        p = Path(path)
        marked = self._marked(p)
        if marked is not None:
            return marked
        if not p.is_dir():
            structure = _structure(path)
            if structure is not None:
                return structure
        said = f"unchanged for {self.quiet_for:g}s"
        if self.clock() - newest_mtime(p) < self.quiet_for:
            past = moved_past(p, newer)
            if past is None:  # the same words every second: a verdict that changes is news
                return False, settling(self.quiet_for, (
                    "complete once unchanged that long; --checkpoint-quiet-for, a marker or "
                    "the client's report say so sooner"))
            said = past
        if not nonempty(p):
            return False, "empty"
        if p.is_dir():
            for broken in self._broken_inside(p):
                return False, broken
        return True, said

    @staticmethod
    def _broken_inside(folder: Path) -> Iterable[str]:
        """What its files' own formats say is cut short (the top level, at most 64)."""
        try:
            with os.scandir(folder) as it:
                files = [e.path for e in itertools.islice(it, 64)
                         if e.is_file(follow_symlinks=False)]
        except OSError:
            return
        for f in files:
            said = _structure(f)
            if said is not None and not said[0]:
                yield said[1]

    def step_of(self, path: str) -> int | None:
        if self.naming is None:
            return None
        m = self.naming.regex.match(os.path.basename(os.path.normpath(path)))
        return int(m.group(1)) if m else None

    def accepts(self, step: int, path: str) -> bool:
        return self.step_of(path) == step

    def reported(self, step: int, path: str) -> None:
        pass
