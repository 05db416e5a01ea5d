"""The host's GPU sources, run for the supervisor loop.

The backend (NVML or simulated) is polled in a thread at ``gpu.poll_interval``
and the kernel log is tailed in another; NVML's Xid events arrive on its own
event thread. Everything goes through one queue to the loop's thread, which
applies drill overlays, runs the detectors (GpuHealth) and routes faults, so
no detector state is shared between threads. A source that cannot start is
reported once and leaves the GPUs ``unknown``; it never looks healthy.
"""

from __future__ import annotations

import logging
import queue
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainwatch.config import ConfigError, Gpu
from trainwatch.detectors.xid import classify
from trainwatch.lifecycle.drill import Overlay
from trainwatch.sources.gpusim import SimGpus
from trainwatch.sources.kmsg import KernelLog, KernelLogError
from trainwatch.state import atomic, statewrites
from trainwatch.state.gpuhealth import GpuHealth
from trainwatch.types import Action, Fault, GpuSample, XidEvent

log = logging.getLogger("trainwatch")

_KMSG_TICK = 0.05  # a kernel-log file (not /dev/kmsg) is read this often


@dataclass(frozen=True)
class SourceStatus:
    """One source as the exporter reports it."""

    name: str
    up: bool
    errors: int
    duration: float | None  # seconds its last read took; None: not read yet


class Backend(Protocol):
    def start(self) -> None: ...
    def poll(self) -> list[GpuSample]: ...
    def bus_ids(self) -> dict[str, int]: ...
    def close(self) -> None: ...


class GpuWatch:
    def __init__(self, spec: Gpu, state_dir: str, wake: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.wake = wake
        self.clock = clock
        self.health = GpuHealth(thermal_sustain=spec.thermal_sustain)
        self.overlay = Overlay()
        self.backend: Backend | None = None
        self.kmsg: KernelLog | None = None
        self.indices: list[int] = []
        self.up: dict[str, bool] = {"nvml": False, "sim": False, "kmsg": False}
        # Written by the source threads, read by the exporter: plain values, swapped whole.
        self.took: dict[str, float] = {}
        self.failures: dict[str, int] = {}
        self._q: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._exclusions = Path(state_dir) / "gpus.json"

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        backend = self.spec.backend
        if backend == "sim":
            self.backend = SimGpus(self.spec.count, self.clock)
            self.up["sim"] = True
        elif backend in ("auto", "nvml"):
            from trainwatch.sources.nvml import GpuUnavailable, NvmlSource

            src = NvmlSource(clock=self.clock)
            try:
                src.start()
            except GpuUnavailable as e:
                if backend == "nvml":
                    raise ConfigError(f"gpu.backend: nvml: {e}") from None
                log.warning("GPU monitoring is off: %s (gpu.backend auto); GPUs are unknown", e)
                return
            self.backend = src
            self.up["nvml"] = True
            src.start_event_thread(lambda evs: self._put("xids", evs))
        if self.backend is None:
            return
        first = self.backend.poll()
        self.indices = sorted(s.index for s in first)
        self._put("samples", first)
        excluded, broken = self._saved()
        for idx, why in excluded.items():
            self.health.exclude(idx, why, self.clock())
        # A GPU a drill broke stays broken across a restart of ours, as a real one does.
        self.overlay.broken.update(broken)
        if self.spec.kmsg:
            try:
                self.kmsg = KernelLog(self.spec.kmsg, self.backend.bus_ids(),
                                      Path(self._exclusions.parent, "kmsg-position.json"),
                                      self.clock)
                self.up["kmsg"] = True
            except (KernelLogError, OSError) as e:
                log.warning("kernel-log Xids are off: %s", e)
        self._spawn(self._poll_loop, "trainwatch-gpu-poll")
        if self.kmsg is not None:
            self._spawn(self._kmsg_loop, "trainwatch-kmsg")

    def _spawn(self, fn: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        stop = getattr(self.backend, "stop", None)
        if stop is not None:
            stop()
        for t in self._threads:
            t.join(timeout=2)
        if self.kmsg is not None:
            self.kmsg.close()
        if self.backend is not None:
            self.backend.close()

    # --- the threads -----------------------------------------------------------

    def _put(self, kind: str, item: Any) -> None:
        self._q.put((kind, item))
        self.wake()

    def _poll_loop(self) -> None:
        assert self.backend is not None
        name = "sim" if self.spec.backend == "sim" else "nvml"
        while not self._stop.wait(self.spec.poll_interval):
            t0 = time.perf_counter()
            try:
                samples = self.backend.poll()
            except Exception:  # a source's failure is logged and counted, never fatal
                log.exception("GPU poll failed")
                self.failures[name] = self.failures.get(name, 0) + 1
                self._put("down", None)
                continue
            self.took[name] = time.perf_counter() - t0
            self._put("samples", samples)

    def _kmsg_loop(self) -> None:
        k = self.kmsg
        assert k is not None
        while not self._stop.is_set():
            if k.selectable:
                select.select([k], [], [], 0.5)
            else:
                self._stop.wait(_KMSG_TICK)
            t0 = time.perf_counter()
            events = k.read()
            self.took["kmsg"] = time.perf_counter() - t0
            if events:
                self._put("xids", events)

    def sources(self) -> list[SourceStatus]:
        """The configured GPU sources: is each reading the world, and at what cost."""
        out = []
        name = "sim" if self.spec.backend == "sim" else "nvml"
        errors = self.failures.get(name, 0)
        counters = getattr(self.backend, "counters", None)
        if counters is not None:
            errors += sum(counters.errors.values())
        out.append(SourceStatus(name, self.up[name] and self.health.source_up, errors,
                                self.took.get(name)))
        if self.spec.kmsg:
            k = self.kmsg
            out.append(SourceStatus("kmsg", self.up["kmsg"], k.counters.errors if k else 0,
                                    self.took.get("kmsg")))
        return out

    # --- the loop's side -------------------------------------------------------

    def drain(self) -> list[Fault]:
        """Everything the threads delivered -> faults (call from the loop's thread)."""
        faults: list[Fault] = []
        while True:
            try:
                kind, item = self._q.get_nowait()
            except queue.Empty:
                return faults
            if kind == "samples":
                for f in self.health.samples(self.overlay.apply(item)):
                    if self.overlay.active(f.gpu):
                        f.evidence["source"] = "drill"  # a drill rides on this GPU's samples
                    faults.append(f)
            elif kind == "xids":
                for ev in item:
                    xf = self.health.xid(ev)
                    if xf is not None:
                        faults.append(xf)
            elif kind == "down":
                self.health.source_down()
            if kind == "samples" and self.spec.recheck_after is not None:
                for gpu in self.health.passed_recheck(self.clock(), self.spec.recheck_after):
                    log.warning("GPU %d passed its health re-check (%gs without a fault): "
                                "back in service", gpu, self.spec.recheck_after)
                    self.clear(gpu)

    def inject_xid(self, gpu: int, xid: int, message: str = "") -> None:
        """A drill: handled exactly like an Xid from NVML, marked injected."""
        self._check(gpu)
        if classify(xid, message).action is Action.RESTART_EXCLUDE_GPU:
            self.overlay.broken[gpu] = f"injected Xid {xid}, not cleared"
            self._save()
        ev = XidEvent(xid, self.clock(), "drill", gpu=gpu, message=message, injected=True)
        self._put("xids", [ev])

    def _check(self, gpu: int) -> None:
        if self.backend is None:
            raise ValueError("GPU monitoring is off (gpu.backend)")
        if gpu not in self.indices:
            raise ValueError(f"no GPU {gpu} (GPUs: {', '.join(map(str, self.indices))})")

    def inject(self, what: str, gpu: int, uncorrected: bool = False) -> None:
        """ecc, thermal or lost on one GPU, riding on its next samples."""
        self._check(gpu)
        if what == "ecc":
            self.overlay.ecc(gpu, uncorrected)
        elif what == "thermal":
            self.overlay.thermal(gpu)
        elif what == "lost":
            self.overlay.lost(gpu)
        else:
            raise ValueError(f"unknown drill {what!r}")

    # --- exclusions, persisted ---------------------------------------------------

    def exclude(self, gpu: int, why: str) -> None:
        self.health.exclude(gpu, why, self.clock())
        self._save()

    def clear(self, gpu: int) -> None:
        self.health.clear(gpu)
        self.overlay.clear(gpu)
        self._save()

    def _saved(self) -> tuple[dict[int, str], dict[int, str]]:
        """The exclusions and drill-broken GPUs saved before; a file of another
        shape is said once and ignored (the GPUs start unexcluded), never fatal."""
        saved = atomic.read_json(self._exclusions)
        try:
            if saved is None:
                return {}, {}
            return ({int(i): str(w) for i, w in saved.get("excluded", {}).items()},
                    {int(i): str(w) for i, w in saved.get("broken", {}).items()})
        except (AttributeError, TypeError, ValueError) as e:
            log.warning("%s: not a GPU exclusion file (%s): ignored", self._exclusions, e)
            return {}, {}

    def _save(self) -> None:
        try:
            atomic.write_json(self._exclusions, {"excluded": self.health.excluded(),
                                                 "broken": self.overlay.broken})
        except OSError as e:  # the exclusion holds in memory; it is lost only on restart
            statewrites.failed("gpus", self._exclusions, e)

    def healthy(self, devices: tuple[int, ...] | None) -> list[int]:
        """Of these GPUs (None: all), the ones not excluded."""
        pool = self.indices if devices is None else list(devices)
        excluded = self.health.excluded()
        return [g for g in pool if g not in excluded]
