"""The bounded /metrics server, in-process on a real socket: prometheus-client's
exposition, and a scrape that gets through whatever other local clients do (idle
connections held and reopened, a trickled request, an oversized one)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import local_user, need_root, run_name, wait_for


def _server(**kw: Any) -> Any:
    from prometheus_client import CollectorRegistry, Counter
    from trainwatch.export.metricsserver import MetricsServer

    reg = CollectorRegistry()
    Counter("tw_test_things", "Things.", registry=reg).inc(3)
    server = MetricsServer("127.0.0.1", 0, reg, **kw)
    server.start()
    return server


@pytest.fixture
def servers() -> Iterator[list[Any]]:
    """Servers a test started, stopped at its end."""
    started: list[Any] = []
    yield started
    for s in started:
        s.stop()


def _scrape(port: int, accept: str | None = None, timeout: float = 10) -> tuple[str, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                 headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.headers["Content-Type"], r.read().decode()


def _closed_by_peer(c: socket.socket) -> bool:
    c.settimeout(0.05)
    try:
        return c.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


# The holder: any local user's process keeping n idle connections open to the port,
# each reopened as soon as the server closes it. Prints "ready" once all are open.
HOLDER = textwrap.dedent("""
    import selectors, socket, sys, time
    port, n = int(sys.argv[1]), int(sys.argv[2])
    sel = selectors.DefaultSelector()
    def connect():
        while True:
            s = socket.socket()
            try:
                s.connect(("127.0.0.1", port))
            except OSError:
                s.close(); time.sleep(0.01); continue
            sel.register(s, selectors.EVENT_READ); return
    for _ in range(n):
        connect()
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(1):
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj); key.fileobj.close(); connect()
""")


@pytest.fixture
def holder() -> Iterator[Any]:
    """Start the holder on a port with n connections: holder(port, n)."""
    procs: list[subprocess.Popen[str]] = []

    def start(port: int, n: int) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(port), str(n)],
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=30)
        if p.stdout:
            p.stdout.close()


def test_the_server_answers_with_prometheus_clients_exposition(servers: list[Any]) -> None:
    """Text and OpenMetrics, as prometheus-client's generate_latest writes them."""
    from prometheus_client import generate_latest

    s = _server()
    servers.append(s)
    port = s.server_address[1]
    ctype, text = _scrape(port)
    assert ctype.startswith("text/plain") and "tw_test_things_total 3.0" in text
    assert text.encode() == generate_latest(s.registry)
    ctype, text = _scrape(port, accept="application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text") and text.endswith("# EOF\n")


def _served(port: int, n: int) -> int:
    """How many of n scrapes in a row are served, each within a generous 10 s."""
    served = 0
    for _ in range(n):
        with contextlib.suppress(OSError):
            served += "tw_test_things_total" in _scrape(port, timeout=10)[1]
        time.sleep(0.05)
    return served


def test_scrapes_get_through_while_64_connections_are_held_and_reopened(
        servers: list[Any], holder: Any) -> None:
    """64 idle connections held by another process, each reopened when the 1 s io
    timeout closes it: at least 19 of 20 scrapes are served."""
    s = _server(io_timeout=1.0)
    servers.append(s)
    port = s.server_address[1]
    holder(port, 64)
    wait_for(lambda: s.open_connections >= 64, what="the holder's connections open")
    assert _served(port, 20) >= 19, s.dropped


def test_scrapes_get_through_when_held_connections_exceed_the_cap(
        servers: list[Any], holder: Any) -> None:
    """32 connections held and reopened at once against a cap of 16: the held ones make
    room for the scrapes (over_limit), at least 9 of 10 scrapes are served."""
    s = _server(max_connections=16, io_timeout=30.0)
    servers.append(s)
    port = s.server_address[1]
    holder(port, 32)
    wait_for(lambda: s.open_connections == 16, what="the cap filled by the holder")
    assert _served(port, 10) >= 9, s.dropped
    assert s.dropped.over_limit >= 16  # the holder's surplus kept reconnecting


def test_past_the_cap_the_longest_idle_connection_makes_room(servers: list[Any]) -> None:
    """With 4 idle connections open at a cap of 4, a fifth client is served and the
    oldest idle one is closed (over_limit), not the newcomer."""
    s = _server(max_connections=4, io_timeout=30.0)
    servers.append(s)
    port = s.server_address[1]
    idle = []
    try:
        for n in range(4):
            idle.append(socket.create_connection(("127.0.0.1", port)))
            wait_for(lambda n=n: s.open_connections == n + 1, what=f"connection {n + 1} open")
        assert "tw_test_things_total" in _scrape(port)[1]
        assert s.dropped.over_limit == 1
        wait_for(lambda: _closed_by_peer(idle[0]), timeout=5, what="the oldest closed")
        assert not any(_closed_by_peer(c) for c in idle[1:])
    finally:
        for c in idle:
            c.close()


def test_idle_connections_are_closed_at_the_io_timeout(servers: list[Any]) -> None:
    """Connections that send no request are closed io_timeout after they opened, counted."""
    s = _server(io_timeout=1.0, deadline=30.0)
    servers.append(s)
    port = s.server_address[1]
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        wait_for(lambda: all(_closed_by_peer(c) for c in idle), timeout=10,
                 what="the idle ones dropped at the io timeout")
        assert s.dropped.timeout == 4
        wait_for(lambda: s.open_connections == 0, what="every connection gone")
    finally:
        for c in idle:
            c.close()


def test_a_client_trickling_its_request_is_cut_at_the_io_timeout(servers: list[Any]) -> None:
    """A header line every 0.2 s gains nothing: the whole head must arrive within the
    1 s io timeout, long before the 30 s deadline; counted as a timeout."""
    s = _server(io_timeout=1.0, deadline=30.0)
    servers.append(s)
    c = socket.create_connection(("127.0.0.1", s.server_address[1]))
    try:
        t0 = time.monotonic()
        c.sendall(b"GET /metrics HTTP/1.1\r\n")
        cut = False
        while time.monotonic() - t0 < 15 and not cut:
            try:
                c.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
            cut = _closed_by_peer(c)
            time.sleep(0.2)
        assert time.monotonic() - t0 < 15, "still open after 15 s"
        wait_for(lambda: s.dropped.timeout == 1, what="counted")
        assert s.dropped.error == 0
    finally:
        c.close()


def test_an_oversized_request_head_is_closed_and_counted(servers: list[Any]) -> None:
    """A request head beyond 8 KiB is not buffered further: closed, counted as an error."""
    s = _server(io_timeout=10.0)
    servers.append(s)
    c = socket.create_connection(("127.0.0.1", s.server_address[1]))
    try:
        with contextlib.suppress(OSError):  # closed (or reset) before all of it is sent
            c.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"x" * 20_000)
        wait_for(lambda: _closed_by_peer(c), timeout=10, what="closed")
        assert s.dropped.error == 1
        assert "tw_test_things_total" in _scrape(s.server_address[1])[1]
    finally:
        c.close()


def _page(url: str) -> int:
    """A page's HTTP status."""
    import urllib.error

    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def _threads(n: int, fn: Callable[[], object]) -> list[threading.Thread]:
    """``n`` threads running ``fn``, started."""
    started = [threading.Thread(target=fn) for _ in range(n)]
    for t in started:
        t.start()
    return started


def test_slow_incident_pages_never_hold_up_a_scrape(servers: list[Any]) -> None:
    """Pages render in a thread of their own from a short queue: 24 page requests at
    once, each taking 1 s to render, are answered (200, or 503 when the queue is
    full) while every scrape meanwhile gets its 200 (rendered with the pages, the
    scrapes would wait ~12 s behind them)."""

    rendered: list[tuple[str, int | None]] = []

    def pages(path: str, uid: int | None) -> tuple[int, bytes]:
        rendered.append((path, uid))
        time.sleep(1.0)
        return 200, b"<!doctype html><p>page"

    server = _server(pages=pages)
    servers.append(server)
    port = server.server_address[1]
    got: list[int] = []

    askers = _threads(24, lambda: got.append(_page(f"http://127.0.0.1:{port}/incidents/1")))
    scrapes = []
    for _ in range(5):
        t0 = time.monotonic()
        _, text = _scrape(port)
        scrapes.append(time.monotonic() - t0)
        assert "tw_test_things_total 3.0" in text
    for t in askers:
        t.join(timeout=60)
    assert len(got) == 24 and set(got) <= {200, 503} and 200 in got, got
    assert got.count(200) == len(rendered), (got, len(rendered))
    # This process is the client: the page was told its own uid.
    assert {uid for _, uid in rendered} == {os.geteuid()}, rendered
    assert sum(scrapes) < 6.0, scrapes


# Another user's five page requests, one after another: each one's status, a line each.
ASKER = textwrap.dedent("""
    import sys, urllib.error, urllib.request
    for _ in range(5):
        try:
            with urllib.request.urlopen(sys.argv[1], timeout=60) as r:
                print(r.status, flush=True)
        except urllib.error.HTTPError as e:
            print(e.code, flush=True)
""")


def test_one_users_flood_of_pages_leaves_another_users_pages_served(servers: list[Any]) -> None:
    """16 threads of one user ask for pages without pause (each 0.2 s to render) while
    another user asks five times: all five are served, not 503 (the queue was one line
    of 8, which the flood kept full); the flood itself gets 503s, and its share."""

    need_root("a second user's requests")
    other = local_user(run_name("pager"))
    rendered: list[int | None] = []

    def pages(path: str, uid: int | None) -> tuple[int, bytes]:
        rendered.append(uid)
        time.sleep(0.2)
        return 200, b"<!doctype html><p>page"

    server = _server(pages=pages)
    servers.append(server)
    url = f"http://127.0.0.1:{server.server_address[1]}/incidents/"
    stop = threading.Event()
    flood: list[int] = []

    def ask() -> None:
        while not stop.is_set():
            flood.append(_page(url))

    askers = _threads(16, ask)
    try:
        wait_for(lambda: 503 in flood, timeout=30, what="the flood to fill its share")
        p = subprocess.run(["setpriv", f"--reuid={other.pw_uid}", f"--regid={other.pw_gid}",
                            "--clear-groups", "/usr/bin/python3", "-c", ASKER, url],
                           capture_output=True, text=True, timeout=120, check=False)
    finally:
        stop.set()
        for t in askers:
            t.join(timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["200"] * 5, (p.stdout, p.stderr)
    assert rendered.count(other.pw_uid) == 5 and 503 in flood and 200 in flood
