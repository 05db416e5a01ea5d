"""What a host's shared checkpoint claims cost (multihost/known.py): the bound
between a report reaching one host and every other host being able to read it.

A host writes its claims (``share_in_hand``) in its job's quick hand at each new
report, and a deciding host reads every other host's (``others_in_hand``) before
it decides. Both run here in a warm hand as this user (``Hand.call``, as the
daemon calls them), ``--n`` times each on a fresh folder, with ``--hosts`` other
hosts' files present, 16 claims each; medians and p90 printed, in ms.

    .venv/bin/python benchmarks/bench_known.py [--n 200] [--hosts 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from trainwatch.multihost import known
from trainwatch.privsep.hand import Hand


def _ms(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"median {statistics.median(xs) * 1e3:.2f} ms, p90 {xs[int(len(xs) * 0.9)] * 1e3:.2f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--hosts", type=int, default=64)
    args = ap.parse_args()
    claims = {str(s): f"/ckpt/step_{s}" for s in range(10, 170, 10)}
    with tempfile.TemporaryDirectory() as root:
        for h in range(args.hosts):
            known.share_in_hand(root, f"h{h}", claims)
        hand = Hand("bench known", None)
        hand.call(known.others_in_hand, root, "me", timeout=10)  # warm, as the daemon's
        share, read = [], []
        for _ in range(args.n):
            t = time.perf_counter()
            hand.call(known.share_in_hand, root, "me", claims, timeout=10)
            share.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = hand.call(known.others_in_hand, root, "me", timeout=10)
            read.append(time.perf_counter() - t)
        assert len(got) == args.hosts, len(got)
        hand.close()
    print(f"share (one host's 16 claims, written and fsynced, in the hand): {_ms(share)}")
    print(f"read ({args.hosts} other hosts' files, in the hand): {_ms(read)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
