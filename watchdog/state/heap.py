"""Memory given back to the system once a large listing is forgotten.

A job's folder of 600,000 planted names leaves root's mirror of the newest
10,000 checkpoints, and its dictionaries' tables, freed when they go; glibc
keeps what was freed in its heap unless asked (``malloc_trim``), so the daemon
would stay 10-17 MB larger for the rest of its life. Elsewhere (musl) nothing."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

_trim: Callable[[int], int] | None = None
_looked = False

SHRINK = 1024  # entries forgotten at once that make a mirror rebuild its tables


def give_back() -> None:
    """Return the heap's free memory to the system (glibc's malloc_trim(0))."""
    global _trim, _looked
    if not _looked:
        _looked = True
        try:
            _trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _trim = None
    if _trim is not None:
        _trim(0)
