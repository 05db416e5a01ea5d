"""Incident pages on the metrics port: ``GET /incidents/`` and ``/incidents/N``.

A page request is routed here by the metrics server (metricsserver.py) once its
head is complete, and rendered by one thread of its own from a short queue: a
page reads the ledger and the incident's files, and however many pages are
asked for, the scrape workers never render one, so a scrape gets through. Who
asks is the local user whose socket is the connection's other end (tcppeer.py,
read as the request is queued); ``pages`` decides what that user may see.

Each user has a share of the queue: at most PER_USER requests of one user wait
(every remote client is one user, None), QUEUE in all, one more is answered 503 at
once, and the renderer takes the users in turn. One user's flood (16 threads for
15 s) had another user's pages answered 503, five of five: the queue was one line.
"""

from __future__ import annotations

import http
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from trainwatch.export import tcppeer

log = logging.getLogger("trainwatch")

PREFIX = b"/incidents"
QUEUE = 32  # page requests waiting at most, of every user; one more is answered 503
PER_USER = 4  # of one user
# A page is the daemon's own markup around escaped data: no script from elsewhere,
# no request anywhere (the page is self-contained).
_HEADERS = ("Content-Type: text/html; charset=utf-8\r\n"
            "Content-Security-Policy: default-src 'none'; style-src 'unsafe-inline'; "
            "img-src data:; base-uri 'none'; form-action 'none'\r\n"
            "X-Content-Type-Options: nosniff\r\nCache-Control: no-store\r\n")

Pages = Callable[[str, int | None], tuple[int, bytes]]  # (path, uid) -> (status, body)


def path_of(head: bytes) -> str | None:
    """The path of a GET for a page, or None (not a page request)."""
    line = head.split(b"\n", 1)[0].split()
    if len(line) < 2 or line[0] != b"GET" or not line[1].startswith(PREFIX):
        return None
    return line[1].split(b"?", 1)[0].decode("ascii", "replace")


def response(status: int, body: bytes) -> bytes:
    reason = http.HTTPStatus(status).phrase
    return (f"HTTP/1.0 {status} {reason}\r\n{_HEADERS}Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


def _plain(status: int, text: str) -> bytes:
    return response(status, f"<!doctype html><title>{status}</title><p>{text}".encode())


class PageWorker:
    """Renders page requests in one thread, taking the users in turn; ``done(conn,
    answer)`` hands each answer back to the server's selector thread."""

    def __init__(self, pages: Pages, done: Callable[[Any, bytes | None], None]) -> None:
        self.pages, self.done = pages, done
        self._cv = threading.Condition()
        # uid -> its waiting requests, in the order the users came: the next is the
        # first user's first, and that user goes to the back (round robin).
        self._waiting: dict[int | None, deque[tuple[Any, str]]] = {}
        self._count = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="incident-pages", daemon=True)
        self.served = self.busy = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, conn: Any, path: str, client: Any, server: Any) -> bytes | None:
        """None: queued (answered through ``done``); else the answer now (503)."""
        uid = tcppeer.uid_of(client, server)
        with self._cv:
            mine = self._waiting.get(uid)
            if self._count >= QUEUE or (mine is not None and len(mine) >= PER_USER):
                self.busy += 1
                return _plain(503, "busy: ask again")
            self._waiting.setdefault(uid, deque()).append((conn, path))
            self._count += 1
            self._cv.notify()
        return None

    def stop(self) -> None:
        with self._cv:  # a daemon thread: it ends with the process
            self._stopped = True
            self._cv.notify()

    def _next(self) -> tuple[Any, str, int | None] | None:
        with self._cv:
            while not self._waiting and not self._stopped:
                self._cv.wait()
            if self._stopped:
                return None
            uid = next(iter(self._waiting))
            mine = self._waiting.pop(uid)
            conn, path = mine.popleft()
            if mine:
                self._waiting[uid] = mine
            self._count -= 1
            return conn, path, uid

    def _run(self) -> None:
        while (item := self._next()) is not None:
            conn, path, uid = item
            try:
                status, body = self.pages(path, uid)
                answer: bytes | None = response(status, body)
            except Exception as e:  # one page's failure: counted by the server, logged here
                log.warning("incident page %s failed: %s: %s", path, type(e).__name__, e)
                answer = None
            self.served += 1
            self.done(conn, answer)
