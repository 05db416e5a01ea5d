"""Job-log rules: named regexes over the job's output lines, each raising a fault
kind once it matched ``count`` distinct lines within ``window`` seconds (modelled
on Node Problem Detector's log monitor rules).

Pure: lines and a clock in, ``LogMatch`` out; the log follower and the policy are
the caller's. ``BUILTIN`` holds the lines PyTorch, NCCL, CUDA and torchrun really
print; each pattern names where its text comes from (see
shared/prior-art/stalls-and-log-lines.md for the versions read).

Speed: a batch is joined into one string and every rule's required literal (taken
from its parsed regex) is looked for with ``str.find``, a C-level scan. An ordinary
batch thus costs one join and a dozen scans; only lines holding a literal go
through their rule's regex. A rule with no required literal (e.g. a pattern under
``(?i)``) falls back to a regex search of every line.
"""

from __future__ import annotations

import importlib
import math
import re
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from trainwatch.types import Action, FaultKind

if TYPE_CHECKING:
    import sre_parse as _parser
else:  # sre_parse warns on import since 3.11; re._parser is the same module, untyped
    _parser = importlib.import_module("re._parser")

EVIDENCE_CHARS = 500  # longest piece of one line kept as evidence
CONTEXT_LINES = 10  # neighbours kept on each side: a torchrun failure summary is ~15 lines
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class LogRule:
    name: str  # [A-Za-z0-9_.-]+
    pattern: str  # a Python regex, searched in each line
    kind: str  # a FaultKind value
    count: int = 1  # distinct matching lines within `window` seconds before it fires
    window: float = 60.0
    action: str | None = None  # None: the policy's action for `kind`


@dataclass(frozen=True)
class LogMatch:
    """One firing of a rule: the line that completed its count and its neighbours."""

    rule: str
    kind: str
    action: str | None
    line: str  # clipped to EVIDENCE_CHARS around the match
    before: tuple[str, ...]  # up to `context` lines before it, across earlier batches
    after: tuple[str, ...]  # up to `context` lines after it, from the same batch only
    at: float  # the `now` of the batch it fired in
    count: int  # distinct lines counted for this firing


# Sources: PGNCCL = pytorch torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (the newest
# version read, and cf1380df); NCCLUtils = torch/csrc/distributed/c10d/NCCLUtils.{hpp,cpp}
# (aac9c440, 37ee6bc7); nccl = NVIDIA/nccl 5067397c. The CUDA runtime's texts are
# closed-source: they are as seen verbatim after "CUDA error: " in public logs.
BUILTIN: tuple[LogRule, ...] = (
    # PGNCCL WorkNCCL::checkTimeout:
    # "[Rank N] Watchdog caught collective operation timeout: WorkNCCL(...) ran for ..."
    LogRule("nccl_watchdog_timeout", r"Watchdog caught collective operation timeout",
            "nccl_stall"),
    # PGNCCL WorkNCCL::handleException, after a timeout or an async NCCL error.
    LogRule("nccl_operations_failed", r"Some NCCL operations have failed or timed out",
            "nccl_stall"),
    # Old wording (2.3/2.4 logs, LlamaFactory#6953): "Heartbeat monitor timed out! Process will
    # be terminated ..."; PGNCCL-new HeartbeatMonitor::runLoop: "ProcessGroupNCCL's watchdog
    # got stuck for N seconds without making progress ...".
    LogRule("nccl_heartbeat_monitor",
            r"Heartbeat monitor timed out|ProcessGroupNCCL's watchdog got stuck for \d+ seconds",
            "nccl_stall"),
    # NCCLUtils C10D_NCCL_CHECK:
    # "NCCL error in: <file>:<line>, <ncclGetErrorString>, NCCL version <v>".
    LogRule("nccl_error", r"NCCL error in: ", "crash"),
    # NCCLUtils getNcclErrorDetailStr: "ncclUnhandledCudaError: Call to CUDA function failed." etc.
    LogRule("nccl_unhandled_cuda_error", r"ncclUnhandledCudaError", "crash"),
    LogRule("nccl_system_error", r"ncclSystemError", "crash"),
    LogRule("nccl_internal_error", r"ncclInternalError", "crash"),
    # A peer died or the network failed. nccl src/init.cc ncclGetErrorString(ncclRemoteError):
    # "remote process exited or there was a network error"; NCCLUtils: "ncclRemoteError: A call
    # failed possibly due to a network error or a remote process exiting prematurely."; nccl
    # src/debug.cc WARN lines "... NCCL WARN <msg>" with src/misc/socket.cc "socketProgress:
    # Connection closed by remote peer" or src/transport/net_ib/p2p.cc "Got completion from peer".
    LogRule("nccl_remote_error",
            r"ncclRemoteError|remote process exited or there was a network error"
            r"|NCCL WARN .*(?:remote process exited|Connection closed by remote peer"
            r"|Got completion from peer)",
            "crash"),
    # c10/cuda/CUDAException.cpp: "CUDA error: " + cudaGetErrorString; also inside NCCL's
    # "Cuda failure 'an illegal memory access was encountered'" (nccl src/include/checks.h).
    LogRule("cuda_illegal_memory_access", r"an illegal memory access was encountered", "crash"),
    # CUDA runtime text after "CUDA error: "; the line names no GPU, so the kind's action
    # cannot exclude one by itself (the NVML Xid 48/63/64 path does that).
    LogRule("cuda_ecc_uncorrectable", r"uncorrectable ECC error encountered", "gpu_ecc"),
    # c10/cuda/CUDACachingAllocator.cpp DeviceCachingAllocator::malloc: "CUDA out of memory.
    # Tried to allocate ..."; raised as torch.OutOfMemoryError (older logs:
    # torch.cuda.OutOfMemoryError).
    LogRule("cuda_oom", r"CUDA out of memory|torch\.(?:cuda\.)?OutOfMemoryError", "oom"),
    # torch/distributed/elastic/multiprocessing/errors/__init__.py ChildFailedError.format_msg:
    # "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:" then the summary with
    # "Root Cause (first observed failure):".
    LogRule("torchrun_child_failed",
            r"ChildFailedError|^Root Cause \(first observed failure\):", "crash"),
    # torch/distributed/elastic/rendezvous/dynamic_rendezvous.py raises RendezvousTimeoutError()
    # with no message: the traceback ends "torch.distributed.elastic.rendezvous.api.
    # RendezvousTimeoutError". The "Rendezvous ... timed out" wording is the issue's; not verified.
    LogRule("elastic_rendezvous_timeout",
            r"RendezvousTimeoutError|Rendezvous\b.*\btimed out", "crash"),
)


# --- required literals (the prefilter) ------------------------------------------


def _literals(seq: Any) -> frozenset[str] | None:
    """Strings of which every match of ``seq`` (a parsed regex) contains at least one;
    None when no such set is known."""
    options: list[frozenset[str]] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            options.append(frozenset({"".join(run)}))
            run.clear()

    for op, av in seq:
        if op is _parser.LITERAL:
            run.append(chr(av))
            continue
        flush()
        found: frozenset[str] | None = None
        if op is _parser.SUBPATTERN:
            _group, add_flags, _del, sub = av
            if not add_flags & re.IGNORECASE:
                found = _literals(sub)
        elif op is _parser.BRANCH:
            sets = [_literals(b) for b in av[1]]
            if sets and all(s is not None for s in sets):
                found = frozenset().union(*(s for s in sets if s is not None))
        elif op in (_parser.MAX_REPEAT, _parser.MIN_REPEAT) and av[0] >= 1:
            found = _literals(av[2])
        if found:
            options.append(found)
    flush()
    if not options:
        return None
    # The best filter: its shortest literal longest, then the fewest literals.
    return max(options, key=lambda s: (min(map(len, s)), -len(s)))


def required_literals(rx: re.Pattern[str]) -> frozenset[str] | None:
    """The literals a line must contain to match ``rx``, or None (search every line)."""
    if rx.flags & re.IGNORECASE:
        return None
    try:
        found = _literals(_parser.parse(rx.pattern, rx.flags))
    except Exception:
        return None
    return found if found and all(found) else None


# --- compiling and matching -----------------------------------------------------


@dataclass
class _Compiled:
    rule: LogRule
    rx: re.Pattern[str]
    hits: dict[str, float]  # distinct lines counted -> when first seen
    quiet_until: float = -math.inf


def _check(rule: LogRule) -> re.Pattern[str]:
    def bad(what: str) -> ValueError:
        return ValueError(f"rule {rule.name}: {what}")

    if not isinstance(rule.name, str) or not _NAME.fullmatch(rule.name):
        raise ValueError(f"rule {rule.name!r}: bad name, expected letters, digits, '_', '.', '-'")
    if rule.kind not in {k.value for k in FaultKind}:
        raise bad(f"unknown kind {rule.kind!r}, expected one of "
                  f"{', '.join(k.value for k in FaultKind)}")
    if rule.action is not None and rule.action not in {a.value for a in Action}:
        raise bad(f"unknown action {rule.action!r}, expected one of "
                  f"{', '.join(a.value for a in Action)}")
    if isinstance(rule.count, bool) or not isinstance(rule.count, int) or rule.count < 1:
        raise bad(f"count must be an integer >= 1, got {rule.count!r}")
    if (isinstance(rule.window, bool) or not isinstance(rule.window, (int, float))
            or not math.isfinite(rule.window) or rule.window <= 0):
        raise bad(f"window must be a number of seconds > 0, got {rule.window!r}")
    if not isinstance(rule.pattern, str) or not rule.pattern:
        raise bad("pattern must be a non-empty regex")
    try:
        return re.compile(rule.pattern)
    except re.error as e:
        raise bad(f"bad regex {rule.pattern!r}: {e}") from None


def compile_rules(rules: Iterable[LogRule], context: int = CONTEXT_LINES) -> Matcher:
    """Validate ``rules`` and build their matcher, keeping ``context`` neighbours of a
    match on each side. Raises ValueError("rule NAME: ...")."""
    compiled: list[_Compiled] = []
    seen: set[str] = set()
    for rule in rules:
        rx = _check(rule)
        if rule.name in seen:
            raise ValueError(f"rule {rule.name}: defined twice")
        seen.add(rule.name)
        compiled.append(_Compiled(rule, rx, {}))
    return Matcher(compiled, context)


def _clip(line: str, at: int = 0) -> str:
    line = line.rstrip("\r\n")
    if len(line) <= EVIDENCE_CHARS:
        return line
    start = max(0, min(at - EVIDENCE_CHARS // 4, len(line) - EVIDENCE_CHARS))
    return line[start:start + EVIDENCE_CHARS]


class Matcher:
    """The rules' state over one stream of lines (one job attempt): feed it batches."""

    def __init__(self, compiled: Sequence[_Compiled], context: int = CONTEXT_LINES) -> None:
        self._rules = list(compiled)
        self._context = context
        self._tail: list[str] = []  # the last `context` lines of earlier batches, clipped
        # literal -> indexes of the rules it filters for; rules without one scan every line
        self._by_literal: dict[str, list[int]] = {}
        self._scan_all: list[int] = []
        for i, c in enumerate(self._rules):
            lits = required_literals(c.rx)
            if lits is None:
                self._scan_all.append(i)
            for lit in lits or ():
                self._by_literal.setdefault(lit, []).append(i)

    @property
    def rules(self) -> tuple[LogRule, ...]:
        return tuple(c.rule for c in self._rules)

    def reset(self) -> None:
        """Forget counts, quiet periods and context (e.g. for a new attempt)."""
        self._tail = []
        for c in self._rules:
            c.hits.clear()
            c.quiet_until = -math.inf

    def feed(self, lines: Sequence[str], now: float) -> list[LogMatch]:
        """Scan ``lines`` (all seen at ``now``); the rules that fired, in line order."""
        if not lines:
            return []
        out: list[LogMatch] = []
        for i, r in self._candidates(lines):
            c = self._rules[r]
            m = c.rx.search(lines[i])
            if m is not None and (fired := self._count(c, lines, i, m.start(), now)):
                out.append(fired)
        keep = self._context
        if keep:
            self._tail = (self._tail + [_clip(x) for x in lines[-keep:]])[-keep:]
        return out

    def _candidates(self, lines: Sequence[str]) -> list[tuple[int, int]]:
        """(line index, rule index) pairs worth a regex search, sorted."""
        pairs: set[tuple[int, int]] = set()
        blob = "\n".join(lines)
        starts: list[int] | None = None
        for lit, rule_ids in self._by_literal.items():
            pos = blob.find(lit)
            if pos < 0:
                continue
            if starts is None:  # line i starts at starts[i]; built only when something hit
                starts = [0, *accumulate(len(x) + 1 for x in lines)]
            while pos >= 0:
                i = bisect_right(starts, pos) - 1
                pairs.update((i, r) for r in rule_ids)
                pos = blob.find(lit, starts[i + 1]) if i + 1 < len(lines) else -1
        for r in self._scan_all:
            rx = self._rules[r].rx
            pairs.update((i, r) for i, x in enumerate(lines) if rx.search(x))
        return sorted(pairs)

    def _count(self, c: _Compiled, lines: Sequence[str], i: int, at: int,
               now: float) -> LogMatch | None:
        if now < c.quiet_until:  # fired already for this window: the same incident
            return None
        rule = c.rule
        for key in [k for k, t in c.hits.items() if now - t >= rule.window]:
            del c.hits[key]
        key = _clip(lines[i])
        if key in c.hits:  # the same line again within the window counts once
            return None
        c.hits[key] = now
        if len(c.hits) < rule.count:
            return None
        n = len(c.hits)
        c.hits.clear()
        c.quiet_until = now + rule.window
        k = self._context
        before = (self._tail + [_clip(x) for x in lines[max(0, i - k):i]])[-k:] if k else []
        after = [_clip(x) for x in lines[i + 1:i + 1 + k]]
        return LogMatch(rule.name, rule.kind, rule.action, _clip(lines[i], at),
                        tuple(before), tuple(after), now, n)
