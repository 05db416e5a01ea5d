"""Checkpoint layouts (trainwatch.layouts) on real files.

Hugging Face, Lightning and DCP checkpoints are written here by the frameworks
themselves on CPU (transformers Trainer, lightning Trainer + ModelCheckpoint,
torch.distributed.checkpoint.save), once per module, then copied and damaged
per test. Megatron-LM and DeepSpeed do not install on a CPU-only machine, so
their folders are built from the documented file sets (Megatron-LM
checkpointing.py get_checkpoint_name / get_checkpoint_tracker_filename,
dist_checkpointing CONFIG_FNAME; DeepSpeed engine.py save_checkpoint), with
their shard files written by the same torch.save / DCP those frameworks call.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import missing
from trainwatch import layouts
from trainwatch.layouts import Found


def _need(*modules: str) -> None:
    for m in modules:
        if importlib.util.find_spec(m) is None:
            missing(f"{m} is not installed (the dev extra pins it; make test installs it)")


def _cut(path: Path, keep: float = 0.5) -> None:
    """A file cut short, as a writer killed mid-write leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _verdicts(found: list[Found]) -> list[tuple[int, bool]]:
    return [(f.step, f.complete) for f in found]


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst, symlinks=True)
    return dst


# --- what the frameworks write (once per module) ----------------------------------


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """checkpoint-2 and checkpoint-4 written by a tiny GPT-2 under the real Trainer,
    plus checkpoint-6 with sharded weights (save_pretrained's own index)."""
    _need("torch", "transformers", "accelerate")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Data(torch.utils.data.Dataset[dict[str, Any]]):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, Any]:
            ids = torch.arange(8) % 50
            return {"input_ids": ids, "labels": ids}

    out = tmp_path_factory.mktemp("hf")
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=50,
                                       n_positions=16))
    args = TrainingArguments(output_dir=str(out), save_steps=2, max_steps=4, report_to=[],
                             use_cpu=True, per_device_train_batch_size=2, disable_tqdm=True,
                             logging_steps=100)
    Trainer(model=model, args=args, train_dataset=Data()).train()
    sharded = out / "checkpoint-6"
    model.save_pretrained(sharded, max_shard_size="4KB")
    shutil.copy(out / "checkpoint-4" / "trainer_state.json", sharded)
    return out


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """epoch=0-step=2.ckpt, epoch=0-step=4.ckpt and a last.ckpt link, by the real
    Lightning Trainer and ModelCheckpoint."""
    _need("torch", "lightning")
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], _i: int) -> torch.Tensor:
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    out = tmp_path_factory.mktemp("lightning")
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
    cb = ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1, save_last="link")
    L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[cb],
              default_root_dir=out).fit(Tiny(), data)
    return out


def _dcp_save(path: Path, threads: int = 1) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(16, 16), "b": torch.randn(16), "v": torch.randn(64), "step": 3}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads))


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """step_3 (one shard) and step_6 (two writer threads: two shards) by torch's
    own DCP save in a single process (no process group)."""
    _need("torch")
    out = tmp_path_factory.mktemp("dcp")
    _dcp_save(out / "step_3")
    _dcp_save(out / "step_6", threads=2)
    return out


# --- Hugging Face -------------------------------------------------------------------


def test_hf_trainer_checkpoints_are_complete(hf_run: Path) -> None:
    """The Trainer's own checkpoint-N folders (whole and sharded weights) are complete."""
    found = layouts.get("hf").scan(hf_run)
    assert _verdicts(found) == [(2, True), (4, True), (6, True)]
    assert found[0].why == "trainer_state.json + model.safetensors"
    assert found[2].why == "trainer_state.json + model.safetensors.index.json"
    assert found[0].path == str(hf_run / "checkpoint-2")
    assert layouts.detect(hf_run) == "hf"


@pytest.mark.parametrize(("damage", "why"), [
    (lambda c: (c / "trainer_state.json").unlink(), "no trainer_state.json"),
    (lambda c: _cut(c / "trainer_state.json"), "trainer_state.json partial or not JSON"),
    (lambda c: _cut(c / "model.safetensors", 0.9), "model.safetensors truncated"),
    (lambda c: (c / "model.safetensors").unlink(), "no model weights"),
])
def test_hf_checkpoint_killed_mid_write_is_incomplete(
        hf_run: Path, tmp_path: Path, damage: Callable[[Path], None], why: str) -> None:
    """A checkpoint-N whose marker is missing/partial or whose weights are cut is not complete."""
    root = _copy(hf_run, tmp_path)
    damage(root / "checkpoint-4")
    found = layouts.get("hf").scan(root)
    assert _verdicts(found) == [(2, True), (4, False), (6, True)]
    assert found[1].why == why


def test_hf_sharded_weights_need_every_shard(hf_run: Path, tmp_path: Path) -> None:
    """A sharded checkpoint with one shard missing or cut short is not complete."""
    root = _copy(hf_run, tmp_path)
    index = json.loads((root / "checkpoint-6" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    _cut(root / "checkpoint-6" / shards[-1])
    assert layouts.get("hf").scan(root)[-1] == Found(
        6, str(root / "checkpoint-6"), False, f"{shards[-1]} truncated")
    (root / "checkpoint-6" / shards[0]).unlink()
    assert layouts.get("hf").scan(root)[-1].why == f"{shards[0]} missing"


def test_hf_staging_folder_is_never_complete(hf_run: Path, tmp_path: Path) -> None:
    """A tmp-checkpoint-N folder (staged save) is listed as incomplete even when whole."""
    root = _copy(hf_run, tmp_path)
    shutil.copytree(root / "checkpoint-4", root / "tmp-checkpoint-8")
    shutil.copytree(root / "checkpoint-4", root / "tmp-checkpoint-4")
    found = layouts.get("hf").scan(root)
    assert _verdicts(found) == [(2, True), (4, True), (6, True), (8, False)]
    assert layouts.get("hf").step_of(str(root / "checkpoint-4")) == 4


# --- Lightning ----------------------------------------------------------------------


def test_lightning_checkpoints_are_complete_and_last_link_not_counted(
        lightning_run: Path) -> None:
    """ModelCheckpoint's epoch=E-step=S.ckpt files are complete; last.ckpt is not a second entry."""
    assert (lightning_run / "last.ckpt").is_symlink()
    found = layouts.get("lightning").scan(lightning_run)
    assert _verdicts(found) == [(2, True), (4, True)]
    assert found[1].path == str(lightning_run / "epoch=0-step=4.ckpt")
    assert layouts.get("lightning").step_of(str(lightning_run / "last.ckpt")) is None
    assert layouts.detect(lightning_run) == "lightning"


@pytest.mark.parametrize(("keep", "why"), [
    (0.5, "epoch=0-step=4.ckpt truncated (no zip directory)"),
    (0.0, "epoch=0-step=4.ckpt empty"),
])
def test_lightning_checkpoint_cut_short_is_incomplete(
        lightning_run: Path, tmp_path: Path, keep: float, why: str) -> None:
    """A .ckpt cut short (copy across file systems killed) or empty is not complete."""
    root = _copy(lightning_run, tmp_path)
    _cut(root / "epoch=0-step=4.ckpt", keep)
    found = layouts.get("lightning").scan(root)
    assert _verdicts(found) == [(2, True), (4, False)]
    assert found[1].why == why


def test_lightning_version_suffix_prefers_the_whole_file(
        lightning_run: Path, tmp_path: Path) -> None:
    """Of step=4.ckpt (cut) and step=4-v1.ckpt (whole), the whole one is the step's checkpoint."""
    root = _copy(lightning_run, tmp_path)
    shutil.copy(root / "epoch=0-step=4.ckpt", root / "epoch=0-step=4-v1.ckpt")
    _cut(root / "epoch=0-step=4.ckpt")
    found = layouts.get("lightning").scan(root)
    assert found[-1] == Found(4, str(root / "epoch=0-step=4-v1.ckpt"), True,
                              "whole torch.save archive")


def test_lightning_sharded_folder_needs_meta_pt(lightning_run: Path, tmp_path: Path) -> None:
    """An FSDP-sharded .ckpt folder is complete only once meta.pt (written last) is whole."""
    import torch

    root = _copy(lightning_run, tmp_path)
    sharded = root / "epoch=0-step=6.ckpt"
    _dcp_save(sharded)
    assert layouts.get("lightning").scan(root)[-1].why == "sharded: meta.pt missing"
    torch.save({"global_step": 6}, sharded / "meta.pt")
    assert layouts.get("lightning").scan(root)[-1].complete
    _cut(sharded / "meta.pt")
    assert not layouts.get("lightning").scan(root)[-1].complete


# --- torch.distributed.checkpoint ---------------------------------------------------


def test_dcp_saves_are_complete(dcp_run: Path) -> None:
    """Folders written by dcp.save are complete, every shard .metadata names checked."""
    found = layouts.get("dcp").scan(dcp_run)
    assert _verdicts(found) == [(3, True), (6, True)]
    assert found[0].why == ".metadata + 1 shard(s) whole"
    assert found[1].why == ".metadata + 2 shard(s) whole"
    assert layouts.detect(dcp_run) == "dcp"


@pytest.mark.parametrize(("damage", "why"), [
    (lambda d: (d / ".metadata").unlink(), "no .metadata"),
    (lambda d: (d / ".metadata").rename(d / ".metadata.tmp"), ".metadata.tmp not yet renamed"),
    (lambda d: _cut(d / ".metadata"), ".metadata unreadable"),
    (lambda d: _cut(d / "__0_1.distcp", 0.99), "__0_1.distcp truncated"),
    (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp missing"),
])
def test_dcp_damaged_save_is_incomplete(
        dcp_run: Path, tmp_path: Path, damage: Callable[[Path], None], why: str) -> None:
    """A DCP folder without its marker, its marker cut, or a shard cut/missing is incomplete."""
    root = _copy(dcp_run, tmp_path)
    damage(root / "step_6")
    found = layouts.get("dcp").scan(root)
    assert _verdicts(found) == [(3, True), (6, False)]
    assert found[1].why == why


def test_dcp_folder_names_follow_the_job_pattern(dcp_run: Path, tmp_path: Path) -> None:
    """DCP steps come from the job's pattern; other folders are not listed."""
    root = _copy(dcp_run, tmp_path)
    (root / "step_6").rename(root / "ckpt-6.dcp")
    layout = layouts.get("dcp", "ckpt-{step}.dcp")
    assert _verdicts(layout.scan(root)) == [(6, True)]
    assert layout.step_of(str(root / "ckpt-6.dcp")) == 6
    with pytest.raises(ValueError, match="exactly once"):
        layouts.get("dcp", "ckpt")


# --- Megatron-LM (documented file set) ----------------------------------------------


def _megatron(root: Path, tracker: str | None) -> Path:
    """iter_0000100 in torch_dist (DCP shards + common.pt + metadata.json) and
    iter_0000200 in legacy torch (mp_rank_00, mp_rank_01 / model_optim_rng.pt)."""
    import torch

    dist = root / "iter_0000100"
    _dcp_save(dist)
    torch.save({"args": None}, dist / "common.pt")
    (dist / "metadata.json").write_text('{"sharded_backend": "torch_dist", '
                                        '"sharded_backend_version": 1}')
    for rank in ("mp_rank_00", "mp_rank_01"):
        (root / "iter_0000200" / rank).mkdir(parents=True)
        torch.save({"iteration": 200}, root / "iter_0000200" / rank / "model_optim_rng.pt")
    if tracker is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    return root


def test_megatron_iterations_named_by_the_tracker_are_complete(tmp_path: Path) -> None:
    """torch_dist and legacy iter_XXXXXXX folders at or below the tracker are complete."""
    _need("torch")
    root = _megatron(tmp_path, "200")
    found = layouts.get("megatron").scan(root)
    assert _verdicts(found) == [(100, True), (200, True)]
    assert found[0].why == "torch_dist: metadata.json, tracker at 200"
    assert layouts.detect(root) == "megatron"


@pytest.mark.parametrize(("tracker", "verdicts"), [
    ("100\n", [(100, True), (200, False)]),  # 200: newer than the tracker
    ("", [(100, False), (200, False)]),  # tracker being written
    ("2O0", [(100, False), (200, False)]),  # not a number: read_metadata exits
    (None, [(100, False), (200, False)]),
])
def test_megatron_iteration_beyond_the_tracker_is_incomplete(
        tmp_path: Path, tracker: str | None, verdicts: list[tuple[int, bool]]) -> None:
    """An iteration newer than the tracker, or any under an unreadable tracker, is incomplete."""
    _need("torch")
    found = layouts.get("megatron").scan(_megatron(tmp_path, tracker))
    assert _verdicts(found) == verdicts
    if tracker == "100\n":
        assert found[1].why == "newer than latest_checkpointed_iteration.txt"


@pytest.mark.parametrize(("damage", "why"), [
    (lambda r: (r / "iter_0000100" / "metadata.json").unlink(), "no metadata.json"),
    (lambda r: _cut(r / "iter_0000100" / "metadata.json"), "metadata.json partial or not JSON"),
    (lambda r: (r / "iter_0000100" / "__0_0.distcp").unlink(), "__0_0.distcp missing"),
])
def test_megatron_torch_dist_without_its_files_is_incomplete(
        tmp_path: Path, damage: Callable[[Path], None], why: str) -> None:
    """A torch_dist iteration missing metadata.json or a shard is not complete."""
    _need("torch")
    root = _megatron(tmp_path, "200")
    damage(root)
    assert layouts.get("megatron").scan(root)[0] == Found(
        100, str(root / "iter_0000100"), False, why)


def test_megatron_legacy_rank_file_cut_is_incomplete(tmp_path: Path) -> None:
    """A legacy iteration whose model_optim_rng.pt of one rank is cut short is not complete."""
    _need("torch")
    root = _megatron(tmp_path, "200")
    _cut(root / "iter_0000200" / "mp_rank_01" / "model_optim_rng.pt")
    assert layouts.get("megatron").scan(root)[1].why == (
        "mp_rank_01/model_optim_rng.pt truncated (no zip directory)")


# --- DeepSpeed (documented file set) ------------------------------------------------


def _deepspeed(root: Path, latest: str | None, tags: tuple[int, ...] = (10, 20)) -> Path:
    """global_stepN folders with mp_rank_00_model_states.pt and two ZeRO ranks'
    optimizer states, zero_to_fp32.py and ``latest`` beside them."""
    import torch

    for step in tags:
        d = root / f"global_step{step}"
        d.mkdir(parents=True)
        torch.save({"module": {}}, d / "mp_rank_00_model_states.pt")
        for dp in (0, 1):
            torch.save({"optimizer_state_dict": {}},
                       d / f"bf16_zero_pp_rank_{dp}_mp_rank_00_optim_states.pt")
    (root / "zero_to_fp32.py").write_text("# recovery script\n")
    if latest is not None:
        (root / "latest").write_text(latest)
    return root


def test_deepspeed_tags_up_to_latest_are_complete(tmp_path: Path) -> None:
    """global_stepN folders at or below the tag in `latest`, all shards whole, are complete."""
    _need("torch")
    root = _deepspeed(tmp_path, "global_step20")
    assert _verdicts(layouts.get("deepspeed").scan(root)) == [(10, True), (20, True)]
    assert layouts.detect(root) == "deepspeed"


@pytest.mark.parametrize(("damage", "why"), [
    (lambda r: (r / "latest").write_text("global_step10"), "newer than `latest`"),
    (lambda r: (r / "latest").write_text(""), "no readable `latest`"),
    (lambda r: _cut(r / "global_step20" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
     "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt truncated (no zip directory)"),
    (lambda r: (r / "global_step20" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink(),
     "zero_pp_rank_0 optimizer states missing"),
    (lambda r: (r / "global_step20" / "mp_rank_00_model_states.pt").unlink(),
     "no *_model_states.pt"),
])
def test_deepspeed_tag_still_being_written_is_incomplete(
        tmp_path: Path, damage: Callable[[Path], None], why: str) -> None:
    """A tag beyond `latest`, or one `latest` names while a rank still writes, is not complete."""
    _need("torch")
    root = _deepspeed(tmp_path, "global_step20")
    damage(root)
    assert layouts.get("deepspeed").scan(root)[-1] == Found(
        20, str(root / "global_step20"), False, why)


# --- detect and get -----------------------------------------------------------------


def test_detect_sees_nothing_in_an_empty_or_missing_folder(tmp_path: Path) -> None:
    """An empty or absent checkpoint folder holds no recognisable layout yet."""
    assert layouts.detect(tmp_path) is None
    assert layouts.detect(tmp_path / "absent") is None
    (tmp_path / "notes.txt").write_text("x")
    assert layouts.detect(tmp_path) is None
    for name in layouts.NAMES:
        assert layouts.get(name).scan(tmp_path / "absent") == []


def test_detect_prefers_hf_over_deepspeed_inside_it(hf_run: Path, tmp_path: Path) -> None:
    """A Trainer run under DeepSpeed (latest + global_stepN beside checkpoint-N) is hf."""
    root = _copy(hf_run, tmp_path)
    (root / "global_step4").mkdir()
    (root / "latest").write_text("global_step4")
    assert layouts.detect(root) == "hf"


def test_get_refuses_an_unknown_layout() -> None:
    """An unknown layout name is one clear ValueError naming the known ones."""
    with pytest.raises(ValueError, match="unknown checkpoint layout 'orbax'"):
        layouts.get("orbax")


def test_checkpoints_lists_a_hf_jobs_folder_from_its_reports_when_none_is_configured(
        hf_run: Path, tmp_path: Path) -> None:
    """`trainwatch checkpoints JOB` post-mortem, for a job with no checkpoints.dir whose
    Trainer callback reported its output_dir's checkpoints: they are listed from that
    folder (it said "no checkpoints" while the live catalog had resumed from them)."""
    import subprocess
    import sys

    ckpt = _copy(hf_run, tmp_path)
    job = tmp_path / "state" / "jobs" / "job"
    job.mkdir(parents=True)
    (job / "catalog.json").write_text(json.dumps(
        {"owner": "python train.py|step_{step}", "reported": {"4": str(ckpt / "checkpoint-4")}}))
    r = subprocess.run([sys.executable, "-m", "trainwatch.cli", "checkpoints", "job",
                        "--state-dir", str(tmp_path / "state")],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    rows = [ln.split("  /")[0].split(None, 1) for ln in r.stdout.splitlines()[2:]]
    assert [(row[0], row[1].split("  ")[0]) for row in rows] == [
        ("2", "good"), ("4", "good"), ("6", "last good")], r.stdout
    assert f"the folder its checkpoints were reported in, {ckpt}" in r.stdout, r.stdout
