"""Drill overlays: an injected GPU condition (ECC, thermal, lost) rides on the
real samples of any backend until cleared, so that a drill passes through the
same detectors as a real fault."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trainwatch.detectors.gpu import HW_THERMAL_SLOWDOWN
from trainwatch.types import Fault, GpuSample


@dataclass
class Overlay:
    """Per GPU: the fields a drill overrides, and ECC errors it added."""

    fields: dict[int, dict[str, object]] = field(default_factory=dict)
    added_uncorrected: dict[int, int] = field(default_factory=dict)
    # An injected Xid whose GPU must be reset (79: fallen off the bus) leaves it
    # broken until cleared: a pre-flight fails on it (multihost/preflight.py).
    broken: dict[int, str] = field(default_factory=dict)

    def ecc(self, gpu: int, uncorrected: bool) -> None:
        if uncorrected:
            self.added_uncorrected[gpu] = self.added_uncorrected.get(gpu, 0) + 1
        else:
            self.fields.setdefault(gpu, {})["remap_pending"] = True

    def thermal(self, gpu: int) -> None:
        self.fields.setdefault(gpu, {})["clock_event_reasons"] = HW_THERMAL_SLOWDOWN

    def lost(self, gpu: int) -> None:
        self.fields.setdefault(gpu, {})["lost"] = "gpu_is_lost"

    def active(self, gpu: int | None) -> bool:
        return gpu is not None and (gpu in self.fields or gpu in self.added_uncorrected)

    def clear(self, gpu: int) -> None:
        self.fields.pop(gpu, None)
        self.added_uncorrected.pop(gpu, None)
        self.broken.pop(gpu, None)

    def apply(self, samples: list[GpuSample]) -> list[GpuSample]:
        out = []
        for s in samples:
            changes = dict(self.fields.get(s.index, {}))
            extra = self.added_uncorrected.get(s.index)
            if extra:
                changes["ecc_volatile_uncorrected"] = (s.ecc_volatile_uncorrected or 0) + extra
            out.append(dataclasses.replace(s, **changes) if changes else s)  # type: ignore[arg-type]
        return out


# Seconds a drill notice waits for its fault.
NOTICE_VALID = 60.0


@dataclass(frozen=True)
class DrillNotice:
    """faultinject said it is about to crash or hang a job (the control op
    ``drill``): the next such fault is marked injected, and a crash's onset is
    the notice's time (the kernel does not say when a process died)."""

    kind: str  # "crash" | "hang" | "nccl_stall" | "log_line"
    at: float  # monotonic, when the notice arrived
    pids: frozenset[int]

    def fits(self, kind: str, now: float) -> bool:
        return self.kind == kind and now - self.at <= NOTICE_VALID

    def mark(self, fault: Fault) -> Fault:
        """The crash announced: marked injected, its onset the notice's."""
        return dataclasses.replace(fault, onset=self.at, onset_known=True,
                                   evidence={**fault.evidence, "source": "drill"})

