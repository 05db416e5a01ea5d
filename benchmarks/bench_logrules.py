"""Log-rule scanning throughput (``trainwatch.detectors.logrules``): lines per second
through ``Matcher.feed`` with every built-in rule on, on one core.

The stream: mostly ordinary training output (metrics dicts, tqdm bars, NCCL INFO
lines, torchrun chatter, long lines of 200-2,000 characters, lines with U+FFFD
from a lossy decode), with one real-format fatal line per ``--match-every`` lines
(default 10,000), fed in batches of ``--batch`` lines (default 1,000, about what a
follower reads per wake-up from a chatty job). Each run uses a fresh matcher; the
figure is the median over ``--runs`` runs.

Goal (issue 12): >= 200,000 lines/s per core. Run:
``.venv/bin/python benchmarks/bench_logrules.py``.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_logrules import ORDINARY, REAL_LINES  # the tests' real-format lines
from trainwatch.detectors.logrules import BUILTIN, compile_rules


def make_stream(n: int, match_every: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pool = [x for x in ORDINARY if x]
    lines: list[str] = []
    for i in range(n):
        if match_every and i % match_every == match_every - 1:
            lines.append(REAL_LINES[rng.randrange(len(REAL_LINES))][2])
        elif i % 50 == 0:  # a long line: a dumped config, a tokenizer warning
            lines.append("config: " + ", ".join(f"k{j}={rng.random():.6f}"
                                                for j in range(rng.randrange(15, 150))))
        else:
            step = i // 7
            line = rng.choice(pool)
            lines.append(f"[{step:07d}] {line}" if rng.random() < 0.5 else line)
    return lines


def run_once(lines: list[str], batch: int) -> tuple[float, int]:
    m = compile_rules(BUILTIN)
    fired = 0
    t0 = time.perf_counter()
    now = 0.0
    for i in range(0, len(lines), batch):
        now += 1.0
        fired += len(m.feed(lines[i:i + batch], now))
    return time.perf_counter() - t0, fired


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--match-every", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    lines = make_stream(a.lines, a.match_every, a.seed)
    avg_len = sum(map(len, lines)) / len(lines)
    print(f"machine: {platform.machine()} {platform.processor() or ''} python "
          f"{platform.python_version()}; rules: {len(BUILTIN)} built-in")
    print(f"stream: {len(lines)} lines, mean {avg_len:.0f} chars, batch {a.batch}, "
          f"a fatal line every {a.match_every}")
    rates = []
    for _ in range(a.runs):
        secs, fired = run_once(lines, a.batch)
        rates.append(len(lines) / secs)
    print(f"fired: {fired} per run")
    print(f"lines/s: median {statistics.median(rates):,.0f}  min {min(rates):,.0f}  "
          f"max {max(rates):,.0f}  ({a.runs} runs)")


if __name__ == "__main__":
    main()
