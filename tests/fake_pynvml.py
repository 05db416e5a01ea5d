"""A fake ``pynvml`` (nvidia-ml-py) for machines without a GPU.

Names, constants, signatures and the ``NVMLError`` hierarchy are those of the
real module (nvidia-ml-py 13.615.71; ``test_nvml_source.py`` checks them
against the installed one). The error classes are built the way pynvml builds
them: one ``NVMLError`` whose ``__new__`` maps an error value to the subclass
that ``_extractNVMLErrorsAsClasses`` registered for it, so
``NVMLError(NVML_ERROR_NOT_SUPPORTED)`` is an ``NVMLError_NotSupported``.

A ``FakeNvml(gpus=4)`` instance is the module: pass it where the real module
would go. Per-GPU values live in ``fake.gpus[i]`` (``FakeGpu``) and may be
changed between polls; failures are injected per GPU and per function
(``fail``, ``lose``, ``missing``, ``absent``, ``init_error``); ``emit_xid``
queues an Xid critical-error event; ``calls`` counts every call made.
"""

from __future__ import annotations

import ctypes
import string
import sys
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

# --- constants (values as in pynvml) ---------------------------------------------

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1

NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_TEMPERATURE_THRESHOLD_MEM_MAX = 2
NVML_TEMPERATURE_THRESHOLD_GPU_MAX = 3
nvmlTemperature_v1 = 0x100000C

NVML_SINGLE_BIT_ECC = 0
NVML_DOUBLE_BIT_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1

NVML_NVLINK_MAX_LINKS = 36
NVML_NVLINK_ERROR_DL_REPLAY = 0
NVML_NVLINK_ERROR_DL_RECOVERY = 1
NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
NVML_NVLINK_ERROR_DL_CRC_DATA = 3
NVML_NVLINK_ERROR_DL_ECC_DATA = 4

NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4
NVML_VALUE_TYPE_SIGNED_INT = 5
NVML_VALUE_TYPE_UNSIGNED_SHORT = 6

NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL = 38
NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL = 45
NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL = 52
NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL = 59
NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_TOTAL = 160
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
NVML_GPU_RECOVERY_ACTION_NONE = 0
NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
NVML_GPU_RECOVERY_ACTION_DRAIN_P2P = 3
NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET = 4

nvmlEventTypeSingleBitEccError = 0x0000000000000001
nvmlEventTypeDoubleBitEccError = 0x0000000000000002
nvmlEventTypePState = 0x0000000000000004
nvmlEventTypeXidCriticalError = 0x0000000000000008
nvmlEventTypeClock = 0x0000000000000010
nvmlEventTypeNone = 0x0000000000000000

nvmlClocksEventReasonGpuIdle = 0x0000000000000001
nvmlClocksEventReasonApplicationsClocksSetting = 0x0000000000000002
nvmlClocksEventReasonSwPowerCap = 0x0000000000000004
nvmlClocksEventReasonHwSlowdown = 0x0000000000000008
nvmlClocksEventReasonSyncBoost = 0x0000000000000010
nvmlClocksEventReasonSwThermalSlowdown = 0x0000000000000020
nvmlClocksEventReasonHwThermalSlowdown = 0x0000000000000040
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x0000000000000080
nvmlClocksEventReasonNone = 0x0000000000000000
nvmlClocksThrottleReasonHwSlowdown = 0x0000000000000008
nvmlClocksThrottleReasonSwThermalSlowdown = 0x0000000000000020
nvmlClocksThrottleReasonHwThermalSlowdown = 0x0000000000000040
nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 0x0000000000000080


# --- errors, built as pynvml builds them -------------------------------------------


class NVMLError(Exception):
    _valClassMapping: ClassVar[dict[int, type[NVMLError]]] = {}
    _errcode_to_string: ClassVar[dict[int, str]] = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }
    value: int

    def __new__(cls, value: int) -> NVMLError:
        """Maps value to the registered subclass, as pynvml's NVMLError.__new__ does."""
        typ: type[NVMLError] = cls
        if cls is NVMLError:
            typ = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(typ)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return NVMLError._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    # pynvml defines __eq__ (and so no __hash__): its errors are unhashable too.
    def __eq__(self, other: object) -> bool:
        return self.value == other.value  # type: ignore[attr-defined,no-any-return]


def nvmlExceptionClass(nvmlErrorCode: int) -> type[NVMLError]:
    if nvmlErrorCode not in NVMLError._valClassMapping:
        raise ValueError(f"nvmlErrorCode {nvmlErrorCode} is not valid")
    return NVMLError._valClassMapping[nvmlErrorCode]


def _extractNVMLErrorsAsClasses() -> None:
    """One NVMLError subclass per NVML_ERROR_* constant, set on this module:
    NVML_ERROR_GPU_IS_LOST -> NVMLError_GpuIsLost (pynvml's own recipe)."""
    this_module = sys.modules[__name__]
    for err_name in [x for x in dir(this_module) if x.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(
            err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        err_val = getattr(this_module, err_name)

        def gen_new(val: int) -> Any:
            def new(typ: type[NVMLError], *args: Any) -> NVMLError:
                return NVMLError.__new__(typ, val)
            return new

        new_error_class = type(class_name, (NVMLError,), {"__new__": gen_new(err_val)})
        new_error_class.__module__ = __name__
        setattr(this_module, class_name, new_error_class)
        NVMLError._valClassMapping[err_val] = new_error_class


_extractNVMLErrorsAsClasses()


# --- structures (field names as in pynvml) -----------------------------------------


class _FakeDevice(ctypes.Structure):
    """What a handle points to. Real handles are ctypes pointers to an opaque
    struct: a fresh pointer object per call, equal only by address."""

    _fields_ = [("index", ctypes.c_uint)]


c_nvmlDevice_t = ctypes.POINTER(_FakeDevice)


class nvmlPciInfo_t(ctypes.Structure):
    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    ]


class c_nvmlMemory_t(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class c_nvmlUtilization_t(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class c_nvmlValue_t(ctypes.Union):
    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class c_nvmlFieldValue_t(ctypes.Structure):
    _fields_ = [
        ("fieldId", ctypes.c_uint32),
        ("scopeId", ctypes.c_uint32),
        ("timestamp", ctypes.c_int64),
        ("latencyUsec", ctypes.c_int64),
        ("valueType", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", c_nvmlValue_t),
    ]


class c_nvmlEventData_t(ctypes.Structure):
    _fields_ = [
        ("device", c_nvmlDevice_t),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


# --- the simulated machine -----------------------------------------------------------

XID_EVENTS = (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError
              | nvmlEventTypePState | nvmlEventTypeXidCriticalError | nvmlEventTypeClock)
# NVLink *_TOTAL field -> the per-link counter it sums (as the driver does)
_NVLINK_TOTALS = {
    NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: NVML_NVLINK_ERROR_DL_CRC_FLIT,
    NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: NVML_NVLINK_ERROR_DL_CRC_DATA,
    NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: NVML_NVLINK_ERROR_DL_REPLAY,
    NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: NVML_NVLINK_ERROR_DL_RECOVERY,
    NVML_FI_DEV_NVLINK_ECC_DATA_ERROR_COUNT_TOTAL: NVML_NVLINK_ERROR_DL_ECC_DATA,
}
_ECC_KEYS = [(e, c) for e in (NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
             for c in (NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC)]


@dataclass
class FakeGpu:
    """One simulated GPU. None for a value: that call answers NotSupported."""

    index: int
    uuid: str = ""
    name: str = "NVIDIA H100 80GB HBM3"
    bus: int = 0
    temperature: int | None = 40
    slowdown_temp: int | None = 87
    power_mw: int | None = 300_000
    util_gpu: int | None = 90
    mem_total: int | None = 80 << 30
    mem_used: int = 40 << 30
    clock_reasons: int | None = 0
    # (NVML_MEMORY_ERROR_TYPE_*, NVML_*_ECC) -> count
    ecc: dict[tuple[int, int], int] | None = field(
        default_factory=lambda: dict.fromkeys(_ECC_KEYS, 0))
    remapped: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # corr, unc, pending, failure
    retired_pages_pending: bool | None = False  # None: Ampere and later
    pcie_replay: int | None = 0
    nvlinks: int = 18  # active links, as on an H100 SXM; 0: no NVLink (NotSupported)
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)  # (link, counter)
    recovery_action: int | None = NVML_GPU_RECOVERY_ACTION_NONE  # None: field NotSupported
    field_errors: dict[int, int] = field(default_factory=dict)  # field id -> its nvmlReturn
    supported_events: int = XID_EVENTS
    lost: int | None = None  # an NVML_ERROR_* every call on this GPU answers
    lose_at: tuple[str, int] | None = None  # (function, error): the GPU is lost at that call
    struct: _FakeDevice = field(default_factory=_FakeDevice)

    def __post_init__(self) -> None:
        self.struct.index = self.index
        self.uuid = self.uuid or f"GPU-{self.index:08x}-fake-4e5d-9c1a-{self.index:012x}"
        self.bus = self.bus or 0x18 + 0x10 * self.index

    @property
    def bus_id(self) -> str:
        return f"{0:08X}:{self.bus:02X}:00.0"


class _EventSet:
    def __init__(self) -> None:
        self.masks: dict[int, int] = {}  # gpu index -> registered event types
        self.queue: deque[tuple[int, int, int]] = deque()  # (gpu, type, data)
        self.freed = False


class FakeNvml:
    """The pynvml module over ``gpus`` simulated GPUs."""

    def __init__(self, gpus: int = 4, init_error: int | None = None) -> None:
        self.gpus = [FakeGpu(i, temperature=40 + i) for i in range(gpus)]  # told apart by heat
        self.init_error = init_error  # e.g. NVML_ERROR_LIBRARY_NOT_FOUND: no driver
        self.missing: set[str] = set()  # functions the driver lacks: FunctionNotFound
        self.absent: set[str] = set()  # functions these bindings lack: AttributeError
        self.calls: Counter[tuple[str, int | None]] = Counter()  # (function, gpu)
        self.fields_asked: Counter[tuple[int, int]] = Counter()  # (field id, gpu)
        self.initialized = 0
        self.event_sets: list[_EventSet] = []
        self._failures: dict[tuple[str, int | None], list[Any]] = {}  # -> [error, times]
        self._cond = threading.Condition()

    # --- test controls -------------------------------------------------------------

    def fail(self, gpu: int | None, function: str, error: int, times: int | None = None) -> None:
        """``function`` on GPU ``gpu`` (None: a call without a device) raises
        NVMLError(error): always, or for the next ``times`` calls."""
        self._failures[(function, gpu)] = [error, times]

    def lose(self, gpu: int, error: int = NVML_ERROR_GPU_IS_LOST, at: str | None = None) -> None:
        """GPU ``gpu`` answers ``error`` to every call: from now, or from its
        next call of ``at`` (so it falls off the bus in the middle of a poll)."""
        if at is None:
            self.gpus[gpu].lost = error
        else:
            self.gpus[gpu].lose_at = (at, error)

    def emit_xid(self, gpu: int, xid: int) -> int:
        """Queue an Xid critical error on ``gpu`` in every event set registered
        for it; the number of sets it reached."""
        with self._cond:
            n = 0
            for s in self.event_sets:
                if not s.freed and s.masks.get(gpu, 0) & nvmlEventTypeXidCriticalError:
                    s.queue.append((gpu, nvmlEventTypeXidCriticalError, xid))
                    n += 1
            self._cond.notify_all()
            return n

    def count(self, function: str, gpu: int | None = None) -> int:
        return self.calls[(function, gpu)]

    # --- plumbing ------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """Constants, error classes and structures: the module's globals."""
        try:
            return _EXPORTS[name]
        except KeyError:
            raise AttributeError(f"module 'pynvml' has no attribute {name!r}") from None

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name in object.__getattribute__(self, "absent"):
            raise AttributeError(f"module 'pynvml' has no attribute {name!r}")
        return object.__getattribute__(self, name)

    def _enter(self, function: str, gpu: int | None = None) -> None:
        """Every call: counted, then initialised? the symbol present? injected failure?"""
        with self._cond:
            self.calls[(function, gpu)] += 1
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if function in self.missing:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        f = self._failures.get((function, gpu))
        if f is not None:
            error, times = f
            if times is not None:
                if times <= 0:
                    return
                f[1] = times - 1
            raise NVMLError(error)

    def _dev(self, function: str, handle: Any) -> FakeGpu:
        try:
            index = int(handle.contents.index)
            gpu = self.gpus[index]
        except (AttributeError, ValueError, IndexError):
            self._enter(function)
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT) from None
        self._enter(function, index)
        if gpu.lose_at is not None and gpu.lose_at[0] == function:
            gpu.lost, gpu.lose_at = gpu.lose_at[1], None
        if gpu.lost is not None:
            raise NVMLError(gpu.lost)
        return gpu

    @staticmethod
    def _value(v: Any) -> Any:
        if v is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return v

    # --- the API -------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        with self._cond:
            self.calls[("nvmlInit", None)] += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialized -= 1

    def nvmlErrorString(self, result: int) -> str:
        return str(NVMLError(result))

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return "580.65.06"

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._enter("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if gpu.lost is not None:
            raise NVMLError(gpu.lost)
        return ctypes.pointer(gpu.struct)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        return self._dev("nvmlDeviceGetIndex", handle).index

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._dev("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._dev("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> nvmlPciInfo_t:
        gpu = self._dev("nvmlDeviceGetPciInfo", handle)
        info = nvmlPciInfo_t()
        info.bus = gpu.bus
        info.busId = gpu.bus_id.encode()  # bytes, as from the real module
        info.busIdLegacy = f"{0:04X}:{gpu.bus:02X}:00.0".encode()
        return info

    def nvmlDeviceGetTemperatureV(self, handle: Any, sensor: int,
                                  version: int = nvmlTemperature_v1) -> int:
        gpu = self._dev("nvmlDeviceGetTemperatureV", handle)
        if version != nvmlTemperature_v1:
            raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return int(self._value(gpu.temperature))

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return int(self._value(self._dev("nvmlDeviceGetTemperature", handle).temperature))

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        gpu = self._dev("nvmlDeviceGetTemperatureThreshold", handle)
        if threshold != NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return int(self._value(gpu.slowdown_temp))

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return int(self._value(self._dev("nvmlDeviceGetPowerUsage", handle).power_mw))

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> c_nvmlUtilization_t:
        gpu = self._dev("nvmlDeviceGetUtilizationRates", handle)
        return c_nvmlUtilization_t(gpu=self._value(gpu.util_gpu), memory=30)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> c_nvmlMemory_t:
        gpu = self._dev("nvmlDeviceGetMemoryInfo", handle)
        total = self._value(gpu.mem_total)
        return c_nvmlMemory_t(total=total, used=gpu.mem_used, free=total - gpu.mem_used)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        gpu = self._dev("nvmlDeviceGetCurrentClocksEventReasons", handle)
        return int(self._value(gpu.clock_reasons))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        gpu = self._dev("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return int(self._value(gpu.clock_reasons))

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        gpu = self._dev("nvmlDeviceGetTotalEccErrors", handle)
        return int(self._value(gpu.ecc)[(errorType, counterType)])

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        gpu = self._dev("nvmlDeviceGetRemappedRows", device)
        corr, unc, pending, failure = self._value(gpu.remapped)
        return (corr, unc, pending, failure)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        gpu = self._dev("nvmlDeviceGetRetiredPagesPendingStatus", device)
        pending = self._value(gpu.retired_pages_pending)
        return NVML_FEATURE_ENABLED if pending else NVML_FEATURE_DISABLED

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return int(self._value(self._dev("nvmlDeviceGetPcieReplayCounter", handle).pcie_replay))

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        gpu = self._dev("nvmlDeviceGetNvLinkState", device)
        if gpu.nvlinks == 0:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < gpu.nvlinks:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        gpu = self._dev("nvmlDeviceGetNvLinkErrorCounter", device)
        if gpu.nvlinks == 0:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < gpu.nvlinks:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlink_errors.get((link, counter), 0)

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[int]) -> Any:
        """Like the real one: the call succeeds and each value carries its own
        nvmlReturn (NotSupported for a field this GPU does not have)."""
        gpu = self._dev("nvmlDeviceGetFieldValues", handle)
        values = (c_nvmlFieldValue_t * len(fieldIds))()
        for v, fid in zip(values, fieldIds, strict=True):
            self.fields_asked[(fid, gpu.index)] += 1
            v.fieldId = fid
            v.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
            if fid in gpu.field_errors:
                v.nvmlReturn = gpu.field_errors[fid]
            elif fid == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and gpu.recovery_action is not None:
                v.valueType, v.value.uiVal = NVML_VALUE_TYPE_UNSIGNED_INT, gpu.recovery_action
                v.nvmlReturn = NVML_SUCCESS
            elif fid in _NVLINK_TOTALS and gpu.nvlinks:
                counter = _NVLINK_TOTALS[fid]
                total = sum(n for (_, c), n in gpu.nvlink_errors.items() if c == counter)
                v.valueType, v.value.ullVal = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, total
                v.nvmlReturn = NVML_SUCCESS
        return values

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        return self._dev("nvmlDeviceGetSupportedEventTypes", handle).supported_events

    def nvmlEventSetCreate(self) -> _EventSet:
        self._enter("nvmlEventSetCreate")
        s = _EventSet()
        with self._cond:
            self.event_sets.append(s)
        return s

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: _EventSet) -> None:
        gpu = self._dev("nvmlDeviceRegisterEvents", handle)
        if eventTypes & ~gpu.supported_events:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        with self._cond:
            eventSet.masks[gpu.index] = eventSet.masks.get(gpu.index, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: _EventSet, timeoutms: int) -> c_nvmlEventData_t:
        """Blocks up to ``timeoutms``; NVMLError_Timeout when nothing came."""
        self._enter("nvmlEventSetWait_v2")
        with self._cond:
            if eventSet.freed:
                raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
            self._cond.wait_for(lambda: bool(eventSet.queue), timeout=timeoutms / 1000.0)
            if not eventSet.queue:
                raise NVMLError(NVML_ERROR_TIMEOUT)
            gpu, event_type, data = eventSet.queue.popleft()
        # A new pointer object to the same device: not the handle the caller holds.
        device = ctypes.cast(ctypes.addressof(self.gpus[gpu].struct), c_nvmlDevice_t)
        return c_nvmlEventData_t(device=device, eventType=event_type, eventData=data)

    def nvmlEventSetWait(self, eventSet: _EventSet, timeoutms: int) -> c_nvmlEventData_t:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: _EventSet) -> None:
        self._enter("nvmlEventSetFree")
        with self._cond:
            eventSet.freed = True
            self._cond.notify_all()


_EXPORTS: dict[str, Any] = {
    k: v for k, v in globals().items()
    if k.startswith(("NVML_", "NVMLError", "nvmlEventType", "nvmlClocks", "nvmlTemperature_",
                     "nvmlPciInfo_t", "c_nvml", "nvmlExceptionClass"))
}
