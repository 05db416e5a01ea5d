"""The GPU families of the exporter (metrics.py's StateCollector): each GPU's
last NVML sample, its health verdict, and the Xids seen, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric
from trainwatch.detectors.gpu import CLOCK_EVENT_REASONS
from trainwatch.export.families import counter as _counter
from trainwatch.export.families import gauge as _gauge
from trainwatch.state.gpuhealth import GpuState
from trainwatch.types import GpuSample

if TYPE_CHECKING:
    from trainwatch.export.scraped import Scraped

RECOVERY_ACTIONS = ("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset")


def families(sup: Scraped) -> Iterator[Metric]:
    """The GPUs' last samples, health and Xid counts (read under the loop's lock)."""
    w = sup.gpus
    if w is None:
        return
    known = set(w.indices)
    for r in sup.runners:
        known.update(r.job.gpus.devices or ())
    health = w.health
    samples: dict[int, GpuSample | None] = {}
    for i in sorted(known):
        g = health.gpus.get(i)
        samples[i] = g.last if g is not None else None
    uuids = {i: (s.uuid or "") if s is not None else "" for i, s in samples.items()}
    ids = ["gpu", "uuid"]

    info = _gauge("trainwatch_gpu_info", "The GPU's identity; always 1.",
                  [*ids, "name", "pci"])
    state = _gauge("trainwatch_gpu_state",
                   "1 for the GPU's current state: healthy, unknown or excluded.",
                   [*ids, "state"])
    lost = _gauge("trainwatch_gpu_lost", "1 while NVML says the GPU is lost or needs a reset.",
                  ids)
    for i, s in samples.items():
        key = [str(i), uuids[i]]
        info.add_metric([*key, (s.name or "") if s else "", (s.pci or "") if s else ""], 1)
        now = health.state(i)
        for st in GpuState:
            state.add_metric([*key, st.value], 1 if st is now else 0)
        if s is not None:
            lost.add_metric(key, 1 if s.lost is not None else 0)
    yield from (info, state, lost)

    plain = [
        ("temperature_celsius", "Temperature.", "temperature_c"),
        ("slowdown_temperature_celsius", "The driver's slowdown threshold.",
         "slowdown_temp_c"),
        ("power_watts", "Power draw.", "power_w"),
        ("utilization_ratio", "Time a kernel ran, 0 to 1.", "utilization_ratio"),
        ("memory_used_bytes", "Frame buffer memory used.", "memory_used_bytes"),
        ("memory_total_bytes", "Frame buffer memory.", "memory_total_bytes"),
        ("row_remap_pending", "1 while a row remap waits for a GPU reset.", "remap_pending"),
        ("row_remap_failed", "1 when a row remap failed.", "remap_failure"),
        ("retired_pages_pending", "1 while a page retirement waits (before Ampere).",
         "retired_pages_pending"),
    ]
    for suffix, doc, attr in plain:
        fam = _gauge(f"trainwatch_gpu_{suffix}", doc, ids)
        for i, s in samples.items():
            v = getattr(s, attr) if s is not None else None
            if v is not None:
                fam.add_metric([str(i), uuids[i]], float(v))
        yield fam

    clocks = _gauge("trainwatch_gpu_clock_event_active",
                    "1 while that clock-event (throttle) reason is active.",
                    [*ids, "reason"])
    ecc = _counter("trainwatch_gpu_ecc_errors", "Volatile ECC errors since the driver "
                   "loaded.", [*ids, "type"])
    rows = _gauge("trainwatch_gpu_remapped_rows", "Rows remapped.", [*ids, "type"])
    replays = _counter("trainwatch_gpu_pcie_replays", "PCIe replays.", ids)
    nvlink = _counter("trainwatch_gpu_nvlink_errors", "NVLink errors, summed over links.",
                      [*ids, "type"])
    recovery = _gauge("trainwatch_gpu_recovery_action",
                      "1 for NVML's current recovery action.", [*ids, "action"])
    for i, s in samples.items():
        if s is None:
            continue
        key = [str(i), uuids[i]]
        if s.clock_event_reasons is not None:
            for bit, reason in CLOCK_EVENT_REASONS:
                clocks.add_metric([*key, reason], 1 if s.clock_event_reasons & bit else 0)
        for typ, v in (("corrected", s.ecc_volatile_corrected),
                       ("uncorrected", s.ecc_volatile_uncorrected)):
            if v is not None:
                ecc.add_metric([*key, typ], v)
        for typ, v in (("correctable", s.remapped_rows_corrected),
                       ("uncorrectable", s.remapped_rows_uncorrected)):
            if v is not None:
                rows.add_metric([*key, typ], v)
        if s.pcie_replay_total is not None:
            replays.add_metric(key, s.pcie_replay_total)
        for typ, v in s.nvlink_errors:
            nvlink.add_metric([*key, typ], v)
        if s.recovery_action is not None:
            for code, action in enumerate(RECOVERY_ACTIONS):
                recovery.add_metric([*key, action], 1 if s.recovery_action == code else 0)
    yield from (clocks, ecc, rows, replays, nvlink, recovery)

    xids = _counter("trainwatch_gpu_xid_errors",
                    "Xids seen (one per error, whichever paths reported it), by the "
                    "catalog's immediate action (class).", [*ids, "xid", "class"])
    for (gpu, xid, cls), n in sorted(health.xid_counts.items(),
                                     key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2])):
        label = "unknown" if gpu is None else str(gpu)
        xids.add_metric([label, uuids.get(gpu, "") if gpu is not None else "", str(xid), cls],
                        n)
    yield xids
