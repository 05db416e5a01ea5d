"""The ``/metrics`` HTTP server: prometheus-client's exposition (its
``MetricsHandler``: format negotiation, gzip, ``name[]`` filters) behind a
server that a scrape gets through whatever other clients do.

prometheus-client's ``start_http_server`` gives every connection a thread and
no timeout: 1,024 idle connections held 1,024 descriptors, and the next ``open``
anywhere in trainwatch failed with EMFILE. A pool of 16 threads, each blocked
reading a connection, was no better: 16 connections held open by any local user
(reconnecting when closed) made 20 of 20 scrapes fail. So here no thread ever
waits on a client:

- one thread runs a selector: it accepts, reads each request head and writes
  each answer without blocking;
- a complete head is answered by prometheus-client's handler in a small pool of
  workers, from memory to memory: rendering costs CPU, never a client's time;
- at most ``max_connections`` are open; one more makes room by closing the
  connection that has waited longest without a complete request (a scrape sends
  its request at once, so a newcomer is never the one closed), counted as
  ``over_limit``;
- a request head must be complete ``io_timeout`` seconds after the connect (a
  client trickling a byte at a time gains nothing), a write must progress within
  ``io_timeout``, and every connection is cut at ``deadline`` (``timeout``);
- a failure in one connection is counted (``error``), never printed as a traceback.

The server's own counters are exported by the ``Exporter`` as
``trainwatch_metrics_connections*``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import queue
import resource
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import MetricsHandler
from prometheus_client.registry import Collector
from trainwatch.export import pageserve

log = logging.getLogger("trainwatch")

MAX_CONNECTIONS = 256  # open at once: a descriptor and a few KiB each
IO_TIMEOUT = 5.0  # seconds for a request head to arrive, or a write to progress
DEADLINE = 30.0  # seconds a connection may last in all (Prometheus' scrape_timeout is 10s)
WORKERS = 2  # threads rendering answers; they never wait on a client
MAX_HEAD = 8192  # bytes of request line and headers (a Prometheus scrape sends ~300)
_TICK = 0.5  # the selector's longest sleep: how late a timeout may be enforced
_SWEEP_EVERY = 0.1  # seconds between looks for connections past their time
_GRACE = 0.25  # seconds a new connection is safe from being closed to make room
_READING, _RENDERING, _WRITING = "reading", "rendering", "writing"


@dataclass
class Dropped:
    over_limit: int = 0  # closed to make room: max_connections were open
    timeout: int = 0  # no complete head or no write progress in io_timeout, or the deadline
    error: int = 0  # a malformed or oversized request, the client gone mid-answer, a failed render


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: Any
    opened: float
    phase: str = _READING
    head: bytearray = field(default_factory=bytearray)
    out: memoryview = field(default_factory=lambda: memoryview(b""))
    waiting_since: float = 0.0  # when the current read or write began waiting


class _Handler(MetricsHandler):
    """prometheus-client's handler, reading the head from memory and writing the
    answer to memory (``request`` is the head's bytes)."""

    answer = b""

    def setup(self) -> None:
        self.rfile = io.BytesIO(self.request)
        self.wfile = self._out = io.BytesIO()

    def finish(self) -> None:
        self.answer = self._out.getvalue()

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing per request: a scrape every 15 s would flood the log."""


def connection_cap() -> int:
    """The default cap on connections open at once (MetricsServer's docstring)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft // 4))


class MetricsServer:
    """Serves ``registry`` on ``address:port`` from its own thread (``start``);
    bounded as the module says. Raises OSError when the port cannot be bound."""

    def __init__(self, address: str, port: int, registry: Collector,
                 max_connections: int | None = None, io_timeout: float = IO_TIMEOUT,
                 deadline: float = DEADLINE, workers: int = WORKERS,
                 pages: pageserve.Pages | None = None) -> None:
        """``max_connections``: by default MAX_CONNECTIONS, or a quarter of the
        descriptors this process may open when that is fewer (the rest are the
        jobs', the ledger's, the hands'), never under 16."""
        self.registry = registry
        self.max_connections = max_connections or connection_cap()
        self.io_timeout = io_timeout
        self.deadline = deadline
        self.dropped = Dropped()
        self._handler = type("Handler", (_Handler,), {"registry": registry})
        self._listener = socket.socket(_family(address, port), socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((address, port))
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.server_address: tuple[Any, ...] = self._listener.getsockname()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        # Daemon threads, not a ThreadPoolExecutor (whose threads are joined at exit):
        # a render stuck behind a lock must never keep the daemon from exiting.
        self._todo: queue.SimpleQueue[tuple[_Conn, bytes] | None] = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, name=f"metrics-render-{n}",
                                          daemon=True) for n in range(workers)]
        self._conns: dict[int, _Conn] = {}  # by fd; touched by the selector thread only
        self._rendered: deque[tuple[_Conn, bytes | None]] = deque()  # from the workers
        self._lock = threading.Lock()  # guards dropped and the count read by open_connections
        self._open = 0
        self._accepting = True
        self._next_sweep = 0.0
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Incident pages (pageserve.py), rendered apart from the scrapes.
        self._pages = pageserve.PageWorker(pages, self._rendered_page) if pages else None

    @property
    def open_connections(self) -> int:
        with self._lock:
            return self._open

    # --- running it -------------------------------------------------------------------

    def start(self) -> threading.Thread:
        for w in self._workers:
            w.start()
        if self._pages is not None:
            self._pages.start()
        t = threading.Thread(target=self._serve, name="metrics-http", daemon=True)
        self._thread = t
        t.start()
        return t

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for _ in self._workers:
            self._todo.put(None)
        if self._pages is not None:
            self._pages.stop()
        for c in list(self._conns.values()):
            self._drop(c)
        self._sel.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
            self._wake_w.send(b"\0")

    def _serve(self) -> None:
        while not self._stopping:
            # While accepting is paused, look again as soon as a sweep may resume it.
            for key, events in self._sel.select(_TICK if self._accepting else _SWEEP_EVERY):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                else:
                    c = self._conns.get(key.fd)
                    if c is not None and events & selectors.EVENT_READ:
                        self._read(c)
                    elif c is not None and events & selectors.EVENT_WRITE:
                        self._write(c)
            while self._rendered:
                c, answer = self._rendered.popleft()
                self._answer(c, answer)
            now = time.monotonic()
            if now >= self._next_sweep:
                self._next_sweep = now + _SWEEP_EVERY
                self._sweep(now)

    # --- one connection's life: accept, read the head, render, write ------------------------

    def _accept(self) -> None:
        for _ in range(64):  # a few per wake-up: a flood cannot starve the reads
            victim = None
            if len(self._conns) >= self.max_connections:
                victim = self._victim()
                if victim is None:
                    # Every connection is new or being rendered: the rest wait in the backlog.
                    self._pause_accepting()
                    return
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                self._count("error")
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accepting()  # out of descriptors: until the next sweep
                return
            if victim is not None:  # closed only once there is a newcomer to take its place
                self._count("over_limit")
                self._drop(victim)
            sock.setblocking(False)
            now = time.monotonic()
            c = _Conn(sock, peer, now, waiting_since=now)
            self._conns[sock.fileno()] = c
            self._sel.register(sock, selectors.EVENT_READ)
            with self._lock:
                self._open += 1
            self._read(c)  # a scrape's request is usually there already: render it now

    def _pause_accepting(self) -> None:
        """Until the next sweep: rather than spin on a listener that stays readable."""
        if self._accepting:
            self._accepting = False
            self._sel.unregister(self._listener)

    def _victim(self) -> _Conn | None:
        """The connection to close to make room: the one waiting longest without a
        complete request (else the oldest one being written to); None when none is
        older than _GRACE."""
        # The grace bounds the churn a client reconnecting at once can cause, and gives
        # every newcomer time to be read: a burst of accepts never closes one it made.
        old = time.monotonic() - _GRACE
        for phase in (_READING, _WRITING):
            waiting = [c for c in self._conns.values() if c.phase == phase and c.opened <= old]
            if waiting:
                return min(waiting, key=lambda c: c.opened)
        return None

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(MAX_HEAD + 1)
        except BlockingIOError:
            return
        except OSError:
            self._count("error")
            self._drop(c)
            return
        if not data:  # the client left before asking
            self._drop(c)
            return
        c.head += data
        if b"\n\r\n" in c.head or b"\n\n" in c.head:
            c.phase = _RENDERING
            self._sel.unregister(c.sock)
            path = pageserve.path_of(bytes(c.head)) if self._pages is not None else None
            if path is None or self._pages is None:
                self._todo.put((c, bytes(c.head)))
                return
            try:
                server = c.sock.getsockname()
            except OSError:
                server = None
            now = self._pages.submit(c, path, c.peer, server)
            if now is not None:
                self._rendered.append((c, now))
        elif len(c.head) > MAX_HEAD:
            self._count("error")
            self._drop(c)

    def _work(self) -> None:
        """A worker: each head's whole answer (None when the handler failed), handed
        back to the selector thread."""
        while (item := self._todo.get()) is not None:
            c, head = item
            answer: bytes | None = None
            try:
                answer = self._handler(head, c.peer, self).answer
            except Exception as e:  # a failing collector: counted and logged, never raised
                log.warning("metrics: a scrape failed: %s: %s", type(e).__name__, e)
            self._rendered.append((c, answer))
            self._wake()

    def _rendered_page(self, c: _Conn, answer: bytes | None) -> None:
        self._rendered.append((c, answer))
        self._wake()

    def _answer(self, c: _Conn, answer: bytes | None) -> None:
        if c.sock.fileno() < 0:
            return  # cut (deadline, stop) while it was rendered
        if answer is None:
            self._count("error")
            self._drop(c)
            return
        c.phase, c.out, c.waiting_since = _WRITING, memoryview(answer), time.monotonic()
        self._sel.register(c.sock, selectors.EVENT_WRITE)
        self._write(c)

    def _write(self, c: _Conn) -> None:
        try:
            sent = c.sock.send(c.out)
        except BlockingIOError:
            return
        except OSError:  # the client went away mid-answer
            self._count("error")
            self._drop(c)
            return
        c.out = c.out[sent:]
        c.waiting_since = time.monotonic()
        if not c.out:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_WR)  # the end of the answer (HTTP/1.0)
            self._drop(c)

    def _sweep(self, now: float) -> None:
        """Cut what waited past io_timeout or lived past the deadline; accept again
        after running out of descriptors."""
        for c in list(self._conns.values()):
            late = now - c.opened >= self.deadline
            stuck = c.phase != _RENDERING and now - c.waiting_since >= self.io_timeout
            if late or stuck:
                self._count("timeout")
                self._drop(c)
        if not self._accepting:
            self._accepting = True
            self._sel.register(self._listener, selectors.EVENT_READ)

    def _drop(self, c: _Conn) -> None:
        if self._conns.pop(c.sock.fileno(), None) is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(c.sock)
        c.sock.close()
        with self._lock:
            self._open -= 1

    def _count(self, reason: str) -> None:
        with self._lock:
            setattr(self.dropped, reason, getattr(self.dropped, reason) + 1)


def _family(address: str, port: int) -> socket.AddressFamily:
    """IPv6 for an IPv6 address (``::``), else IPv4; as prometheus-client does."""
    with contextlib.suppress(OSError):
        infos = socket.getaddrinfo(address or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        if infos:
            return infos[0][0]
    return socket.AF_INET
