"""GpuHealth: detectors over a stream of samples and Xids, with per-GPU state."""

from __future__ import annotations

import dataclasses

from trainwatch.detectors.gpu import HW_SLOWDOWN
from trainwatch.sources.gpusim import SimGpus
from trainwatch.state.gpuhealth import GpuHealth, GpuState
from trainwatch.types import FaultKind, GpuSample, XidEvent


def test_gpus_are_unknown_until_seen_and_while_the_source_is_down() -> None:
    """A GPU never polled, or polled while the source is down, is unknown, never healthy."""
    h = GpuHealth()
    assert h.state(0) is GpuState.UNKNOWN
    assert h.samples(SimGpus(2, clock=lambda: 0.0).poll()) == []
    assert h.state(0) is GpuState.HEALTHY
    h.source_down()
    assert h.state(0) is GpuState.UNKNOWN


def test_a_lost_gpu_is_reported_once_and_is_unknown() -> None:
    """GpuIsLost in consecutive polls is one gpu_lost fault, and the GPU reads unknown."""
    h = GpuHealth()
    lost = GpuSample(index=3, at=1.0, lost="gpu_is_lost")
    assert [f.kind for f in h.samples([lost])] == [FaultKind.GPU_LOST]
    assert h.samples([GpuSample(index=3, at=2.0, lost="gpu_is_lost")]) == []
    assert h.state(3) is GpuState.UNKNOWN


def test_one_thermal_fault_per_episode() -> None:
    """Sustained slowdown raises gpu_thermal once; it may fire again after it clears."""
    h = GpuHealth(thermal_sustain=2.0)
    hot = [GpuSample(index=0, at=float(t), clock_event_reasons=HW_SLOWDOWN) for t in range(5)]
    kinds = [f.kind for s in hot for f in h.samples([s])]
    assert kinds == [FaultKind.GPU_THERMAL]
    assert h.samples([GpuSample(index=0, at=5.0, clock_event_reasons=0)]) == []
    again = [GpuSample(index=0, at=float(t), clock_event_reasons=HW_SLOWDOWN) for t in range(6, 9)]
    assert [f.kind for s in again for f in h.samples([s])] == [FaultKind.GPU_THERMAL]


def test_an_xid_from_two_paths_is_one_fault_and_exclusion_sticks() -> None:
    """NVML event + kernel log copy: one gpu_xid fault; an excluded GPU stays excluded."""
    h = GpuHealth(dedup_window=10.0)
    assert h.xid(XidEvent(79, at=1.0, source="nvml_event", gpu=1)) is not None
    assert h.xid(XidEvent(79, at=1.2, source="kmsg", gpu=1)) is None
    h.samples(SimGpus(4, clock=lambda: 2.0).poll())
    h.exclude(1, "xid 79", at=2.0)
    assert h.state(1) is GpuState.EXCLUDED and h.excluded() == {1: "xid 79"}
    h.samples(SimGpus(4, clock=lambda: 3.0).poll())
    assert h.state(1) is GpuState.EXCLUDED
    h.clear(1)
    assert h.state(1) is GpuState.HEALTHY


def test_an_excluded_gpu_returns_only_after_a_clean_recheck_period() -> None:
    """An excluded GPU returns once readable and fault-free for the period; an Xid resets it."""
    h = GpuHealth()
    h.samples(SimGpus(2, clock=lambda: 0.0).poll())
    h.exclude(1, "xid 79", at=0.0)
    h.samples([GpuSample(index=1, at=50.0, lost="gpu_is_lost")])
    assert h.passed_recheck(now=100.0, after=60.0) == []  # lost at 50: the clock restarted
    h.samples(SimGpus(2, clock=lambda: 100.0).poll())
    assert h.passed_recheck(now=109.0, after=60.0) == []
    assert h.passed_recheck(now=111.0, after=60.0) == [1]
    h.xid(XidEvent(13, at=112.0, source="kmsg", gpu=1))
    assert h.passed_recheck(now=150.0, after=60.0) == []
    assert h.passed_recheck(now=173.0, after=60.0) == [1]


def test_a_gpu_with_a_failed_row_remap_never_returns_by_itself() -> None:
    """A failed remap does not heal with time: the GPU stays excluded until a person clears it."""
    h = GpuHealth()
    h.exclude(0, "xid 64", at=0.0)
    failed = dataclasses.replace(SimGpus(1, clock=lambda: 10.0).poll()[0], remap_failure=True)
    h.samples([failed])
    assert h.passed_recheck(now=10_000.0, after=60.0) == []
    assert h.state(0) is GpuState.EXCLUDED


def test_xids_are_counted_by_gpu_xid_and_class_once_per_error() -> None:
    """The exporter's Xid counter: duplicates across paths count once; unmapped GPUs as None."""
    h = GpuHealth(dedup_window=10.0)
    h.xid(XidEvent(79, at=1.0, source="nvml_event", gpu=1))
    h.xid(XidEvent(79, at=1.5, source="kmsg", gpu=1))
    h.xid(XidEvent(79, at=30.0, source="kmsg", gpu=1))
    h.xid(XidEvent(13, at=2.0, source="kmsg", gpu=None))
    assert h.xid_counts == {(1, 79, "restart_bm"): 2, (None, 13, "restart_app"): 1}
