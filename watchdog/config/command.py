"""A job's command, checked at load: its size against what exec takes, its
``{num_gpus}`` where GPUs are counted, and, for a job across hosts (``nodes``),
the torchrun command it spans hosts with (config/torchrun.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trainwatch.config import fields, torchrun
from trainwatch.config.fields import Said, show
from trainwatch.config.reader import Reader
from trainwatch.config.schema import (
    ConfigError,
)

MAX_ARG_BYTES = 32 * 4096  # MAX_ARG_STRLEN: the most exec takes in one string, NUL included


MAX_EXEC_BYTES = 1 << 20  # a job's command, resume_args and env together




def _exec_bytes(s: str) -> int:
    """What a string takes in exec's argument block: its bytes and a NUL."""
    return len(s.encode("utf-8", "surrogatepass")) + 1


def check_exec_size(r: Reader, path: str, command: tuple[str, ...],
                     resume_args: tuple[str, ...], env: Mapping[str, str]) -> None:
    """Refuse a command, resume_args and env that exec would refuse (E2BIG) or that
    would take the daemon's memory to format (a few aliases of one long string): one
    string beyond MAX_ARG_STRLEN, or more than MAX_EXEC_BYTES in all, which leaves
    exec's total (ARG_MAX, 2 MiB on a default stack) room for the inherited env."""
    strings = [(f"{path}.command[{n}]", a) for n, a in enumerate(command)]
    strings += [(f"{path}.resume_args[{n}]", a) for n, a in enumerate(resume_args)]
    n_cmd = 0
    for where, a in strings:
        size = _exec_bytes(a)
        if size > MAX_ARG_BYTES:
            raise r.fail(where, f"an argument of at most {MAX_ARG_BYTES - 1} bytes (what"
                         " exec accepts)", Said(f"one of {size - 1} bytes"))
        n_cmd += size
    n_env = 0
    for k, v in env.items():
        size = _exec_bytes(k) + _exec_bytes(v)  # "k=v" and its NUL
        if size > MAX_ARG_BYTES:
            raise r.fail(f"{path}.env.{fields.key(k)}", f"a variable of at most"
                         f" {MAX_ARG_BYTES - 1} bytes as NAME=value (what exec accepts)",
                         Said(f"one of {size - 1} bytes"))
        n_env += size
    if n_cmd + n_env > MAX_EXEC_BYTES:
        where = f"{path}.command" if n_cmd >= n_env else f"{path}.env"
        raise r.fail(where, f"a command and env of at most 1 MiB ({MAX_EXEC_BYTES} bytes)"
                     " together, what exec accepts", Said(f"{n_cmd + n_env} bytes"))


def span(r: Reader, m: Mapping[str, Any], path: str, command: tuple[str, ...],
           env: Mapping[str, str], folder: str | None) -> tuple[int, int] | None:
    """``nodes``: the job spans hosts, through the torchrun command it runs
    (config/torchrun.py), resuming from a folder every host sees."""
    nodes: tuple[int, int] | None = r.get(m, "nodes", path, fields.NODES, None)
    if nodes is None:
        return None
    if folder is None:
        raise r.fail(f"{path}.checkpoints.dir", "the folder every host sees (a job with nodes"
                     " spans hosts; every rank resumes from the same checkpoint)",
                     Said("none"))
    try:
        torchrun.plan(command, nodes, "", env)
    except torchrun.SpanError as e:
        raise ConfigError(f"{r.source}: {path}.command: {e}") from None
    return nodes


def check_command(command: Sequence[str], backend: str, where: Any) -> None:
    """{num_gpus} needs GPUs counted: refuse it where nothing counts them.

    ``where(n)`` names the n-th argument in the message."""
    if backend != "off":
        return
    for n, arg in enumerate(command):
        if "{num_gpus}" in arg:
            raise ConfigError(
                f"{where(n)}: expected no {{num_gpus}} with gpu.backend: off (no GPUs are"
                f" counted, so it has no value), got {show(arg)}"
            )
