"""stacks: which rank is the odd one out, judged from py-spy stack dumps, as
ByteRobust's "aggregation analysis" does it (SOSP 2025; summary in
shared/prior-art/stalls-and-log-lines.md section 7). Pure: no I/O.

Input, per rank: the list of threads that ``py-spy dump --json`` prints (each
with ``thread_name``, ``os_thread_id``, ``pid`` and ``frames``, innermost
first), or None when no stack could be read for that rank.

- The thread that matters is the main thread: the one named ``MainThread``,
  else the one whose OS thread id is the process id, else the first listed
  (py-spy does not list the main thread first). Training loops and the
  collectives they call run there; helper threads (data loaders, the
  heartbeat) look alike on every rank and would only blur the groups.
- A rank's signature is that thread's frames reduced to (function name, short
  file name): line numbers differ between ranks at the same call site and
  native addresses (``0x7f..`` frames of ``--native``) between processes, so
  both are left out.
- Ranks are grouped by signature. A group holding strictly more than half of
  the ranks with a stack is taken as healthy ("majority"); every rank outside
  it is a suspect.
- Without a majority (two ranks that differ; any tie), the ranks whose stack is
  *not* inside a collective are the suspects, provided at least one rank is
  inside one ("outside_collective"): the healthy ranks wait in the collective
  for the one that never arrived.
- When the stacks name no one, a rank whose process is stopped, in D state or
  a zombie while others run or sleep is named ("process_state"). Else no one
  ("none").
- A rank with no stack is evidence of nothing: it is in no group and never a
  suspect of the stack rules.

"Inside a collective" (``in_collective``), any frame of the main thread where:
- the file is under ``torch/distributed/`` (every Python collective,
  ``distributed_c10d.py`` and its ``c10d_logger.py`` wrapper, lives there);
- or the function (the part after the last ".") is one of ``COLLECTIVES``
  (names distinctive enough to count in any file);
- or the function is one of ``GENERIC`` (``wait``, ``send``, ``recv``, ...) and
  the file is under ``torch/`` (a bare ``Condition.wait`` or
  ``Connection.recv`` is a data loader, not a collective);
- or the function is ``_engine_run_backward`` in ``torch/autograd/``: the
  backward pass, where DDP's reducer runs its all-reduce. Measured here: a DDP
  rank on gloo blocked on a stopped peer shows only that frame in Python's
  stack; natively, ``c10d::Reducer::finalize_backward``. (Before, such a rank
  was "outside any collective" and its stopped peer no odd one out.) A rank
  hung in its own backward is then no suspect of the stack rules while its peers
  wait in a collective; a stopped one is named by its process state;
- or, for native frames (``--native``), the name holds ``c10d::``, ``gloo::``
  or ``nccl`` (case-insensitive).

``agrees`` cross-checks the rank that the step and CPU evidence named: True
when it is among the suspects, False when the stacks name others, None when
either names no one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# Functions of torch.distributed distinctive enough to count wherever they are.
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "allreduce", "all_gather", "all_gather_into_tensor",
    "all_gather_object", "allgather", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "alltoall", "broadcast_object_list", "barrier",
    "monitored_barrier", "batch_isend_irecv", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
})
# Names that are collectives only in torch's files (elsewhere: threading, sockets).
GENERIC = frozenset({
    "wait", "_wait", "wait_stream", "synchronize", "send", "recv", "isend", "irecv",
    "broadcast", "reduce", "gather", "scatter",
})
_NATIVE = re.compile(r"c10d::|gloo::|nccl", re.IGNORECASE)
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_BAD_STATES = frozenset("TtDZ")  # stopped, traced, uninterruptible, zombie

Signature = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Verdict:
    suspects: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]  # ranks with a stack, by signature, largest first
    in_collective: tuple[int, ...]
    decided_by: str  # "majority" | "outside_collective" | "process_state" | "none"
    why: str
    agrees: bool | None

    def as_dict(self) -> dict[str, Any]:
        """As JSON holds it: lists for the tuples."""
        d = asdict(self)
        d.update(suspects=list(self.suspects), groups=[list(g) for g in self.groups],
                 in_collective=list(self.in_collective))
        return d


def main_thread(threads: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The thread a rank is judged by (see the module docstring)."""
    ts = [t for t in threads if isinstance(t, Mapping)]
    for t in ts:
        if t.get("thread_name") == "MainThread":
            return t
    for t in ts:
        if t.get("os_thread_id") is not None and t.get("os_thread_id") == t.get("pid"):
            return t
    return ts[0] if ts else None


def frames(thread: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    fs = thread.get("frames") if thread is not None else None
    return [f for f in fs if isinstance(f, Mapping)] if isinstance(fs, list) else []


def signature(threads: Sequence[Mapping[str, Any]]) -> Signature:
    """The main thread's frames as (function, short file name), addresses dropped."""
    out = []
    for f in frames(main_thread(threads)):
        name = str(f.get("name") or "?")
        if _ADDRESS.fullmatch(name):
            continue
        out.append((name, str(f.get("short_filename") or f.get("filename") or "?")))
    return tuple(out)


def _is_collective(f: Mapping[str, Any]) -> bool:
    name = str(f.get("name") or "")
    paths = [str(f.get(k) or "").replace("\\", "/") for k in ("filename", "short_filename")]
    if any("torch/distributed/" in p for p in paths):
        return True
    bare = name.rsplit(".", 1)[-1]
    if bare in COLLECTIVES:
        return True
    if bare in GENERIC and any(p.startswith("torch/") or "/torch/" in p for p in paths):
        return True
    if bare == "_engine_run_backward" and any("torch/autograd/" in p for p in paths):
        return True  # DDP's all-reduce runs in the autograd engine, out of Python's sight
    return bool(_NATIVE.search(name))


def in_collective(threads: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the main thread is inside a torch.distributed collective or wait."""
    return any(_is_collective(f) for f in frames(main_thread(threads)))


def _names(ranks: Sequence[int]) -> str:
    rs = [str(r) for r in ranks]
    word = "rank" if len(rs) == 1 else "ranks"
    return f"{word} {', '.join(rs)}"


def verdict(stacks: Mapping[int, Sequence[Mapping[str, Any]] | None],
            states: Mapping[int, str] | None = None, named: int | None = None) -> Verdict:
    """The suspects from the stacks of every rank (None: none could be read)."""
    states = states or {}
    have = {r: s for r, s in sorted(stacks.items()) if isinstance(s, Sequence) and s}
    missing = sorted(r for r in stacks if r not in have)
    by_sig: dict[Signature, list[int]] = {}
    for r, s in have.items():
        by_sig.setdefault(signature(s), []).append(r)
    groups = tuple(sorted((tuple(g) for g in by_sig.values()), key=lambda g: (-len(g), g[0])))
    inside = tuple(r for r, s in have.items() if in_collective(s))
    suspects: tuple[int, ...] = ()
    decided = "none"
    if len(have) >= 2 and len(groups[0]) * 2 > len(have):
        healthy = set(groups[0])
        suspects = tuple(r for r in have if r not in healthy)
        if suspects:
            decided = "majority"
            why = (f"{len(healthy)} of {len(have)} ranks share one stack; "
                   f"{_names(suspects)} differ")
        else:
            why = f"all {len(have)} ranks with a stack share one stack: no odd one out"
    elif len(have) >= 2:
        outside = tuple(r for r in have if r not in inside)
        if inside and outside:
            suspects, decided = outside, "outside_collective"
            verb = "waits" if len(inside) == 1 else "wait"
            why = (f"no stack is shared by a majority; {_names(inside)} {verb} inside a "
                   f"collective, {_names(outside)} not")
        else:
            where = "inside a collective" if inside else "outside any collective"
            why = f"no stack is shared by a majority and all ranks are {where}"
    else:
        why = f"stacks of {len(have)} rank(s) only: nothing to compare"
    if not suspects:
        bad = tuple(r for r in sorted(states) if states[r] in _BAD_STATES)
        if bad and len(bad) < len(states):
            suspects, decided = bad, "process_state"
            how = ", ".join(f"{r}={states[r]}" for r in bad)
            why += f"; the process state names {_names(bad)} ({how})"
    if missing:
        why += f"; no stack for {_names(missing)}"
    agrees = None if named is None or not suspects else named in suspects
    return Verdict(suspects, groups, inside, decided, why, agrees)
