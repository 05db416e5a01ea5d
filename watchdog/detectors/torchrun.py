"""torchrun's own account of a failure: the summary its agent prints to stderr
when a worker fails (``ChildFailedError.format_msg``, torch/distributed/elastic/
multiprocessing/errors/__init__.py)::

    Root Cause (first observed failure):
    [0]:
      time      : 2026-11-25_12:38:56
      host      : node-3
      rank      : 1 (local_rank: 1)
      exitcode  : -9 (pid: 9127)
      error_file: <N/A>
      traceback : Signal 9 (SIGKILL) received by PID 9127
    ======================================================

Pure: lines in, the root cause out (the last summary in the lines)."""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from typing import Any

_HEAD = "Root Cause (first observed failure):"
_RANK = re.compile(r"\brank\s*:\s*(\d+)(?:\s*\(local_rank:\s*(\d+)\))?")
_EXIT = re.compile(r"\bexitcode\s*:\s*(-?\d+)(?:\s*\(pid:\s*(\d+)\))?")
_HOST = re.compile(r"\bhost\s*:\s*(\S+)")
_END = re.compile(r"^\s*(?:\[[^\]]*\]:\s*)?={10,}\s*$")
_MAX_BLOCK = 16  # lines of one block; torchrun's has 8


def root_cause(lines: Sequence[str]) -> dict[str, Any] | None:
    """The rank, host, exit code (or signal) and pid of the last root cause in
    ``lines``; None when there is none (or it names no rank)."""
    at = next((i for i in range(len(lines) - 1, -1, -1) if _HEAD in lines[i]), None)
    if at is None:
        return None
    out: dict[str, Any] = {}
    for line in lines[at + 1:at + 1 + _MAX_BLOCK]:
        if _END.match(line):
            break
        if "rank" not in out and (m := _RANK.search(line)):
            out["rank"] = int(m.group(1))
            if m.group(2) is not None:
                out["local_rank"] = int(m.group(2))
        elif "host" not in out and (m := _HOST.search(line)):
            out["host"] = m.group(1)
        elif "exit" not in out and (m := _EXIT.search(line)):
            code = int(m.group(1))
            out["exit"] = code
            if m.group(2) is not None:
                out["pid"] = int(m.group(2))
    if "rank" not in out:
        return None
    code = out.pop("exit", None)
    if isinstance(code, int) and code < 0:
        try:
            out["signal"] = signal.Signals(-code).name
        except ValueError:
            out["signal"] = str(-code)
    elif code is not None:
        out["exit_code"] = code
    return out
