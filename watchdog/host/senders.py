"""The control socket's senders (control.py): a rate per uid, for all but admins,
and their refusals and drops logged at most once per sender and kind per
NOTE_EVERY seconds, saying how many more there were meanwhile. Anyone may send,
so a flood must stay cheap and must not flood the journal."""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainwatch.privsep.access import Peer

log = logging.getLogger("trainwatch")

NOTE_EVERY = 10.0  # seconds between log lines of one sender's refusals (or drops)
SENDERS_MAX = 1024  # senders remembered (rate, last line); all forgotten when full
RATE = 100.0  # requests a second from one sender that is not an admin ...
BURST = 200.0  # ... after a burst of this many
ERROR_MAX = 300  # characters of an error line


def one_line(text: str) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= ERROR_MAX else line[: ERROR_MAX - 3] + "..."


class Senders:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._notes: dict[tuple[int, str], tuple[float, int]] = {}  # -> (logged at, since)
        self._rates: dict[int, tuple[float, float]] = {}  # uid -> (tokens, at)

    def within_rate(self, peer: Peer) -> bool:
        """A token bucket per uid (RATE a second, BURST at once); admins have none."""
        if peer.admin:
            return True
        now = self.clock()
        tokens, at = self._rates.get(peer.uid, (BURST, now))
        tokens = min(BURST, tokens + (now - at) * RATE)
        if len(self._rates) >= SENDERS_MAX and peer.uid not in self._rates:
            self._rates.clear()
        self._rates[peer.uid] = (tokens - 1 if tokens >= 1 else tokens, now)
        return tokens >= 1

    def note(self, peer: Peer, what: str, why: str) -> None:
        """One line per sender and kind per NOTE_EVERY seconds, saying how many
        more there were meanwhile: a flood must not flood the journal."""
        now = self.clock()
        key = (peer.uid, what.split(" ", 1)[0])
        at, since = self._notes.get(key, (float("-inf"), 0))
        if now - at < NOTE_EVERY:
            self._notes[key] = (at, since + 1)
            return
        if len(self._notes) >= SENDERS_MAX:
            self._notes.clear()
        self._notes[key] = (now, 0)
        more = f" ({since} more since the last line)" if since else ""
        log.warning("control: %s from pid %d %s: %s%s", what, peer.pid, peer, one_line(why),
                    more)
