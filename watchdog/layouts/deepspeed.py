"""DeepSpeed: ``<save_dir>/global_step<N>/`` and the tag file ``<save_dir>/latest``.

deepspeedai/DeepSpeed edaa722 (0.19.6) ``deepspeed/runtime/engine.py``
``save_checkpoint``: the tag defaults to ``global_step{global_steps}``; files
are ``mp_rank_XX_model_states.pt`` (``_get_ckpt_name``; ZeRO-3:
``zero_pp_rank_D_mp_rank_XX_model_states.pt``) and per data-parallel rank
``[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt``
(``_get_rank_zero_ckpt_name``), each a torch.save archive. Global rank 0
writes ``latest`` (the tag, in place) after its own files but BEFORE the final
``dist.barrier()`` (prior-art A5), so ``latest`` may name a tag whose other
ranks are still writing. ``load_checkpoint`` reads ``latest`` with
``fd.read().strip()``.

So complete = ``latest`` names this tag or a newer ``global_stepM``, AND at
least one ``*_model_states.pt`` exists, AND every ``*_model_states.pt`` /
``*_optim_states.pt`` present reads as a whole zip archive (a file still being
written lacks its central directory), AND the ZeRO ranks D run 0..max without
a gap. Limit: a pure scan has no clock, so a rank that has not yet created its
file at all is missed when it is the highest rank.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainwatch.layouts.base import (
    Found,
    Tracked,
    entries,
    small_text,
    torch_archive,
)

NAME = re.compile(r"^global_step(\d+)$")
LATEST = "latest"
_ZERO_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def latest(root: Path | str) -> int | None:
    """The step of the tag ``latest`` names; None when absent, empty, partial or not a step tag."""
    text = small_text(os.path.join(root, LATEST))
    m = NAME.match(text or "")
    return int(m.group(1)) if m else None


class DeepSpeed(Tracked):
    name = "deepspeed"
    regex = NAME

    def tracker(self, root: str | Path) -> int | None:
        return latest(root)

    def verdict(self, step: int, path: str, tracked: int | None) -> Found:
        return _judge(step, path, tracked)


def _judge(step: int, path: str, tag: int | None) -> Found:
    if tag is None:
        return Found(step, path, False, "no readable `latest`")
    if step > tag:
        return Found(step, path, False, "newer than `latest`")
    if not os.path.isdir(path):
        return Found(step, path, False, "not a folder")
    names = sorted(e.name for e in entries(path))
    shards = [n for n in names if n.endswith(("_model_states.pt", "_optim_states.pt"))]
    if not any(n.endswith("_model_states.pt") for n in shards):
        return Found(step, path, False, "no *_model_states.pt")
    for n in shards:
        err = torch_archive(os.path.join(path, n))
        if err:
            return Found(step, path, False, err)
    zero = sorted({int(m.group(1)) for n in shards if (m := _ZERO_RANK.search(n))})
    if zero and zero != list(range(zero[-1] + 1)):
        gap = min(set(range(zero[-1] + 1)) - set(zero))
        return Found(step, path, False, f"zero_pp_rank_{gap} optimizer states missing")
    return Found(step, path, True,
                 f"named by `latest`; {len(shards)} shard(s) whole (no clock: ranks unfenced)")
