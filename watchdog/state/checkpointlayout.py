"""The layout a job's ``checkpoints.layout`` names, as the catalog asks it
(ondisk.Layout): ``generic`` (names matching ``pattern``; complete by report,
marker or quiet time), a framework's (trainwatch.layouts: complete only when
the framework would load it), ``auto`` (the framework recognised in the folder,
generic until one is), and ``fixed``: one path overwritten in place, as
PyTorch's torchrun tutorial does with ``snapshot.pt``.

A fixed checkpoint is versioned by what is on disk (size, mtime, inode: any
rewrite changes them) and the step the training side reports with it: a report
of content already seen is the same version, never a second checkpoint. Only
the version on disk now exists; one rewritten since its report is incomplete
until the job reports it again (or, with ``quiet_for``, it has been still that
long). Without reports its step is unknown and counted as 0.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from trainwatch import layouts
from trainwatch.config import Checkpoints
from trainwatch.state.numbered import Numbered
from trainwatch.state.ondisk import Generic, Layout, listed, newest_mtime, nonempty

_MAX_VERSIONS = 256


class Framework:
    """A layout of trainwatch.layouts, as the catalog asks it."""

    volatile = False

    def __init__(self, impl: layouts.Layout) -> None:
        self.impl = impl
        self.name = impl.name

    def candidates(self, root: Path) -> dict[int, str]:
        return listed(root, self.impl.step_of)

    def judge(self, root: Path, step: int, path: str, newer: str | None = None
              ) -> tuple[bool, str]:
        f = self.impl.judge(path)
        if f is None:
            return False, f"not a {self.name} checkpoint"
        return f.complete, f.why

    def step_of(self, path: str) -> int | None:
        return self.impl.step_of(path)

    def accepts(self, step: int, path: str) -> bool:
        return self.impl.step_of(path) == step

    def reported(self, step: int, path: str) -> None:
        pass


class GenericLayout(Generic):
    """Generic, with the job's reports: a report is the job's word, enough here
    (never for a framework's layout: it would refuse what it did not finish)."""

    volatile = False

    def __init__(self, spec: Checkpoints, reported: dict[int, str],
                 clock: Callable[[], float]) -> None:
        super().__init__(spec.pattern, spec.marker, spec.quiet_for, clock)
        self.reports = reported

    def judge(self, root: Path, step: int, path: str, newer: str | None = None
              ) -> tuple[bool, str]:
        if self.reports.get(step) == path:
            return (True, "reported by the job") if nonempty(Path(path)) else (False, "empty")
        return super().judge(root, step, path, newer)

    def accepts(self, step: int, path: str) -> bool:
        return self.step_of(path) == step

    def reported(self, step: int, path: str) -> None:
        pass


def fingerprint(path: str) -> tuple[int, int, int] | None:
    """What is on disk at ``path`` itself (a link is no checkpoint: root reads this
    beside the job's hand, and must not learn of a file the link points at)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


class Fixed:
    name = "fixed"
    volatile = True  # rewritten in place: the folder's mtime does not say so

    def __init__(self, path: str, versions: dict[int, tuple[int, int, int]],
                 quiet_for: float | None, clock: Callable[[], float]) -> None:
        self.path = path
        self.versions = versions  # step -> fingerprint, saved with the catalog
        self.quiet_for = quiet_for
        self.clock = clock

    def _step_now(self) -> tuple[int, bool]:
        """The step of what is on disk, and whether a report vouches for it."""
        fp = fingerprint(self.path)
        for step, v in self.versions.items():
            if v == fp:
                return step, True
        return (max(self.versions) if self.versions else 0), False

    def candidates(self, root: Path) -> dict[int, str]:
        if fingerprint(self.path) is None:
            return {}
        return {self._step_now()[0]: self.path}

    def judge(self, root: Path, step: int, path: str, newer: str | None = None
              ) -> tuple[bool, str]:
        now_step, vouched = self._step_now()
        if vouched and now_step == step:
            return True, f"reported at step {step}, unchanged since"
        if self.quiet_for is not None and self.clock() - newest_mtime(Path(path)) >= \
                self.quiet_for:
            said = f"step {step} from the last report" if self.versions else "step unknown"
            return True, f"unchanged for {self.quiet_for:g}s ({said})"
        if self.versions:
            return False, f"rewritten since the report of step {max(self.versions)}"
        return False, "never reported (and no quiet_for)"

    def step_of(self, path: str) -> int | None:
        return self._step_now()[0] if os.path.normpath(path) == self.path else None

    def accepts(self, step: int, path: str) -> bool:
        return os.path.normpath(path) == self.path

    def reported(self, step: int, path: str) -> None:
        fp = fingerprint(self.path)
        if fp is None or fp in self.versions.values():
            return  # the same content reported again: one version, counted once
        self.versions[step] = fp
        while len(self.versions) > _MAX_VERSIONS:
            del self.versions[min(self.versions)]


class Auto:
    """The framework recognised in the folder (layouts.detect); generic until then,
    its pattern learned from the job's first report when the default does not
    name it (``step_6.pt`` reported at step 6: ``step_{step}.pt``); for a job
    that has never reported, numbered names inferred from the folder alone
    (state/numbered.py)."""

    volatile = False

    def __init__(self, spec: Checkpoints, reported: dict[int, str],
                 clock: Callable[[], float]) -> None:
        self.spec, self.reports, self.clock = spec, reported, clock
        self.generic = GenericLayout(spec, reported, clock)
        self.numbered = Numbered(spec, clock)
        self.pattern = spec.pattern
        self.found: Framework | None = None
        for step, path in sorted(reported.items())[-1:]:  # learned before a restart
            self._learn(step, path)

    def _learn(self, step: int, path: str) -> bool:
        """A pattern from a reported name holding its step once, as a number."""
        if self.generic.step_of(path) == step:
            return True
        name = os.path.basename(os.path.normpath(path))
        runs = [m for m in re.finditer(r"\d+", name) if int(m.group()) == step]
        if len(runs) != 1:
            return False  # a fixed name (snapshot.pt) is never a step's checkpoint
        m = runs[0]
        pattern = f"{name[:m.start()]}{{step}}{name[m.end():]}"
        self.generic = GenericLayout(replace(self.spec, pattern=pattern), self.reports,
                                     self.clock)
        return True

    @property
    def name(self) -> str:
        return self.found.name if self.found is not None else "generic"

    def _current(self, root: Path | None = None) -> Framework | GenericLayout | Numbered:
        if self.found is None and root is not None:
            name = layouts.detect(root)
            if name is not None:
                fw = Framework(layouts.get(name, self.pattern))
                # Only once it names a checkpoint: Lightning's *.ckpt under names of
                # the job's own (step_6.ckpt) are the job's pattern's, learned from
                # its reports.
                if fw.candidates(root):
                    self.found = fw
        if self.found is not None:
            return self.found
        return self.generic if self.reports else self.numbered  # the job's word, else the folder's

    def candidates(self, root: Path) -> dict[int, str]:
        return self._current(root).candidates(root)

    def judge(self, root: Path, step: int, path: str, newer: str | None = None
              ) -> tuple[bool, str]:
        return self._current().judge(root, step, path, newer)  # recognised at the listing

    def step_of(self, path: str) -> int | None:
        return self._current().step_of(path)

    def accepts(self, step: int, path: str) -> bool:
        if self.found is not None:
            return self.found.accepts(step, path)
        return self._learn(step, path)

    def reported(self, step: int, path: str) -> None:
        pass


def make_layout(spec: Checkpoints, reported: dict[int, str],
                versions: dict[int, tuple[int, int, int]],
                clock: Callable[[], float] = time.time) -> Layout:
    """The layout of ``spec`` (its dir already absolute); ``reported`` and
    ``versions`` are the catalog's, kept up to date by it."""
    if spec.layout == "fixed":
        return Fixed(os.path.join(spec.dir or ".", spec.pattern), versions, spec.quiet_for,
                     clock)
    if spec.layout == "auto":
        return Auto(spec, reported, clock)
    if spec.layout in layouts.NAMES:
        return Framework(layouts.get(spec.layout, spec.pattern))
    return GenericLayout(spec, reported, clock)


def recognise(layout: Layout, name: str) -> None:
    """What auto recognised in the folder, as the job's hand listed it (privsep):
    root's own copy of the layout takes it, so its reports are judged alike."""
    if isinstance(layout, Auto) and layout.found is None and name in layouts.NAMES:
        layout.found = Framework(layouts.get(name, layout.pattern))
