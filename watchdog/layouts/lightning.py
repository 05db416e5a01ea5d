"""PyTorch Lightning: ``*.ckpt`` files as ``ModelCheckpoint`` names them.

lightning 2.6.6 ``pytorch/callbacks/model_checkpoint.py``
``ModelCheckpoint._format_checkpoint_name``: the default filename
``{epoch}-{step}`` becomes ``epoch=E-step=S`` (``auto_insert_metric_name``),
a collision adds ``-vN`` (``format_checkpoint_name``, ``STARTING_VERSION``),
``FILE_EXTENSION = ".ckpt"``. The step is read from ``step=S`` in the name;
a name without it (``auto_insert_metric_name=False``) is not listed.

``last.ckpt`` is skipped: with ``save_last=True`` it is a copy whose step is
only inside the pickle (never unpickled here), and with ``save_last="link"``
(``_link_checkpoint``) it is a relative symlink to a stepped file in the same
folder, which is listed under its own name. Symlinks are never followed, so a
checkpoint is never counted twice. A ``CHECKPOINT_NAME_LAST`` holding
``{step}`` names its step and is listed like any other.

Complete: ``fabric/utilities/cloud_io.py`` ``_atomic_save`` streams
``torch.save`` (a zip archive) through an fsspec transaction: atomic only when
TMPDIR is on the same file system, else the file grows in place (prior-art
A3); a whole archive has a readable zip central directory, its last bytes.
FSDP sharded state (``pytorch/strategies/fsdp.py`` ``save_checkpoint``) is a
``*.ckpt`` folder of DCP shards and then ``meta.pt`` from rank 0, last;
``fabric/strategies/fsdp.py`` ``_is_sharded_checkpoint`` tests ``meta.pt``.
Of several files with one step (``-vN``), a whole one wins, then the highest N.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainwatch.layouts.base import Found, entries, torch_archive

_STEP = re.compile(r"(?:^|-)step=(\d+)(?=-|$)")
_VERSION = re.compile(r"-v(\d+)$")
SUFFIX = ".ckpt"  # ModelCheckpoint.FILE_EXTENSION
META = "meta.pt"  # fabric/utilities/load.py _METADATA_FILENAME


def _parse(name: str) -> tuple[int, int] | None:
    """(step, version) from a ModelCheckpoint file name, None without ``step=``."""
    if not name.endswith(SUFFIX):
        return None
    stem = name[: -len(SUFFIX)]
    m = _STEP.search(stem)
    if not m:
        return None
    v = _VERSION.search(stem)
    return int(m.group(1)), int(v.group(1)) if v else 0


class Lightning:
    name = "lightning"

    def step_of(self, path: str) -> int | None:
        parsed = _parse(os.path.basename(os.path.normpath(path)))
        return parsed[0] if parsed else None

    def judge(self, path: str) -> Found | None:
        step = self.step_of(path)
        if step is None or os.path.islink(path):
            return None
        return _judge(step, os.path.abspath(path))

    def scan(self, root: Path) -> list[Found]:
        best: dict[int, tuple[bool, int, Found]] = {}
        for e in entries(root):
            parsed = _parse(e.name)
            if parsed is None or e.is_symlink():
                continue
            step, version = parsed
            f = _judge(step, os.path.abspath(e.path))
            rank = (f.complete, version)
            if step not in best or rank > best[step][:2]:
                best[step] = (f.complete, version, f)
        return [best[s][2] for s in sorted(best)]


def _judge(step: int, path: str) -> Found:
    if os.path.isdir(path):
        err = torch_archive(os.path.join(path, META))
        if err:
            return Found(step, path, False, f"sharded: {err}")
        return Found(step, path, True, f"sharded, {META} written last")
    err = torch_archive(path)
    if err:
        return Found(step, path, False, err)
    return Found(step, path, True, "whole torch.save archive")
