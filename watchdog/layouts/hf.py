"""Hugging Face Trainer: ``<output_dir>/checkpoint-<global_step>/``.

transformers 5.23 ``Trainer._save_checkpoint`` (trainer.py) writes in place,
in this order: ``save_model`` (weights + config), optimizer/scheduler/rng
state, then ``trainer_state.json`` on the main process, last. So a folder is
complete when ``trainer_state.json`` parses and a weights file the Trainer
would load (``Trainer._load_from_checkpoint``'s list: ``model.safetensors``,
``pytorch_model.bin``, their ``*.index.json`` with every shard it names,
PEFT ``adapter_model.*``, FSDP ``pytorch_model_fsdp*``) is whole.
``trainer_utils.get_last_checkpoint`` itself takes any ``checkpoint-\\d+``
folder without checking (prior-art A2), hence this.

``tmp-checkpoint-<N>`` (4.36-4.38 staged saves there, then renamed) is listed
as never complete, and only when no ``checkpoint-<N>`` exists for that step.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainwatch.layouts.base import (
    Found,
    basename_step,
    entries,
    is_dir,
    json_file,
    safetensors_file,
    torch_archive,
)

# trainer_utils.PREFIX_CHECKPOINT_DIR / _re_checkpoint.
NAME = re.compile(r"^checkpoint-(\d+)$")
_TMP = re.compile(r"^tmp-checkpoint-(\d+)$")
STATE = "trainer_state.json"  # trainer_utils TRAINER_STATE_NAME
# transformers/utils/__init__.py and utils/peft_utils.py names, in
# _load_from_checkpoint's order of preference.
_SINGLE = ("model.safetensors", "pytorch_model.bin",
           "adapter_model.safetensors", "adapter_model.bin")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_FSDP = "pytorch_model_fsdp"  # trainer.py FSDP_MODEL_NAME


def _weights_file(path: str) -> str | None:
    return safetensors_file(path) if path.endswith(".safetensors") else torch_archive(path)


def _index(folder: str, name: str) -> str | None:
    """None when every shard the index's ``weight_map`` names is whole."""
    doc, err = json_file(os.path.join(folder, name))
    if err:
        return err
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        return f"{name} names no shards"
    for shard in sorted({str(v) for v in wmap.values()}):
        if os.path.basename(shard) != shard:
            return f"{name} names a shard outside the folder"
        err = _weights_file(os.path.join(folder, shard))
        if err:
            return err
    return None


def _fsdp(folder: str) -> str | None:
    """An FSDP save: ``pytorch_model_fsdp*.bin`` (full state dict) or a
    ``pytorch_model_fsdp_*`` DCP folder with its ``.metadata``. None when none."""
    for e in entries(folder):
        if e.name.startswith(_FSDP):
            if is_dir(e):
                if os.path.isfile(os.path.join(e.path, ".metadata")):
                    return e.name
            elif e.name.endswith(".bin") and torch_archive(e.path) is None:
                return e.name
    return None


def weights(folder: str) -> tuple[str | None, str]:
    """(the weights file found, None if none is whole) and what was seen."""
    problem = ""
    for name in _SINGLE:
        p = os.path.join(folder, name)
        if os.path.lexists(p):
            err = _weights_file(p)
            if err is None:
                return name, name
            problem = problem or err
    for name in _INDEXES:
        if os.path.lexists(os.path.join(folder, name)):
            err = _index(folder, name)
            if err is None:
                return name, name
            problem = problem or err
    fsdp = _fsdp(folder)
    if fsdp:
        return fsdp, fsdp
    return None, problem or "no model weights"


class HF:
    name = "hf"

    def step_of(self, path: str) -> int | None:
        return basename_step(NAME, path)

    def judge(self, path: str) -> Found | None:
        step = self.step_of(path)
        if step is None:
            tmp = basename_step(_TMP, path)
            if tmp is None:
                return None
            return Found(tmp, os.path.abspath(path), False, "staging folder, never loaded")
        return _judge(step, os.path.abspath(path))

    def scan(self, root: Path) -> list[Found]:
        out: dict[int, Found] = {}
        staging: dict[int, Found] = {}
        for e in entries(root):
            if not is_dir(e):
                continue
            m, t = NAME.match(e.name), _TMP.match(e.name)
            if m:
                out[int(m.group(1))] = _judge(int(m.group(1)), os.path.abspath(e.path))
            elif t:
                staging[int(t.group(1))] = Found(int(t.group(1)), os.path.abspath(e.path),
                                                 False, "staging folder, never loaded")
        for step, f in staging.items():
            out.setdefault(step, f)
        return [out[s] for s in sorted(out)]


def _judge(step: int, path: str) -> Found:
    if not os.path.isdir(path):
        return Found(step, path, False, "not a folder")
    # Weights first: a missing trainer_state.json says "still being written"
    # only once the weights are there; without weights that is what is missing.
    found, seen = weights(path)
    if found is None:
        return Found(step, path, False, seen)
    _doc, err = json_file(os.path.join(path, STATE))
    if err:
        return Found(step, path, False, err)
    return Found(step, path, True, f"{STATE} + {found}")
