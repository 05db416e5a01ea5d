"""torch.distributed.checkpoint (DCP): one folder per save, named by the job's
``pattern`` (DCP has no naming convention of its own; default ``step_{step}``).

torch 2.13 ``torch/distributed/checkpoint/filesystem.py``: every rank writes
``__<rank>_<n>.distcp`` under its final name (``_FileSystemWriter.write_data``,
``gen_file``); the coordinator then writes ``.metadata.tmp``, fsyncs it and
renames it to ``.metadata`` (``finish``), only when no rank failed
(``state_dict_saver`` via ``_DistWrapper.all_reduce``). Without collectives
each rank writes ``__<rank>.metadata`` and readers take rank 0's
(``FileSystemReader._get_metadata_path``). So ``.metadata`` is the marker.

Deeper check without unpickling: ``.metadata`` is a pickle whose
``storage_data`` maps each item to ``_StorageInfo(relative_path, offset,
length)``. ``pickletools.genops`` walks the opcodes without running any of
them; each ``{relative_path, offset, length}`` dict found that way names a
shard that must exist and hold at least offset+length bytes. Limits: a
format this walk does not recognise (no such dicts found) is judged by the
marker alone, and says so; a shard the writer never referenced (an empty
bucket) is not required. A reused folder keeps its old ``.metadata`` while
shards are rewritten (prior-art A1): the size check catches a shorter shard,
not a same-sized one being overwritten.
"""

from __future__ import annotations

import os
import pickletools
from pathlib import Path
from typing import Any

from trainwatch.layouts.base import Found, basename_step, open_regular, scan_dirs, size, step_regex

METADATA = ".metadata"  # filesystem.py _metadata_fn
RANK0_METADATA = "__0.metadata"  # use_collectives=False
SUFFIX = ".distcp"  # filesystem.py DEFAULT_SUFFIX
_MAX_METADATA = 256 * 1024 * 1024

_PUSH_STR = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"}
_PUSH_INT = {"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG"}
_GET = {"GET", "BINGET", "LONG_BINGET"}
_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}
_NOTHING = object()  # a pushed value this walk does not track


def shard_extents(path: str) -> dict[str, int] | None:
    """Each shard the pickled ``.metadata`` references, with the bytes it must
    hold; None when the file is cut short or not a pickle. Nothing is executed:
    the opcodes are read, the keys/values of MARK ... SETITEMS groups tracked."""
    n = size(path)
    if n is None or n > _MAX_METADATA:
        return None
    try:
        with open_regular(path) as f:
            data = f.read()
    except OSError:
        return None
    memo: dict[int, Any] = {}
    groups: list[list[Any]] = []
    last: Any = _NOTHING
    out: dict[str, int] = {}
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name in _PUSH_STR or name in _PUSH_INT:
                last = arg
            elif name in _GET:
                last = memo.get(int(str(arg)), _NOTHING)
            elif name == "MEMOIZE":
                memo[len(memo)] = last
                continue
            elif name in _PUT:
                memo[int(str(arg))] = last
                continue
            elif name == "MARK":
                groups.append([])
                last = _NOTHING
                continue
            elif name in ("SETITEMS", "APPENDS", "TUPLE", "LIST", "DICT", "FROZENSET",
                          "ADDITEMS", "OBJ", "INST", "POP_MARK"):
                items = groups.pop() if groups else []
                if name == "SETITEMS":
                    _storage_info(items, out)
                last = _NOTHING
                continue
            else:
                last = _NOTHING
            if groups and op.stack_after:
                groups[-1].append(last)
    except (ValueError, IndexError, KeyError):
        return None  # truncated or not a pickle
    return out


def _storage_info(items: list[Any], out: dict[str, int]) -> None:
    if len(items) < 2 or items[0] != "relative_path" or len(items) % 2:
        return
    d = dict(zip(items[::2], items[1::2], strict=True))
    rel, offset, length = d.get("relative_path"), d.get("offset", 0), d.get("length", 0)
    if isinstance(rel, str) and isinstance(offset, int) and isinstance(length, int):
        out[rel] = max(out.get(rel, 0), offset + length)


def judge_folder(path: str) -> tuple[bool, str]:
    """Whether a DCP folder would load, and what marked it or is missing."""
    meta = os.path.join(path, METADATA)
    if size(meta) is None:
        meta = os.path.join(path, RANK0_METADATA)
        if size(meta) is None:
            if os.path.lexists(os.path.join(path, METADATA + ".tmp")):
                return False, ".metadata.tmp not yet renamed"
            return False, "no .metadata"
    extents = shard_extents(meta)
    if extents is None:
        return False, f"{os.path.basename(meta)} unreadable"
    if not extents:
        return True, f"{os.path.basename(meta)} present (shard list not read)"
    for rel in sorted(extents):
        if os.path.basename(rel) != rel:
            return False, f"{os.path.basename(meta)} names a shard outside the folder"
        have = size(os.path.join(path, rel))
        if have is None:
            return False, f"{rel} missing"
        if have < extents[rel]:
            return False, f"{rel} truncated"
    return True, f"{os.path.basename(meta)} + {len(extents)} shard(s) whole"


class DCP:
    name = "dcp"

    def __init__(self, pattern: str = "step_{step}") -> None:
        self.pattern = pattern
        self._regex = step_regex(pattern)

    def step_of(self, path: str) -> int | None:
        return basename_step(self._regex, path)

    def judge(self, path: str) -> Found | None:
        step = self.step_of(path)
        return None if step is None else _found(step, os.path.abspath(path))

    def scan(self, root: Path) -> list[Found]:
        return scan_dirs(root, self._regex, _found)


def _found(step: int, path: str) -> Found:
    if not os.path.isdir(path):
        return Found(step, path, False, "not a folder")
    complete, why = judge_folder(path)
    return Found(step, path, complete, why)
