"""What replacing a small state file costs on a folder's file system: the status
file (`status.json`, ~700 bytes) is replaced once a second per stepping job.

Ways timed, 300 times each, 3 ms apart, medians and p90:
- replace: a temp file created (O_TRUNC), written, closed, renamed over the file
  (what `state/atomic.py` does for `durable=False`);
- exchange+unlink: a new temp file written, swapped with the file by
  ``renameat2(RENAME_EXCHANGE)``, the old one unlinked (readers holding it keep it).
ext4 starts writeback of a file renamed over another (``auto_da_alloc``), which
is what the second way avoids.

``python benchmarks/bench_replace.py [DIR ...]`` (default: the state folder's
file system, /var/tmp, and /dev/shm for tmpfs).
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
DATA = json.dumps({"job": "j", "step": 123456, "pad": "x" * 640}).encode()


def _write(path: str, flags: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        os.write(fd, DATA)
    finally:
        os.close(fd)


def replace(p: str, tmp: str) -> None:
    _write(tmp, os.O_TRUNC)
    os.replace(tmp, p)


def exchange_unlink(p: str, tmp: str) -> None:
    _write(tmp, os.O_EXCL)
    if _libc.renameat2(_AT_FDCWD, tmp.encode(), _AT_FDCWD, p.encode(), _RENAME_EXCHANGE):
        raise OSError(ctypes.get_errno(), "renameat2")
    os.unlink(tmp)


def timed(fn: Callable[[str, str], None], d: str, n: int = 300) -> tuple[float, float]:
    p, tmp = os.path.join(d, "status.json"), os.path.join(d, ".status.json.tmp")
    _write(p, os.O_TRUNC)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(p, tmp)
        ts.append(time.perf_counter() - t0)
        time.sleep(0.003)
    ts.sort()
    return statistics.median(ts) * 1e6, ts[int(0.9 * n)] * 1e6


def main() -> int:
    dirs = sys.argv[1:] or ["/var/tmp", "/dev/shm"]
    for base in dirs:
        with tempfile.TemporaryDirectory(dir=base) as d:
            for fn in (replace, exchange_unlink, replace, exchange_unlink):
                med, p90 = timed(fn, d)
                print(f"{base:12s} {fn.__name__:16s} median {med:6.0f} µs  p90 {p90:6.0f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
