"""Which local user holds the other end of a TCP connection to us (identd's
question), from the kernel's socket tables: ``/proc/net/tcp`` and ``tcp6`` list
every socket of this network namespace with its owner's uid.

An HTTP client sends no credentials the kernel vouches for, unlike a unix
socket's SO_PEERCRED; but a connection from this host is a socket in those
tables, whose local address is the client's and whose remote address is ours,
owned by the uid that made it. A client on another host has no such row: no uid.
Standard library only; the tables are read whole, at most ``MAX_BYTES``.
"""

from __future__ import annotations

import ipaddress
import struct
from typing import Any

MAX_BYTES = 64 << 20  # of each table: a host with ~400,000 sockets
_ESTABLISHED = "01"


def _hex(address: str, port: int) -> tuple[str, str]:
    """(/proc/net/tcp's form, tcp6's form) of one endpoint."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv4Address):
        v4 = f"{struct.unpack('<I', ip.packed)[0]:08X}:{port:04X}"
        mapped = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed).packed
    else:
        v4, mapped = "", ip.packed
    v6 = "".join(f"{struct.unpack('<I', mapped[i:i + 4])[0]:08X}" for i in range(0, 16, 4))
    return v4, f"{v6}:{port:04X}"


def uid_of(client: Any, server: Any, proc: str = "/proc") -> int | None:
    """The uid that owns the socket at ``client`` (address, port, ...) connected to
    ``server`` (our address and port: the listener's, or the accepted socket's
    local end), both as ``socket`` gives them; None when no socket of this host
    is that client (a remote one) or the tables cannot be read."""
    try:
        c4, c6 = _hex(str(client[0]), int(client[1]))
        s4, s6 = _hex(str(server[0]), int(server[1]))
    except (ValueError, TypeError, IndexError):
        return None
    for table, here, there in (("tcp", c4, s4), ("tcp6", c6, s6)):
        if not here:
            continue
        try:
            with open(f"{proc}/net/{table}", "rb") as f:
                text = f.read(MAX_BYTES).decode("ascii", "replace")
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            cols = line.split()
            if len(cols) > 7 and cols[1] == here and cols[2] == there \
                    and cols[3] == _ESTABLISHED and cols[7].isdigit():
                return int(cols[7])
    return None
