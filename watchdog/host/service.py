"""The daemon's side of systemd: sd_notify (readiness, status line, watchdog
pings, reload and stop) and a journald log handler with structured fields.

Both come from the optional extra ``trainwatchd[systemd]`` (systemd-python,
which wraps libsystemd's sd_notify). Without it the journald fields are off and
notifications go through a minimal sender of sd_notify's datagram (``_datagram``),
because a ``Type=notify`` unit that never hears ``READY=1`` is killed and restarted
forever; one info line says so, only when we run under systemd.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from types import ModuleType

from trainwatch.config import ConfigError

log = logging.getLogger("trainwatch")

STATUS_MAX = 200  # systemctl status shows one line; keep it readable
IDENTIFIER = "trainwatch"  # SYSLOG_IDENTIFIER, so `journalctl -t trainwatch` finds us

_said_missing = False  # the "extra is not installed" line is logged once per process


def _module(name: str) -> ModuleType | None:
    # importlib rather than `import systemd.daemon`: the package has no type
    # information, and it is optional, so its absence is an ordinary outcome.
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def under_systemd(env: Mapping[str, str] = os.environ) -> bool:
    """True when the service manager started us (it sets these for every unit)."""
    return any(env.get(k) for k in ("NOTIFY_SOCKET", "INVOCATION_ID", "JOURNAL_STREAM"))


def _say_missing() -> None:
    global _said_missing
    if not _said_missing and under_systemd():
        _said_missing = True
        log.info("journald fields are off and sd_notify uses trainwatch's own minimal sender:"
                 " systemd-python is not installed (make install again on a host with"
                 " libsystemd-dev, or pip install '/path/to/trainwatch[systemd]')")


def watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds between pings: half of WATCHDOG_USEC, as sd_watchdog_enabled(3)
    advises; None when no watchdog is asked of this process."""
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    owner = env.get("WATCHDOG_PID")
    if usec <= 0 or (owner and owner != str(pid)):
        # WATCHDOG_PID names another process: we inherited the variable from it.
        return None
    return usec / 2 / 1e6


def one_line(text: str) -> str:
    """A STATUS= value: no newlines or control characters, at most STATUS_MAX."""
    printable = "".join(c if c.isprintable() else " " for c in text)
    return " ".join(printable.split())[:STATUS_MAX]


def _datagram(address: str) -> Callable[[str], object]:
    """sd_notify(3) without libsystemd: the message as one AF_UNIX datagram to
    NOTIFY_SOCKET, a path or, after '@', an abstract name. STYLE prefers the
    dependency, and it is used whenever installed; this fallback exists because
    systemd-python needs a C toolchain and libsystemd-dev to install, and without
    READY=1 a Type=notify unit never starts. The protocol is documented and stable
    (man sd_notify, "Notes"). Other forms (vsock:) are refused at start, in one line."""
    if address.startswith("@"):
        target = "\0" + address[1:]
    elif address.startswith("/"):
        target = address
    else:
        raise ConfigError(f"NOTIFY_SOCKET: expected an AF_UNIX path or @name (what"
                          f" trainwatch's own sd_notify sender speaks), got {address!r}; install"
                          " systemd-python (pip install '/path/to/trainwatch[systemd]') for the"
                          " others")

    def send(message: str) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(message.encode(), target)

    return send


class Service:
    """Notifications to systemd; each method is a no-op when there is no one to tell."""

    def __init__(self) -> None:
        self.notify_failures = 0  # notify calls that raised (socket gone, ...)
        self.watchdog_interval: float | None = None
        self._notify: Callable[[str], object] | None = None
        self._status: str | None = None
        self._last_ping: float | None = None
        daemon = _module("systemd.daemon")
        address = os.environ.get("NOTIFY_SOCKET")
        if address:
            self._notify = daemon.notify if daemon is not None else _datagram(address)
            self.watchdog_interval = watchdog_interval(os.environ, os.getpid())
        # else not started by systemd (or as Type=simple): nothing to tell
        if daemon is None:
            _say_missing()

    def _send(self, message: str) -> None:
        if self._notify is None:
            return
        try:
            self._notify(message)
        except Exception as e:
            self.notify_failures += 1
            if self.notify_failures == 1:
                log.warning("systemd notify failed: %s (later failures are counted, not logged)",
                            e)

    def ready(self, status: str) -> None:
        """Start-up (or a reload) is done: systemctl start returns now."""
        self._status = one_line(status)
        self._send(f"READY=1\nSTATUS={self._status}")

    def status(self, line: str) -> None:
        """The one line `systemctl status` shows; sent only when it changed."""
        text = one_line(line)
        if text != self._status:
            self._status = text
            self._send(f"STATUS={text}")

    def watchdog(self, now: float) -> None:
        """Ping WatchdogSec= when the last ping is watchdog_interval old (now: monotonic)."""
        if self.watchdog_interval is None:
            return
        if self._last_ping is None or now - self._last_ping >= self.watchdog_interval:
            self._last_ping = now
            self._send("WATCHDOG=1")

    def reloading(self) -> None:
        """A reload began; ready() ends it. MONOTONIC_USEC= ties the message to this
        reload (systemd 257 waits for it and hangs the reload without it)."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def stopping(self) -> None:
        """We are shutting down on purpose."""
        self._send("STOPPING=1")


def journal_handler(
    sender_function: Callable[..., object] | None = None,
) -> logging.Handler | None:
    """A handler that writes to journald with structured fields (each upper-case
    ``extra=`` key, e.g. TRAINWATCH_JOB, becomes a field), when systemd started us
    (it sets JOURNAL_STREAM or INVOCATION_ID) and systemd-python is installed; else
    None (keep logging to stderr). sender_function stands in for journald in tests."""
    if not (os.environ.get("JOURNAL_STREAM") or os.environ.get("INVOCATION_ID")):
        return None
    journal = _module("systemd.journal")
    if journal is None:
        return None  # Service() says so, once logging is set up (this runs before)
    kwargs: dict[str, object] = {"SYSLOG_IDENTIFIER": IDENTIFIER}
    if sender_function is not None:
        kwargs["sender_function"] = sender_function
    handler: logging.Handler = journal.JournalHandler(**kwargs)
    return handler
