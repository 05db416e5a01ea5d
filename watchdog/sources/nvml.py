"""The NVML source: polls every GPU through pynvml (nvidia-ml-py) into GpuSample
observations, and waits on an NVML event set for Xid critical errors (that half
in nvmlevents.py).

The pynvml module is injected (tests pass a fake; the default imports the real
one lazily, so importing this module never needs a driver). pynvml has no type
stubs: the module is held as ``Any`` in ``self._nvml`` and every value read
from it is converted to a plain int, float, str or bool before it leaves here.

What NVML says is trusted as far as it goes and no further:

- ``NVMLError_NotSupported`` (or a function the driver or bindings lack) for one
  field on one GPU: that field stays None on that GPU and is never asked again.
- ``NVMLError_GpuIsLost`` / ``NVMLError_ResetRequired``: the GPU's sample carries
  ``lost`` and no readings; the other GPUs are polled as usual.
- Any other NVMLError on a field: counted by kind, that field is None this poll.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from typing import Any

from trainwatch.sources.nvmlevents import (
    Clock,
    Gpu,
    XidEvents,
    error_kind,
    handle_key,
)
from trainwatch.types import GpuSample

log = logging.getLogger("trainwatch.nvml")

# Read together in one nvmlDeviceGetFieldValues call: (name, pynvml constant,
# its value in nvml.h for bindings that predate it). The NVLink ``*_TOTAL``
# fields are the driver's own sums over all links (what DCGM exports), one
# call instead of links x counters nvmlDeviceGetNvLinkErrorCounter calls.
_FIELDS = (
    ("recovery_action", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", 230),
    ("nvlink_crc_flit", "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", 38),
    ("nvlink_crc_data", "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", 45),
    ("nvlink_replay", "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", 52),
    ("nvlink_recovery", "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", 59),
    ("nvlink_ecc_data", "NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_TOTAL", 160),
)


class GpuUnavailable(RuntimeError):
    """NVML cannot be used on this host (no bindings, no driver, no library)."""


class _Lost(Exception):
    """Internal: the GPU answered GpuIsLost or ResetRequired."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class _Unsupported(Exception):
    """Internal: the field cannot be read on this GPU, now or later."""


class _Missing(_Unsupported):
    """Internal: the function is absent from the bindings or from the driver."""


Reading = dict[str, Any]  # GpuSample field name -> value


class NvmlSource(XidEvents):
    """GPU health from NVML. ``start()``, then ``poll()`` at the configured rate;
    Xid events through ``xid_events()`` or ``start_event_thread()``; ``close()``."""

    def __init__(self, nvml: Any | None = None, clock: Clock = time.monotonic) -> None:
        super().__init__(clock)
        self._nvml: Any = nvml
        self._skip: set[tuple[int, str]] = set()  # (gpu index, field) not supported
        self._warned: set[tuple[int, str, str]] = set()
        self._temp_v = True  # nvmlDeviceGetTemperatureV exists in bindings and driver
        self._event_reasons = True  # ...CurrentClocksEventReasons, else ...ThrottleReasons
        self._started = False
        self._readers: tuple[tuple[str, Callable[[Any], Reading]], ...] = (
            ("temperature", self._temperature),
            ("slowdown_temp", self._slowdown_temp),
            ("power", self._power),
            ("utilization", self._utilization),
            ("memory", self._memory),
            ("clock_event_reasons", self._clock_event_reasons),
            *((f"ecc_{vol}_{kind}", self._ecc(vol, kind))
              for vol in ("volatile", "aggregate") for kind in ("corrected", "uncorrected")),
            ("remapped_rows", self._remapped_rows),
            ("retired_pages_pending", self._retired_pages_pending),
            ("pcie_replay", self._pcie_replay),
            ("field_values", self._field_values),
        )

    # --- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        """Load NVML and enumerate the GPUs; GpuUnavailable if NVML cannot load."""
        nvml = self._load()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise GpuUnavailable(f"NVML cannot be initialised: {e} ({type(e).__name__})") from e
        self._started = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as e:
            self.close()
            raise GpuUnavailable(f"NVML cannot count the GPUs: {e} ({type(e).__name__})") from e
        self.gpus = [self._enumerate(i) for i in range(count)]
        if not self.gpus:
            log.warning("NVML loaded but reports no GPUs")
        self._register_events()

    def close(self) -> None:
        """Stop the event thread, free the event set and shut NVML down."""
        self.stop()
        if not self._started:
            return
        nvml = self._nvml
        self._started = False
        if self._event_set is not None:
            try:
                nvml.nvmlEventSetFree(self._event_set)
            except nvml.NVMLError as e:
                self._count_error(e)
            self._event_set = None
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as e:
            self._count_error(e)

    def _load(self) -> Any:
        if self._nvml is None:
            try:
                # By name: pynvml ships no type stubs, and it is held as Any here anyway.
                self._nvml = importlib.import_module("pynvml")
            except ImportError as e:
                raise GpuUnavailable("NVML bindings missing: install nvidia-ml-py") from e
        return self._nvml

    def _enumerate(self, index: int) -> Gpu:
        gpu = Gpu(index)
        try:
            self._identify(gpu)
        except _Lost as lost:
            log.warning("GPU %d: %s at enumeration", index, lost.kind)
        except (_Unsupported, self._nvml.NVMLError) as e:
            if not isinstance(e, _Unsupported):
                self._count_error(e)
            log.warning("GPU %d: no handle (%s)", index, e)
        return gpu

    def _identify(self, gpu: Gpu) -> None:
        """Handle, UUID, name and bus id. Raises _Lost."""
        nvml = self._nvml
        h = self._call(nvml.nvmlDeviceGetHandleByIndex, gpu.index)
        self._by_key[handle_key(h)] = gpu
        gpu.uuid = self._text(lambda: nvml.nvmlDeviceGetUUID(h))
        gpu.name = self._text(lambda: nvml.nvmlDeviceGetName(h))
        gpu.pci = self._text(lambda: nvml.nvmlDeviceGetPciInfo(h).busId)
        gpu.handle = h

    def _text(self, read: Callable[[], Any]) -> str | None:
        """A string attribute; bytes from a ctypes char array are decoded."""
        try:
            v = self._call(read)
        except _Unsupported:
            return None
        except self._nvml.NVMLError as e:
            self._count_error(e)
            return None
        return v.decode(errors="replace") if isinstance(v, bytes) else str(v)

    # --- polling ---------------------------------------------------------------

    def poll(self) -> list[GpuSample]:
        """One sample per enumerated GPU, in index order."""
        with self._lock:
            self.counters.polls += 1
        return [self._poll_one(g) for g in self.gpus]

    def _poll_one(self, gpu: Gpu) -> GpuSample:
        try:
            if gpu.handle is None:
                self._identify(gpu)  # refused or lost at enumeration: try again
                self._register(gpu)
            values: Reading = {}
            for name, read in self._readers:
                values.update(self._field(gpu, name, read))
        except _Lost as lost:
            with self._lock:
                self.counters.samples_lost += 1
            return GpuSample(at=self.clock(), lost=lost.kind, **self._ident(gpu))
        except (_Unsupported, self._nvml.NVMLError) as e:
            # Still no handle: a GPU that cannot be read is unknown, not healthy.
            if not isinstance(e, _Unsupported):
                self._count_error(e)
            return GpuSample(at=self.clock(), **self._ident(gpu))
        return GpuSample(at=self.clock(), **self._ident(gpu), **values)

    @staticmethod
    def _ident(gpu: Gpu) -> dict[str, Any]:
        return {"index": gpu.index, "uuid": gpu.uuid, "name": gpu.name, "pci": gpu.pci}

    def _field(self, gpu: Gpu, name: str, read: Callable[[Any], Reading]) -> Reading:
        if (gpu.index, name) in self._skip:
            return {}
        try:
            return read(gpu)
        except _Unsupported as e:
            self._unsupported(gpu, name, e)
        except self._nvml.NVMLError as e:
            self._failed(gpu, name, e)
        return {}

    def _unsupported(self, gpu: Gpu, name: str, e: BaseException) -> None:
        self._skip.add((gpu.index, name))
        with self._lock:
            self.counters.unsupported += 1
        log.debug("GPU %d: %s not supported (%s); not read again", gpu.index, name, e)

    def _failed(self, gpu: Gpu, name: str, e: BaseException) -> None:
        kind = self._count_error(e)
        if (gpu.index, name, kind) not in self._warned:
            self._warned.add((gpu.index, name, kind))
            log.warning("GPU %d: reading %s failed: %s (counted from now on)", gpu.index, name, e)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call into NVML, turning the errors that have a fixed meaning into
        _Lost and _Unsupported; any other NVMLError propagates."""
        nvml = self._nvml
        try:
            return fn(*args)
        except (nvml.NVMLError_GpuIsLost, nvml.NVMLError_ResetRequired) as e:
            kind = self._count_error(e)
            raise _Lost(kind) from e
        except nvml.NVMLError_FunctionNotFound as e:
            self._count_error(e)
            raise _Missing(error_kind(e)) from e
        except nvml.NVMLError_NotSupported as e:
            self._count_error(e)
            raise _Unsupported(error_kind(e)) from e

    def _fn(self, name: str) -> Callable[..., Any]:
        fn: Callable[..., Any] | None = getattr(self._nvml, name, None)
        if fn is None:
            raise _Missing(f"{name} missing from these bindings")
        return fn

    # One reader per field (or group of fields read by one call). Each returns
    # the GpuSample fields it read, or raises.

    def _temperature(self, gpu: Gpu) -> Reading:
        sensor = self._nvml.NVML_TEMPERATURE_GPU
        if self._temp_v:
            try:
                t = self._call(self._fn("nvmlDeviceGetTemperatureV"), gpu.handle, sensor)
                return {"temperature_c": float(t)}
            except _Missing:
                self._temp_v = False  # bindings or driver predate it: the older call from now on
        t = self._call(self._fn("nvmlDeviceGetTemperature"), gpu.handle, sensor)
        return {"temperature_c": float(t)}

    def _slowdown_temp(self, gpu: Gpu) -> Reading:
        nvml = self._nvml
        fn = self._fn("nvmlDeviceGetTemperatureThreshold")
        t = self._call(fn, gpu.handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        return {"slowdown_temp_c": float(t)}

    def _power(self, gpu: Gpu) -> Reading:
        mw = self._call(self._fn("nvmlDeviceGetPowerUsage"), gpu.handle)
        return {"power_w": int(mw) / 1000.0}

    def _utilization(self, gpu: Gpu) -> Reading:
        u = self._call(self._fn("nvmlDeviceGetUtilizationRates"), gpu.handle)
        return {"utilization_ratio": int(u.gpu) / 100.0}

    def _memory(self, gpu: Gpu) -> Reading:
        m = self._call(self._fn("nvmlDeviceGetMemoryInfo"), gpu.handle)
        return {"memory_used_bytes": int(m.used), "memory_total_bytes": int(m.total)}

    def _clock_event_reasons(self, gpu: Gpu) -> Reading:
        if self._event_reasons:
            try:
                fn = self._fn("nvmlDeviceGetCurrentClocksEventReasons")
                return {"clock_event_reasons": int(self._call(fn, gpu.handle))}
            except _Missing:
                self._event_reasons = False  # bindings or driver predate the rename
        fn = self._fn("nvmlDeviceGetCurrentClocksThrottleReasons")
        return {"clock_event_reasons": int(self._call(fn, gpu.handle))}

    def _ecc(self, counter: str, kind: str) -> Callable[[Gpu], Reading]:
        def read(gpu: Gpu) -> Reading:
            nvml = self._nvml
            error_type = (nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED if kind == "corrected"
                          else nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
            counter_type = (nvml.NVML_VOLATILE_ECC if counter == "volatile"
                            else nvml.NVML_AGGREGATE_ECC)
            n = self._call(self._fn("nvmlDeviceGetTotalEccErrors"), gpu.handle,
                           error_type, counter_type)
            return {f"ecc_{counter}_{kind}": int(n)}

        return read

    def _remapped_rows(self, gpu: Gpu) -> Reading:
        corr, unc, pending, failure = self._call(self._fn("nvmlDeviceGetRemappedRows"),
                                                 gpu.handle)
        return {"remapped_rows_corrected": int(corr), "remapped_rows_uncorrected": int(unc),
                "remap_pending": bool(pending), "remap_failure": bool(failure)}

    def _retired_pages_pending(self, gpu: Gpu) -> Reading:
        # Page retirement is pre-Ampere; Ampere and later answer NotSupported
        # (they remap rows instead), so this is skipped there after one call.
        v = self._call(self._fn("nvmlDeviceGetRetiredPagesPendingStatus"), gpu.handle)
        return {"retired_pages_pending": int(v) == int(self._nvml.NVML_FEATURE_ENABLED)}

    def _pcie_replay(self, gpu: Gpu) -> Reading:
        n = self._call(self._fn("nvmlDeviceGetPcieReplayCounter"), gpu.handle)
        return {"pcie_replay_total": int(n)}

    def _field_values(self, gpu: Gpu) -> Reading:
        """The recovery action and the NVLink error totals, in one call. Each value
        carries its own return code, and each field is skipped on its own."""
        nvml = self._nvml
        wanted = [(name, int(getattr(nvml, const, default))) for name, const, default in _FIELDS
                  if (gpu.index, name) not in self._skip]
        if not wanted:
            return {}
        values = self._call(self._fn("nvmlDeviceGetFieldValues"), gpu.handle,
                            [fid for _, fid in wanted])
        out: Reading = {}
        nvlink: list[tuple[str, int]] = []
        for (name, _), v in zip(wanted, values, strict=True):
            ret = int(v.nvmlReturn)
            if ret != nvml.NVML_SUCCESS:
                if ret == nvml.NVML_ERROR_INVALID_ARGUMENT:  # a field this driver does not know
                    self._unsupported(gpu, name, _Unsupported("invalid_argument"))
                    continue
                try:
                    # NVMLError(ret) is the registered subclass: raised through _call it
                    # means here what it means from any other call (lost, unsupported).
                    self._call(_raise, nvml.NVMLError(ret))
                except _Unsupported as e:
                    self._unsupported(gpu, name, e)
                except nvml.NVMLError as e:
                    self._failed(gpu, name, e)
                continue
            if name == "recovery_action":
                out[name] = _field_value(nvml, v)
            else:
                nvlink.append((name.removeprefix("nvlink_"), _field_value(nvml, v)))
        if nvlink:
            out["nvlink_errors"] = tuple(nvlink)
        return out

    # --- for the kernel-log source -------------------------------------------------

    def bus_ids(self) -> dict[str, int]:
        """PCI bus id as NVML spells it ("00000000:06:00.0") -> GPU index."""
        return {g.pci: g.index for g in self.gpus if g.pci}


def _raise(e: BaseException) -> None:
    raise e


def _field_value(nvml: Any, v: Any) -> int:
    """The value of one nvmlFieldValue_t, by its valueType."""
    member = {
        nvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        nvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
    }.get(int(v.valueType), "uiVal")
    return int(getattr(v.value, member))
