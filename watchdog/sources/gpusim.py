"""The simulated GPU backend (``gpu.backend: sim``): ``count`` healthy GPUs,
for demos and drills on machines without GPUs. It never stands in for NVML
silently: it is chosen only by name."""

from __future__ import annotations

import time
from collections.abc import Callable

from trainwatch.types import GpuSample

_SIM_BUS = "00000000:{:02x}:00.0"
_NVLINK_CLEAN = tuple((name, 0) for name in ("crc_flit", "crc_data", "replay", "recovery",
                                             "ecc_data"))


class SimGpus:
    def __init__(self, count: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.count = count
        self.clock = clock

    def start(self) -> None:
        pass

    def bus_ids(self) -> dict[str, int]:
        return {_SIM_BUS.format(0x10 + i): i for i in range(self.count)}

    def poll(self) -> list[GpuSample]:
        now = self.clock()
        return [
            GpuSample(
                index=i, at=now, uuid=f"GPU-sim-{i:04d}", name="Simulated GPU",
                pci=_SIM_BUS.format(0x10 + i), temperature_c=45.0, slowdown_temp_c=90.0,
                power_w=120.0, utilization_ratio=0.9, memory_used_bytes=40 << 30,
                memory_total_bytes=80 << 30, clock_event_reasons=0,
                ecc_volatile_corrected=0, ecc_volatile_uncorrected=0,
                ecc_aggregate_corrected=0, ecc_aggregate_uncorrected=0,
                remapped_rows_corrected=0, remapped_rows_uncorrected=0,
                remap_pending=False, remap_failure=False, pcie_replay_total=0,
                recovery_action=0, nvlink_errors=_NVLINK_CLEAN,
            )
            for i in range(self.count)
        ]

    def close(self) -> None:
        pass
