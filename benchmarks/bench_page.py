"""Size and render time of an incident page (``trainwatch incidents --show N
--html FILE``; trainwatch.evidence.page) for a heavy incident: a nan_loss
rollback whose lead rank's series.json holds 10,000 steps of loss and grad
norm, with the stacks of 64 ranks kept (py-spy-shaped dumps, 3 threads and ~25
frames each: 61 ranks in one all-reduce, 2 in the data loader, 1 stopped), 256
checkpoints in the catalog and a 50-line log tail. The incident is recorded
through the real ledger (state/ledger.py), the stacks' verdict by
detectors/stacks.py, as a run would.

Figures: the page's bytes; the time to make it in Python (median of
``--runs``); and the time to render it in Debian's chromium, headless: a script
put before the page's Content-Security-Policy records, at the load event and
after forcing layout, ``performance.now()`` (ms since navigation began) into
the DOM, which ``--dump-dom`` reads back; one fresh browser per run, median of
``--runs``; beside it the same for a blank page (what any page costs).

Goal (issue 24): <= 300 KB and <= 1 s in the browser. Run:
``.venv/bin/python benchmarks/bench_page.py`` (``--keep`` keeps the page).
"""

from __future__ import annotations

import argparse
import html
import math
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from _common import machine_line, scratch_dir
from trainwatch.detectors.stacks import verdict
from trainwatch.evidence import page
from trainwatch.evidence.capture import SUMMARY
from trainwatch.evidence.show import folder
from trainwatch.state.atomic import write_json
from trainwatch.state.ledger import Ledger, Relaunch
from trainwatch.types import Fault, FaultKind, JobState

JOB = "llama-pretrain"
STEPS = 10_000
RANKS = 64
ONSET = 9_400
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--hide-scrollbars", "--window-size=1280,900",
         "--host-resolver-rules=MAP * ~NOTFOUND"]
TIMER = ('<script>addEventListener("load", () => { document.body.offsetHeight; '
         'document.documentElement.setAttribute("data-bench", String(performance.now())); '
         "});</script>")


def _frame(name: str, file: str, line: int) -> dict[str, Any]:
    return {"name": name, "filename": f"/opt/venv/lib/python3.11/site-packages/{file}",
            "short_filename": file, "line": line, "module": None, "locals": None}


_TRAIN = [("_engine_run_backward", "torch/autograd/graph.py", 825),
          ("backward", "torch/autograd/__init__.py", 289),
          ("backward", "torch/_tensor.py", 581),
          ("training_step", "train.py", 412), ("fit", "train.py", 530),
          ("main", "train.py", 611), ("<module>", "train.py", 640)]
_ALLREDUCE = [("wait", "torch/distributed/distributed_c10d.py", 2520),
              ("all_reduce", "torch/distributed/distributed_c10d.py", 2501),
              ("wrapper", "torch/distributed/c10d_logger.py", 83),
              ("_allreduce_fut", "torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py",
               27), ("allreduce_hook",
                     "torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py", 60),
              *(("_call_impl", "torch/nn/modules/module.py", 1747 + i) for i in range(10)),
              *_TRAIN]
_LOADER = [("recv_bytes", "multiprocessing/connection.py", 216), ("get", "queue.py", 180),
           ("_try_get_data", "torch/utils/data/dataloader.py", 1133),
           ("_next_data", "torch/utils/data/dataloader.py", 1295),
           ("__next__", "torch/utils/data/dataloader.py", 701), ("fit", "train.py", 521),
           ("main", "train.py", 611), ("<module>", "train.py", 640)]
_STOPPED = [("forward", "model.py", 88), ("_call_impl", "torch/nn/modules/module.py", 1747),
            ("training_step", "train.py", 405), ("fit", "train.py", 530),
            ("main", "train.py", 611), ("<module>", "train.py", 640)]


def _dump(rank: int) -> list[dict[str, Any]]:
    main = _STOPPED if rank == 37 else _LOADER if rank in (12, 50) else _ALLREDUCE
    threads = [("MainThread", main), ("pin_memory", [("wait", "threading.py", 355)]),
               ("Thread-2 (_serve)", [("select", "selectors.py", 415)])]
    return [{"pid": 40_000 + rank, "thread_id": i, "thread_name": n, "os_thread_id": 40_000 + rank
             + i, "active": False, "owns_gil": False,
             "frames": [_frame(*f) for f in fs]} for i, (n, fs) in enumerate(threads)]


def make_state(root: Path) -> tuple[str, dict[str, Any]]:
    """A state dir with one such incident, recorded as a run records it; its row."""
    state = root / "state"
    ledger = Ledger(state)
    t0 = time.time() - 0.8  # the onset; detected now, 0.8 s later
    ledger.transition(JOB, 0, None, JobState.STARTING, "start: attempt 0, pid 4000, fresh, "
                      "GPUs 0,1,2,3,4,5,6,7")
    ledger.transition(JOB, 0, JobState.STARTING, JobState.RUNNING,
                      "first heartbeat (rank 0, step 1)")
    fault = Fault(FaultKind.NAN_LOSS, JOB, t0, {"noticed_step": ONSET + 2, "series": "loss",
                                                "level": "act"}, rank=0, onset_step=ONSET)
    inc = ledger.incident(fault, "rollback", "restart 1 of 10 within 86400s", 0, 0.8,
                          backoff=10.0)
    ledger.amend(inc, {"rollback": {
        "window": [ONSET - 10, ONSET + 12], "widening": 0, "max_widenings": 3,
        "previous_window": None, "resume_before": ONSET - 60, "resume_step": ONSET - 100,
        "quarantined": list(range(ONSET - 50, STEPS, 50)),
        "quarantined_count": len(range(ONSET - 50, STEPS, 50)), "skip": "exact",
        "skip_why": "each batch is drawn from (seed, step)", "budget": "charged"}}, None)
    for old, new, why in ((JobState.RUNNING, JobState.STOPPING, "nan_loss: restart 1 of 10"),
                          (JobState.STOPPING, JobState.BACKOFF, "relaunch in 10s")):
        ledger.transition(JOB, 0, old, new, why)
    ledger.transition(JOB, 1, JobState.BACKOFF, JobState.STARTING,
                      f"relaunch: attempt 1, pid 4100, from /ckpt/step_{ONSET - 100} "
                      f"(step {ONSET - 100}), GPUs 0,1,2,3,4,5,6,7")
    ledger.relaunched(inc, Relaunch(time.time(), f"/ckpt/step_{ONSET - 100}", ONSET - 100, 102))
    ledger.transition(JOB, 1, JobState.STARTING, JobState.RUNNING,
                      f"first heartbeat (rank 0, step {ONSET - 99})")
    ledger.close()
    where = folder(str(state), JOB, inc)
    steps = list(range(1, STEPS + 1))
    loss = [("nan" if ONSET <= s <= ONSET + 2 else 9.0 / math.sqrt(s) + 0.05 * math.sin(s))
            for s in steps]
    grad = [1e6 if s == ONSET - 1 else 0.8 + 0.3 * abs(math.sin(s / 7)) for s in steps]
    write_json(where / "series.json", {"rank": 0, "onset_step": ONSET,
                                       "noticed_step": ONSET + 2, "steps": steps,
                                       "loss": loss, "grad_norm": grad})
    dumps = {r: _dump(r) for r in range(RANKS)}
    for r, d in dumps.items():
        write_json(where / "stacks" / f"rank{r}.json", d)
    states = {r: "T" if r == 37 else "S" for r in range(RANKS)}
    write_json(where / SUMMARY, {
        "version": 1, "time": t0 + 0.81, "seconds": 1.8, "errors": [], "deadline_hit": False,
        "targets": [{"pid": 40_000 + r, "rank": r, "file": f"rank{r}", "state": states[r],
                     "cpu_seconds": 812.4 + r, "py_spy": {"ok": True, "mode": "nonblocking"}}
                    for r in range(RANKS)],
        "verdict": verdict(dumps, states, 37).as_dict()})
    (where / "log-tail.txt").write_text("".join(
        f"[rank{r % 8}]: step {ONSET - 50 + r} loss {9 / math.sqrt(ONSET):.4f} "
        f"lr 3.0e-4 tokens/s 812345\n" for r in range(50)))
    write_json(state / "jobs" / JOB / "catalog.json", {
        "owner": "/ckpt|step_{step}",
        "reported": {str(s): f"/ckpt/step_{s}" for s in range(STEPS - 256 * 10, STEPS, 10)},
        "bad": {str(s): f"quarantined: nan_loss from step {ONSET}"
                for s in range(ONSET - 50, STEPS, 50)},
        "health": {}, "used": {str(ONSET - 100): [1]}})
    row = next(r for r in Ledger(str(state), readonly=True).incidents() if r["id"] == inc)
    return str(state), row


def chromium_ms(path: Path, work: Path) -> float:
    """ms from navigation start to the load event with layout done, in a fresh chromium."""
    out = subprocess.run(["chromium", *FLAGS, f"--user-data-dir={work / 'profile'}",
                          "--dump-dom", path.as_uri()], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    start = out.index('data-bench="') + len('data-bench="')
    return float(html.unescape(out[start:out.index('"', start)]))


def timed_copy(text: str, dest: Path) -> Path:
    """The page with the timer ahead of its CSP (which forbids every later script)."""
    dest.write_text(text.replace("<head>", "<head>" + TIMER, 1))
    return dest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--keep", action="store_true", help="keep the scratch dir (and the page)")
    a = p.parse_args()
    root = scratch_dir("twbpage")
    try:
        state, row = make_state(root)
        made = []
        for _ in range(a.runs):
            t = time.perf_counter()
            text = page.incident_page(state, row)
            made.append((time.perf_counter() - t) * 1000)
        (root / "incident.html").write_text(text)
        size = len(text.encode())
        print(machine_line())
        print(f"incident page: {STEPS} steps of loss and grad norm, {RANKS} ranks' stacks")
        print(f"  size: {size} bytes ({size / 1024:.1f} KiB; goal <= 300 KB)")
        print(f"  made in Python: median {statistics.median(made):.1f} ms "
              f"(min {min(made):.1f}, max {max(made):.1f}, n={len(made)})")
        if shutil.which("chromium") is None:
            print("  in the browser: chromium is not installed (apt-get install chromium)")
            return 0
        page_copy = timed_copy(text, root / "timed.html")
        blank = timed_copy("<!DOCTYPE html><html><head><title>blank</title></head>"
                           "<body><p>blank</p></body></html>", root / "blank.html")
        chromium_ms(page_copy, root)  # warm the disk cache and the profile
        rendered, empty = [], []
        for _ in range(a.runs):
            rendered.append(chromium_ms(page_copy, root))
            empty.append(chromium_ms(blank, root))
        print(f"  load + layout in chromium: median {statistics.median(rendered):.0f} ms "
              f"(min {min(rendered):.0f}, max {max(rendered):.0f}, n={len(rendered)}; "
              f"goal <= 1000 ms)")
        print(f"  a blank page, the same way: median {statistics.median(empty):.0f} ms")
        version = subprocess.run(["chromium", "--version"], capture_output=True, text=True,
                                 check=False).stdout.strip()
        print(f"  browser: {version}")
        if a.keep:
            print(f"  kept: {root}")
        return 0
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
