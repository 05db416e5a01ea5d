"""trainwatch.integrations against the real frameworks on CPU (torch, transformers,
lightning): the callbacks send the values the framework really computed (a NaN
step loss as NaN, with the HF Trainer's default arguments), report checkpoints
only once written, honour the skip window; and each example under a real
`trainwatch run` is crashed once and resumes, and is driven into NaN once and
rolled back to a checkpoint before the NaN step."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace, finish, missing
from trainwatch import client
from trainwatch.sources import ring, ringreader
from trainwatch.sources.heartbeat import parse
from trainwatch.types import DataOrder

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# example -> (script, the checkpoint pattern it writes under OUT/ckpt, its imports)
KINDS = {
    "torch": ("torch_train.py", "step_{step}.pt", ("torch",)),
    "hf": ("hf_train.py", "checkpoint-{step}", ("torch", "transformers", "accelerate")),
    "lightning": ("lightning_train.py", "step_{step}.ckpt", ("torch", "lightning")),
}


def _need(*modules: str) -> None:
    for m in modules:
        if importlib.util.find_spec(m) is None:
            missing(f"{m} is not installed (the dev extra pins it; make test installs it)")


# --- in-process: the values that reach the heartbeat ------------------------------


@pytest.fixture
def rings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, socket.socket]]:
    """A ring folder and a bound heartbeat socket, as the daemon gives a job."""
    d = tmp_path / "rings"
    d.mkdir(mode=0o700)
    sock_path = tmp_path / "hb.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(sock_path))
    s.setblocking(False)
    monkeypatch.setenv(ring.ENV, str(d))
    monkeypatch.setenv("TRAINWATCH_SOCKET", str(sock_path))
    yield d, s
    s.close()


def _beats(d: Path) -> dict[int, ringreader.Record]:
    with ringreader.RingReader(str(d / ring.file_name(0, os.getpid()))) as r:
        return {x.step: x for x in r.read()}


def _datagrams(s: socket.socket) -> list[Any]:
    out = []
    while True:
        try:
            out.append(parse(s.recv(65536), pid=1, at=0.0))
        except BlockingIOError:
            return out


def _tiny_gpt2() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


class _Same:
    """Every item is one token sequence, so every batch is the same whatever the order.
    The first label is ignored (-100), as the causal shift drops it anyway: then the
    Trainer's token count (num_items_in_batch) equals the tokens the loss averages."""

    def __init__(self) -> None:
        import torch

        self.ids = torch.arange(8) % 5
        self.labels = self.ids.clone()
        self.labels[0] = -100

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids, "labels": self.labels}


def _hf_train(out: Path, steps: int, nan_at: int | None = None) -> tuple[Any, Any, list[Any]]:
    """A Trainer with default arguments (bar output_dir, max_steps, batch size); returns the
    trainer, the callback, and the first parameter's value after each step."""
    from trainwatch.integrations.hf import TrainwatchCallback
    from transformers import Trainer, TrainerCallback, TrainingArguments

    params: list[Any] = []

    class Probe(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                          **kw: Any) -> None:
            if state.global_step + 1 == nan_at:
                model.transformer.wte.weight.data.fill_(math.nan)

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                        **kw: Any) -> None:
            params.append(model.lm_head.weight.detach().clone())

    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4)
    assert args.logging_nan_inf_filter and args.max_grad_norm == 1.0  # the defaults under test
    tw = TrainwatchCallback()
    trainer = Trainer(model=_tiny_gpt2(), args=args, train_dataset=_Same(),
                      callbacks=[tw, Probe()])
    trainer.train()
    return trainer, tw, params


def test_hf_callback_beats_the_real_step_loss_and_grad_norm_nan_included(
    tmp_path: Path, rings: tuple[Path, socket.socket]
) -> None:
    """With the Trainer's default arguments (logging_nan_inf_filter on), every optimizer step
    reaches the ring with the loss and pre-clip grad norm the Trainer computed, and the NaN
    step's loss arrives as NaN (also as a datagram at once) while the Trainer's own logged
    loss stays finite."""
    _need("torch", "transformers", "accelerate")
    import torch

    # Step 1's values, computed independently on the same initial model and batch.
    ref = _tiny_gpt2()
    item = _Same()[0]
    loss1 = ref(input_ids=item["input_ids"].repeat(4, 1), labels=item["labels"].repeat(4, 1)).loss
    loss1.backward()
    norm1 = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in ref.parameters()
                     if p.grad is not None]))
    assert norm1.item() > 1.0  # so the default clipping (1.0) changes the gradients

    trainer, _, _ = _hf_train(tmp_path / "out", steps=5, nan_at=3)
    got = _beats(rings[0])
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert got[1].loss == pytest.approx(loss1.item(), rel=1e-5)
    assert got[1].grad_norm == pytest.approx(norm1.item(), rel=1e-5)  # pre-clip
    assert got[2].loss is not None and math.isfinite(got[2].loss)
    assert got[3].loss is not None and math.isnan(got[3].loss)
    assert got[3].grad_norm is not None and math.isnan(got[3].grad_norm)
    nan_sent = [b for b in _datagrams(rings[1]) if b.step == 3]
    assert nan_sent and nan_sent[0].loss is not None and math.isnan(nan_sent[0].loss)
    # What a callback reading the Trainer's logs would have seen: no NaN anywhere.
    logged = [v for row in trainer.state.log_history for k, v in row.items() if "loss" in k]
    assert logged and all(math.isfinite(v) for v in logged)


def test_hf_callback_skips_the_window_without_touching_the_weights(
    tmp_path: Path, rings: tuple[Path, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRAINWATCH_SKIP_STEPS=2:3 (end inclusive): steps 2 and 3 are beaten without values and
    leave every weight as step 1 left it; steps 1 and 4 train."""
    _need("torch", "transformers", "accelerate")
    import torch

    monkeypatch.setenv("TRAINWATCH_SKIP_STEPS", "2:3")
    trainer, tw, params = _hf_train(tmp_path / "out", steps=4)
    assert tw.skipped == [2, 3]
    assert trainer.state.global_step == 4
    got = _beats(rings[0])
    assert [(s, got[s].loss is None) for s in sorted(got)] == [
        (1, False), (2, True), (3, True), (4, False)]
    assert torch.equal(params[0], params[1]) and torch.equal(params[1], params[2])
    assert not torch.equal(params[2], params[3])


def test_torch_watch_numbers_steps_skips_the_window_and_reads_tensors(
    rings: tuple[Path, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Watch.steps() drops every micro-batch of the steps in the window (end inclusive) and
    beats them without values; step() takes 0-d tensors as they are."""
    _need("torch")
    import torch
    from trainwatch.integrations.torch import Watch

    monkeypatch.setenv("TRAINWATCH_SKIP_STEPS", "3:4")
    with Watch() as w:
        trained = list(w.steps(range(12), first=2, per_step=2))
        for step, _ in trained[1::2]:  # once per step, after its last micro-batch
            w.step(step, torch.tensor(step * 1.5), torch.tensor(math.nan) if step == 5 else 0.5)
    assert trained == [(2, 0), (2, 1), (5, 6), (5, 7), (6, 8), (6, 9), (7, 10), (7, 11)]
    assert w.skipped == [3, 4]
    got = _beats(rings[0])
    assert [(s, got[s].loss) for s in sorted(got)][:3] == [(2, 3.0), (3, None), (4, None)]
    assert got[5].grad_norm is not None and math.isnan(got[5].grad_norm)


def test_lightning_callback_reports_a_checkpoint_only_once_its_file_is_complete(
    tmp_path: Path, rings: tuple[Path, socket.socket]
) -> None:
    """Each checkpoint is reported after Lightning has written it (it loads, and holds the
    reported step), never from on_save_checkpoint, which runs before the write; beats carry
    the real loss and a NaN once the weights are NaN."""
    _need("torch", "lightning")
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from trainwatch.integrations.lightning import TrainwatchCallback

    seen: list[tuple[int, str, int | None]] = []

    class Observed(client.Heartbeat):
        def checkpoint(self, step: int, path: Any, rank: int | None = None) -> bool:
            try:
                held = int(torch.load(path, weights_only=False)["global_step"])
            except Exception:
                held = None
            seen.append((step, os.path.basename(path), held))
            return super().checkpoint(step, path, rank)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, i: int) -> Any:
            if self.trainer.global_step + 1 == 5:
                self.net.weight.data.fill_(math.nan)
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)
    tw = TrainwatchCallback(hb=Observed(os.environ["TRAINWATCH_SOCKET"], 0, str(rings[0])))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="step_{step}",
                           auto_insert_metric_name=False, every_n_train_steps=2, save_top_k=-1)
    pl.Trainer(max_steps=6, callbacks=[tw, ckpt], accelerator="cpu", logger=False,
               enable_progress_bar=False, enable_model_summary=False).fit(Module(), data)
    assert seen == [(2, "step_2.ckpt", 2), (4, "step_4.ckpt", 4), (6, "step_6.ckpt", 6)]
    got = _beats(rings[0])
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert all(got[s].loss is not None and math.isfinite(got[s].loss) for s in range(1, 5))
    assert all(got[s].grad_norm is not None and got[s].grad_norm > 0 for s in range(1, 5))
    assert got[5].loss is not None and math.isnan(got[5].loss)


def _orders(s: socket.socket) -> list[DataOrder]:
    return [d for d in _datagrams(s) if isinstance(d, DataOrder)]


def test_hf_callback_says_the_trainer_orders_data_by_step(
    tmp_path: Path, rings: tuple[Path, socket.socket]
) -> None:
    """With default arguments the HF callback tells the daemon, once, that the batch of a
    step is a function of the step (seeded sampler, skip on resume), from step 0."""
    _need("torch", "transformers", "accelerate")
    _hf_train(tmp_path / "out", steps=2)
    (said,) = _orders(rings[1])
    assert (said.order, said.step, said.rank) == ("step", 0, 0), said
    assert "seed 42" in said.why, said


@pytest.mark.parametrize(("loader", "order"), [("shuffled", "unknown"),
                                               ("sequential", "epoch-seeded"),
                                               ("stateful", "step")])
def test_lightning_callback_says_how_its_dataloader_follows_the_step(
    rings: tuple[Path, socket.socket], loader: str, order: str
) -> None:
    """An ordinary shuffled DataLoader is 'unknown' (a resumed run draws other batches), an
    unshuffled one 'epoch-seeded' with its epoch's length in steps, and a stateful one
    (state_dict/load_state_dict, restored by Lightning) 'step'."""
    _need("torch", "lightning")
    import lightning.pytorch as pl
    import torch
    from trainwatch.integrations.lightning import TrainwatchCallback

    class Stateful(torch.utils.data.DataLoader[Any]):
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, i: int) -> Any:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    ds = torch.utils.data.TensorDataset(torch.randn(12, 4))
    make = Stateful if loader == "stateful" else torch.utils.data.DataLoader
    data = make(ds, batch_size=4, shuffle=loader == "shuffled")
    pl.Trainer(max_steps=2, callbacks=[TrainwatchCallback()], accelerator="cpu", logger=False,
               enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False).fit(Module(), data)
    (said,) = _orders(rings[1])
    assert (said.order, said.step) == (order, 0), said
    assert said.epoch_steps == (3 if order == "epoch-seeded" else None), said


def test_importing_trainwatch_and_its_integrations_package_imports_no_framework() -> None:
    """`import trainwatch.integrations` (and the client) pulls in neither torch,
    transformers nor lightning."""
    code = ("import sys, trainwatch, trainwatch.client, trainwatch.integrations; "
            "print([m for m in ('torch', 'transformers', 'lightning') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, check=True)
    assert r.stdout.strip() == "[]"


# --- each example under a real `trainwatch run` ------------------------------------


def _example(ws: Workspace, kind: str, *args: str) -> tuple[dict[str, Any], Path]:
    script, pattern, modules = KINDS[kind]
    _need(*modules)
    out = ws.root / "out"
    job = {"command": [sys.executable, str(EXAMPLES / script), "--out", str(out), *args],
           "checkpoints": {"dir": str(out / "ckpt"), "pattern": pattern}}
    return job, out


def _progress(out: Path) -> list[dict[str, Any]]:
    path = out / "progress.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _name(pattern: str, step: int) -> str:
    return pattern.replace("{step}", str(step))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_example_driven_into_nan_is_rolled_back_before_the_nan_step(
    ws: Workspace, kind: str
) -> None:
    """Its weights really turn NaN at step 8: trainwatch records a nan_loss incident with
    onset 8, rolls back to step 6's checkpoint (the newest strictly before the onset), hands
    the job a skip window covering step 8, and the job resumes at step 7, skips the window
    and finishes all 16 steps."""
    job, out = _example(ws, kind, "--steps", "16", "--ckpt-every", "3", "--nan-at", "8",
                        "--step-time", "0.15")
    rc, log = finish(ws.run(ws.config(job, policy={"actions": {"nan_loss": "rollback"}})),
                     timeout=120)
    pattern = KINDS[kind][1]
    incidents = ws.incidents()
    assert [i["kind"] for i in incidents] == ["nan_loss"], (incidents, log)
    (incident,) = incidents
    assert incident["onset_step"] == 8
    assert incident["action"] == "rollback"
    assert incident["resumed_step"] == 6
    assert incident["resumed_from"] == str(out / "ckpt" / _name(pattern, 6))
    runs = _progress(out)
    starts = [e for e in runs if e["event"] == "start"]
    assert [(e["attempt"], e["first_step"]) for e in starts] == [(0, 1), (1, 7)], runs
    assert starts[1]["resume_from"] == incident["resumed_from"]
    skip = starts[1]["skip"]
    assert skip is not None and skip[0] <= 8 <= skip[1] and skip[0] >= 7, starts[1]
    (end,) = [e for e in runs if e["event"] == "end"]
    assert end["attempt"] == 1 and end["last_step"] == 16
    assert end["skipped"] == list(range(skip[0], skip[1] + 1))
    assert rc == 0, log
    # Whatever attempt 0 saved after step 6 was quarantined and is still on disk (a
    # checkpoint the relaunch wrote anew under the same name is good again).
    catalog = json.loads((ws.state / "jobs" / "job" / "catalog.json").read_text())
    bad = {int(k): v for k, v in catalog.get("bad", {}).items()}
    assert all(s > 6 and v.startswith("quarantined") for s, v in bad.items()), bad
    assert all((out / "ckpt" / _name(pattern, s)).exists() for s in bad), bad
    # Each example's batch of step k is a function of k (HF: its seeded sampler and
    # skip on resume; Lightning: a fixed order resumed at an epoch end; torch: batches
    # seeded by step), and said so: the skip is recorded as exact.
    rb = json.loads(incident["evidence"])["rollback"]
    assert (rb["skip"], rb["data_order"]["order"], rb["resume_step"]) == (
        "exact", {"hf": "step", "lightning": "epoch-seeded", "torch": "step"}[kind], 6), rb
    assert rb["window"] == skip and rb["widening"] == 0 and rb["budget"] == "charged", rb
    assert rb["quarantined"] == sorted(bad), (rb, bad)


def test_lightning_with_a_shuffled_dataloader_is_rolled_back_with_an_approximate_skip(
    ws: Workspace
) -> None:
    """An ordinary DataLoader(shuffle=True) draws a new order in every run: the NaN incident
    records the skip as approximate, naming the unseeded RandomSampler, and
    `incidents --show` says so with the window and the quarantined checkpoints."""
    job, _ = _example(ws, "lightning", "--steps", "12", "--ckpt-every", "3", "--nan-at", "8",
                      "--step-time", "0.1", "--shuffle")
    rc, log = finish(ws.run(ws.config(job, policy={"actions": {"nan_loss": "rollback"}})),
                     timeout=120)
    assert rc == 0, log
    (incident,) = ws.incidents()
    rb = json.loads(incident["evidence"])["rollback"]
    assert rb["skip"] == "approximate" and rb["data_order"]["order"] == "unknown", rb
    assert "RandomSampler without a generator" in rb["skip_why"], rb
    shown = subprocess.run(
        [sys.executable, "-m", "trainwatch.cli", "incidents", "--show", str(incident["id"]),
         "--state-dir", str(ws.state)], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    w = rb["window"]
    for want in (f"skip window: steps {w[0]}-{w[1]}", "quarantined (kept on disk",
                 "skip: approximate: a RandomSampler without a generator",
                 "loss and grad norm of rank 0", "<- onset"):
        assert want in shown.stdout, (want, shown.stdout)
    assert "no evidence captured" not in shown.stdout
