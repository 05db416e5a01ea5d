"""Record real loss and grad-norm curves for ``bench_loss.py`` (run once; the
output is committed under ``benchmarks/curves/``).

How: a tiny GPT-2 (``transformers.GPT2LMHeadModel``: 2 layers, width 64, byte
vocabulary of 256, context 64) trained with AdamW on CPU, one thread, over the
bytes of this Python's standard library sources (sorted, deterministic; no
download). Every optimizer step records the mean batch loss and the pre-clip
total grad norm that ``torch.nn.utils.clip_grad_norm_`` returns (clip 1.0), as
a training loop would report them to trainwatch.

Runs (each seeded):
- ``cosine``: linear warm-up over 100 steps to 3e-3, cosine decay to 1e-4.
- ``steps_restart``: warm-up, step drops x0.3 at 350 and 550, then a warm
  restart back to 3e-3 at 750 (the loss rises by itself: must not fire).
- ``lr_blowup``: the cosine schedule, but from step 400 the learning rate is
  0.3 (an operator's mistake), a real cause of divergence. The update of step
  400 is the first at that rate, so the loss of step 401 is the first it
  harms: labelled onset 401.

Writes ``benchmarks/curves/<run>.csv.gz`` (step,loss,grad_norm,lr) and
``benchmarks/curves/labels.json``. About 55 s of one CPU core.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

HERE = Path(__file__).resolve().parent
OUT = HERE / "curves"
CTX, BATCH = 64, 16


def corpus(limit: int = 2_000_000) -> torch.Tensor:
    """The bytes of the stdlib's .py files, sorted by path: the same on every run."""
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    if not lib.is_dir():
        lib = Path(f"/usr/lib/python{sys.version_info[0]}.{sys.version_info[1]}")
    buf = bytearray()
    for p in sorted(lib.glob("*.py")):
        buf += p.read_bytes()
        if len(buf) >= limit:
            break
    return torch.tensor(list(buf[:limit]), dtype=torch.long)


def cosine(step: int, total: int, peak: float = 3e-3, warm: int = 100,
           floor: float = 1e-4) -> float:
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(1.0, t)))


def steps_restart(step: int, total: int) -> float:
    if step < 100:
        return 3e-3 * (step + 1) / 100
    if step >= 750:
        return 3e-3  # the warm restart
    return 3e-3 * (0.3 if step >= 350 else 1.0) * (0.3 if step >= 550 else 1.0)


def lr_blowup(step: int, total: int) -> float:
    return 0.3 if step >= 400 else cosine(step, 700)


def train(name: str, steps: int, lr_at: Callable[[int, int], float], data: torch.Tensor,
          seed: int) -> list[tuple[int, float, float, float]]:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=256, n_positions=CTX, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0, steps), weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    rows: list[tuple[int, float, float, float]] = []
    for step in range(steps):
        lr = lr_at(step, steps)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, data.numel() - CTX - 1, (BATCH,), generator=gen)
        x = torch.stack([data[i:i + CTX] for i in idx.tolist()])
        out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rows.append((step, float(out.loss.item()), float(gn.item()), lr))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = corpus()
    runs: list[tuple[str, int, Callable[[int, int], float], int]] = [
        ("cosine", 700, cosine, 1),
        ("steps_restart", 900, steps_restart, 2),
        ("lr_blowup", 600, lr_blowup, 3),
    ]
    for name, steps, sched, seed in runs:
        t0 = time.process_time()
        rows = train(name, steps, sched, data, seed)
        with gzip.open(out / f"{name}.csv.gz", "wt") as f:
            f.write("step,loss,grad_norm,lr\n")
            for s, loss, gn, lr in rows:
                f.write(f"{s},{loss:.6g},{gn:.6g},{lr:.6g}\n")
        print(f"{name}: {steps} steps, {time.process_time() - t0:.1f} s CPU, "
              f"final loss {rows[-1][1]:.3f}")
    labels = {
        "cosine": [],
        "steps_restart": [],
        "lr_blowup": [{"kind": "divergence", "onset": 401,
                       "cause": "learning rate 0.3 from the update of step 400"}],
    }
    (out / "labels.json").write_text(json.dumps(labels, indent=1) + "\n")


if __name__ == "__main__":
    main()
