"""The stacks of a silent job's ranks, read while every process is idle (a job
without the client: stallwatch.py), for the stall rule that names a rank that
does nothing while the others wait in a collective (detectors/stall.py).

``py-spy dump --nonblocking`` of each rank in parallel (evidence/pyspy.py; the
process is not paused, and a dump takes 10-15 ms), started at most every
``EVERY`` seconds and collected at the loop's next turns, never waited for:
the loop serves other jobs. A dump past ``DEADLINE`` is killed. Only the main
thread's frames are kept, reduced as detectors/stacks.py reduces them, and the
file read is bounded: py-spy prints what the job's memory holds."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainwatch.detectors import stacks
from trainwatch.detectors.stall import Stack, StackProbe
from trainwatch.evidence import pyspy

log = logging.getLogger("trainwatch")

EVERY = 2.0  # seconds between two probes' starts
DEADLINE = 3.0  # seconds a probe may take
_MAX_DUMP = 4 << 20  # bytes of one rank's py-spy output read at most


class Prober:
    """One job's probes of one quiet stretch: the last two kept."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.probes: deque[StackProbe] = deque(maxlen=2)
        self.peers: dict[int, bool] = {}  # other hosts' ranks, read last (probeshare.py)
        self._runner: pyspy.Runner | None = None
        self._folder: str | None = None
        self._ranks: dict[int, str] = {}  # rank -> its dump's file stem, this probe
        self._started = 0.0
        self._binary = pyspy.find()
        self._said = False

    @property
    def running(self) -> bool:
        """A probe's dumps are under way."""
        return self._runner is not None

    def reset(self) -> None:
        """The stretch ended (a process busy, the output spoke, a new attempt)."""
        self.probes.clear()
        self.peers = {}
        self._stop()

    def tick(self, pids: Mapping[int, int], states: Mapping[int, str]) -> StackProbe | None:
        """Collect a probe done (returned); start the next one when due. ``pids``:
        rank -> pid."""
        now, got = self.clock(), None
        if self._runner is not None:
            if self._runner.poll() is None:
                return None
            got = self._collect()
        if self._binary is None:
            if not self._said:
                self._said = True
                log.info("py-spy not found: a silent job's idle rank is named by its stacks "
                         "only with the pyspy extra")
            return got
        if not pids or (self.probes and now - self._started < EVERY):
            return got
        self._folder = tempfile.mkdtemp(prefix="trainwatch-probe-")
        self._ranks = {rank: f"rank{rank}" for rank in pids}
        targets = [(pid, f"rank{rank}", states.get(rank)) for rank, pid in pids.items()]
        self._runner = pyspy.Runner(self._binary, targets, Path(self._folder), False,
                                    now + DEADLINE, self.clock, pause=False)
        self._started = now
        self._runner.start()
        return got

    def _collect(self) -> StackProbe | None:
        assert self._folder is not None
        got: dict[int, Stack] = {}
        for rank, stem in self._ranks.items():
            threads = _read(os.path.join(self._folder, f"{stem}.json"))
            if threads is not None:
                got[rank] = (stacks.signature(threads), stacks.in_collective(threads))
        self._stop()
        if len(got) != len(self._ranks):  # a rank unread is no evidence: not kept
            return None
        self.probes.append(probe := StackProbe(self._started, got))
        return probe

    def _stop(self) -> None:
        if self._runner is not None:
            self._runner.deadline = 0.0
            self._runner.poll()  # kills what still runs
            self._runner = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def _read(path: str) -> list[dict[str, Any]] | None:
    with contextlib.suppress(OSError, ValueError):
        with open(path, "rb") as f:
            raw = f.read(_MAX_DUMP + 1)
        if len(raw) <= _MAX_DUMP:
            loaded = json.loads(raw)
            if isinstance(loaded, list) and all(isinstance(t, dict) for t in loaded):
                return loaded
    return None
