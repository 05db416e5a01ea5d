"""The local user at the other end of a TCP connection, read from the kernel's
socket tables (export/tcppeer.py): real sockets, real users, IPv4, IPv6 and an
IPv4 client of a dual-stack listener."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import local_user, run_name
from trainwatch.export.incidentpages import IncidentPages
from trainwatch.export.tcppeer import uid_of

# Connects to argv[1]:argv[2], says so, and holds the connection until stdin closes.
_CLIENT = ("import socket, sys\n"
           "s = socket.create_connection((sys.argv[1], int(sys.argv[2])))\n"
           "print(s.getsockname()[1], flush=True)\n"
           "sys.stdin.read()\n")


def _connect_as(uid: int, gid: int, host: str, port: int) -> subprocess.Popen[str]:
    def drop() -> None:
        os.setgid(gid)
        os.setgroups([])
        os.setuid(uid)

    # The system's python: another user cannot reach this checkout's venv.
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    return subprocess.Popen([python, "-c", _CLIENT, host, str(port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            preexec_fn=drop if os.geteuid() == 0 else None)


@pytest.fixture
def other() -> Iterator[tuple[int, int]]:
    u = local_user(run_name("peer"))
    yield u.pw_uid, u.pw_gid


@pytest.mark.parametrize(("family", "bind", "host"), [
    (socket.AF_INET, "127.0.0.1", "127.0.0.1"),
    (socket.AF_INET6, "::1", "::1"),
    (socket.AF_INET6, "::", "127.0.0.1"),  # dual stack: the peer is ::ffff:127.0.0.1
])
def test_the_uid_of_a_local_client_is_the_users_who_connected(
        other: tuple[int, int], family: socket.AddressFamily, bind: str, host: str) -> None:
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind((bind, 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        mine = _connect_as(os.geteuid(), os.getegid(), host, port)
        theirs = _connect_as(*other, host, port)
        try:
            ports = {}
            for proc, uid in ((mine, os.geteuid()), (theirs, other[0])):
                assert proc.stdout is not None
                ports[int(proc.stdout.readline())] = uid
            got = {}
            for _ in ports:
                conn, peer = listener.accept()
                with conn:
                    got[peer[1]] = uid_of(peer, conn.getsockname())
            assert got == ports
        finally:
            for proc in (mine, theirs):
                proc.kill()
                proc.wait()
    finally:
        listener.close()


def test_no_uid_for_an_endpoint_no_socket_of_this_host_has() -> None:
    assert uid_of(("192.0.2.7", 40000), ("127.0.0.1", 9400)) is None
    assert uid_of(("not an address", 1), ("127.0.0.1", 9400)) is None


def test_a_client_no_local_user_vouches_for_is_served_no_incident_page(tmp_path: Path) -> None:
    """A page request from another host (no uid found) is refused before anything is read."""
    pages = IncidentPages(str(tmp_path / "no-state-dir"), dict)
    status, body = pages("/incidents/", None)
    assert status == 403 and b"users of this host only" in body
