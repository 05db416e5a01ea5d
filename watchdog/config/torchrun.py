"""The torchrun command of a job that spans hosts (``nodes``), as trainwatch runs it.

Every host's daemon runs the user's ordinary multi-node command (``torchrun
--nnodes=2:4 ... --rdzv-backend=c10d --rdzv-endpoint=HEAD:29400 train.py``);
torchrun's rendezvous restarts the group. What trainwatch settles first:

- ``--max-restarts=1000000`` unless the command gives its own. trainwatch kills
  a faulted attempt's workers and the local agent restarts them; an agent whose
  own budget runs out (torchrun's default is 0) exits and closes the rendezvous,
  which ends the job on every host (multinode.md §1.3, E-4). trainwatch's
  budget, not torchrun's, must end a job.
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless the job's environment sets it:
  with the shared store, a fresh agent joining a running group deadlocked
  (§1.3, E-3) and only recovered with it (E-3c, 4.6 s). On one host as well: the
  workers restarted in place after a stalled rank was ended failed to start for
  137 s with the shared store (the goodput drill, docs/figures.md).
- ``TRAINWATCH_HOST``: this host's name, as its incidents and group records say it.

Pure functions of the command: torch is not imported (the daemon's Python need
not have it). ``python -m torch.distributed.launch`` is refused: PyTorch
deprecated it for torchrun, and it passes ``--local-rank`` to the script by
default, a different contract from the one every rank here is started with.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

RESTARTS = 1_000_000  # torchrun's budget: never the one that ends a job
LOW_RESTARTS = 1000  # a user's own --max-restarts below this is warned about
MAX_NODES = 1 << 20  # beyond any job of today; each host runs at least one rank
SHARED_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
HOST_ENV = "TRAINWATCH_HOST"
_TORCHRUN_MODULE = "torch.distributed.run"
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?")
_SHOWN = 60

# torchrun's options (torch 2.13, torch/distributed/run.py): those that take no
# value; every other takes one. Each hyphenated option also has an underscore
# spelling (--max_restarts), and argparse takes any unique prefix (--max-r=5).
_FLAGS = frozenset({"--standalone", "--module", "--no-python", "--run-path",
                    "--virtual-local-rank", "--help"})
_LONG = ("--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
         "--rdzv-conf", "--standalone", "--max-restarts", "--monitor-interval",
         "--start-method", "--event-log-handler", "--role", "--module", "--no-python",
         "--run-path", "--log-dir", "--redirects", "--tee", "--local-ranks-filter",
         "--duplicate-stdout-filters", "--duplicate-stderr-filters", "--node-rank",
         "--master-addr", "--master-port", "--local-addr", "--logs-specs", "--numa-binding",
         "--signals-to-handle", "--shutdown-timeout", "--virtual-local-rank", "--help")
_SHORT = {"-m": "--module", "-r": "--redirects", "-t": "--tee", "-h": "--help"}


class SpanError(ValueError):
    """A job's ``nodes`` and its command that do not fit together: one line; the
    config reader says which job."""


@dataclass(frozen=True)
class Torchrun:
    """Where a command's torchrun options are, and what they say."""

    options_at: int  # the index of torchrun's first option (just after the launcher)
    script_at: int | None  # the training script's index; None: there is none
    options: Mapping[str, str]  # by canonical name (--max-restarts); a flag's value is ""


@dataclass(frozen=True)
class Plan:
    """What trainwatch runs for a job that spans hosts."""

    argv: tuple[str, ...]  # the command with torchrun's options settled
    env: Mapping[str, str]  # set over the job's own: trainwatch's variables
    env_defaults: Mapping[str, str]  # set unless the job's environment has them already
    added: tuple[str, ...] = ()  # what trainwatch added, as said at each launch
    warnings: tuple[str, ...] = ()


def _show(s: str) -> str:
    return repr(s if len(s) <= _SHOWN else s[:_SHOWN] + "...")


def parse_nodes(text: str) -> tuple[int, int]:
    """``"2:4"`` -> (2, 4), ``"2"`` -> (2, 2), as torchrun reads --nnodes; ValueError
    unless 1 <= MIN <= MAX <= MAX_NODES."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isascii() and p.strip().isdigit() and len(p) <= 8
                                 for p in parts):
        raise ValueError(text)
    low, high = int(parts[0]), int(parts[-1])
    if not 1 <= low <= high <= MAX_NODES:
        raise ValueError(text)
    return low, high


def span(nodes: tuple[int, int]) -> str:
    """(2, 4) -> "2:4"; (2, 2) -> "2"."""
    return str(nodes[0]) if nodes[0] == nodes[1] else f"{nodes[0]}:{nodes[1]}"


def _module_at(command: Sequence[str]) -> tuple[str, int] | None:
    """For ``python [interpreter options] -m MODULE ...``: the module and the index
    after it; None for a script, ``-c`` or stdin."""
    i = 1
    while i < len(command):
        a = command[i]
        if not a.startswith("-") or a in ("-", "--"):
            return None
        if a.startswith("--"):  # --check-hash-based-pycs MODE; --version and the like
            i += 2 if a == "--check-hash-based-pycs" else 1
            continue
        for j in range(1, len(a)):  # clustered: -u, -OO, -Wignore, -X dev, -um MODULE
            rest = a[j + 1:]
            if a[j] == "m":
                if rest:
                    return rest, i + 1
                return (command[i + 1], i + 2) if i + 1 < len(command) else None
            if a[j] == "c":
                return None
            if a[j] in "WX":
                i += 0 if rest else 1  # its value is the rest of this token or the next
                break
        i += 1
    return None


def _canonical(name: str) -> str | None:
    """A long option as torchrun's parser resolves it, by its hyphenated name."""
    name = "--" + name[2:].replace("_", "-")
    if name in _LONG:
        return name
    matches = [o for o in _LONG if o.startswith(name)]
    return matches[0] if len(matches) == 1 else None


def find(command: Sequence[str]) -> Torchrun | None:
    """The command's torchrun options, or None when it is not torchrun (``torchrun
    ...`` or ``python -m torch.distributed.run ...``). Raises SpanError for
    ``python -m torch.distributed.launch``."""
    if not command:
        return None
    prog = os.path.basename(command[0])
    if prog == "torchrun":
        start = 1
    elif _PYTHON.fullmatch(prog):
        found = _module_at(command)
        if found is None:
            return None
        module, start = found
        if module == "torch.distributed.launch":
            raise SpanError("python -m torch.distributed.launch is not supported (PyTorch "
                            "deprecated it, and it passes --local-rank to the script): "
                            "use torchrun or python -m torch.distributed.run, same options")
        if module != _TORCHRUN_MODULE:
            return None
    else:
        return None
    options: dict[str, str] = {}
    i = start
    while i < len(command):
        a = command[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        name, eq, value = a.partition("=")
        if a.startswith("--"):
            canon = _canonical(name)
        else:  # -r3, -r 3, -m
            canon, eq, value = _SHORT.get(a[:2]), "", a[2:]
            eq = "=" if value else ""
        key = canon or name
        if eq or key in _FLAGS:
            options[key] = value
            i += 1
        else:  # the value is the next argument (an option unknown here is taken to have one)
            options[key] = command[i + 1] if i + 1 < len(command) else ""
            i += 2
    return Torchrun(start, i if i < len(command) else None, options)


def plan(command: Sequence[str], nodes: tuple[int, int], host: str,
         env: Mapping[str, str]) -> Plan:
    """The command and environment trainwatch runs for a job with ``nodes``; ``env``
    is the job's own (its config). Raises SpanError."""
    t = find(command)
    if t is None:
        prog = _show(command[0]) if command else "nothing"
        raise SpanError(f"nodes needs a torchrun command; got {prog} (torchrun ... or python "
                        "-m torch.distributed.run ..., the program itself, not a shell or a "
                        "wrapper around it)")
    said = t.options.get("--nnodes")
    where = "--nnodes"
    if said is None and "PET_NNODES" in env:  # torchrun reads its options from PET_* too
        said, where = env["PET_NNODES"], "env PET_NNODES"
    try:
        given = parse_nodes(said) if said is not None else (1, 1)  # torchrun's default
    except ValueError:
        raise SpanError(f"torchrun's {where}: expected N or MIN:MAX, got {_show(said or '')}") \
            from None
    if given != nodes:
        shown = f"{where}={said}" if said is not None else "no --nnodes (torchrun's default 1:1)"
        raise SpanError(f"nodes is {span(nodes)} but the torchrun command has {shown}: "
                        "make them say the same")
    if "--standalone" in t.options and nodes[1] > 1:
        raise SpanError("torchrun's --standalone is a rendezvous on this host alone; a job "
                        "with nodes needs --rdzv-backend=c10d --rdzv-endpoint=HEAD:PORT")
    argv, added, warnings = tuple(command), [], []
    restarts = t.options.get("--max-restarts")
    where = "--max-restarts"
    if restarts is None and "PET_MAX_RESTARTS" in env:
        restarts, where = env["PET_MAX_RESTARTS"], "env PET_MAX_RESTARTS"
    if restarts is None:
        flag = f"--max-restarts={RESTARTS}"
        argv = (*argv[:t.options_at], flag, *argv[t.options_at:])
        added.append(flag)
    else:
        try:
            n = int(restarts)
        except ValueError:
            raise SpanError(f"torchrun's {where}: expected an integer, got "
                            f"{_show(restarts)}") from None
        if n < LOW_RESTARTS:
            warnings.append(
                f"torchrun's {where}={restarts} is kept: after {n} restarts of one host's "
                "workers its agent exits and ends the job on every host, before "
                f"trainwatch's budget does; remove it (trainwatch sets {RESTARTS}) or set "
                f"it to at least {LOW_RESTARTS}")
    defaults = {SHARED_STORE_OFF: "1"}
    if SHARED_STORE_OFF not in env:
        added.append(f"{SHARED_STORE_OFF}=1")
    return Plan(argv, {HOST_ENV: host}, defaults, tuple(added), tuple(warnings))


def said(job: str, nodes: tuple[int, int], p: Plan) -> str:
    """The launch's line: what trainwatch added to torchrun, and why."""
    flags = [a for a in p.added if a.startswith("--")]
    env = [a for a in p.added if not a.startswith("--")]
    what = ""
    if flags:
        what = f"torchrun gets {' '.join(flags)} (trainwatch's budget ends the job, not torchrun's)"
    if env:
        what += (" and " if what else "torchrun gets ") + " ".join(env)
    hosts = "host" if nodes == (1, 1) else "hosts"
    return f"job {job}: spans {span(nodes)} {hosts}; {what or 'torchrun runs as the job wrote it'}"
