"""What a snapshot costs the training loop (trainwatch.snapshot), side by side
with torch.save and DCP's async_save, in one run; medians over ``--runs``.

How (everything under ``--dir``, default build/ in the checkout, on disk, not
tmpfs; removed at the end):

(1) blocked: the time the training loop waits per save of a ``--gib`` GiB state
    (fp32 tensors of 16 MiB, each changed in place between saves, as a full
    fine-tuning step changes them):
    - ``Snapshotter.maybe_save`` in steady state (its host buffers reused: one
      save before the measured ones); phase 2 (hash, write, fsync, publish) runs
      in its thread and is waited for, outside the timing, before the next save,
      so no save is coalesced;
    - ``torch.save`` to the same disk, without fsync (returns once the bytes are
      in the page cache: not yet durable) and with ``fsync`` (durable);
    - ``torch.distributed.checkpoint.async_save`` (a gloo process group of world
      size 1, default storage writer): blocked until it returns, then its future
      is waited for, outside the timing; as called by default (a new stager, so
      new host memory, per call) and with one ``DefaultStager`` kept across
      saves (what the Snapshotter's phase 1 uses).
    The page cache is flushed (``os.sync``) between saves, outside the timing.
(2) bytes written per snapshot, incremental vs full (``incremental=False``), and
    incremental with zstd, after a few real AdamW steps between saves, for (a)
    full fine-tuning of a small GPT-2-style transformer (transformers, built from
    a config: no download) and (b) a LoRA fine-tune of the same model (a
    hand-written LoRA of rank ``--rank``, base frozen) on c_attn only (peft's
    default for GPT-2: "lora-attn") and on every attention and MLP projection
    ("lora-all"). The first save of each is the whole state; the figure is the
    median of the next ``--runs``. The time maybe_save blocked is shown too.
(3) restore time of those states (``Snapshotter.restore``): local with the page
    cache warm and cold (``posix_fadvise(DONTNEED)``), and into an empty folder
    from a local S3 server (``moto_server``, real HTTP), which pulls the newest
    snapshot first; and local for the ``--gib`` state.
(4) zstd (trainwatch.snapshot.codec, the level it uses): compression ratio and
    CPU seconds per GB (raw bytes) to compress and to decompress, for fp32
    weights and bf16 weights (the model of (a) after its steps), Adam state
    (its exp_avg and exp_avg_sq) and int buffers (int64 token ids and int64
    position ids).

Run: ``.venv/bin/python benchmarks/bench_snapshot.py [--runs 5] [--gib 1]
[--only blocked,bytes,restore,compress] [--quick]``. ``--quick``: 0.25 GiB,
3 runs, a smaller model (about 1 minute). About 4 minutes with the defaults
on 2 cores; disk: about 4 GB at most (for --gib 1).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _common import ROOT, machine, machine_line, summarize, write_json
from torch import nn
from trainwatch.snapshot import Snapshotter, codec, format
from trainwatch.state import manifest

MIB = 1 << 20
GB = 1e9
TENSOR = 16 * MIB  # bytes per tensor of the big state
BUCKET = "twbench"


def median(xs: list[float]) -> float:
    return summarize(xs).median if xs else math.nan


# --- the states ----------------------------------------------------------------


def big_state(gib: float) -> dict[str, Any]:
    n = max(1, round(gib * 1024 * MIB / TENSOR))
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(TENSOR // 4, generator=g) for i in range(n)}
    return {"model": model, "step": 0, "rng": torch.get_rng_state()}


class LoRA(nn.Module):
    """A frozen projection plus a trainable low-rank update (B @ A, B zero at first).
    Wraps transformers' Conv1D (weight in x out) and nn.Linear (out x in)."""

    def __init__(self, base: nn.Module, r: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        rows, cols = (int(n) for n in cast(torch.Tensor, base.weight).shape)
        fan_in, fan_out = (rows, cols) if type(base).__name__ == "Conv1D" else (cols, rows)
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(r, fan_in) / math.sqrt(fan_in))
        self.lora_b = nn.Parameter(torch.zeros(fan_out, r))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        return out + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


# Where the LoRA goes: "attn" is peft's default for GPT-2 (the fused q, k, v
# projection c_attn only); "all": every attention and MLP projection.
LORA_TARGETS = {"attn": ("attn.c_attn",),
                "all": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


def add_lora(model: nn.Module, targets: tuple[str, ...], rank: int) -> None:
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.transformer.h:  # type: ignore[union-attr]
        for target in targets:
            part, name = target.split(".")
            parent = getattr(block, part)
            setattr(parent, name, LoRA(getattr(parent, name), r=rank))


class Trainer:
    """A small GPT-2-style model and AdamW, trained on seeded random tokens."""

    def __init__(self, layers: int, width: int, vocab: int, lora: tuple[str, ...] = (),
                 rank: int = 8) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=vocab, n_positions=128, n_embd=width, n_layer=layers,
                         n_head=max(1, width // 64), bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(cfg)
        if lora:
            add_lora(self.model, lora, rank)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.vocab, self.n = vocab, 0

    def steps(self, k: int) -> None:
        for _ in range(k):
            self.n += 1
            g = torch.Generator().manual_seed(self.n)
            ids = torch.randint(0, self.vocab, (4, 64), generator=g)
            loss = self.model(input_ids=ids, labels=ids).loss
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(),
                "rng": torch.get_rng_state(), "step": self.n}

    def describe(self) -> str:
        total = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        distinct = {t.data_ptr(): t.numel() for t in self.model.state_dict().values()}
        train = sum(p.numel() for p in self.params)
        return (f"{total / MIB:.1f} MiB of weights in its state_dict (wte and lm_head tied), "
                f"{train / 1e6:.3f} M trainable parameters of {sum(distinct.values()) / 1e6:.2f} M "
                f"({100 * train / sum(distinct.values()):.2f} %)")


# --- helpers -------------------------------------------------------------------


def restore(d: Path, remote: str | None = None) -> tuple[int, Any] | None:
    """What a relaunch does: a fresh Snapshotter's restore() (standalone: the newest
    complete local snapshot, else the newest remote one, pulled first)."""
    with Snapshotter(str(d), every_steps=1, remote=remote) as s:
        return s.restore()


def published(d: Path) -> dict[int, str]:
    return dict(format.published(str(d)))


def save_and_wait(snap: Snapshotter, d: Path, step: int, state: dict[str, Any]) -> float:
    """maybe_save (timed), then wait outside the timing until snapshot-<step> is published
    and the Snapshotter is idle again."""
    t0 = time.perf_counter()
    snap.maybe_save(step, state)
    blocked = time.perf_counter() - t0
    snap.wait()
    if step not in published(d):
        raise RuntimeError(f"snapshot-{step} was not published in {d} (coalesced?)")
    return blocked


def manifest_stats(d: Path, step: int) -> dict[str, Any]:
    return dict(format.read(str(d / format.folder_name(step))).stats)


def drop_cache(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def s3_server(logdir: Path) -> Iterator[str]:
    """moto_server on a free port, a bucket made, the AWS env pointed at it; yields the url."""
    port = free_port()
    exe = Path(sys.executable).parent / "moto_server"
    log = open(logdir / "moto.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT"),
                                       timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {log.name}") from None
                time.sleep(0.05)
        yield f"s3://{BUCKET}"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --- (1) blocked per save ------------------------------------------------------


def bench_blocked(root: Path, gib: float, runs: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import async_save

    state = big_state(gib)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    print(f"\n(1) blocked per save, state {nbytes / GB:.3f} GB "
          f"({len(state['model'])} fp32 tensors of {TENSOR // MIB} MiB), s", flush=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    snapdir = root / "blocked-snap"
    snap = Snapshotter(str(snapdir), every_steps=1, keep=2)
    out: dict[str, list[float]] = {k: [] for k in
                                   ("snapshot", "torch_save", "torch_save_fsync", "dcp_async",
                                    "dcp_async_kept")}
    out |= {"snapshot_phase2": [], "dcp_total": []}
    # async_save makes a DefaultStager per call by default (fresh host memory each
    # time); kept across saves, as the Snapshotter keeps its own, it refills in place.
    kept = DefaultStager(StagingOptions(False, False, False, False))
    step = 0

    def change() -> None:
        nonlocal step
        step += 1
        state["step"] = step
        for t in state["model"].values():
            t.add_(1e-3)

    def torch_save(fsync: bool) -> float:
        path = root / "torch.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        s = time.perf_counter() - t0
        path.unlink()
        return s

    def dcp_save(stager: Any = None) -> tuple[float, float]:
        where = root / f"dcp-{step}"
        t0 = time.perf_counter()
        fut = async_save(state, checkpoint_id=str(where), async_stager=stager)
        blocked = time.perf_counter() - t0
        (fut.result() if hasattr(fut, "result") else fut.upload_completion.result())
        total = time.perf_counter() - t0
        shutil.rmtree(where)
        return blocked, total

    try:
        # Warm-up (not counted): the Snapshotter's buffers, DCP's first plan, the allocator.
        change()
        save_and_wait(snap, snapdir, step, state)
        dcp_save()
        dcp_save(kept)
        os.sync()
        for r in range(runs):  # interleaved, so a drift of the disk hits every method alike
            change()
            out["snapshot"].append(save_and_wait(snap, snapdir, step, state))
            out["snapshot_phase2"].append(float(manifest_stats(snapdir, step).get("write_s", 0)))
            os.sync()
            out["torch_save"].append(torch_save(False))
            os.sync()
            out["torch_save_fsync"].append(torch_save(True))
            os.sync()
            b, t = dcp_save()
            out["dcp_async"].append(b)
            out["dcp_total"].append(t)
            os.sync()
            out["dcp_async_kept"].append(dcp_save(kept)[0])
            os.sync()
            print(f"  run {r + 1}/{runs}: snapshot {out['snapshot'][-1]:.3f}, torch.save "
                  f"{out['torch_save'][-1]:.3f} / fsync {out['torch_save_fsync'][-1]:.3f}, "
                  f"dcp {out['dcp_async'][-1]:.3f} / stager kept {out['dcp_async_kept'][-1]:.3f}",
                  flush=True)
    finally:
        snap.close()
        kept.close()
        dist.destroy_process_group()
    res: dict[str, Any] = {"bytes": nbytes, **{k: summarize(v).as_dict() for k, v in out.items()}}
    # Restore of the same state, local, page cache warm: the last snapshot.
    secs = []
    for _ in range(runs):
        secs.append(timed(lambda: restore(snapdir))[0])
    res["restore_local_warm"] = summarize(secs).as_dict()
    shutil.rmtree(snapdir)
    state.clear()
    gc.collect()
    return res


# --- (2) bytes written and (3) restore -----------------------------------------


def bench_model(root: Path, name: str, trainer: Trainer, runs: int, between: int,
                url: str | None, do_restore: bool) -> dict[str, Any]:
    print(f"\n(2) {name}: {trainer.describe()}; {between} AdamW steps between saves", flush=True)
    variants: dict[str, dict[str, Any]] = {
        "full": {"incremental": False}, "incremental": {"incremental": True},
        "incremental+zstd": {"incremental": True, "compress": "zstd"}}
    dirs = {v: root / f"{name}-{v.replace('+', '-')}" for v in variants}
    snaps = {v: Snapshotter(str(dirs[v]), every_steps=1, keep=3, **kw)
             for v, kw in variants.items()}
    if url:
        dirs["remote"] = root / f"{name}-remote"
        snaps["remote"] = Snapshotter(str(dirs["remote"]), every_steps=1, keep=3,
                                      remote=f"{url}/{name}")
    written: dict[str, list[int]] = {v: [] for v in variants}
    raw: list[int] = []
    blocked: list[float] = []
    try:
        for i in range(runs + 1):
            trainer.steps(between)
            state = trainer.state()
            for v, s in snaps.items():
                t = save_and_wait(s, dirs[v], trainer.n, state)
                if v == "incremental" and i > 0:
                    blocked.append(t)
            if i == 0:
                continue  # the first save writes everything, whatever the variant
            raw.append(int(manifest_stats(dirs["full"], trainer.n)["bytes"]))
            for v in variants:
                written[v].append(int(manifest_stats(dirs[v], trainer.n)["stored_new"]))
    finally:
        for s in snaps.values():
            s.close()  # waits for the uploads too
    res: dict[str, Any] = {"state_bytes": median([float(x) for x in raw]),
                           "blocked": summarize(blocked).as_dict()}
    print(f"  blocked per save (incremental): median {median(blocked):.4f} s", flush=True)
    full = median([float(x) for x in written["full"]])
    for v in variants:
        m = median([float(x) for x in written[v]])
        res[f"written_{v}"] = m
        print(f"  written per snapshot, {v:16s}: {m / MIB:9.3f} MiB "
              f"({100 * m / full:6.2f} % of full)", flush=True)

    res |= bench_manifest(name, dirs["incremental"], runs)
    if do_restore:
        res |= bench_restore(root, name, dirs["incremental"], runs, url)
    for p in dirs.values():
        shutil.rmtree(p, ignore_errors=True)
    return res


def bench_manifest(name: str, d: Path, runs: int) -> dict[str, Any]:
    """The daemon's side of one new snapshot: its verification manifest (state/manifest.py,
    xxh3 of every file), every byte read vs the digests of chunks it shares with the
    snapshot before taken from that one's manifest (page cache warm in both)."""
    before, newest = sorted(published(d))[-2:]
    known: manifest.Known = {}
    manifest.make(before, str(d / format.folder_name(before)), known=known)
    folder = str(d / format.folder_name(newest))
    every, linked = [], []
    for _ in range(runs):
        every.append(timed(lambda: manifest.make(newest, folder))[0])
        linked.append(timed(lambda: manifest.make(newest, folder, known=dict(known)))[0])
    print(f"(2) {name}: the daemon's manifest of a new snapshot: every byte read "
          f"{median(every):.4f} s, shared chunks known {median(linked):.4f} s", flush=True)
    return {"manifest_every": summarize(every).as_dict(),
            "manifest_known": summarize(linked).as_dict()}


def bench_restore(root: Path, name: str, d: Path, runs: int, url: str | None) -> dict[str, Any]:
    print(f"(3) {name}: restore, s", flush=True)
    res: dict[str, Any] = {}
    newest = max(published(d))
    for cache in ("warm", "cold"):
        secs = []
        for _ in range(runs):
            if cache == "cold":
                drop_cache(d / format.folder_name(newest))
            t, got = timed(lambda: restore(d))
            assert got is not None and got[0] == newest, got
            secs.append(t)
        res[f"restore_local_{cache}"] = summarize(secs).as_dict()
        print(f"  local, page cache {cache}: median {median(secs):.3f}", flush=True)
    if url:
        secs = []
        for r in range(runs):
            fresh = root / f"{name}-fresh-{r}"
            t, got = timed(lambda: restore(fresh, f"{url}/{name}"))  # noqa: B023 - called now
            assert got is not None and got[0] == newest, got
            secs.append(t)
            shutil.rmtree(fresh)
        res["restore_s3"] = summarize(secs).as_dict()
        print(f"  from the S3 server into an empty folder: median {median(secs):.3f}", flush=True)
    return res


# --- (4) compression -----------------------------------------------------------


def tensor_bytes(ts: list[torch.Tensor]) -> bytes:
    return b"".join(t.detach().contiguous().view(torch.uint8).numpy().tobytes() for t in ts)


def bench_compress(trainer: Trainer, runs: int) -> dict[str, Any]:
    # Each storage once: wte and lm_head are one tensor (zstd would find the copy
    # within its window and report a ratio no real state has).
    distinct = {t.data_ptr(): t for t in trainer.model.state_dict().values()}
    weights = [t for t in distinct.values() if t.is_floating_point()]
    adam = [v for s in trainer.opt.state.values() for k, v in s.items()
            if k in ("exp_avg", "exp_avg_sq")]
    n = sum(t.numel() for t in weights)
    g = torch.Generator().manual_seed(0)
    samples = {
        "fp32 weights": tensor_bytes(weights),
        "bf16 weights": tensor_bytes([t.to(torch.bfloat16) for t in weights]),
        "Adam state (fp32 exp_avg, exp_avg_sq)": tensor_bytes(adam),
        "int64 token ids (vocab 50257)": tensor_bytes(
            [torch.randint(0, 50257, (n // 2,), generator=g)]),
        "int64 position ids (arange 1024, tiled)": tensor_bytes(
            [torch.arange(1024).repeat(max(1, n // 2048))]),
    }
    import zstandard

    # What the Snapshotter does: one frame per chunk, its level, one thread.
    cctx, dctx = zstandard.ZstdCompressor(level=codec.LEVEL), zstandard.ZstdDecompressor()
    print(f"\n(4) zstd level {codec.LEVEL}, one thread, a frame per {format.CHUNK // MIB} MiB "
          "chunk: ratio raw/zstd, CPU s per GB raw", flush=True)
    res: dict[str, Any] = {}
    for what, data in samples.items():
        comp, dec, ratio = [], [], []
        view = memoryview(data)
        pieces = [view[i:i + format.CHUNK] for i in range(0, len(data), format.CHUNK)]
        for _ in range(runs):
            c0 = time.process_time()
            frames = [cctx.compress(p) for p in pieces]
            c1 = time.process_time()
            back = b"".join(dctx.decompress(f) for f in frames)
            c2 = time.process_time()
            assert back == data
            comp.append((c1 - c0) / (len(data) / GB))
            dec.append((c2 - c1) / (len(data) / GB))
            ratio.append(len(data) / sum(len(f) for f in frames))
        res[what] = {"bytes": len(data), "ratio": median(ratio),
                     "compress_cpu_s_per_gb": median(comp),
                     "decompress_cpu_s_per_gb": median(dec)}
        print(f"  {what:40s} {len(data) / MIB:7.1f} MiB: ratio {median(ratio):5.3f}, "
              f"compress {median(comp):6.2f} CPU s/GB, decompress {median(dec):5.2f} CPU s/GB",
              flush=True)
    return res


# --- the table -----------------------------------------------------------------


def table(res: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str]] = [("figure", "median", "goal / note")]
    b = res.get("blocked")
    if b:
        ts, tf = b["torch_save"]["median"], b["torch_save_fsync"]["median"]
        gb = f"{b['bytes'] / GB:.2f} GB"
        rows += [
            (f"blocked per save [{gb}]: Snapshotter.maybe_save", f"{b['snapshot']['median']:.3f} s",
             f"{100 * b['snapshot']['median'] / ts:.1f} % of torch.save (goal ≤ 10 %: "
             f"{'met' if b['snapshot']['median'] <= 0.1 * ts else 'NOT met'}), "
             f"{100 * b['snapshot']['median'] / tf:.1f} % of torch.save + fsync "
             f"({'met' if b['snapshot']['median'] <= 0.1 * tf else 'NOT met'})"),
            ("  its phase 2 in the background (write_s)", f"{b['snapshot_phase2']['median']:.3f} s",
             "not blocking"),
            ("  torch.save, no fsync (page cache, not durable)", f"{ts:.3f} s", "baseline"),
            ("  torch.save + fsync (durable)", f"{tf:.3f} s", ""),
            ("  DCP async_save (until it returns)", f"{b['dcp_async']['median']:.3f} s",
             f"{100 * b['dcp_async']['median'] / ts:.1f} % of torch.save"),
            ("  DCP async_save, its stager kept across saves",
             f"{b['dcp_async_kept']['median']:.3f} s",
             f"{100 * b['dcp_async_kept']['median'] / ts:.1f} % of torch.save"),
            ("  DCP async_save, until its future is done", f"{b['dcp_total']['median']:.3f} s",
             "not blocking"),
            (f"restore [{gb}], local, page cache warm",
             f"{b['restore_local_warm']['median']:.3f} s", ""),
        ]
    for name in ("full-ft", "lora-attn", "lora-all"):
        m = res.get(name)
        if not m:
            continue
        full = m["written_full"]
        for v in ("full", "incremental", "incremental+zstd"):
            w = m[f"written_{v}"]
            note = f"{100 * w / full:.2f} % of full"
            if name.startswith("lora") and v == "incremental":
                note += f" (goal ≤ 5 %: {'met' if w <= 0.05 * full else 'NOT met'})"
            rows.append((f"bytes written per snapshot [{name}], {v}", f"{w / MIB:.3f} MiB", note))
        rows.append((f"blocked per save [{name}], Snapshotter.maybe_save",
                     f"{m['blocked']['median']:.4f} s", ""))
        if "manifest_every" in m:
            rows.append((f"daemon: manifest of a new snapshot [{name}]",
                         f"{m['manifest_known']['median']:.4f} s",
                         f"shared chunks' digests known; {m['manifest_every']['median']:.4f} s "
                         "reading every byte"))
        for k, label in (("restore_local_warm", "local, warm"),
                         ("restore_local_cold", "local, cold"),
                         ("restore_s3", "from S3 (moto) into an empty dir")):
            if k in m:
                rows.append((f"restore [{name}, {m['state_bytes'] / MIB:.0f} MiB], {label}",
                             f"{m[k]['median']:.3f} s", ""))
    for what, c in res.get("compress", {}).items():
        rows.append((f"zstd: {what}", f"ratio {c['ratio']:.3f}",
                     f"{c['compress_cpu_s_per_gb']:.2f} CPU s/GB to compress, "
                     f"{c['decompress_cpu_s_per_gb']:.2f} to decompress"))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w[j]) for j, c in enumerate(r)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=5, help="measured saves / restores per figure")
    ap.add_argument("--gib", type=float, default=1.0, help="size of the state of (1)")
    ap.add_argument("--only", default="blocked,bytes,restore,compress",
                    help="comma-separated subset of blocked, bytes, restore, compress")
    ap.add_argument("--quick", action="store_true", help="0.25 GiB, 3 runs, a smaller model")
    ap.add_argument("--layers", type=int, default=6, help="transformer layers of (2)")
    ap.add_argument("--width", type=int, default=512, help="transformer width of (2)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary of (2)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank of (2)")
    ap.add_argument("--between", type=int, default=2, help="AdamW steps between saves")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 restore")
    ap.add_argument("--dir", default=str(ROOT / "build"), help="where to write (not tmpfs)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.quick:
        a.gib, a.runs, a.layers, a.width, a.vocab = min(a.gib, 0.25), min(a.runs, 3), 2, 128, 4096
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    torch.set_num_threads(1)  # the loop's own thread; the Snapshotter's is its other core
    print(machine_line())
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="twsnap-", dir=a.dir))
    print(f"writing under {root} ({'tmpfs' if _fstype(root) == 'tmpfs' else _fstype(root)})")
    res: dict[str, Any] = {"machine": machine(), "args": vars(a)}
    t0 = time.monotonic()
    try:
        if "blocked" in only:
            res["blocked"] = bench_blocked(root, a.gib, a.runs)
        if only & {"bytes", "restore", "compress"}:
            with contextlib.ExitStack() as stack:
                url = None
                if "restore" in only and not a.no_s3:
                    if (Path(sys.executable).parent / "moto_server").exists():
                        url = stack.enter_context(s3_server(root))
                    else:
                        print("no moto_server beside this python (pip install 'moto[server]'): "
                              "the S3 restore is left out")
                for name, lora in (("full-ft", ()), ("lora-attn", LORA_TARGETS["attn"]),
                                   ("lora-all", LORA_TARGETS["all"])):
                    tr = Trainer(a.layers, a.width, a.vocab, lora, a.rank)
                    if only & {"bytes", "restore"}:
                        res[name] = bench_model(root, name, tr, a.runs, a.between, url,
                                                "restore" in only)
                    else:
                        tr.steps(a.between)  # Adam state to compress
                    if "compress" in only and not lora:
                        res["compress"] = bench_compress(tr, a.runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n=== summary ({time.monotonic() - t0:.0f} s; medians over {a.runs} runs)")
    print(machine_line())
    print(table(res))
    write_json(a.json, res)
    return 0


def _fstype(p: Path) -> str:
    best, fs = "", "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and str(p).startswith(parts[1]) and len(parts[1]) > len(best):
                best, fs = parts[1], parts[2]
    return fs


if __name__ == "__main__":
    sys.exit(main())
