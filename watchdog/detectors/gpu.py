"""GPU health detectors: pure functions of GPU samples and Xid events.

They return faults with an empty ``job``; the caller routes a GPU's fault to
every job that uses that GPU (``dataclasses.replace(fault, job=...)``).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainwatch.types import Fault, FaultKind, GpuSample, XidEvent

# nvmlClocksEventReason* bits (nvml.h), with the names the metrics use.
CLOCK_EVENT_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
# The ones that mean the GPU is being slowed by heat or by the board, not by an
# idle or a configured clock.
HW_SLOWDOWN = 0x8
SW_THERMAL_SLOWDOWN = 0x20
HW_THERMAL_SLOWDOWN = 0x40
HW_POWER_BRAKE_SLOWDOWN = 0x80
THERMAL_REASONS = HW_SLOWDOWN | SW_THERMAL_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN


def reason_names(bits: int) -> list[str]:
    return [name for bit, name in CLOCK_EVENT_REASONS if bits & bit & THERMAL_REASONS]


def is_duplicate(recent: Sequence[XidEvent], ev: XidEvent, window: float) -> bool:
    """The same Xid on the same GPU already seen (by any path) within ``window`` s:
    NVML's event, the kernel log and a poll all report one fault once. A drill
    never hides a real Xid, nor a real one a drill."""
    return any(
        r.xid == ev.xid and r.gpu == ev.gpu and r.injected == ev.injected
        and abs(ev.at - r.at) <= window
        for r in recent
    )


def detect_xid(ev: XidEvent) -> Fault:
    evidence: dict[str, object] = {"xid": ev.xid, "source": ev.source}
    if ev.message:
        evidence["message"] = ev.message
    if ev.pci:
        evidence["pci"] = ev.pci
    if ev.pid is not None:
        evidence["pid"] = ev.pid
    return Fault(FaultKind.GPU_XID, "", ev.at, evidence, gpu=ev.gpu)


def detect_lost(cur: GpuSample) -> Fault | None:
    if cur.lost is None:
        return None
    return Fault(FaultKind.GPU_LOST, "", cur.at, {"nvml": cur.lost, "uuid": cur.uuid},
                 gpu=cur.index)


def detect_ecc(prev: GpuSample | None, cur: GpuSample) -> Fault | None:
    """A new uncorrected ECC error (the volatile count rose) or a row remap
    pending (newly, or already at the first look)."""
    evidence: dict[str, object] = {}
    new = cur.ecc_volatile_uncorrected
    old = prev.ecc_volatile_uncorrected if prev is not None else None
    if new is not None and old is not None and new > old:
        evidence["uncorrected_new"] = new - old
    if cur.remap_pending and not (prev is not None and prev.remap_pending):
        evidence["remap_pending"] = True
    if cur.retired_pages_pending and not (prev is not None and prev.retired_pages_pending):
        evidence["retired_pages_pending"] = True
    if not evidence:
        return None
    evidence["uncorrected_volatile"] = new
    return Fault(FaultKind.GPU_ECC, "", cur.at, evidence, gpu=cur.index)


def detect_thermal(window: Sequence[GpuSample], sustain: float) -> Fault | None:
    """Thermal or hardware slowdown in every sample for at least ``sustain``
    seconds, or the temperature at the driver's slowdown threshold.
    ``window`` is one GPU's recent samples, oldest first."""
    if not window:
        return None
    cur = window[-1]
    if (
        cur.temperature_c is not None
        and cur.slowdown_temp_c is not None
        and cur.temperature_c >= cur.slowdown_temp_c
    ):
        evidence: dict[str, object] = {"temperature_c": cur.temperature_c,
                                       "slowdown_temp_c": cur.slowdown_temp_c}
        return Fault(FaultKind.GPU_THERMAL, "", cur.at, evidence, gpu=cur.index)
    # Walk back over the unbroken run of slowed samples that ends now.
    seen, onset = 0, None
    for sample in reversed(window):
        bits = (sample.clock_event_reasons or 0) & THERMAL_REASONS
        if not bits:
            break
        seen |= bits
        onset = sample.at
    if onset is None or cur.at - onset < sustain:
        return None
    evidence = {"reasons": reason_names(seen), "for_s": round(cur.at - onset, 3),
                "temperature_c": cur.temperature_c}
    return Fault(FaultKind.GPU_THERMAL, "", onset, evidence, gpu=cur.index)
