"""What verifying a checkpoint costs (trainwatch.state.manifest / verifier).

How (a 1 GiB checkpoint folder of 8 files of 128 MiB of random bytes under
``--dir``, default /tmp; removed at the end; disk use 1 GiB):

(a) hashing cost per GB, for each hash installed (sha256 always, xxh3_128 with
    the ``xxhash`` package): ``manifest.make()`` of the folder, ``--n`` rounds
    (default 5), cold and warm page cache. Cold: each file is fsynced and
    dropped from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``
    before each round; ``fincore`` (util-linux), where installed, checks that
    none of it stayed resident.
(b) the time a relaunch waits: ``Verifier.verify()`` of the checkpoint with its
    manifest already made (a check: every file hashed again) and without one
    (made now, fsynced to the store), cold and warm, with the default hash.
(c) what the background worker costs the supervisor's thread: while it hashes
    the (warm) checkpoint, the main thread sleeps 1 ms at a time; how late it
    wakes (the GIL: a hash that does not release it shows here).

Run: ``.venv/bin/python benchmarks/bench_verify.py [--n 5] [--dir /var/lib/x]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_summary, machine, machine_line, summarize, write_json
from trainwatch.state import manifest
from trainwatch.state.manifest import Store, make
from trainwatch.state.verifier import Verifier

MIB = 1 << 20
FILES, FILE_SIZE = 8, 128 * MIB
TOTAL = FILES * FILE_SIZE
GB = 1e9


def write_checkpoint(d: Path) -> list[Path]:
    d.mkdir()
    paths = []
    for i in range(FILES):
        p = d / f"shard_{i}.bin"
        with open(p, "wb") as f:
            for _ in range(FILE_SIZE // (16 * MIB)):
                f.write(os.urandom(16 * MIB))
            f.flush()
            os.fsync(f.fileno())
        paths.append(p)
    return paths


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(paths: list[Path]) -> int | None:
    """Bytes of ``paths`` in the page cache (fincore), None without fincore."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES",
                          *map(str, paths)], capture_output=True, text=True, check=True)
    return sum(int(x) for x in out.stdout.split())


def warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(16 * MIB):
                pass


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(machine_line())
    print(f"hashes installed: {', '.join(manifest.ALGOS)} (default {manifest.DEFAULT_ALGO})")
    root = Path(tempfile.mkdtemp(prefix="twverify", dir=args.dir))
    results: dict[str, Any] = {"machine": machine(), "bytes": TOTAL}
    try:
        ck = root / "step_1000"
        paths = write_checkpoint(ck)
        drop_cache(paths)
        left = resident(paths)
        print(f"checkpoint: {FILES} files, {TOTAL / GB:.3f} GB; resident after "
              f"posix_fadvise(DONTNEED): {'? (no fincore)' if left is None else left} bytes")
        results["resident_after_drop"] = left

        print("\n(a) manifest.make() of the checkpoint, GB/s (higher is better)")
        for algo in manifest.ALGOS:
            for cache in ("cold", "warm"):
                secs = []
                for _ in range(args.n):
                    if cache == "cold":
                        drop_cache(paths)
                    else:
                        warm(paths)
                    secs.append(timed(lambda a=algo: make(1000, str(ck), algo=a)))
                s = summarize([TOTAL / GB / x for x in secs])
                results[f"make_{algo}_{cache}_gbps"] = s.as_dict()
                print(f"  {algo:9s} {cache}: {fmt_summary(s, 'GB/s')}; "
                      f"{min(secs) / (TOTAL / GB):.3f}-{max(secs) / (TOTAL / GB):.3f} s/GB")

        print(f"\n(b) Verifier.verify() of the 1 GB checkpoint ({manifest.DEFAULT_ALGO}): "
              "the time a relaunch waits, s")
        store = Store(root / "state" / "manifests")
        v = Verifier(store)
        try:
            for have in ("with manifest (check)", "without manifest (make)"):
                for cache in ("cold", "warm"):
                    secs = []
                    for _ in range(args.n):
                        if have.startswith("without"):
                            store.drop(1000)
                        elif store.get(1000) is None:
                            v.verify(1000, str(ck), 600)
                        if cache == "cold":
                            drop_cache(paths)
                        else:
                            warm(paths)
                        t0 = time.perf_counter()
                        ok, why = v.verify(1000, str(ck), 600)
                        secs.append(time.perf_counter() - t0)
                        assert ok, why
                    s = summarize(secs)
                    results[f"verify_{have.split()[0]}_{cache}_s"] = s.as_dict()
                    print(f"  {have:24s} {cache}: {fmt_summary(s, 's')}")

            print("\n(c) main thread's 1 ms sleeps while the worker hashes (warm), lateness ms")
            late = []
            for _ in range(args.n):
                store.drop(1000)
                warm(paths)
                made = v.counts()["made"]
                v.submit(1000, str(ck))
                while v.counts()["made"] == made:
                    t0 = time.perf_counter()
                    time.sleep(0.001)
                    late.append((time.perf_counter() - t0 - 0.001) * 1000)
            s = summarize(late)
            results["loop_lateness_ms"] = s.as_dict()
            print(f"  {fmt_summary(s, 'ms')}")
        finally:
            v.close()
        quiet = []
        for _ in range(2000):
            t0 = time.perf_counter()
            time.sleep(0.001)
            quiet.append((time.perf_counter() - t0 - 0.001) * 1000)
        s = summarize(quiet)
        results["loop_lateness_idle_ms"] = s.as_dict()
        print(f"  (baseline, no hashing: {fmt_summary(s, 'ms')})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
