"""NvmlSource driven by the fake pynvml: every field, NotSupported once, lost
GPUs, a missing library, event waits and the event thread. The fake itself is
checked against the installed nvidia-ml-py, so it cannot drift from the API."""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
import logging
import sys
import threading
import time

import fake_pynvml as fk
import pytest
from fake_pynvml import FakeNvml
from trainwatch.sources.nvml import GpuUnavailable, NvmlSource, error_kind
from trainwatch.types import GpuSample, XidEvent

NOW = 1234.5


def _source(fake: FakeNvml) -> NvmlSource:
    src = NvmlSource(fake, clock=lambda: NOW)
    src.start()
    return src


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml(gpus=4)


# --- the fake is the real API ----------------------------------------------------------


def test_fake_errors_are_built_like_pynvml() -> None:
    """NVMLError(value) is the registered subclass, and each subclass knows its value."""
    e = fk.NVMLError(fk.NVML_ERROR_NOT_SUPPORTED)
    assert type(e) is fk.NVMLError_NotSupported
    assert isinstance(e, fk.NVMLError)
    assert fk.NVMLError_GpuIsLost().value == fk.NVML_ERROR_GPU_IS_LOST
    assert isinstance(fk.NVMLError(fk.NVML_ERROR_RESET_REQUIRED), fk.NVMLError_ResetRequired)
    assert type(fk.NVMLError(12345)) is fk.NVMLError  # an unknown value stays the base class
    assert str(fk.NVMLError(fk.NVML_ERROR_LIBRARY_NOT_FOUND)) == "NVML Shared Library Not Found"
    with pytest.raises(TypeError):
        hash(e)  # pynvml defines __eq__ without __hash__


def test_fake_matches_installed_pynvml() -> None:
    """Every constant, error class, structure and function of the fake exists in
    nvidia-ml-py with the same value, fields and parameter names."""
    import pynvml  # nvidia-ml-py, a dependency: its absence is a failure
    fake = FakeNvml(gpus=1)
    for name, value in fk._EXPORTS.items():
        assert hasattr(pynvml, name), name
        real = getattr(pynvml, name)
        if isinstance(value, int):
            assert real == value, name
        elif isinstance(value, type) and issubclass(value, fk.NVMLError):
            if value is fk.NVMLError:
                continue
            assert real().value == value().value, name
            assert type(pynvml.NVMLError(value().value)) is real, name
        elif isinstance(value, type) and issubclass(value, ctypes.Structure | ctypes.Union):
            assert [f[0] for f in value._fields_] == [f[0] for f in real._fields_], name
    api = [n for n, _ in inspect.getmembers(FakeNvml, inspect.isfunction) if n.startswith("nvml")]
    assert len(api) > 30
    for name in api:
        real_params = list(inspect.signature(getattr(pynvml, name)).parameters)
        fake_params = list(inspect.signature(getattr(fake, name)).parameters)
        assert fake_params == real_params, name
    assert set(fk.NVMLError._valClassMapping) == set(pynvml.NVMLError._valClassMapping)


# --- start ------------------------------------------------------------------------------


def test_start_enumerates_index_uuid_name_pci(fake: FakeNvml) -> None:
    """start() finds every GPU with its UUID, name and NVML bus id (decoded from bytes)."""
    src = _source(fake)
    assert [(g.index, g.uuid, g.name, g.pci) for g in src.gpus] == [
        (i, fake.gpus[i].uuid, "NVIDIA H100 80GB HBM3", fake.gpus[i].bus_id) for i in range(4)
    ]
    assert src.bus_ids() == {"00000000:18:00.0": 0, "00000000:28:00.0": 1,
                             "00000000:38:00.0": 2, "00000000:48:00.0": 3}
    src.close()


def test_library_missing_is_gpu_unavailable() -> None:
    """No libnvidia-ml.so: start() raises GpuUnavailable naming the NVML error."""
    fake = FakeNvml(gpus=0, init_error=fk.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(GpuUnavailable, match="NVML Shared Library Not Found"):
        NvmlSource(fake).start()


def test_driver_not_loaded_is_gpu_unavailable() -> None:
    """The library is there but the kernel driver is not: GpuUnavailable too."""
    fake = FakeNvml(gpus=2, init_error=fk.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(GpuUnavailable, match="NVMLError_DriverNotLoaded"):
        NvmlSource(fake).start()


def test_bindings_missing_is_gpu_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without nvidia-ml-py the default (lazy ``import pynvml``) raises GpuUnavailable."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(GpuUnavailable, match="nvidia-ml-py"):
        NvmlSource().start()


def test_close_shuts_nvml_down_and_frees_the_event_set(fake: FakeNvml) -> None:
    """close() frees the event set and balances nvmlInit with nvmlShutdown, once."""
    src = _source(fake)
    src.close()
    src.close()
    assert fake.initialized == 0
    assert fake.event_sets[0].freed
    assert fake.count("nvmlShutdown") == 1


# --- poll -------------------------------------------------------------------------------


def test_poll_reads_every_field(fake: FakeNvml) -> None:
    """Every GpuSample field comes from its NVML call, with units converted."""
    for i, g in enumerate(fake.gpus):
        g.temperature, g.slowdown_temp, g.power_mw, g.util_gpu = 50 + i, 87, 312_500 + i, 40 + i
        g.mem_total, g.mem_used = 80 << 30, (10 + i) << 30
        g.clock_reasons = fk.nvmlClocksEventReasonSwThermalSlowdown if i == 2 else 0
        g.ecc = {(fk.NVML_MEMORY_ERROR_TYPE_CORRECTED, fk.NVML_VOLATILE_ECC): 1 + i,
                 (fk.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, fk.NVML_VOLATILE_ECC): 2 + i,
                 (fk.NVML_MEMORY_ERROR_TYPE_CORRECTED, fk.NVML_AGGREGATE_ECC): 30 + i,
                 (fk.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, fk.NVML_AGGREGATE_ECC): 40 + i}
        g.remapped = (5 + i, 6 + i, int(i == 1), int(i == 3))
        g.retired_pages_pending = i == 0
        g.pcie_replay = 7 + i
        g.nvlinks = 18
        g.nvlink_errors = {(0, fk.NVML_NVLINK_ERROR_DL_REPLAY): 1,
                           (17, fk.NVML_NVLINK_ERROR_DL_REPLAY): 2 + i,
                           (3, fk.NVML_NVLINK_ERROR_DL_CRC_FLIT): 9}
        g.recovery_action = fk.NVML_GPU_RECOVERY_ACTION_GPU_RESET if i == 1 else 0
    src = _source(fake)
    samples = src.poll()
    assert samples == [
        GpuSample(
            index=i, at=NOW, uuid=fake.gpus[i].uuid, name="NVIDIA H100 80GB HBM3",
            pci=fake.gpus[i].bus_id, temperature_c=50.0 + i, slowdown_temp_c=87.0,
            power_w=(312_500 + i) / 1000, utilization_ratio=(40 + i) / 100,
            memory_used_bytes=(10 + i) << 30, memory_total_bytes=80 << 30,
            clock_event_reasons=0x20 if i == 2 else 0,
            ecc_volatile_corrected=1 + i, ecc_volatile_uncorrected=2 + i,
            ecc_aggregate_corrected=30 + i, ecc_aggregate_uncorrected=40 + i,
            remapped_rows_corrected=5 + i, remapped_rows_uncorrected=6 + i,
            remap_pending=i == 1, remap_failure=i == 3, retired_pages_pending=i == 0,
            pcie_replay_total=7 + i,
            nvlink_errors=(("crc_flit", 9), ("crc_data", 0), ("replay", 3 + i),
                           ("recovery", 0), ("ecc_data", 0)),
            recovery_action=1 if i == 1 else 0,
        )
        for i in range(4)
    ]
    unread = [f.name for f in dataclasses.fields(GpuSample)
              if f.name != "lost" and getattr(samples[0], f.name) in (None, ())]
    assert unread == []
    assert src.counters.errors == {}
    assert src.counters.polls == 1


def test_nvml_temperature_v_is_used_where_the_driver_has_it(fake: FakeNvml) -> None:
    """nvmlDeviceGetTemperatureV is the call made; the deprecated one is not."""
    src = _source(fake)
    src.poll()
    assert fake.count("nvmlDeviceGetTemperatureV", 0) == 1
    assert fake.count("nvmlDeviceGetTemperature", 0) == 0
    assert fake.count("nvmlDeviceGetCurrentClocksThrottleReasons", 0) == 0


def test_temperature_falls_back_when_the_driver_lacks_v(fake: FakeNvml) -> None:
    """A driver without nvmlDeviceGetTemperatureV (FunctionNotFound): the older
    call from then on, and V is not tried again."""
    fake.missing.add("nvmlDeviceGetTemperatureV")
    src = _source(fake)
    first, second = src.poll(), src.poll()
    assert [s.temperature_c for s in first + second] == [40.0, 41.0, 42.0, 43.0] * 2
    assert sum(fake.count("nvmlDeviceGetTemperatureV", i) for i in range(4)) == 1
    assert fake.count("nvmlDeviceGetTemperature", 3) == 2


def test_older_bindings_fall_back_to_old_names(fake: FakeNvml) -> None:
    """Bindings without TemperatureV or ClocksEventReasons: the older functions."""
    fake.absent |= {"nvmlDeviceGetTemperatureV", "nvmlDeviceGetCurrentClocksEventReasons"}
    fake.gpus[1].clock_reasons = fk.nvmlClocksThrottleReasonHwSlowdown
    s = _source(fake).poll()[1]
    assert (s.temperature_c, s.clock_event_reasons) == (41.0, 0x8)
    assert fake.count("nvmlDeviceGetCurrentClocksThrottleReasons", 1) == 1


def test_not_supported_field_is_skipped_once(
        fake: FakeNvml, caplog: pytest.LogCaptureFixture) -> None:
    """NotSupported for power on GPU 0: None there, never asked again, logged once
    at debug; GPU 1 still reports power."""
    caplog.set_level(logging.DEBUG, logger="trainwatch.nvml")
    fake.fail(0, "nvmlDeviceGetPowerUsage", fk.NVML_ERROR_NOT_SUPPORTED)
    src = _source(fake)
    first, second = src.poll(), src.poll()
    assert first[0].power_w is None and second[0].power_w is None
    assert first[0].temperature_c == 40.0 and second[1].power_w == 300.0
    assert fake.count("nvmlDeviceGetPowerUsage", 0) == 1
    assert fake.count("nvmlDeviceGetPowerUsage", 1) == 2
    notes = [r for r in caplog.records if "not supported" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.DEBUG
    assert src.counters.unsupported == 1
    assert src.counters.errors == {"not_supported": 1}


def test_per_field_not_supported_in_field_values_is_skipped_once(fake: FakeNvml) -> None:
    """Field 230 answered NotSupported inside a successful nvmlDeviceGetFieldValues:
    recovery_action None on that GPU and the call not repeated."""
    fake.gpus[2].recovery_action = None
    src = _source(fake)
    src.poll()
    samples = src.poll()
    assert [s.recovery_action for s in samples] == [0, 0, None, 0]
    assert fake.fields_asked[(fk.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 2)] == 1
    assert fake.fields_asked[(fk.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 1)] == 2
    assert samples[2].nvlink_errors == samples[1].nvlink_errors != ()


def test_retired_pages_not_supported_on_newer_gpus(fake: FakeNvml) -> None:
    """Ampere and later answer NotSupported for retired pages: None, asked once."""
    for g in fake.gpus:
        g.retired_pages_pending = None
    src = _source(fake)
    src.poll()
    assert {s.retired_pages_pending for s in src.poll()} == {None}
    assert fake.count("nvmlDeviceGetRetiredPagesPendingStatus", 0) == 1


def test_field_values_are_one_call_per_gpu(fake: FakeNvml) -> None:
    """The recovery action and the five NVLink totals come from one
    nvmlDeviceGetFieldValues call; no per-link calls."""
    _source(fake).poll()
    assert fake.count("nvmlDeviceGetFieldValues", 0) == 1
    assert fake.count("nvmlDeviceGetNvLinkErrorCounter", 0) == 0


def test_gpu_without_nvlink_stops_asking_for_its_counters(fake: FakeNvml) -> None:
    """No NVLink: the totals answer NotSupported once, then only field 230 is asked for."""
    for g in fake.gpus:
        g.nvlinks = 0
    src = _source(fake)
    first = src.poll()
    assert {s.nvlink_errors for s in first} == {()}
    assert {s.recovery_action for s in first} == {0}
    src.poll()
    assert fake.fields_asked[(fk.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, 0)] == 1
    assert fake.fields_asked[(fk.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, 0)] == 2
    assert src.counters.unsupported == 4 * 5


def test_lost_reported_in_a_field_value(fake: FakeNvml) -> None:
    """GpuIsLost as one field value's own return code makes the GPU's sample lost too."""
    fake.gpus[1].field_errors[fk.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION] = fk.NVML_ERROR_GPU_IS_LOST
    samples = _source(fake).poll()
    assert [s.lost for s in samples] == [None, "gpu_is_lost", None, None]


def test_other_error_in_a_field_value_is_counted(fake: FakeNvml) -> None:
    """Another error code in one field value: that field None, counted, asked again."""
    fake.gpus[0].field_errors[fk.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL] = \
        fk.NVML_ERROR_UNKNOWN
    src = _source(fake)
    s = src.poll()[0]
    assert [name for name, _ in s.nvlink_errors] == ["crc_flit", "crc_data", "recovery",
                                                      "ecc_data"]
    del fake.gpus[0].field_errors[fk.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL]
    assert ("replay", 0) in src.poll()[0].nvlink_errors
    assert src.counters.errors == {"unknown": 1}


def test_gpu_lost_mid_poll(fake: FakeNvml) -> None:
    """GPU 1 falls off the bus halfway through its poll: its sample has lost set and
    no readings; GPUs 0, 2 and 3 are polled as usual, then and after."""
    src = _source(fake)
    fake.lose(1, at="nvmlDeviceGetPowerUsage")
    samples = src.poll()
    assert samples[1] == GpuSample(index=1, at=NOW, uuid=fake.gpus[1].uuid,
                                   name="NVIDIA H100 80GB HBM3", pci=fake.gpus[1].bus_id,
                                   lost="gpu_is_lost")
    assert [s.lost for s in samples] == [None, "gpu_is_lost", None, None]
    assert all(s.power_w == 300.0 for s in samples if s.index != 1)
    again = src.poll()
    assert again[1].lost == "gpu_is_lost" and again[3].temperature_c == 43.0
    assert src.counters.samples_lost == 2
    assert src.counters.errors == {"gpu_is_lost": 2}


def test_reset_required(fake: FakeNvml) -> None:
    """ResetRequired from a GPU: lost="reset_required", the others unaffected."""
    src = _source(fake)
    fake.lose(2, error=fk.NVML_ERROR_RESET_REQUIRED)
    samples = src.poll()
    assert [s.lost for s in samples] == [None, None, "reset_required", None]
    assert samples[2].temperature_c is None and samples[3].temperature_c == 43.0
    assert src.counters.errors == {"reset_required": 1}


def test_gpu_lost_at_start_is_reported_then_picked_up_again(fake: FakeNvml) -> None:
    """A GPU already lost at enumeration polls as lost; once it answers again it
    is identified and read."""
    fake.lose(3)
    src = _source(fake)
    assert src.poll()[3].lost == "gpu_is_lost"
    fake.gpus[3].lost = None
    s = src.poll()[3]
    assert (s.lost, s.uuid, s.temperature_c) == (None, fake.gpus[3].uuid, 43.0)
    assert src.gpus[3].events


def test_other_errors_are_counted_and_the_field_retried(fake: FakeNvml) -> None:
    """NoPermission on one field: counted by kind, that field None, asked again next poll."""
    fake.fail(2, "nvmlDeviceGetPcieReplayCounter", fk.NVML_ERROR_NO_PERMISSION, times=1)
    src = _source(fake)
    first, second = src.poll(), src.poll()
    assert first[2].pcie_replay_total is None and first[2].lost is None
    assert first[2].temperature_c == 42.0
    assert second[2].pcie_replay_total == 0
    assert src.counters.errors == {"no_permission": 1}
    assert fake.count("nvmlDeviceGetPcieReplayCounter", 2) == 2


def test_error_kind_names() -> None:
    """Error kinds are bounded snake_case labels from the NVMLError subclass name."""
    assert error_kind(fk.NVMLError(fk.NVML_ERROR_GPU_IS_LOST)) == "gpu_is_lost"
    assert error_kind(fk.NVMLError(fk.NVML_ERROR_LIB_RM_VERSION_MISMATCH)) == \
        "lib_rm_version_mismatch"
    assert error_kind(fk.NVMLError(4242)) == "other"


# --- Xid events -------------------------------------------------------------------------


def test_event_wait_times_out_empty(fake: FakeNvml) -> None:
    """A wait with nothing to report ends with NVMLError_Timeout: [] after the timeout."""
    src = _source(fake)
    t0 = time.monotonic()
    assert src.xid_events(60) == []
    assert time.monotonic() - t0 >= 0.05
    assert src.counters.errors == {}


def test_xid_event_becomes_xid_event(fake: FakeNvml) -> None:
    """An Xid critical error on GPU 1 (eventData 79) is XidEvent(79, gpu=1, nvml_event),
    the event's device handle matched to the GPU by address."""
    src = _source(fake)
    assert fake.emit_xid(1, 79) == 1
    assert src.xid_events(1000) == [
        XidEvent(xid=79, at=NOW, source="nvml_event", gpu=1, pci=fake.gpus[1].bus_id,
                 uuid=fake.gpus[1].uuid)
    ]
    assert fake.count("nvmlDeviceGetIndex", 1) == 0  # matched without asking NVML


def test_queued_xid_events_come_back_together(fake: FakeNvml) -> None:
    """Events already queued are returned by one call, in order."""
    src = _source(fake)
    fake.emit_xid(0, 48)
    fake.emit_xid(3, 63)
    assert [(e.gpu, e.xid) for e in src.xid_events(1000)] == [(0, 48), (3, 63)]
    assert src.counters.xid_events == 2


def test_events_registered_only_where_supported(fake: FakeNvml) -> None:
    """A GPU without Xid event support is not registered (and its Xids come from kmsg)."""
    fake.gpus[3].supported_events = fk.nvmlEventTypePState
    src = _source(fake)
    assert [g.events for g in src.gpus] == [True, True, True, False]
    assert fake.count("nvmlDeviceRegisterEvents", 3) == 0
    assert fake.event_sets[0].masks == dict.fromkeys(range(3), fk.nvmlEventTypeXidCriticalError)
    assert fake.emit_xid(3, 79) == 0


def test_event_wait_error_is_counted(fake: FakeNvml) -> None:
    """A wait failing with another NVMLError: [] and the error counted, never raised."""
    fake.fail(None, "nvmlEventSetWait_v2", fk.NVML_ERROR_UNKNOWN, times=1)
    src = _source(fake)
    assert src.xid_events(10) == []
    assert src.counters.errors == {"unknown": 1}


def test_event_thread_delivers_xid_and_stops_promptly(fake: FakeNvml) -> None:
    """The event thread hands an Xid to the callback, and stop() returns within one wait."""
    src = _source(fake)
    got: list[XidEvent] = []
    arrived = threading.Event()

    def callback(events: list[XidEvent]) -> None:
        got.extend(events)
        arrived.set()

    assert src.start_event_thread(callback)
    time.sleep(0.05)  # the thread is blocked in nvmlEventSetWait_v2
    fake.emit_xid(2, 79)
    assert arrived.wait(2.0)
    assert [(e.xid, e.gpu, e.source) for e in got] == [(79, 2, "nvml_event")]
    thread = src._thread
    t0 = time.monotonic()
    src.stop()
    assert time.monotonic() - t0 < 1.0
    assert thread is not None and not thread.is_alive()
    src.close()


def test_event_thread_survives_a_failing_callback(fake: FakeNvml) -> None:
    """A callback that raises is logged; the next Xid is still delivered."""
    src = _source(fake)
    calls: list[int] = []
    second = threading.Event()

    def callback(events: list[XidEvent]) -> None:
        calls.append(events[0].xid)
        if len(calls) == 1:
            raise RuntimeError("boom")
        second.set()

    src.start_event_thread(callback, wait_ms=50)
    fake.emit_xid(0, 13)
    deadline = time.monotonic() + 2.0
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    fake.emit_xid(0, 31)
    assert second.wait(2.0)
    assert calls == [13, 31]
    src.close()


def test_no_event_thread_without_event_support() -> None:
    """No GPU supports Xid events: start_event_thread says so and starts nothing."""
    fake = FakeNvml(gpus=2)
    for g in fake.gpus:
        g.supported_events = 0
    src = _source(fake)
    assert not src.start_event_thread(lambda events: None)
    assert src._thread is None
