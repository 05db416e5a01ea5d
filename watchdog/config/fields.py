"""Checks of single config values, and how a value found in a config is shown.

Each check takes what YAML gave and returns the typed value, or raises
TypeError/ValueError (the caller names the field and the expectation), or
Refused when the check knows better what to say.
"""

from __future__ import annotations

import math
import re
import socket
from typing import Any

from trainwatch.config.torchrun import parse_nodes  # pure: it imports nothing of config

MAX_DURATION = 10 * 365 * 86400.0  # no timeout, window or backoff is longer than 10 years
MAX_RANKS = 1 << 20  # a declared world size beyond any job of today
MAX_ID = (1 << 32) - 2  # uid_t/gid_t; 2**32 - 1 is (uid_t)-1, "leave unchanged", never an id
_DURATION = re.compile(
    r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(ms|s|m|h|d)?\s*$"
)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_SHOWN = 60  # characters of a found value shown in a message
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
HOST_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")  # whole: fullmatch


class Refused(ValueError):
    """A check's own words: what it expected and what it found instead."""

    def __init__(self, expected: str, got: object) -> None:
        super().__init__(expected)
        self.expected, self.got = expected, got


class Said(str):
    """A description of what was found, shown as is rather than quoted as a value."""


def show(value: object, limit: int = _SHOWN) -> str:
    """A value as a message shows it: short, one line, and cheap whatever it is.

    Never the repr of a whole container: a billion-laughs document is a few
    nested lists whose repr would take hours and all the memory there is."""
    if isinstance(value, Said):
        return str(value)
    if isinstance(value, str):
        shown = repr(value[: limit + 1])
    elif isinstance(value, bool) or value is None or isinstance(value, float):
        shown = repr(value)
    elif isinstance(value, int):
        if value.bit_length() > 64:
            digits = len(str(abs(value))) if value.bit_length() < 14000 else None
            return f"an integer of {digits} digits" if digits else "an integer of > 4000 digits"
        shown = repr(value)
    elif isinstance(value, list | tuple | dict | set):
        if _small(value):
            shown = repr(value)
        else:
            noun = "a mapping" if isinstance(value, dict) else f"a {type(value).__name__}"
            return f"{noun} of {len(value)} items"
    elif isinstance(value, bytes):
        return f"{len(value)} bytes of binary"
    else:
        shown = f"a {type(value).__name__}: {str(value)[:limit]}"
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _small(value: object, budget: int = 24) -> bool:
    """Whether a container holds at most ``budget`` values in all, not counting
    deeper than that; a container inside itself is not small."""
    stack, seen = [value], 0
    while stack:
        v = stack.pop()
        seen += 1
        if seen > budget:
            return False
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple | set):
            stack.extend(v)
        elif isinstance(v, str) and len(v) > _SHOWN:
            return False
    return True


def key(k: object) -> str:
    """A mapping key as a path part: itself when it reads plainly, else shown."""
    if isinstance(k, str) and NAME_RE.match(k):
        return k
    if isinstance(k, int) and not isinstance(k, bool) and k.bit_length() <= 64:
        return str(k)
    return show(k, 40)


def parse_duration(value: object, minimum: float = 0.0) -> float:
    """30, 30.5, '30s', '5m', '24h', '250ms', '1e-06', '1.5e3s' -> seconds,
    from ``minimum`` to 10 years. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        if not minimum <= value <= MAX_DURATION:  # exact for any int: no float(10**400)
            raise ValueError(value)
        return float(value)
    if isinstance(value, float):
        seconds = value
    elif isinstance(value, str) and len(value) <= 100 and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _UNITS[m.group(2)]  # 400 digits: inf, refused below
    else:
        raise ValueError(value)
    if not (math.isfinite(seconds) and minimum <= seconds <= MAX_DURATION):
        raise ValueError(value)
    return seconds


def duration(v: object) -> float:
    if parse_duration(v) <= 0:
        raise ValueError(v)
    return parse_duration(v)


def duration_or_zero(v: object) -> float:
    return parse_duration(v)


def optional_duration(v: object) -> float | None:
    return None if v is None else duration(v)


def duration_or_off(v: object) -> float | None:
    """A duration > 0, or None for 0, ``off`` or null (YAML reads a bare off as false)."""
    if v is None or v is False or v == "off" or (not isinstance(v, bool) and v in (0, "0")):
        return None
    return duration(v)


def text(v: object) -> str:
    if not isinstance(v, str) or not v:
        raise TypeError(v)
    if "\0" in v:
        raise Refused("a string without NUL bytes", v)
    return v


def numeric_id(s: str) -> int | None:
    """The uid or gid a string of ASCII digits names; None for a name. Raises
    ValueError beyond MAX_ID. ASCII only: str.isdigit() also takes "²", which
    int() refuses, and "٣", which int() reads as 3."""
    if not (s.isascii() and s.isdigit()):
        return None
    if len(s.lstrip("0")) > len(str(MAX_ID)) or int(s) > MAX_ID:  # no int() of 5000 digits
        raise ValueError(s)
    return int(s)


def _account(v: object, expected: str) -> str:
    if not isinstance(v, str) or not v:
        raise Refused(STR, v)  # `user: 1000` is refused as before: quote a uid
    text(v)  # its own words for a NUL
    try:
        numeric_id(v)
    except ValueError:
        raise Refused(expected, v) from None
    return v


def user(v: object) -> str:
    return _account(v, USER)


def group(v: object) -> str:
    return _account(v, GROUP)


def argument(v: object) -> str:
    """One element of a command line: a string, or a number or boolean as text."""
    if isinstance(v, bool):
        return "true" if v else "false"  # YAML gives the text as written; this is for code
    if isinstance(v, int | float):
        return str(v)
    if not isinstance(v, str):
        raise Refused("a string or a number", v)
    if "\0" in v:
        raise Refused("a string without NUL bytes", v)
    return v


def natural(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TypeError(v)
    return v


def positive_int(v: object) -> int:
    n = natural(v)
    if n == 0:
        raise ValueError(v)
    return n


def ranks(v: object) -> int | None:
    if v is None:
        return None
    n = positive_int(v)
    if n > MAX_RANKS:
        raise ValueError(v)
    return n


def positive_number(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 \
            or v == float("inf"):
        raise ValueError(v)
    return float(v)


def port(v: object) -> int:
    n = natural(v)
    if not 0 <= n < 65536:
        raise ValueError(v)
    return n


def factor(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 1 <= v <= 1000:
        raise TypeError(v)
    return float(v)


def fraction(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1:
        raise TypeError(v)
    return float(v)


def boolean(v: object) -> bool:
    if not isinstance(v, bool):
        raise TypeError(v)
    return v


def name(v: object) -> str:
    if not isinstance(v, str) or not NAME_RE.match(v):
        raise ValueError(v)
    return v


def pattern(v: object) -> str:
    if not isinstance(v, str) or v.count("{step}") != 1 or "/" in v or "\0" in v:
        raise ValueError(v)
    return v


def host(v: object) -> str:
    """This host's name in incidents and group records (``host:``, ``--host``)."""
    if not isinstance(v, str) or not HOST_RE.fullmatch(v):
        raise ValueError(v)
    return v


def address(v: object) -> str:
    """An address to listen on: a literal IP, or a name that resolves now (else the
    exporter's bind failed at start with a resolver error, after the config said ok)."""
    v = text(v)
    try:
        socket.getaddrinfo(v, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        why = e.strerror if isinstance(e, socket.gaierror) else "not a host name"
        raise Refused(f"{ADDRESS} ({why})", v) from None
    return v


def nodes(v: object) -> tuple[int, int]:
    """A job's span across hosts: N or "MIN:MAX", as torchrun's --nnodes."""
    if isinstance(v, int) and not isinstance(v, bool):
        v = str(v)
    if not isinstance(v, str):
        raise ValueError(v)
    return parse_nodes(v)


def backend(v: object) -> str:
    if v not in ("auto", "nvml", "sim", "off"):
        raise ValueError(v)
    return str(v)


# How a job writes its checkpoints (trainwatch.layouts; generic: names matching
# checkpoints.pattern; fixed: one path overwritten in place; auto: recognised).
LAYOUTS = ("auto", "generic", "fixed", "hf", "lightning", "dcp", "megatron", "deepspeed",
           "trainwatch")


def layout(v: object) -> str:
    if not isinstance(v, str) or v not in LAYOUTS:
        raise ValueError(v)
    return v


# A remote snapshot store (trainwatch.snapshot.remote, fsspec): a URL with a scheme.
# Credentials come only from the standard environment and files (AWS_ACCESS_KEY_ID,
# ~/.aws/credentials): a config is read by many and copied everywhere.
_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://([^/?#]*)(.*)$")
_SECRET_QUERY = re.compile(r"(key|secret|token|passw|signature|credential)", re.IGNORECASE)
REMOTE = "a URL such as s3://bucket/prefix (credentials only from the AWS environment or files)"


def remote(v: object) -> str:
    """A remote store's URL, refused when it carries credentials (never echoed)."""
    if not isinstance(v, str):
        raise ValueError(v)
    m = _URL.match(v)
    where = m.group(2) if m else v  # the part userinfo (KEY:SECRET@) would be in
    query = m.group(3).partition("?")[2] if m else ""
    if "@" in where or _SECRET_QUERY.search(query):
        raise Refused("a URL without credentials in it (they come from the standard AWS "
                      "environment or files: AWS_ACCESS_KEY_ID, ~/.aws/credentials)",
                      Said("a URL with credentials in it (not shown)"))
    if m is None or (not m.group(2) and m.group(1) != "file") or "\0" in v \
            or any(c.isspace() for c in v):
        raise ValueError(v)
    return v


STR = "a non-empty string"
LAYOUT = "one of " + ", ".join(LAYOUTS)
DUR = "a duration > 0 such as 30s, 5m or 24h (at most 10 years)"
DUR0 = "a duration >= 0 such as 0, 30s or 5m (at most 10 years)"
OPT_DUR = "a duration > 0 such as 30s, 5m or 24h (at most 10 years), or null"
OFF_DUR = "a duration > 0 such as 5m (at most 10 years), or 0, off or null for off"
NAME = "a name of letters, digits, '_', '.', '-' (at most 63)"
NATURAL = "an integer >= 0"
POSITIVE = "an integer >= 1"
FACTOR = "a number from 1 to 1000"
POSITIVE_NUMBER = "a finite number > 0"
USER = f"a user name, or a uid from 0 to {MAX_ID}"
GROUP = f"a group name, or a gid from 0 to {MAX_ID}"
RANKS = f"an integer from 1 to {MAX_RANKS} (the job's world size), or null"
ADDRESS = "an address to listen on: an IP such as 127.0.0.1, or a name that resolves"
HOST = "a host name of 1-64 letters, digits, '.', '_', '-'"
NODES = ('a host count N or "MIN:MAX" (torchrun\'s --nnodes; 1 <= MIN <= MAX, quoted or'
         ' not)')

CHECKS: dict[str, Any] = {
    STR: text,
    DUR: duration,
    DUR0: duration_or_zero,
    OPT_DUR: optional_duration,
    OFF_DUR: duration_or_off,
    NATURAL: natural,
    POSITIVE: positive_int,
    RANKS: ranks,
    USER: user,
    GROUP: group,
    "a port number 1-65535, or 0 for off": port,
    FACTOR: factor,
    POSITIVE_NUMBER: positive_number,
    "a fraction 0 <= x < 1": fraction,
    "true or false": boolean,
    NAME: name,
    "a file name pattern with one {step} and no '/'": pattern,
    "auto, nvml, sim or off": backend,
    LAYOUT: layout,
    HOST: host,
    ADDRESS: address,
    NODES: nodes,
    REMOTE: remote,
}
