"""This node in Slurm, once trainwatch drained it: back in service only after a
pre-flight of the GPUs that failed passes, and only if the drain is still
trainwatch's (an operator's own drain, or one over ours, is never undone:
NHC's rule, slurm/parse.py ``judge_resume``).

A drain is asked with a requeue (requeue.py) when an attached job's GPU fault
calls for leaving a GPU out (``restart_exclude_gpu``): the node takes no new
job, and the requeued one waits for a node. ``NodeHealth.tick`` runs in the
daemon's scheduler, off the loop: a pre-flight every ``every`` seconds of the
GPUs it drained for (the simulated backend's own check, else DCGM's, else a
torch matmul: multihost/preflight.py); on a pass the GPUs' exclusion is lifted
(under the loop's lock) and the node resumed if the drain is still ours.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from trainwatch.multihost import preflight
from trainwatch.slurm import actions
from trainwatch.slurm.command import Outcome, Slurm
from trainwatch.watch.gpuwatch import GpuWatch

log = logging.getLogger("trainwatch")

EVERY = 10.0  # seconds between two pre-flights of a drained node's GPUs

_this: NodeHealth | None = None  # the daemon's (made by it; requeue.py tells it a drain)


class NodeHealth:
    def __init__(self, node: str, slurm: Slurm, gpus: GpuWatch | None, backend: str,
                 lock: AbstractContextManager[object], every: float = EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.node, self.slurm, self.gpus, self.lock = node, slurm, gpus, lock
        self.check = preflight.choose(backend, python=sys.executable)
        self.every, self.clock = every, clock
        self._drained: set[int] = set()  # GPUs it drained the node for, not yet passed
        self._mine = threading.Lock()  # _drained: set from a requeue's thread
        self._next = 0.0
        self.said = ""

    def drained(self, gpus: list[int]) -> None:
        """trainwatch drained the node for these GPUs (from a requeue's thread)."""
        with self._mine:
            self._drained.update(gpus)
        self._next = 0.0

    @property
    def waiting(self) -> list[int]:
        with self._mine:
            return sorted(self._drained)

    def tick(self) -> None:
        """One pre-flight when one is due; the node resumed once it passes."""
        gpus = self.waiting
        now = self.clock()
        if not gpus or now < self._next:
            return
        self._next = now + self.every
        if self.check.kind == "sim":
            if self.gpus is None:
                return
            with self.lock:
                res = preflight.sim(self.gpus, gpus)
        else:
            res = preflight.run(self.check, gpus, None, {})
        if not res.passed:
            if res.detail != self.said:
                self.said = res.detail
                log.warning("slurm: %s stays drained: pre-flight of GPUs %s: %s (again every "
                            "%gs)", self.node, ",".join(map(str, gpus)), res.detail, self.every)
            return
        if self.gpus is not None:
            with self.lock:
                for d in gpus:
                    if d in self.gpus.health.excluded():
                        self.gpus.clear(d)
        back = actions.resume_if_ours(self.node, slurm=self.slurm)
        log.warning("slurm: pre-flight of GPUs %s passed (%s): %s", ",".join(map(str, gpus)),
                    res.detail, back.message)
        if back.outcome is Outcome.OK:
            with self._mine:
                self._drained.difference_update(gpus)


def this() -> NodeHealth | None:
    return _this


def serve(health: NodeHealth | None) -> None:
    """The daemon's NodeHealth, for requeue.py to tell of a drain (None: none)."""
    global _this
    _this = health
