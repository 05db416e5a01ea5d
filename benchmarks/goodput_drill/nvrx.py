"""NVIDIA nvidia-resiliency-ext's ft_launcher (0.4.1) in the drill: its command line, the
settings chosen (each with where it comes from), and the heartbeat its rank monitor needs.

Paths below are in the installed package, nvidia_resiliency_ext/fault_tolerance/ (the same
files as the v0.4.1 tag), and in the repository at that tag (docs/, examples/)."""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Any

# Worker-group restarts: the CLI's default is 0 (launcher.py:1536-1542), no restart at all.
RESTARTS = 100
# Until the timeouts are calculated: the values of NVRx's own CPU DDP example
# (examples/fault_tolerance/basic_ft_example.py:33). Without them the defaults apply,
# 60 min for the first beat and 45 min after (config.py:60-61, heartbeats.rst:26-30).
INITIAL_TIMEOUT_S = 30
TIMEOUT_S = 15
# Beats into each attempt before calculate_and_set_hb_timeouts(): "after a sufficient range
# of heartbeat intervals has been observed" (heartbeats.rst:46), which for NVRx's examples
# means after a checkpoint was saved (train_ddp_heartbeats_api.py:202-207): the drill saves
# one every 30 steps.
CALIBRATE_AFTER = 50
# How often a rank monitor checks its timeouts: the default, workload_check_interval
# (config.py:59, rank_monitor_server.py:431-440), so a timeout is seen up to 5 s late.
CHECK_INTERVAL_S = 5
# Env the launcher gives each worker: the Unix socket of its rank monitor (data.py:27,
# launcher.py:611). Without it the process is not under ft_launcher.
SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"

SETTINGS = f"""nvrx: `ft_launcher --standalone --nproc-per-node N --max-restarts {RESTARTS} \
--ft-initial-rank-heartbeat-timeout {INITIAL_TIMEOUT_S} --ft-rank-heartbeat-timeout {TIMEOUT_S} \
--ft-enable-nic-monitor false` (nvidia-resiliency-ext 0.4.1). Standalone: a c10d rendezvous \
on a free local port (launcher.py:1523-1530,2111-2114); max restarts {RESTARTS} (default 0: \
launcher.py:1536-1542); restart policy any-failed, its default: all ranks restart when one \
fails (launcher.py:1818-1830, usage_guide.rst:58-59). Hang detection by heartbeats: each rank \
sends RankMonitorClient.send_heartbeat() every step (heartbeats.rst:41-48) and, \
{CALIBRATE_AFTER} steps into each attempt (a checkpoint seen, as its example waits for: \
train_ddp_heartbeats_api.py:202-207), calculate_and_set_hb_timeouts(): the longest interval \
seen on any rank x safety_factor 5, its default (timeouts_calc.py:74-86,154-171; \
config.py:65); the rank monitor keeps them for later attempts, the first-beat one (5 x \
the time from connecting to the first beat) included (rank_monitor_server.py:234-256). \
Before that, {INITIAL_TIMEOUT_S} s for the first beat and {TIMEOUT_S} s between beats, the \
values of its CPU DDP example (basic_ft_example.py:33; the defaults are 60 and 45 min: \
config.py:60-61). workload_check_interval {CHECK_INTERVAL_S} s (default, config.py:59: a \
timeout is seen up to {CHECK_INTERVAL_S} s late, rank_monitor_server.py:431-440); a timed-out \
rank gets SIGCONT then SIGKILL \
(rank_termination_signal default, config.py:66; rank_monitor_server.py:182-188); the other \
ranks SIGTERM, SIGKILL after 30 s (--workers-stop-timeout default, launcher.py:1552-1559); the \
launcher polls its workers every 0.1 s (--monitor-interval default, launcher.py:1560-1567). \
NIC monitor off: it watches InfiniBand link counters, there are none here (default on: \
launcher.py:1832-1841). A 1-process job gets a 1-rank gloo group for the calculation, which \
all-reduces (timeouts_calc.py:78-79)."""


def command(trainer_argv: list[str], nproc: int,
            env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """ft_launcher's argv running `python -u trainer_argv...` on nproc ranks, and its env."""
    launcher = Path(sys.executable).parent / "ft_launcher"
    argv = [str(launcher), "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={RESTARTS}",
            f"--ft-initial-rank-heartbeat-timeout={INITIAL_TIMEOUT_S}",
            f"--ft-rank-heartbeat-timeout={TIMEOUT_S}",
            "--ft-enable-nic-monitor=false", *trainer_argv]
    return argv, dict(env)


class Heartbeat:
    """One rank's link to its rank monitor. Off (both calls return at once) when the
    process was not started by ft_launcher."""

    def __init__(self) -> None:
        self.client: Any = None  # RankMonitorClient: the package is imported only when used
        self.beats = 0

    def start(self) -> None:
        """Connect to this rank's monitor: call once, before the first step."""
        if SOCKET_ENV not in os.environ:
            return
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        self.client = RankMonitorClient()
        self.client.init_workload_monitoring()
        # A rank that stops beating while still connected is hung to its monitor, even on
        # its way out: at a clean end the connection goes first (heartbeats.rst:48).
        atexit.register(self.stop)

    def beat(self) -> None:
        """Tell the monitor this rank made progress: once a step, on every rank (the
        calculation at CALIBRATE_AFTER is a collective)."""
        if self.client is None:
            return
        self.client.send_heartbeat()
        self.beats += 1
        if self.beats == CALIBRATE_AFTER:
            self._calibrate()

    def stop(self) -> None:
        """Disconnect before leaving the step loop (a barrier, a final save): with timeouts
        calculated from 0.1 s steps, half a second without a beat is a hang. Also run at
        exit."""
        if self.client is not None:
            self.client.shutdown_workload_monitoring()
            self.client = None

    def _calibrate(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            self.client.calculate_and_set_hb_timeouts()
            return
        # A 1-process job has no process group, and the calculation all-reduces over one:
        # a private 1-rank group (an in-memory store: no port) just for it.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            self.client.calculate_and_set_hb_timeouts()
        finally:
            dist.destroy_process_group()
