"""The host's GPUs as trainwatch sees them: the last sample and recent history
of each, the Xids already reported, and which GPUs are excluded. It runs the
GPU detectors over what the sources deliver and returns faults; it signals
nothing and does no I/O.

A GPU trainwatch cannot see is ``unknown``, never ``healthy`` (nvrx-watch's
rule: a blind watcher must not look healthy)."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from trainwatch.detectors.gpu import (
    detect_ecc,
    detect_lost,
    detect_thermal,
    detect_xid,
    is_duplicate,
)
from trainwatch.detectors.xid import classify
from trainwatch.types import Fault, GpuSample, XidEvent


class GpuState(str, enum.Enum):
    HEALTHY = "healthy"
    UNKNOWN = "unknown"  # no sample yet, the source is down, or the GPU is lost
    EXCLUDED = "excluded"  # taken out by policy until an operator or a re-check clears it


@dataclass
class _Gpu:
    last: GpuSample | None = None
    window: deque[GpuSample] = field(default_factory=lambda: deque(maxlen=600))
    excluded: str | None = None  # why
    clean_since: float | None = None  # excluded and fault-free since (monotonic)


class GpuHealth:
    def __init__(self, dedup_window: float = 10.0, thermal_sustain: float = 30.0) -> None:
        self.dedup_window = dedup_window
        self.thermal_sustain = thermal_sustain
        self.gpus: dict[int, _Gpu] = {}
        self.source_up = False
        self._recent_xids: deque[XidEvent] = deque(maxlen=256)
        self._thermal_active: set[int] = set()
        # Xids seen, by (GPU or None when unmapped, Xid, the catalog's class): the
        # exporter's counter, one per error whichever paths reported it.
        self.xid_counts: dict[tuple[int | None, int, str], int] = {}

    def _gpu(self, index: int) -> _Gpu:
        return self.gpus.setdefault(index, _Gpu())

    def samples(self, samples: list[GpuSample]) -> list[Fault]:
        """One poll's samples -> the faults they show."""
        self.source_up = True
        faults: list[Fault] = []
        for s in samples:
            g = self._gpu(s.index)
            if g.excluded is not None and (s.lost is not None or s.remap_pending
                                           or s.remap_failure):
                g.clean_since = s.at  # still unwell: the re-check starts over
        for s in samples:
            g = self._gpu(s.index)
            prev, g.last = g.last, s
            g.window.append(s)
            lost = detect_lost(s)
            if lost is not None:
                if prev is None or prev.lost is None:  # once per loss, not every poll
                    faults.append(lost)
                continue
            ecc = detect_ecc(prev, s)
            if ecc is not None:
                faults.append(ecc)
            thermal = detect_thermal(list(g.window), self.thermal_sustain)
            if thermal is None:
                self._thermal_active.discard(s.index)
            elif s.index not in self._thermal_active:  # once per episode
                self._thermal_active.add(s.index)
                faults.append(thermal)
        return faults

    def xid(self, ev: XidEvent) -> Fault | None:
        """An Xid from any path -> a fault, unless another path already reported it."""
        if is_duplicate(self._recent_xids, ev, self.dedup_window):
            return None
        self._recent_xids.append(ev)
        key = (ev.gpu, ev.xid, classify(ev.xid, ev.message).immediate.value.lower())
        self.xid_counts[key] = self.xid_counts.get(key, 0) + 1
        if ev.gpu is not None:
            g = self._gpu(ev.gpu)
            if g.excluded is not None:
                g.clean_since = ev.at
        return detect_xid(ev)

    def source_down(self) -> None:
        self.source_up = False

    def state(self, index: int) -> GpuState:
        g = self.gpus.get(index)
        if g is not None and g.excluded is not None:
            return GpuState.EXCLUDED
        if not self.source_up or g is None or g.last is None or g.last.lost is not None:
            return GpuState.UNKNOWN
        return GpuState.HEALTHY

    def exclude(self, index: int, why: str, at: float) -> None:
        g = self._gpu(index)
        g.excluded, g.clean_since = why, at

    def clear(self, index: int) -> None:
        g = self._gpu(index)
        g.excluded, g.clean_since = None, None

    def passed_recheck(self, now: float, after: float) -> list[int]:
        """Excluded GPUs that have been readable and fault-free for ``after`` seconds."""
        return [
            i for i, g in self.gpus.items()
            if g.excluded is not None and g.clean_since is not None
            and g.last is not None and g.last.lost is None and not g.last.remap_pending
            and not g.last.remap_failure  # a failed remap does not heal: it needs a person
            and now - g.clean_since >= after
        ]

    def excluded(self) -> dict[int, str]:
        return {i: g.excluded for i, g in self.gpus.items() if g.excluded is not None}
