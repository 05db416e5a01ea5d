"""A job's heartbeat intake: its socket, when to read it (sources/beatpoll.py),
and what each message is handed to. Only the job's tree is believed: the
runner's ``believe(pid, uid)`` decides for every sender."""

from __future__ import annotations

import logging
import selectors
from collections.abc import Callable

from trainwatch.sources.beatpoll import BeatPoller
from trainwatch.sources.heartbeat import HeartbeatSocket
from trainwatch.types import Beat, CheckpointReport

log = logging.getLogger("trainwatch")


class Intake:
    def __init__(self, job: str, path: str, selector: selectors.BaseSelector,
                 believe: Callable[[int, int], bool], clock: Callable[[], float],
                 owner: tuple[int, int] | None,
                 on_beat: Callable[[Beat], None],
                 on_report: Callable[[CheckpointReport], None]) -> None:
        self.job, self.path = job, path
        self.on_beat, self.on_report = on_beat, on_report
        # Only the job's user (and root) may reach its socket at all.
        self.socket = HeartbeatSocket(path, believe, clock, owner=owner)
        self.poller = BeatPoller(self.socket, selector, self.drain, clock)

    def drain(self) -> int:
        """Read and act on everything queued on the socket; how many datagrams."""
        c = self.socket.counters
        before = (c.malformed, c.oversized, c.foreign)
        observations = self.socket.drain()
        for what, old, new in zip(("malformed", "oversized", "foreign"), before,
                                  (c.malformed, c.oversized, c.foreign), strict=True):
            if old == 0 and new > 0:  # the first of its kind; the rest are only counted
                log.warning("job %s: dropped a %s datagram on %s", self.job, what, self.path)
        for obs in observations:
            if isinstance(obs, Beat):
                self.on_beat(obs)
            elif isinstance(obs, CheckpointReport):
                self.on_report(obs)
        return len(observations) + c.malformed + c.oversized + c.foreign - sum(before)

    def tick(self, now: float) -> None:
        self.poller.tick(now)

    def next_wake(self) -> float | None:
        return self.poller.next_wake()

    def new_attempt(self) -> None:
        self.socket.forget_senders()  # the last attempt's processes are no longer ours

    def close(self) -> None:
        self.poller.close()
        self.socket.close()
