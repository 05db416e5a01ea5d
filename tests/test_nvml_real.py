"""NvmlSource against the real NVML on a machine with NVIDIA GPUs.

Skipped only when NVML is absent (no libnvidia-ml, or no driver loaded); any
other NVML failure on a GPU machine is a failure, not a skip."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pynvml  # nvidia-ml-py, a dependency: its absence is a broken install, not a skip
import pytest
from trainwatch.sources.nvml import NvmlSource
from trainwatch.types import XidEvent


@pytest.fixture(scope="module")
def nvml() -> Iterator[Any]:
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded) as e:
        # The one thing no install step can provide is the GPU itself. A host that has
        # an NVIDIA device node but no working NVML is broken, and fails even here.
        if os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0"):
            pytest.fail(f"an NVIDIA device is present but NVML is not usable: {e}")
        pytest.skip(f"NVML is absent (no NVIDIA GPU on this host): {e}")
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture
def source(nvml: Any) -> Iterator[NvmlSource]:
    src = NvmlSource(nvml)
    src.start()
    try:
        yield src
    finally:
        src.close()


def test_poll_returns_one_sample_per_gpu(nvml: Any, source: NvmlSource) -> None:
    """One sample per GPU NVML counts, each with a UUID, a name, a bus id and a temperature."""
    samples = source.poll()
    assert [s.index for s in samples] == list(range(nvml.nvmlDeviceGetCount()))
    for s in samples:
        assert s.lost is None, s
        assert s.uuid is not None and s.uuid.startswith(("GPU-", "MIG-")), s
        assert s.name and s.pci, s
        assert s.temperature_c is not None and 0 < s.temperature_c < 120, s
        assert s.memory_total_bytes and s.memory_total_bytes > 1 << 30, s
        assert s.utilization_ratio is not None and 0 <= s.utilization_ratio <= 1, s
    assert set(source.counters.errors) <= {"not_supported", "function_not_found"}


def test_identity_matches_nvml(nvml: Any, source: NvmlSource) -> None:
    """The UUID and bus id of each sample are those NVML gives for that index."""
    for s in source.poll():
        h = nvml.nvmlDeviceGetHandleByIndex(s.index)
        assert s.uuid == nvml.nvmlDeviceGetUUID(h)
        bus = nvml.nvmlDeviceGetPciInfo(h).busId
        assert s.pci == (bus.decode() if isinstance(bus, bytes) else bus)


def test_second_poll_asks_nothing_unsupported_again(source: NvmlSource) -> None:
    """Fields found unsupported in the first poll are not counted again in the second."""
    source.poll()
    first = dict(source.counters.errors)
    source.poll()
    assert source.counters.errors == first


def test_event_set_can_be_created(nvml: Any) -> None:
    """An event set is created and Xid events registered on each GPU that supports them."""
    event_set = nvml.nvmlEventSetCreate()
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            if nvml.nvmlDeviceGetSupportedEventTypes(h) & nvml.nvmlEventTypeXidCriticalError:
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, event_set)
    finally:
        nvml.nvmlEventSetFree(event_set)


def test_event_wait_times_out_and_the_thread_stops(source: NvmlSource) -> None:
    """On a healthy GPU a wait ends empty, and the event thread stops within one wait."""
    t0 = time.monotonic()
    assert source.xid_events(200) == []
    assert time.monotonic() - t0 >= 0.15
    got: list[XidEvent] = []
    if source.start_event_thread(got.extend):
        time.sleep(0.2)
        t0 = time.monotonic()
        source.stop()
        assert time.monotonic() - t0 < 1.0
    assert got == []
