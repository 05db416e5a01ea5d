"""Atomic state files: write a temp file, fsync it, rename it over the old one,
fsync the directory. A reader sees the old file or the new one, never half."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json(path: str | os.PathLike[str], obj: Any, durable: bool = True) -> None:
    """``durable=False`` skips the fsyncs: still old-or-new for readers, but a
    power loss may leave the old file. For snapshots rewritten every second."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        os.unlink(tmp)
        raise
    if not durable:
        return
    dfd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_json(path: str | os.PathLike[str]) -> Any:
    """The parsed file, or None when it is absent or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
