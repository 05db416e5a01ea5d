"""The NVML source's Xid-event half: one NVML event set for Xid critical errors
on every GPU that supports them, waited on by a thread of its own; and what
both halves share (the GPUs as enumerated, the counters, the error kinds).
nvml.py's NvmlSource is this plus the polling."""

from __future__ import annotations

import ctypes
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainwatch.types import XidEvent

log = logging.getLogger("trainwatch.nvml")

Clock = Callable[[], float]
XidCallback = Callable[[list[XidEvent]], None]

# The event thread's wait: short enough that stop() returns promptly.
EVENT_WAIT_MS = 500
# After an event wait failed with something other than a timeout.
_EVENT_RETRY_S = 1.0
# Events already queued are drained with zero-timeout waits, at most this many.
_EVENT_DRAIN = 64


def error_kind(exc: BaseException) -> str:
    """``NVMLError_GpuIsLost`` -> ``gpu_is_lost``: a bounded label for counters."""
    name = type(exc).__name__
    if not name.startswith("NVMLError_"):
        return "other"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name[len("NVMLError_"):]).lower()


def handle_key(handle: Any) -> int:
    """The address a ctypes device handle points to. pynvml's handles are ctypes
    pointers: unhashable, and the one in an event's data is a new object, so
    they are matched by address, not by identity."""
    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


@dataclass
class Counters:
    polls: int = 0
    samples_lost: int = 0  # samples produced with ``lost`` set
    unsupported: int = 0  # (gpu, field) pairs found unsupported and no longer read
    event_waits: int = 0
    xid_events: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # by NVML error kind

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


@dataclass
class Gpu:
    """One GPU as enumerated by start()."""

    index: int
    handle: Any = None  # None: no handle yet (lost or refused at enumeration)
    uuid: str | None = None
    name: str | None = None
    pci: str | None = None
    events: bool = False  # registered for Xid critical error events


class XidEvents:
    """The GPUs, their counters and their Xid event set; the NVML module is the
    subclass's (``_nvml``, loaded at start)."""

    _nvml: Any

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.counters = Counters()
        self.gpus: list[Gpu] = []
        self._by_key: dict[int, Gpu] = {}
        self._event_set: Any = None
        self._lock = threading.Lock()  # counters, shared with the event thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _count_error(self, e: BaseException) -> str:
        kind = error_kind(e)
        with self._lock:
            self.counters.error(kind)
        return kind

    def _register_events(self) -> None:
        """One event set for Xid critical errors on every GPU that supports them."""
        nvml = self._nvml
        candidates = [g for g in self.gpus if g.handle is not None]
        if not candidates:
            return
        try:
            self._event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as e:
            self._count_error(e)
            log.warning("NVML event set cannot be created (%s): Xids only from the kernel log", e)
            return
        for gpu in candidates:
            self._register(gpu)

    def _register(self, gpu: Gpu) -> None:
        nvml = self._nvml
        if self._event_set is None or gpu.handle is None or gpu.events:
            return
        xid = nvml.nvmlEventTypeXidCriticalError
        try:
            if int(nvml.nvmlDeviceGetSupportedEventTypes(gpu.handle)) & xid:
                nvml.nvmlDeviceRegisterEvents(gpu.handle, xid, self._event_set)
                gpu.events = True
        except nvml.NVMLError as e:
            self._count_error(e)
        if not gpu.events:
            log.info("GPU %d: no NVML Xid events; Xids from the kernel log only", gpu.index)

    @property
    def events_registered(self) -> bool:
        return any(g.events for g in self.gpus)

    def xid_events(self, timeout_ms: int) -> list[XidEvent]:
        """Wait up to ``timeout_ms`` for Xid events; [] on timeout or error."""
        return self._wait(timeout_ms)[0]

    def _wait(self, timeout_ms: int) -> tuple[list[XidEvent], bool]:
        """(events, ok): ok is False when the wait failed other than by timing out."""
        nvml = self._nvml
        if self._event_set is None or not self.events_registered:
            time.sleep(timeout_ms / 1000.0)  # nothing to wait on: behave like a timeout
            return [], True
        out: list[XidEvent] = []
        wait = timeout_ms
        for _ in range(_EVENT_DRAIN):
            with self._lock:
                self.counters.event_waits += 1
            try:
                data = nvml.nvmlEventSetWait_v2(self._event_set, wait)
            except nvml.NVMLError_Timeout:
                return out, True
            except nvml.NVMLError as e:
                kind = self._count_error(e)
                log.warning("NVML event wait failed: %s (%s)", e, kind)
                return out, False
            ev = self._xid_event(data)
            if ev is not None:
                out.append(ev)
            wait = 0  # an event arrived: collect those already queued, then return
        return out, True

    def _xid_event(self, data: Any) -> XidEvent | None:
        nvml = self._nvml
        if not int(data.eventType) & int(nvml.nvmlEventTypeXidCriticalError):
            return None
        gpu = self._by_key.get(handle_key(data.device))
        if gpu is None:
            try:
                index = int(nvml.nvmlDeviceGetIndex(data.device))
                gpu = next((g for g in self.gpus if g.index == index), None)
            except nvml.NVMLError as e:
                self._count_error(e)
        with self._lock:
            self.counters.xid_events += 1
        return XidEvent(
            xid=int(data.eventData), at=self.clock(), source="nvml_event",
            gpu=gpu.index if gpu else None, pci=gpu.pci if gpu else None,
            uuid=gpu.uuid if gpu else None,
        )

    def start_event_thread(self, callback: XidCallback, wait_ms: int = EVENT_WAIT_MS) -> bool:
        """Wait for Xid events in a daemon thread, calling ``callback`` with each
        non-empty batch. False (and no thread) when no GPU has Xid events."""
        if not self.events_registered:
            return False
        if self._thread is not None and self._thread.is_alive():
            return True
        self._stop.clear()
        self._thread = threading.Thread(target=self._event_loop, args=(callback, wait_ms),
                                        name="trainwatch-nvml-events", daemon=True)
        self._thread.start()
        return True

    def _event_loop(self, callback: XidCallback, wait_ms: int) -> None:
        while not self._stop.is_set():
            try:
                events, ok = self._wait(wait_ms)
            except Exception:  # never let the thread die silently
                log.exception("NVML event thread")
                self._count_error(RuntimeError())
                events, ok = [], False
            if events:
                try:
                    callback(events)
                except Exception:
                    log.exception("NVML event callback")
            if not ok:
                self._stop.wait(_EVENT_RETRY_S)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the event thread; returns within about one wait."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
