"""How each system runs the drill's trainer: its command, its settings (printed with
the table), and where its own records are."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

TRAINER = Path(__file__).resolve().parent / "trainer.py"
BENCH = str(Path(__file__).resolve().parent.parent)
VENV_BIN = Path(sys.executable).parent
RESTARTS = 100  # more than any schedule needs: the budget is not what is measured
# trainwatch's first skip window after a NaN: this many steps past the last bad one seen.
# Bad data comes in runs (a shard); with 0 (the default) a 6-step run takes three
# rollbacks, the window doubling each time (docs/jobs.md).
SKIP_AFTER = 10


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def trainer_args(ckpt: Path, state: Path, every: int, step_time: float,
                 nan: tuple[int, int] | None) -> list[str]:
    args = [str(TRAINER), "--ckpt", str(ckpt), "--state", str(state), "--every", str(every),
            "--step-time", str(step_time)]
    return args + (["--nan", f"{nan[0]}:{nan[1]}"] if nan else [])


def torchrun_argv(ranks: int, rest: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", *extra, *rest]


def base_env(system: str) -> dict[str, str]:
    env = {**os.environ, "GOODPUT_SYSTEM": system, "PYTHONPATH": BENCH,
           "OMP_NUM_THREADS": "1"}
    for k in [k for k in env if k.startswith("TRAINWATCH_")]:
        del env[k]
    return env


TRAINWATCH_SETTINGS = """trainwatch: `trainwatch run`, the daemon's loop in the foreground; \
the trainer reports beats and checkpoints through trainwatch.client. heartbeat.learned \
{factor 5, floor 1s} (the hang timeout learned from the step time; 1 s, 10 steps, is the \
drill's own detection floor for a hang), required (the job beats: \
silence from its start counts), startup_timeout 60s (a rank that never beats); the stall \
timeout its default (3 x p99 step, 5-30 s); backoff {initial 0.5s, factor 2, max 8s, \
reset_after 60s} (the default 10 s x 2^n is for crash loops of long jobs); rollback \
{skip_after 10} (a first skip window 10 steps past the last bad one); kill_grace 2s; \
checkpoints step_{step} + marker `done`, verified before a resume; Xid via the simulated \
NVML (one GPU more than the ranks, gpus.min = the ranks, poll 1 s: its default); restart \
budget 100. With 2 ranks: nodes 1 (torchrun's agent restarts the workers in place, \
through its rendezvous; a GPU to leave relaunches the agent)."""


def trainwatch(d: Path, ranks: int, rest: list[str]) -> Launch:
    ckpt = Path(rest[rest.index("--ckpt") + 1])
    cmd = torchrun_argv(ranks, rest) if ranks > 1 else [sys.executable, *rest]
    job = {"name": "drill", "command": cmd,
           "checkpoints": {"dir": str(ckpt), "pattern": "step_{step}", "marker": "done"},
           "heartbeat": {"learned": {"factor": 5, "floor": "1s"}, "required": True,
                         "startup_timeout": "60s"},
           "gpus": {"devices": list(range(ranks + 1)), "min": ranks},
           # torchrun's agent restarts its workers in place (its rendezvous), trainwatch
           # deciding when and from where: a rank's crash or hang costs no new agent.
           **({"nodes": 1} if ranks > 1 else {}),
           "env": {k: v for k, v in base_env("trainwatch").items()
                   if k in ("PYTHONPATH", "GOODPUT_SYSTEM", "OMP_NUM_THREADS", "PATH")}}
    doc = {"state_dir": str(d / "tw-state"), "run_dir": str(d / "tw-run"),
           "metrics": {"port": 0},
           "gpu": {"backend": "sim", "count": ranks + 1, "kmsg": None},
           "policies": {"default": {
               "max_restarts": RESTARTS,
               "backoff": {"initial": "0.5s", "factor": 2, "max": "8s", "reset_after": "60s"},
               "rollback": {"skip_after": SKIP_AFTER},
               "kill_grace": "2s"}},
           "jobs": [job]}
    cfg = d / "trainwatch.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    tw = shutil.which("trainwatch", path=str(VENV_BIN)) or "trainwatch"
    return Launch([tw, "run", "--config", str(cfg), "--no-passthrough"],
                  base_env("trainwatch"))


TORCHRUN_SETTINGS = f"""torchrun: `torchrun --standalone --nproc-per-node N --max-restarts \
{RESTARTS}` (its monitor interval and the gloo collective timeout left at their defaults: \
0.1 s and 30 min); the trainer resumes from the newest checkpoint with a `done` marker."""


def torchrun(d: Path, ranks: int, rest: list[str]) -> Launch:
    return Launch(torchrun_argv(ranks, rest, f"--max-restarts={RESTARTS}"),
                  base_env("torchrun"))


def nvrx(d: Path, ranks: int, rest: list[str]) -> Launch:
    from goodput_drill import nvrx as nv
    argv, env = nv.command(rest, ranks, base_env("nvrx"))
    return Launch(argv, env)


def settings(name: str) -> str:
    if name == "nvrx":
        from goodput_drill import nvrx as nv
        return nv.SETTINGS
    return {"trainwatch": TRAINWATCH_SETTINGS, "torchrun": TORCHRUN_SETTINGS}[name]


LAUNCHERS = {"trainwatch": trainwatch, "torchrun": torchrun, "nvrx": nvrx}
