"""The ``/metrics`` HTTP server: prometheus-client's exposition (its
``MetricsHandler``: format negotiation, gzip, ``name[]`` filters) behind a
server whose cost stays bounded whatever its clients do.

prometheus-client's ``start_http_server`` gives every connection a thread
and no timeout: 1,024 idle connections held 1,024 descriptors, and the next
``open`` anywhere in trainwatch failed with EMFILE and killed it. Here:

- at most ``max_connections`` connections are served at once, one thread
  each; one more is closed at once and counted (``over_limit``);
- every read and write times out after ``io_timeout`` seconds, and every
  connection is cut at ``deadline`` seconds, so a client that trickles a
  byte at a time cannot hold its slot either (``timeout``);
- a failure in one connection is counted, never printed as a traceback.

Connections waiting to be accepted sit in the kernel's backlog and cost
trainwatch no descriptor. The server's own counters are exported by the
``Exporter`` as ``trainwatch_metrics_connections*``.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import sys
import threading
import time
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import MetricsHandler
from prometheus_client.registry import Collector

log = logging.getLogger("trainwatch")

MAX_CONNECTIONS = 16
IO_TIMEOUT = 5.0  # seconds of silence from a client before it is dropped
DEADLINE = 30.0  # seconds a connection may last in all (Prometheus' scrape_timeout is 10s)
_SWEEP_EVERY = 0.5  # serve_forever's poll interval: how late a deadline may be enforced


@dataclass
class Dropped:
    over_limit: int = 0  # closed at once: max_connections were being served
    timeout: int = 0  # silent past io_timeout, or still open at the deadline
    error: int = 0  # the client went away mid-answer, or the handler failed


class _Handler(MetricsHandler):
    """prometheus-client's handler; quiet, and telling the server of timeouts."""

    server: MetricsServer

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing per request: a scrape every 15 s would flood the log."""

    def log_error(self, format: str, *args: Any) -> None:
        # BaseHTTPRequestHandler reports a socket timeout here with the exception.
        if args and isinstance(args[0], TimeoutError):
            self.server.count_timeout()


class MetricsServer(ThreadingHTTPServer):
    """Serves ``registry`` on ``address:port`` from ``serve_forever``; bounded
    as the module says. Raises OSError when the port cannot be bound."""

    daemon_threads = True  # a handler stuck past the deadline never blocks our exit
    request_queue_size = 128  # the kernel's backlog, not our descriptors

    def __init__(self, address: str, port: int, registry: Collector,
                 max_connections: int = MAX_CONNECTIONS, io_timeout: float = IO_TIMEOUT,
                 deadline: float = DEADLINE) -> None:
        self.address_family = _family(address, port)
        self.max_connections = max_connections
        self.deadline = deadline
        self.dropped = Dropped()
        # Held while a connection is admitted, cut or closed: a socket is never
        # shut down by the sweeper after its thread closed it (its fd reused).
        self._lock = threading.Lock()
        self._live: dict[socket.socket, float] = {}  # connection -> when it must end
        handler = type("Handler", (_Handler,), {"registry": registry, "timeout": io_timeout})
        super().__init__((address, port), handler)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._live)

    def count_timeout(self) -> None:
        with self._lock:
            self.dropped.timeout += 1

    # --- socketserver hooks ---------------------------------------------------------

    def server_bind(self) -> None:
        """HTTPServer's, without its reverse DNS lookup of the address (getfqdn),
        which can stall the start on a host with a slow resolver."""
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = len(self._live) >= self.max_connections
            if full:
                self.dropped.over_limit += 1
            else:
                self._live[request] = time.monotonic() + self.deadline
        if full:
            self._close(request)
            return
        try:
            super().process_request(request, client_address)  # its own thread
        except RuntimeError:  # no thread to be had: refuse this one, keep serving
            with self._lock:
                self.dropped.error += 1
            self.shutdown_request(request)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._live.pop(request, None)
            self._close(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone mid-answer or a failing collector: counted, not printed."""
        e = sys.exc_info()[1]
        with self._lock:
            if self._live.get(request) == float("inf"):
                return  # cut at its deadline: counted as a timeout already
            self.dropped.error += 1
        if not isinstance(e, (ConnectionError, TimeoutError)):
            log.warning("metrics: a scrape failed: %s: %s", type(e).__name__, e)

    def service_actions(self) -> None:
        """Between two accepts (every 0.5 s): cut the connections past their deadline."""
        now = time.monotonic()
        with self._lock:
            late = [c for c, until in self._live.items() if until <= now]
            for c in late:
                self._live[c] = float("inf")  # cut once; its thread closes it
                self.dropped.timeout += 1
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)  # the blocked read or write returns

    def server_close(self) -> None:
        super().server_close()
        with self._lock:
            for c in self._live:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _close(request: Any) -> None:
        with contextlib.suppress(OSError):
            request.shutdown(socket.SHUT_WR)
        request.close()

    # --- running it -------------------------------------------------------------------

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, args=(_SWEEP_EVERY,),
                             name="metrics-http", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def _family(address: str, port: int) -> socket.AddressFamily:
    """IPv6 for an IPv6 address (``::``), else IPv4; as prometheus-client does."""
    with contextlib.suppress(OSError):
        infos = socket.getaddrinfo(address or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        if infos:
            return infos[0][0]
    return socket.AF_INET
