"""Job-log rules (trainwatch.detectors.logrules): the built-in rules on real-format lines,
count/window semantics, validation and evidence."""

from __future__ import annotations

import pytest
from trainwatch.detectors.logrules import (
    BUILTIN,
    EVIDENCE_CHARS,
    LogMatch,
    LogRule,
    compile_rules,
)
from trainwatch.types import Action, FaultKind

# Real-format lines (shared/prior-art/stalls-and-log-lines.md), one or more per built-in rule.
REAL_LINES: list[tuple[str, str, str]] = [
    ("nccl_watchdog_timeout", "nccl_stall",
     "[rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught "
     "collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, "
     "NumelOut=466119168, Timeout(ms)=600000) ran for 600060 milliseconds before timing out."),
    ("nccl_watchdog_timeout", "nccl_stall",
     "[E ProcessGroupNCCL.cpp:475] [Rank 3] Watchdog caught collective operation timeout: "
     "WorkNCCL(SeqNum=96120, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1800702 milliseconds "
     "before timing out."),
    ("nccl_operations_failed", "nccl_stall",
     "[rank0]:[E321 02:08:08.613467211 ProcessGroupNCCL.cpp:630] [Rank 0] Some NCCL operations "
     "have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU "
     "operations might run on corrupted/incomplete data."),
    ("nccl_heartbeat_monitor", "nccl_stall",
     "[rank1]:[E216 10:11:12.000000000 ProcessGroupNCCL.cpp:1375] [PG 0 Rank 1] Heartbeat monitor "
     "timed out! Process will be terminated after dumping debug info. workMetaList_.size()=1"),
    ("nccl_heartbeat_monitor", "nccl_stall",
     "[rank1]:[F1124 10:11:12.000000000 ProcessGroupNCCL.cpp:1614] [PG ID 0 PG GUID 0(default_pg) "
     "Rank 1] ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress in "
     "monitoring enqueued collectives. This typically indicates a NCCL/CUDA API (e.g., "
     "CudaEventDestroy) hang blocking the watchdog, ..."),
    ("nccl_error", "crash",
     "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
     "ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for details), "
     "NCCL version 2.21.5"),
    ("nccl_unhandled_cuda_error", "crash", "ncclUnhandledCudaError: Call to CUDA function failed."),
    ("nccl_system_error", "crash",
     "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or "
     "device error. "),
    ("nccl_internal_error", "crash", "ncclInternalError: Internal check failed."),
    ("nccl_remote_error", "crash",
     "[2026-06-11 10:02:03] node-1:1234:1290 [0] misc/socket.cc:50 (socketProgress) NCCL WARN "
     "socketProgress: Connection closed by remote peer node-2<38431>"),
    ("nccl_remote_error", "crash",
     "node-1:1234:1301 [0] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer "
     "10.0.0.2<51234> with error 5, opcode 0, len 1, vendor err 244"),
    ("nccl_remote_error", "crash",
     "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
     "prematurely."),
    ("cuda_illegal_memory_access", "crash",
     "RuntimeError: CUDA error: an illegal memory access was encountered"),
    ("cuda_illegal_memory_access", "crash",
     "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"),
    ("cuda_ecc_uncorrectable", "gpu_ecc",
     "RuntimeError: CUDA error: uncorrectable ECC error encountered"),
    ("cuda_oom", "oom",
     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
     "capacity of 79.10 GiB of which 1.06 GiB is free. Of the allocated memory 75.2 GiB is "
     "allocated by PyTorch, and 1.3 GiB is reserved by PyTorch but unallocated."),
    ("cuda_oom", "oom",
     "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 "
     "GiB total capacity; 14.56 GiB already allocated; 3.75 MiB free; 14.63 GiB reserved in total "
     "by PyTorch)"),
    ("torchrun_child_failed", "crash",
     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "),
    ("torchrun_child_failed", "crash", "Root Cause (first observed failure):"),
    ("elastic_rendezvous_timeout", "crash",
     "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError"),
]

# Ordinary output of a training job: none of it may fire.
ORDINARY = [
    "{'loss': 2.3411, 'grad_norm': 1.2345, 'learning_rate': 4.9e-05, 'epoch': 0.12}",
    "  3%|\u258e         | 120/4000 [00:45<24:10,  2.67it/s]",
    "Epoch 0:  10%|\u2588         | 100/1000 [00:10<01:30, 9.87it/s, v_num=0, train_loss=2.310]",
    "step 1200 | loss 2.3101 | lr 3.0e-04 | tokens/s 123456 | mfu 41.2% | mem 70.1/80.0 GiB",
    "node-1:1234:1234 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>",
    "node-1:1234:1290 [0] NCCL INFO comm 0x5581f0 rank 0 nranks 2 cudaDev 0 busId 1000 - Init "
    "COMPLETE",
    "node-1:1234:1290 [0] NCCL INFO Channel 00/02 :    0   1",
    "W1124 10:00:00.000000 123 torch/distributed/run.py:793] Setting OMP_NUM_THREADS environment "
    "variable for each process to be 1 in default, to avoid your system being overloaded",
    "INFO:torch.distributed.elastic.agent.server.api:[default] Rendezvous complete for workers. "
    "Result:",
    "[rank0]:[I1124 10:00:01.000 ProcessGroupNCCL.cpp:900] [PG ID 0 PG GUID 0(default_pg) Rank 0] "
    "ProcessGroupNCCL initialization options: size: 2, global rank: 0, TIMEOUT(ms): 600000",
    "Saving model checkpoint to /data/llama/ckpt/checkpoint-1000",
    "torch.cuda.max_memory_allocated: 71.3 GiB; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    "env: NCCL_DEBUG=WARN TORCH_NCCL_ASYNC_ERROR_HANDLING=1 TORCH_NCCL_TRACE_BUFFER_SIZE=2000",
    "evaluation: accuracy 0.812, memory use stable, no errors",
    "bad bytes \ufffd\ufffd in a decoded line",
    "",
]


def _line(rule: str) -> str:
    """The first real-format line of ``rule``."""
    return next(line for r, _k, line in REAL_LINES if r == rule)


@pytest.mark.parametrize(("rule", "kind", "line"), REAL_LINES,
                         ids=[f"{r}-{i}" for i, (r, _k, _l) in enumerate(REAL_LINES)])
def test_builtin_rule_matches_its_real_line(rule: str, kind: str, line: str) -> None:
    """Each real-format line fires its built-in rule, with the rule's kind, amid ordinary output."""
    fired = compile_rules(BUILTIN).feed([*ORDINARY[:5], line, *ORDINARY[5:]], now=100.0)
    assert (rule, kind) in [(m.rule, m.kind) for m in fired]
    assert all(m.line == line for m in fired)


def test_every_builtin_rule_has_a_real_line() -> None:
    """The table above covers every built-in rule, and every kind is a FaultKind value."""
    assert {r.name for r in BUILTIN} == {r for r, _k, _l in REAL_LINES}
    assert {r.kind for r in BUILTIN} <= {k.value for k in FaultKind}


def test_oom_is_its_own_kind() -> None:
    """A CUDA OOM is kind "oom" (its action, stop by default, is the policy's), not a crash."""
    fired = compile_rules(BUILTIN).feed([_line("cuda_oom")], now=0.0)
    assert [(m.rule, m.kind, m.action) for m in fired] == [("cuda_oom", "oom", None)]


def test_ordinary_training_output_does_not_fire() -> None:
    """Progress bars, metrics, NCCL INFO lines and torchrun's start-up chatter match no rule."""
    m = compile_rules(BUILTIN)
    assert m.feed(ORDINARY * 50, now=0.0) == []
    assert all(m.feed([line], now=float(i)) == [] for i, line in enumerate(ORDINARY))


def test_count_within_window_fires_on_the_nth_distinct_line() -> None:
    """count=3, window=10: three distinct matching lines within 10 s fire once, on the third."""
    m = compile_rules([LogRule("retry", r"retrying collective", "log_pattern", count=3,
                               window=10.0)])
    assert m.feed(["rank 0: retrying collective"], now=0.0) == []
    assert m.feed(["rank 1: retrying collective"], now=4.0) == []
    fired = m.feed(["rank 2: retrying collective"], now=9.0)
    assert [(f.rule, f.count, f.at, f.line) for f in fired] == [
        ("retry", 3, 9.0, "rank 2: retrying collective")]


def test_matches_older_than_the_window_expire() -> None:
    """Hits more than `window` seconds old no longer count towards `count`."""
    m = compile_rules([LogRule("retry", r"retrying", "log_pattern", count=2, window=10.0)])
    assert m.feed(["a retrying"], now=0.0) == []
    assert m.feed(["b retrying"], now=10.0) == []  # "a" is 10 s old: out of the window
    assert len(m.feed(["c retrying"], now=15.0)) == 1  # "b" and "c" within 10 s


def test_repeated_identical_line_counts_once() -> None:
    """The same line printed again within the window is one hit, not several."""
    m = compile_rules([LogRule("retry", r"retrying", "log_pattern", count=2, window=60.0)])
    assert m.feed(["rank 0 retrying"] * 5, now=0.0) == []
    assert m.feed(["rank 0 retrying"], now=30.0) == []
    assert len(m.feed(["rank 1 retrying"], now=31.0)) == 1


def test_fired_rule_stays_quiet_for_its_window() -> None:
    """After firing, a rule does not fire again until its window has passed, then counts afresh."""
    m = compile_rules([LogRule("oom", r"CUDA out of memory", "oom", window=60.0)])
    assert len(m.feed([f"rank {r}: CUDA out of memory." for r in range(8)], now=0.0)) == 1
    assert m.feed(["rank 9: CUDA out of memory."], now=59.0) == []
    assert len(m.feed(["rank 9: CUDA out of memory."], now=60.0)) == 1


def test_several_occurrences_in_one_batch_are_all_found() -> None:
    """Every line holding a rule's literal is checked, not only the first in the batch."""
    m = compile_rules([LogRule("two", r"ncclSystemError", "crash", count=2)])
    lines = ["x", "rank 0 ncclSystemError: a", "y", "rank 1 ncclSystemError: b", "z"]
    fired = m.feed(lines, now=0.0)
    assert [f.line for f in fired] == ["rank 1 ncclSystemError: b"]


def test_rules_fire_in_line_order() -> None:
    """Matches of different rules come back in the order of their lines."""
    lines = [_line("nccl_internal_error"), "ordinary", _line("nccl_watchdog_timeout")]
    assert [f.rule for f in compile_rules(BUILTIN).feed(lines, now=0.0)] == [
        "nccl_internal_error", "nccl_watchdog_timeout"]


def test_rule_without_a_literal_scans_every_line() -> None:
    """A case-insensitive rule (no literal prefilter) still matches: the slow path works."""
    m = compile_rules([LogRule("disk", r"(?i)no space left", "log_pattern")])
    assert [f.rule for f in m.feed(["ok", "OSError: [Errno 28] No Space Left on device"],
                                   now=0.0)] == ["disk"]


def test_explicit_action_is_carried() -> None:
    """A rule's own action travels with its match; None leaves the choice to the policy."""
    m = compile_rules([LogRule("requeue", r"preempted", "log_pattern", action="exec")])
    assert [f.action for f in m.feed(["job preempted by slurm"], now=0.0)] == [Action.EXEC.value]


@pytest.mark.parametrize(("rule", "message"), [
    (LogRule("my-rule", r"(unclosed", "log_pattern"), "rule my-rule: bad regex"),
    (LogRule("k", r"x", "meltdown"), "rule k: unknown kind 'meltdown'"),
    (LogRule("a", r"x", "crash", action="reboot"), "rule a: unknown action 'reboot'"),
    (LogRule("c", r"x", "crash", count=0), "rule c: count must be an integer >= 1"),
    (LogRule("w", r"x", "crash", window=0.0), "rule w: window must be"),
    (LogRule("e", r"", "crash"), "rule e: pattern must be a non-empty regex"),
    (LogRule("bad name", r"x", "crash"), "rule 'bad name': bad name"),
])
def test_invalid_rule_is_a_value_error_naming_it(rule: LogRule, message: str) -> None:
    """A bad regex, kind, action, count, window, pattern or name: ValueError naming the rule."""
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        compile_rules([rule])


def test_duplicate_rule_name_is_refused() -> None:
    """Two rules with one name would make incidents ambiguous: ValueError naming it."""
    with pytest.raises(ValueError, match=r"^rule x: defined twice"):
        compile_rules([LogRule("x", "a", "crash"), LogRule("x", "b", "crash")])


def test_evidence_has_lines_before_across_batches_and_after_in_the_batch() -> None:
    """`before` reaches into earlier batches; `after` holds the rest of the same batch."""
    m = compile_rules(BUILTIN, context=3)
    m.feed(["old 1", "old 2", "old 3", "old 4"], now=0.0)
    summary = [
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
        "train.py FAILED",
        "------------------------------------------------------------",
        "Failures:",
    ]
    fired = m.feed(["new 1", *summary], now=1.0)
    assert fired == [LogMatch(
        rule="torchrun_child_failed", kind="crash", action=None, line=summary[0],
        before=("old 3", "old 4", "new 1"), after=tuple(summary[1:4]), at=1.0, count=1)]


def test_long_lines_are_clipped_around_the_match() -> None:
    """A huge line is kept as EVIDENCE_CHARS characters that still show the matched text."""
    line = "x" * 100_000 + " CUDA error: an illegal memory access was encountered " + "y" * 100_000
    fired = compile_rules(BUILTIN).feed(["a" * 10_000, line], now=0.0)
    assert len(fired) == 1
    assert len(fired[0].line) == EVIDENCE_CHARS
    assert "an illegal memory access was encountered" in fired[0].line
    assert fired[0].before == ("a" * EVIDENCE_CHARS,)


def test_reset_forgets_counts_and_quiet_periods() -> None:
    """After reset (a new attempt) a rule that just fired can fire again at once."""
    m = compile_rules(BUILTIN)
    assert len(m.feed([_line("nccl_watchdog_timeout")], now=0.0)) == 1
    assert m.feed([_line("nccl_watchdog_timeout")], now=1.0) == []
    m.reset()
    assert len(m.feed([_line("nccl_watchdog_timeout")], now=2.0)) == 1
