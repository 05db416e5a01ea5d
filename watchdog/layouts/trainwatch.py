"""trainwatch's own snapshots (trainwatch.snapshot): ``<dir>/snapshot-<step>/``.

The on-disk contract is trainwatch/snapshot/format.py's (stdlib only, so the
daemon loads nothing heavy): ``snapshot.json`` is written last and the folder
appears under its final name by one rename, so a ``snapshot-<step>`` folder is
complete unless something outside cut or removed its files; ``format.judge``
checks the manifest and that every chunk it names is a regular file of its
``stored`` size (nothing is hashed here; the verifier hashes every file).
Staging (``.staging-*``) and deleting (``.deleting-*``) folders are never
named, and the content store ``blobs/`` is not a checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainwatch.layouts.base import Found, basename_step, scan_dirs
from trainwatch.snapshot import format as fmt

NAME = fmt.SNAPSHOT_RE


def _judge(step: int, path: str) -> Found:
    if not os.path.isdir(path):
        return Found(step, path, False, "not a folder")
    complete, why = fmt.judge(path)
    return Found(step, path, complete, why)


def holds_snapshots(root: Path | str, dirs: list[str]) -> bool:
    """``detect``'s test: a ``snapshot-<N>`` folder holding ``snapshot.json``, or
    any ``snapshot-<N>`` folder with the store ``blobs/`` beside it."""
    named = [n for n in dirs if NAME.match(n)]
    if not named:
        return False
    if "blobs" in dirs:
        return True
    return any(os.path.isfile(os.path.join(root, n, fmt.MANIFEST)) for n in sorted(named))


class Trainwatch:
    name = "trainwatch"

    def step_of(self, path: str) -> int | None:
        return basename_step(NAME, path)

    def judge(self, path: str) -> Found | None:
        step = self.step_of(path)
        if step is None:
            return None
        return _judge(step, os.path.abspath(path))

    def scan(self, root: Path) -> list[Found]:
        return scan_dirs(root, NAME, _judge)
