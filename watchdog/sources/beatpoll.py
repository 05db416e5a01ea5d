"""When to read a job's heartbeat socket.

While beats flow (two datagrams within ``FLOWING`` seconds; a lone one, such
as a checkpoint report from a client that beats through its ring, is read
when it comes), the socket is read every ``BEAT_POLL`` seconds rather than
on every datagram (8 ranks x 10 Hz: 4 datagrams a batch, 20 wake-ups/s
instead of 80); a beat's receive time is then late by at most that. The
kernel queues only net.unix.max_dgram_qlen datagrams (10 by default) before a
sender's beat is dropped, and with many ranks in lock-step the same slow rank
would lose every round and look hung: a poll that finds the queue full goes
back to waking on every datagram for ``WAKE_FOR`` seconds.
"""

from __future__ import annotations

import selectors
from collections.abc import Callable

from trainwatch.sources.heartbeat import HeartbeatSocket

BEAT_POLL = 0.05
FLOWING = 0.25
WAKE_FOR = 30.0


def _queue_limit() -> int:
    try:
        with open("/proc/sys/net/unix/max_dgram_qlen") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 10


QUEUE_FULL = max(2, _queue_limit())


class BeatPoller:
    def __init__(self, sock: HeartbeatSocket, sel: selectors.BaseSelector,
                 drain: Callable[[], int], clock: Callable[[], float]) -> None:
        """``drain`` reads and handles what is queued; returns how many datagrams."""
        self.sock, self.sel, self.drain, self.clock = sock, sel, drain, clock
        self.poll_at = 0.0  # 0: waiting on the socket; else: the next poll of it
        self.wake_until = 0.0  # until then, wake on every datagram
        self.ready_at = -FLOWING  # the last wake-up on the socket
        sel.register(sock, selectors.EVENT_READ, self.on_ready)

    def on_ready(self, _fd: int) -> None:
        self.drain()
        now = self.clock()
        flowing, self.ready_at = now - self.ready_at < FLOWING, now
        if flowing and now >= self.wake_until:
            # Beats are flowing: stop waiting on the socket and poll it instead.
            # One wake-up then takes a batch, and a sender does not pay for waking us.
            self._unregister()
            self.poll_at = now + BEAT_POLL

    def tick(self, now: float) -> None:
        if not self.poll_at or now < self.poll_at:
            return
        n = self.drain()
        if n and n < QUEUE_FULL:
            self.poll_at = now + BEAT_POLL
            return
        if n:
            # The kernel's queue filled between two polls (many ranks): beats
            # were being dropped, so wake on every datagram for a while.
            self.wake_until = now + WAKE_FOR
        self.poll_at = 0.0  # quiet, or too busy: wait on the socket again
        self.sel.register(self.sock, selectors.EVENT_READ, self.on_ready)

    def next_wake(self) -> float | None:
        return self.poll_at or None

    def close(self) -> None:
        self._unregister()
        self.poll_at = 0.0

    def _unregister(self) -> None:
        if self.sock.fileno() in self.sel.get_map():
            self.sel.unregister(self.sock)
