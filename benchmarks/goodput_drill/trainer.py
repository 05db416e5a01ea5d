"""The drill's trainer: deterministic, paced, the same under every system.

A small torch model (1 process, or 2 ranks under DDP on gloo when WORLD_SIZE is set)
trained with SGD on data drawn from the step number, so a run resumed from step k is
bit for bit the run that never stopped. Steps ``--nan A:B`` carry a NaN in their batch
(the data went bad); steps trainwatch names in TRAINWATCH_SKIP_STEPS are skipped, and
``--skip A:B`` does the same for the reference run. A typical trainer does not stop on
a NaN loss: this one does not either.

Resumes from TRAINWATCH_RESUME_FROM when trainwatch names a checkpoint, else from the
newest complete one in ``--ckpt`` (as a user's script does under torchrun); a checkpoint
that does not load ends the process with an error. Checkpoints every ``--every`` steps:
``step_N/weights.pt`` then a ``done`` marker, reported to trainwatch.

Faults it plays along with (files in ``--state``, written by the drill):
``gpu-lost-G``: the GPU G it runs on fell off the bus; its next GPU call never returns
(the process blocks, as one waiting on a lost GPU does). ``stall-PID``: this rank
blocks inside its step, alive and not stopped (an NCCL-style stall).

Rank 0 appends each step to ``--state/progress.jsonl``; each rank writes its pid to
``--state/pids/rank-R``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from trainwatch import client

BATCH, WIDTH = 64, 32


# A teacher the model can learn: its loss falls to the noise and stays there, so no
# detector has a reason to act on a healthy run.
TEACHER = torch.randn(WIDTH, 1, generator=torch.Generator().manual_seed(1234)) / WIDTH ** 0.5


def data(step: int, rank: int, nan: range) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = x @ TEACHER + 0.1 * torch.randn(BATCH, 1, generator=g)
    if step in nan:
        x[0, 0] = math.nan
    return x, y


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def window(text: str | None) -> range:
    if not text:
        return range(0)
    a, _, b = text.partition(":")
    return range(int(a), int(b) + 1)


def newest(ckpt: Path) -> Path | None:
    done = [p for p in ckpt.glob("step_*") if (p / "done").exists()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def gpu_of(local_rank: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[local_rank] if visible else str(local_rank)


def process_start() -> float:
    """This process's start, wall clock, to a clock tick (Linux: its start in
    /proc is in ticks since boot)."""
    with open("/proc/self/stat") as f:
        ticks = float(f.read().rsplit(")", 1)[1].split()[19])
    since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since


def block_forever() -> None:
    while True:
        time.sleep(3600)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True, type=Path)
    p.add_argument("--state", required=True, type=Path)
    p.add_argument("--every", type=int, default=30)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--nan", help="A:B: steps whose batch holds a NaN")
    p.add_argument("--skip", help="A:B: steps to skip (the reference run)")
    p.add_argument("--until", type=int, help="stop after this step (the reference run)")
    p.add_argument("--digest-to", type=Path, help="write the final weights' digest here")
    a = p.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    started = time.time()
    pids = a.state / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"rank-{rank}").write_text(str(os.getpid()))
    nan = window(a.nan)
    skips = window(a.skip)
    tw_skip = client.skip_steps()
    if tw_skip is not None:
        skips = range(tw_skip[0], tw_skip[1] + 1)

    # Seconds from `started` to the end of each part of the start (the start record):
    # where a restart's time between the worker's start and its first step goes.
    phases: dict[str, float] = {"exec": round(process_start() - started, 4)}  # < 0: imports
    # And what this process had used by then: CPU seconds, involuntary context switches
    # (a CPU wanted while another ran), major page faults (a read from disk).
    usage: dict[str, list[float]] = {}

    def phase(name: str) -> None:
        phases[name] = round(time.time() - started, 4)
        u = resource.getrusage(resource.RUSAGE_SELF)
        usage[name] = [round(u.ru_utime + u.ru_stime, 3), u.ru_nivcsw, u.ru_majflt]

    phase("main")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model: nn.Module = nn.Sequential(nn.Linear(WIDTH, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    phase("model")
    start = 0
    named = client.resume_from()
    phase("resume_from")
    src = Path(named) if named else newest(a.ckpt)
    if src is not None:
        state = torch.load(src / "weights.pt", weights_only=True)  # raises on a bad file
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    phase("loaded")
    if world > 1:
        dist.init_process_group("gloo")
        phase("process_group")
        model = nn.parallel.DistributedDataParallel(model)
        phase("ddp")
    hb = client.connect(rank=rank)
    hb.data_order("step", "each batch is drawn from its step number")  # a skip is exact
    nv = None
    if os.environ.get("GOODPUT_SYSTEM") == "nvrx":
        from goodput_drill.nvrx import Heartbeat
        nv = Heartbeat()
        nv.start()
    phase("clients")
    log = open(a.state / "progress.jsonl", "a", buffering=1) if rank == 0 else None  # noqa: SIM115
    if log is not None:
        log.write(json.dumps({"t": started, "pid": os.getpid(), "start": True, "from": start,
                              "skip": [skips.start, skips.stop - 1] if skips else None,
                              "phases": phases, "usage": usage}) + "\n")
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    lost, stall = a.state / f"gpu-lost-{gpu_of(local)}", a.state / f"stall-{os.getpid()}"
    step, paced = start, time.monotonic()
    while a.until is None or step < a.until:
        step += 1
        if lost.exists() or stall.exists():
            block_forever()
        skipped = step in skips
        loss = float("nan")
        if not skipped:
            x, y = data(step, rank, nan)
            opt.zero_grad()
            out = nn.functional.mse_loss(model(x), y)
            out.backward()
            opt.step()
            loss = out.item()
        if log is not None:
            log.write(json.dumps({"t": time.time(), "pid": os.getpid(), "step": step,
                                  "loss": loss, "skip": skipped}) + "\n")
        hb.beat(step, loss=None if skipped else loss)
        if nv is not None:
            nv.beat()
        if step % a.every == 0 and rank == 0:
            d = a.ckpt / f"step_{step}"
            d.mkdir(parents=True, exist_ok=True)
            torch.save({"model": inner.state_dict(), "opt": opt.state_dict(), "step": step},
                       d / "weights.pt")
            (d / "done").write_text("")
            hb.checkpoint(step, d)
            if log is not None:
                log.write(json.dumps({"t": time.time(), "pid": os.getpid(), "ckpt": step,
                                      "digest": digest(inner)}) + "\n")
        if a.until is None:
            paced += a.step_time
            time.sleep(max(0.0, paced - time.monotonic()))
    if a.digest_to is not None and rank == 0:
        a.digest_to.write_text(digest(inner))
    if world > 1:
        dist.barrier()  # then exit: gloo's destroy_process_group was seen to hang here
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # goodput_drill.nvrx
    sys.exit(main())
