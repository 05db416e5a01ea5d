"""NVIDIA nvidia-resiliency-ext's ft_launcher (0.4.1) for the drill: its command, its
settings, and the heartbeat its rank monitor needs from the trainer."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

RESTARTS = 100
# After this many steps of an attempt the timeouts are computed from the intervals seen
# (calculate_and_set_hb_timeouts: the observed maximum x safety_factor), as NVRx's docs
# recommend; a collective call, made by every rank at the same step.
CALIBRATE_AFTER = 50

SETTINGS = f"""nvrx: `ft_launcher --standalone --nproc-per-node N --max-restarts {RESTARTS}` \
(nvidia-resiliency-ext 0.4.1, restart policy any-failed: its default); each rank sends \
RankMonitorClient.send_heartbeat() every step and, {CALIBRATE_AFTER} steps into each attempt, \
calculate_and_set_hb_timeouts() (the observed intervals x safety_factor 5, the defaults: \
fault_tolerance/config.py); until then the default timeouts apply (first heartbeat 3600 s, \
then 2700 s); workload_check_interval 5 s and rank_termination_signal SIGKILL (defaults); \
the NIC monitor off (no NICs to watch on this machine)."""


def command(trainer_argv: list[str], nproc: int,
            env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    launcher = Path(sys.executable).parent / "ft_launcher"
    argv = [str(launcher), "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={RESTARTS}", "--ft-enable-nic-monitor=false", *trainer_argv]
    return argv, env


class Heartbeat:
    def __init__(self) -> None:
        self.client: Any = None
        self.beats = 0

    def start(self) -> None:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
        self.client = RankMonitorClient()
        self.client.init_workload_monitoring()

    def beat(self) -> None:
        self.client.send_heartbeat()
        self.beats += 1
        if self.beats == CALIBRATE_AFTER:
            self.client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
