"""The pre-flight a host runs on the GPUs it would use before it joins its
group again (multihost/leave.py): NVIDIA's launcher's node health check, done
by the host that knows its GPUs.

Which check (``choose``), in this order:

- ``sim``: the simulated GPUs (``gpu.backend: sim``): each one's health as
  trainwatch reads it now: no drill condition on it (an injected Xid that
  breaks a GPU, a lost GPU, ECC: until ``trainwatch clear-gpu`` or the
  re-check clears it), readable, not lost, no pending or failed row remap;
- ``dcgmi``: ``dcgmi diag -r 1`` on those GPUs, where DCGM is installed;
- ``torch``: a matmul on each GPU and an all-reduce across them, in the job's
  Python, as the job's user (``TORCH_CHECK``); where torch cannot be imported
  or sees no GPU, none is available after all;
- ``none``: nothing can check the GPUs here: the operator decides (the host
  joins once ``trainwatch clear-gpu`` has put enough GPUs back).

``judge`` says what a check's exit means; every check is bounded by a timeout,
and a timeout is a failure (a GPU that hangs a matmul is not healthy)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainwatch.privsep.credentials import Identity
    from trainwatch.watch.gpuwatch import GpuWatch

log = logging.getLogger("trainwatch")

TIMEOUT = 180.0  # seconds one pre-flight may run (dcgmi diag -r 1 takes ~1 min)
_SHOWN = 200  # characters of a check's output said

# Exit codes of TORCH_CHECK that mean "no pre-flight here", not "the GPU failed".
NO_TORCH, NO_CUDA = 3, 4

TORCH_CHECK = f"""
import sys
try:
    import torch
except Exception as e:
    print(f"torch cannot be imported: {{e}}")
    sys.exit({NO_TORCH})
if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
    print("torch sees no GPU (CUDA unavailable)")
    sys.exit({NO_CUDA})
n = torch.cuda.device_count()
xs = []
for d in range(n):
    a = torch.ones(1024, 1024, device=d)
    b = a @ a  # every element is exactly 1024, in fp32 and in tf32
    torch.cuda.synchronize(d)
    if not bool((b == 1024).all()):
        print(f"GPU {{d}}: a matmul came out wrong")
        sys.exit(1)
    xs.append(torch.full((1 << 20,), float(d + 1), device=d))
if n > 1:
    import torch.cuda.nccl as nccl
    nccl.all_reduce(xs)
    for d in range(n):
        torch.cuda.synchronize(d)
want = n * (n + 1) / 2
bad = [d for d, x in enumerate(xs) if not bool((x == want).all())]
if bad:
    print(f"an all-reduce across the GPUs came out wrong on {{bad}}")
    sys.exit(1)
print(f"{{n}} GPU(s): matmul and all-reduce passed")
"""


@dataclass(frozen=True)
class Check:
    kind: str  # sim | dcgmi | torch | none
    what: str  # as the host's waiting reason says it
    argv: tuple[str, ...] = ()


@dataclass(frozen=True)
class Result:
    passed: bool | None  # None: no check could run here (the operator decides)
    detail: str


def choose(backend: str, which: Callable[[str], str | None] = shutil.which,
           python: str | None = None) -> Check:
    """The check for this host: the sim backend's own, else DCGM's, else torch in
    the job's Python (``python``), else none."""
    if backend == "sim":
        return Check("sim", "the simulated GPUs' health")
    dcgmi = which("dcgmi")
    if dcgmi:
        return Check("dcgmi", "dcgmi diag -r 1", (dcgmi, "diag", "-r", "1"))
    if python:
        return Check("torch", "a matmul on each GPU and an all-reduce across them (torch)",
                     (python, "-c", TORCH_CHECK))
    return Check("none", "none available here (no dcgmi, no Python with torch): "
                         "waiting for the operator (trainwatch clear-gpu)")


def python_of(command: Sequence[str], which: Callable[[str], str | None] = shutil.which
              ) -> str | None:
    """The job's Python: its command's interpreter (python -m torch.distributed.run),
    or the one torchrun's script names on its first line."""
    if not command:
        return None
    first = which(command[0]) if os.sep not in command[0] else command[0]
    name = os.path.basename(command[0])
    if name.startswith("python"):
        return first
    if name != "torchrun" or first is None:
        return None
    try:
        with open(first, "rb") as f:
            line = f.readline(4096)
    except OSError:
        return None
    if not line.startswith(b"#!"):
        return None
    words = line[2:].decode(errors="replace").split()
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        return which(words[1])
    return words[0] if words else None


def judge(check: Check, rc: int | None, out: str) -> Result:
    """What a check's exit status (None: it ran past its timeout) and output mean."""
    said = " ".join(out.split())[-_SHOWN:]
    if rc is None:
        return Result(False, f"{check.kind}: no answer within {TIMEOUT:g}s")
    if check.kind == "dcgmi":
        failed = [x.strip() for x in out.splitlines() if "fail" in x.lower()]
        if rc == 0 and not failed:
            return Result(True, "dcgmi diag -r 1 passed")
        return Result(False, f"dcgmi diag -r 1 (exit {rc}): "
                             f"{' '.join(failed)[:_SHOWN] if failed else said}")
    if check.kind == "torch":
        if rc == 0:
            return Result(True, said or "matmul and all-reduce passed")
        if rc in (NO_TORCH, NO_CUDA):
            return Result(None, f"no pre-flight available ({said}): waiting for the "
                                "operator (trainwatch clear-gpu)")
        return Result(False, f"torch check (exit {rc}): {said}")
    return Result(None, "no pre-flight available: waiting for the operator "
                        "(trainwatch clear-gpu)")


def sim(gpus: GpuWatch, devices: Sequence[int]) -> Result:
    """The simulated GPUs as trainwatch reads them now."""
    bad = []
    for d in devices:
        g = gpus.health.gpus.get(d)
        last = g.last if g is not None else None
        if gpus.overlay.active(d) or d in gpus.overlay.broken:
            bad.append(f"GPU {d}: {gpus.overlay.broken.get(d) or 'a drill condition'}")
        elif not gpus.health.source_up or last is None:
            bad.append(f"GPU {d}: not read")
        elif last.lost is not None or last.remap_pending or last.remap_failure:
            bad.append(f"GPU {d}: {last.lost or 'row remap pending or failed'}")
    if bad:
        return Result(False, "sim: " + "; ".join(bad))
    return Result(True, f"sim: GPU {','.join(map(str, devices))} healthy")


def run(check: Check, devices: Sequence[int], ident: Identity | None,
        env: Mapping[str, str], timeout: float = TIMEOUT) -> Result:
    """A check that runs a program (dcgmi, torch), as the job's user for torch;
    blocking: call it off the loop."""
    if check.kind not in ("dcgmi", "torch"):
        return judge(check, 0, "")
    argv = list(check.argv)
    if check.kind == "dcgmi" and devices:
        argv += ["-i", ",".join(map(str, devices))]
    run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env,
               "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
               "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}
    as_user = ident if check.kind == "torch" else None
    try:
        p = subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=run_env, timeout=timeout, check=False, start_new_session=True,
            user=as_user.uid if as_user else None, group=as_user.gid if as_user else None,
            extra_groups=list(as_user.groups) if as_user else None,
            cwd=(as_user.home if as_user and as_user.home else "/") if as_user else None)
    except subprocess.TimeoutExpired:
        return judge(check, None, "")
    except OSError as e:
        return Result(False, f"{argv[0]}: cannot start: {e.strerror or e}")
    return judge(check, p.returncode, p.stdout.decode(errors="replace"))
