"""Following an attempt's log file. The job writes its stdout and stderr
straight into the file (never through a pipe to trainwatch, so that a job
printing while trainwatch is down or restarting does not die of SIGPIPE);
``trainwatch run`` copies what is appended through to its own stdout."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

_CHUNK = 65536
_MAX_PER_POLL = 1 << 20  # bytes copied per poll, so a flood cannot hold up the loop


class LogFollower:
    def __init__(self, path: str, sink: Callable[[bytes], None], offset: int = 0) -> None:
        self.path, self.sink, self.offset = path, sink, offset
        self.fd: int | None = None

    def poll(self) -> int:
        """Copy what was appended since the last poll; how many bytes."""
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                return 0
        n = 0
        while n < _MAX_PER_POLL:
            try:
                data = os.pread(self.fd, _CHUNK, self.offset)
            except OSError:
                break
            if not data:
                break
            self.offset += len(data)
            n += len(data)
            self.sink(data)
        return n

    def close(self) -> None:
        """Copy the rest, then stop following."""
        self.poll()
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
