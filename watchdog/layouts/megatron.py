"""Megatron-LM: ``<save>/iter_<7 digits>/`` and the tracker
``<save>/latest_checkpointed_iteration.txt``.

NVIDIA/Megatron-LM d98e8a6 ``megatron/training/checkpointing.py``:
``get_checkpoint_name`` names ``iter_{:07d}`` (wider past 9,999,999; the
``release`` folder has no iteration and is not listed);
``get_checkpoint_tracker_filename`` names the tracker, which rank 0 writes in
place (``open('w')``) in ``iter_finalize_fn``, after every rank's files and
``metadata.json``; ``read_metadata`` takes ``int(text.strip())`` or
``release`` and exits on anything else. Here the tracker is parsed strictly:
digits only, else treated as not yet written (a reader racing the write
sees it empty). An iteration newer than the tracker is not complete.

Inside the folder, by ``ckpt_format`` (``training_config.py``, default
``torch_dist``): ``torch_dist`` has ``metadata.json``
(``core/dist_checkpointing/core.py`` ``CONFIG_FNAME``), written by rank 0
after all shards (``serialization.save``); ``torch_dcp``/``fsdp_dtensor`` are
DCP folders (``.metadata``, see dcp.py); legacy ``torch`` has
``mp_rank_XX[_PPP][_EEE]/model_optim_rng.pt`` per model-parallel rank, each a
torch.save archive that must read whole.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainwatch.layouts import dcp
from trainwatch.layouts.base import (
    Found,
    Tracked,
    entries,
    is_dir,
    json_file,
    small_text,
    torch_archive,
)

NAME = re.compile(r"^iter_(\d{7,})$")
TRACKER = "latest_checkpointed_iteration.txt"
CONFIG = "metadata.json"
COMMON = "common.pt"  # core/dist_checkpointing/strategies/common.py COMMON_STATE_FNAME
_MP = re.compile(r"^mp_rank_\d{2}(?:_\d{3}){0,2}$")
LEGACY_FILE = "model_optim_rng.pt"


def tracker(root: Path | str) -> int | None:
    """The iteration the tracker names; None when absent, empty, partial or ``release``."""
    text = small_text(os.path.join(root, TRACKER))
    return int(text) if text and text.isdigit() and text.isascii() else None


class Megatron(Tracked):
    name = "megatron"
    regex = NAME

    def tracker(self, root: str | Path) -> int | None:
        return tracker(root)

    def verdict(self, step: int, path: str, tracked: int | None) -> Found:
        return _judge(step, path, tracked)


def _judge(step: int, path: str, latest: int | None) -> Found:
    if latest is None:
        return Found(step, path, False, f"no readable {TRACKER}")
    if step > latest:
        return Found(step, path, False, f"newer than {TRACKER}")
    if not os.path.isdir(path):
        return Found(step, path, False, "not a folder")
    # torch_dist also writes common.pt; without metadata.json it is not loadable
    # (dist_checkpointing/core.py check_is_distributed_checkpoint tests metadata.json).
    if os.path.lexists(os.path.join(path, CONFIG)) or os.path.lexists(os.path.join(path, COMMON)):
        _doc, err = json_file(os.path.join(path, CONFIG))
        if err:
            return Found(step, path, False, err)
        if os.path.lexists(os.path.join(path, dcp.METADATA)):
            ok, why = dcp.judge_folder(path)
            if not ok:
                return Found(step, path, False, why)
        return Found(step, path, True, f"torch_dist: {CONFIG}, tracker at {latest}")
    if os.path.lexists(os.path.join(path, dcp.METADATA)):
        ok, why = dcp.judge_folder(path)
        return Found(step, path, ok, f"torch_dcp: {why}")
    ranks = sorted(e.path for e in entries(path) if _MP.match(e.name) and is_dir(e))
    if not ranks:
        return Found(step, path, False, f"no {CONFIG} or mp_rank_*/{LEGACY_FILE}")
    for rank in ranks:
        err = torch_archive(os.path.join(rank, LEGACY_FILE))
        if err:
            return Found(step, path, False, f"{os.path.basename(rank)}/{err}")
    return Found(step, path, True, f"torch: {len(ranks)} mp_rank file(s), tracker at {latest}")
