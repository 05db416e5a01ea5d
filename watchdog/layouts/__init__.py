"""Checkpoint layouts as the frameworks write them: where each checkpoint is,
its step, and whether the framework itself would load it (``Found``).

One module per framework (hf, lightning, dcp, megatron, deepspeed, and
trainwatch's own snapshots, trainwatch.snapshot), each citing
the framework code it follows. Layouts read the file system only (scandir,
stat, small reads): nothing is unpickled and torch is never imported.
A scan is stateless: it judges every checkpoint under ``root`` each time
(``judge`` re-judges one path, for callers that cache verdicts).

``detect`` (the ``auto`` layout) looks at ``root`` itself and, for DCP, one
level down, in this precedence, most specific first:
  0. trainwatch a ``snapshot-<N>`` folder holding ``snapshot.json``, or one
                with the store ``blobs/`` beside it;
  1. hf         a ``checkpoint-<N>`` folder (a DeepSpeed run under the Trainer
                puts ``global_step<N>/`` and ``latest`` inside it, so hf wins);
  2. megatron   ``latest_checkpointed_iteration.txt`` or an ``iter_<7 digits>``
                folder (Megatron's torch_dcp iteration folders hold DCP files);
  3. deepspeed  a ``global_step<N>`` folder, or ``latest`` naming one;
  4. lightning  a ``*.ckpt`` entry (FSDP-sharded ``.ckpt`` folders hold DCP files);
  5. dcp        a subfolder holding ``.metadata`` or ``*.distcp``.
None: nothing recognisable yet.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Protocol

from trainwatch.layouts import deepspeed, hf, lightning, megatron, trainwatch
from trainwatch.layouts.base import Found, entries, is_dir
from trainwatch.layouts.dcp import DCP, METADATA, SUFFIX

__all__ = ["NAMES", "Found", "Layout", "detect", "get"]

NAMES: tuple[str, ...] = ("hf", "lightning", "dcp", "megatron", "deepspeed", "trainwatch")


class Layout(Protocol):
    name: str

    def scan(self, root: Path) -> list[Found]:
        """Every checkpoint under ``root`` (the job's checkpoints.dir), oldest step first."""
        ...

    def step_of(self, path: str) -> int | None:
        """The step of a path as this layout names it; None when it names none."""
        ...

    def judge(self, path: str) -> Found | None:
        """The verdict on one checkpoint path; None when this layout names no step in it."""
        ...


def get(name: str, pattern: str = "step_{step}") -> Layout:
    """The layout called ``name``; ``pattern`` (one ``{step}``) names DCP folders."""
    if name == "hf":
        return hf.HF()
    if name == "lightning":
        return lightning.Lightning()
    if name == "dcp":
        return DCP(pattern)
    if name == "megatron":
        return megatron.Megatron()
    if name == "deepspeed":
        return deepspeed.DeepSpeed()
    if name == "trainwatch":
        return trainwatch.Trainwatch()
    raise ValueError(f"unknown checkpoint layout {name!r} (known: {', '.join(NAMES)})")


def _holds_dcp(folder: str) -> bool:
    return any(e.name == METADATA or e.name.endswith(SUFFIX) for e in entries(folder))


def detect(root: Path) -> str | None:
    """Which layout ``root`` holds (see the precedence above); None when none yet."""
    names: dict[str, bool] = {}
    for e in entries(root):
        names[e.name] = is_dir(e)
    dirs = [n for n, d in names.items() if d]

    def any_dir(regex: re.Pattern[str]) -> bool:
        return any(regex.match(n) for n in dirs)

    if trainwatch.holds_snapshots(root, dirs):
        return "trainwatch"
    if any_dir(hf.NAME):
        return "hf"
    if megatron.TRACKER in names or any_dir(megatron.NAME):
        return "megatron"
    if any_dir(deepspeed.NAME) or deepspeed.latest(root) is not None:
        return "deepspeed"
    if any(n.endswith(lightning.SUFFIX) for n in names):
        return "lightning"
    if any(_holds_dcp(os.path.join(root, n)) for n in sorted(dirs)):
        return "dcp"
    return None
