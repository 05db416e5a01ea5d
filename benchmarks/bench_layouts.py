"""What a full scan costs per layout with 10,000 checkpoints on disk.

How: for each layout, ``--n`` (default 10,000) synthetic checkpoints in a
scratch folder under /tmp, each with the files that layout checks, small but
well-formed (a safetensors file as long as its header says, torch-style zip
archives holding ``archive/data.pkl``, a DCP ``.metadata`` pickle referencing
its shard; made without torch); then ``layouts.get(name).scan(root)`` timed
``--repeat`` times (default 5, warm page cache), median reported, and
``detect(root)`` once. Every checkpoint must come back complete.

Run: ``.venv/bin/python benchmarks/bench_layouts.py [--n 10000] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import statistics
import struct
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, scratch_dir
from trainwatch import layouts


def _safetensors(path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)


def _archive(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")


def _dcp(folder: Path) -> None:
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"\0" * 64)
    # The shape of a torch 2.13 ``.metadata``'s storage entry, as plain dicts.
    meta = {"storage_data": [{"relative_path": "__0_0.distcp", "offset": 0, "length": 64}]}
    (folder / ".metadata").write_bytes(pickle.dumps(meta, protocol=4))


def make(name: str, root: Path, n: int) -> None:
    root.mkdir()
    one: Callable[[int], None]
    if name == "hf":
        def one(s: int) -> None:
            d = root / f"checkpoint-{s}"
            d.mkdir()
            _safetensors(d / "model.safetensors")
            (d / "trainer_state.json").write_text(json.dumps({"global_step": s}))
    elif name == "lightning":
        def one(s: int) -> None:
            _archive(root / f"epoch=0-step={s}.ckpt")
    elif name == "dcp":
        def one(s: int) -> None:
            _dcp(root / f"step_{s}")
    elif name == "megatron":
        (root / "latest_checkpointed_iteration.txt").write_text(str(n))

        def one(s: int) -> None:
            d = root / f"iter_{s:07d}"
            d.mkdir()
            _archive(d / "common.pt")
            (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    else:
        (root / "latest").write_text(f"global_step{n}")

        def one(s: int) -> None:
            d = root / f"global_step{s}"
            d.mkdir()
            _archive(d / "mp_rank_00_model_states.pt")
            _archive(d / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    for s in range(1, n + 1):
        one(s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(machine_line())
    scratch = scratch_dir("twlay")
    try:
        for name in layouts.NAMES:
            root = scratch / name
            t0 = time.perf_counter()
            make(name, root, args.n)
            made = time.perf_counter() - t0
            layout = layouts.get(name)
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                found = layout.scan(root)
                times.append(time.perf_counter() - t0)
            assert len(found) == args.n and all(f.complete for f in found), found[:3]
            t0 = time.perf_counter()
            detected = layouts.detect(root)
            det = time.perf_counter() - t0
            assert detected == name, (detected, name)
            med = statistics.median(times)
            print(f"{name:10s} scan of {args.n} checkpoints: median {med * 1000:.0f} ms "
                  f"({med / args.n * 1e6:.1f} µs each; min {min(times) * 1000:.0f}, "
                  f"max {max(times) * 1000:.0f} ms, n={args.repeat}); detect {det * 1000:.1f} ms;"
                  f" made in {made:.1f} s")
            shutil.rmtree(root)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
