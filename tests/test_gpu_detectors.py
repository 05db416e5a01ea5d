"""GPU detectors: pure functions over samples and Xid events, table-driven."""

from __future__ import annotations

import pytest
from trainwatch.detectors.gpu import (
    HW_SLOWDOWN,
    HW_THERMAL_SLOWDOWN,
    detect_ecc,
    detect_lost,
    detect_thermal,
    detect_xid,
    is_duplicate,
)
from trainwatch.types import FaultKind, GpuSample, XidEvent


def s(at: float = 0.0, **kw: object) -> GpuSample:
    return GpuSample(index=1, at=at, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prev", "cur", "expect"),
    [
        (None, s(ecc_volatile_uncorrected=0), None),
        (s(ecc_volatile_uncorrected=0), s(ecc_volatile_uncorrected=0), None),
        (s(ecc_volatile_uncorrected=0), s(ecc_volatile_uncorrected=2), {"uncorrected_new": 2}),
        (None, s(ecc_volatile_uncorrected=5), None),  # old errors at start are no new fault
        (None, s(remap_pending=True), {"remap_pending": True}),
        (s(remap_pending=True), s(remap_pending=True), None),  # reported once
        (s(remap_pending=False), s(remap_pending=True), {"remap_pending": True}),
        (s(retired_pages_pending=False), s(retired_pages_pending=True),
         {"retired_pages_pending": True}),
        (s(), s(), None),  # nothing supported: nothing to say
    ],
    ids=["start-clean", "unchanged", "new-uncorrected", "old-at-start", "remap-at-start",
         "remap-again", "remap-new", "retired-pages", "unsupported"],
)
def test_ecc_fires_on_new_uncorrected_errors_and_pending_remaps(
    prev: GpuSample | None, cur: GpuSample, expect: dict[str, object] | None
) -> None:
    """gpu_ecc fires on a rise in volatile uncorrected errors or a newly pending remap."""
    fault = detect_ecc(prev, cur)
    if expect is None:
        assert fault is None
    else:
        assert fault is not None and fault.kind is FaultKind.GPU_ECC and fault.gpu == 1
        assert expect.items() <= fault.evidence.items()


@pytest.mark.parametrize(
    ("samples", "fires"),
    [
        ([s(0, clock_event_reasons=HW_SLOWDOWN), s(10, clock_event_reasons=HW_SLOWDOWN)], True),
        ([s(0, clock_event_reasons=HW_SLOWDOWN), s(10, clock_event_reasons=0)], False),
        ([s(0, clock_event_reasons=HW_THERMAL_SLOWDOWN)], False),  # one sample is not sustained
        ([s(0, clock_event_reasons=0x1), s(10, clock_event_reasons=0x1)], False),  # idle
        ([s(8, clock_event_reasons=HW_SLOWDOWN), s(10, clock_event_reasons=HW_SLOWDOWN)], False),
        ([s(0, temperature_c=91.0, slowdown_temp_c=90.0)], True),
        ([s(0, temperature_c=89.0, slowdown_temp_c=90.0)], False),
        ([], False),
    ],
    ids=["sustained-hw", "recovered", "single", "idle-bit", "too-short", "over-threshold",
         "under-threshold", "empty"],
)
def test_thermal_fires_on_sustained_slowdown_or_temperature_over_threshold(
    samples: list[GpuSample], fires: bool
) -> None:
    """gpu_thermal needs slowdown in every sample for the sustain window, or heat past it."""
    fault = detect_thermal(samples, sustain=10.0)
    assert (fault is not None) is fires
    if fault is not None:
        assert fault.kind is FaultKind.GPU_THERMAL


def test_lost_gpu_is_a_fault_and_a_readable_one_is_not() -> None:
    """A sample NVML could not read (GpuIsLost) is gpu_lost; a normal one is nothing."""
    assert detect_lost(s()) is None
    fault = detect_lost(s(lost="gpu_is_lost"))
    assert fault is not None and fault.kind is FaultKind.GPU_LOST and fault.gpu == 1


def test_one_xid_seen_by_two_paths_is_one_fault() -> None:
    """The kernel log's copy of an NVML Xid event (same GPU, same Xid, close in time) is a dup."""
    first = XidEvent(79, at=100.0, source="nvml_event", gpu=1)
    drill = XidEvent(79, at=100.1, source="drill", gpu=1, injected=True)
    assert not is_duplicate([first], drill, window=10.0)  # a drill never hides a real one
    assert not is_duplicate([], first, window=10.0)
    assert is_duplicate([first], XidEvent(79, at=100.4, source="kmsg", gpu=1), window=10.0)
    assert not is_duplicate([first], XidEvent(79, at=100.4, source="kmsg", gpu=2), window=10.0)
    assert not is_duplicate([first], XidEvent(48, at=100.4, source="kmsg", gpu=1), window=10.0)
    assert not is_duplicate([first], XidEvent(79, at=200.0, source="kmsg", gpu=1), window=10.0)
    fault = detect_xid(XidEvent(79, at=1.0, source="kmsg", gpu=1, message="fallen off the bus"))
    assert fault.kind is FaultKind.GPU_XID and fault.evidence["xid"] == 79 and fault.gpu == 1
