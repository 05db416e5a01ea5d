"""Rollback past a loss anomaly, end to end with a real trainer (torch on CPU)
under a real `trainwatch run`: its learning rate is blown up at a known step,
the loss goes non-finite, and trainwatch relaunches it from a checkpoint from
before the onset, with the newer checkpoints quarantined (still on disk) and
the anomalous steps' data skipped; the job then trains to its end. One
anomaly that comes back widens its skip window and spends one restart of the
budget, however often; each rollback is recorded with its incident."""

from __future__ import annotations

import json
import random
import socket
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from conftest import Workspace, finish, free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families
from trainwatch import client
from trainwatch.actions import rollback
from trainwatch.config import Backoff, Policy, Rollback
from trainwatch.lifecycle.policy import RestartHistory, decide
from trainwatch.sources.heartbeat import parse
from trainwatch.types import DataOrder, Fault, FaultKind

# A linear model fit by SGD; a checkpoint (and its report) after every step.
# On attempt 0 the update of step BLOW uses a learning rate of 1e30: the
# checkpoint of that step holds the ruined weights, and the loss of the next
# step is inf. Every attempt journals where it resumed and what it was told
# to skip.
_TRAINER = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from trainwatch import client
    ckpt, journal, steps, blow = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    attempt = int(os.environ["TRAINWATCH_ATTEMPT"])
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    w = torch.zeros(4, requires_grad=True)
    start = 0
    if client.resume_from():
        state = torch.load(client.resume_from())
        w.data.copy_(state["w"])
        start = state["step"]
    skip = client.skip_steps()
    with open(journal, "a") as f:
        f.write(json.dumps({"attempt": attempt, "start": start, "skip": skip}) + "\\n")
    hb = client.connect()
    for step in range(start + 1, steps + 1):
        if skip and skip[0] <= step <= skip[1]:
            continue  # this step's data is skipped
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()
        lr = 1e30 if attempt == 0 and step == blow else 0.05
        with torch.no_grad():
            w -= lr * w.grad
            w.grad.zero_()
        hb.beat(step, loss=loss.item())
        path = os.path.join(ckpt, f"step_{step}")
        torch.save({"w": w.detach().clone(), "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
        hb.checkpoint(step, path)
        time.sleep(0.01)
    """
)


def test_a_blown_learning_rate_is_rolled_back_to_before_its_onset(ws: Workspace) -> None:
    """LR blown at the update of step 40: the loss of step 41 is inf (onset 41);
    relaunched from step 39 (the checkpoint of step 40 holds the ruined weights:
    the default margin of 1 step excludes it), 40 and later quarantined yet on
    disk, TRAINWATCH_SKIP_STEPS covering 41; the job finishes."""
    script = ws.root / "trainer.py"
    script.write_text(_TRAINER)
    journal = ws.root / "journal.jsonl"
    cfg = ws.config({"command": [sys.executable, str(script), str(ws.ckpt), str(journal), "80",
                                 "40"],
                     "resume_args": [],
                     "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}"}})
    code, out = finish(ws.run(cfg), timeout=120)
    assert code == 0, out
    incs = ws.incidents()
    assert len(incs) == 1, ([(i["attempt"], i["kind"], i["action"], i["onset_step"],
                              i["resumed_step"], i["evidence"]) for i in incs],
                            journal.read_text(), out[-3000:])
    [inc] = incs
    assert (inc["kind"], inc["action"], inc["onset_step"]) == ("nan_loss", "rollback", 41), inc
    runs = [json.loads(x) for x in journal.read_text().splitlines()]
    assert [r["attempt"] for r in runs] == [0, 1], runs
    assert runs[1]["start"] == 39, (runs, out[-4000:])
    start, end = runs[1]["skip"]
    assert start == 41 <= end, runs
    assert inc["resumed_step"] == 39, inc
    # Quarantined: what attempt 0 wrote from step 40 on; the relaunch wrote 40 anew
    # (good again), and skipped 41..end, whose ruined checkpoints stay on disk.
    catalog = json.loads((ws.state / "jobs" / "job" / "catalog.json").read_text())
    bad = {int(k): v for k, v in catalog["bad"].items()}
    assert all(v.startswith("quarantined") for v in bad.values()), bad
    assert 40 not in bad and set(bad) <= set(range(41, end + 1)), (bad, end)
    assert all((ws.ckpt / f"step_{s}").exists() for s in bad)


# --- one anomaly, one restart: the skip window widens without spending the budget ---

# Steps BAD_FIRST..BAD_LAST have bad data: training on any of them gives a NaN loss.
# Each step's data is a function of the step (said with data_order), and every step
# is checkpointed, so each rollback resumes right before its window.
_BAD_DATA_TRAINER = textwrap.dedent(
    """
    import json, math, os, sys, time
    from trainwatch import client
    ckpt, journal, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    bad = range(int(sys.argv[4]), int(sys.argv[5]) + 1)
    start = int(open(client.resume_from()).read()) if client.resume_from() else 0
    skip = client.skip_steps()
    with open(journal, "a") as f:
        f.write(json.dumps({"attempt": int(os.environ["TRAINWATCH_ATTEMPT"]),
                            "start": start, "skip": skip}) + "\\n")
    hb = client.connect()
    hb.data_order("step", "batch k is drawn from k", step=start)
    for step in range(start + 1, steps + 1):
        time.sleep(0.01)
        if skip and skip[0] <= step <= skip[1]:
            hb.beat(step)
            continue
        hb.beat(step, loss=math.nan if step in bad else 2.0 / (1 + 0.01 * step), grad_norm=0.5)
        path = os.path.join(ckpt, f"step_{step}")
        with open(path + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(path + ".tmp", path)
        hb.checkpoint(step, path)
    release = time.monotonic() + 60  # the test reads the metrics, then lets it end
    while not os.path.exists(sys.argv[6]) and time.monotonic() < release:
        time.sleep(0.02)
    """
)


def _scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {(x.name, frozenset(x.labels.items())): x.value
            for f in text_string_to_metric_families(text) for x in f.samples}


def test_a_six_step_bad_window_costs_one_restart_of_the_budget(ws: Workspace) -> None:
    """Bad data at steps 20-25 under max_restarts 1: three rollbacks (windows 20-20, 19-22,
    15-27), of which only the first is charged; the job finishes. Each incident records its
    window, the window it widened, the checkpoints quarantined (still on disk), that the skip
    is exact (the job said its data follows the step), and keeps the loss series; one log
    line per rollback names window and quarantined steps; the metrics count three exact
    rollbacks and 13 skipped steps."""
    script = ws.root / "trainer.py"
    script.write_text(_BAD_DATA_TRAINER)
    journal, release, port = ws.root / "journal.jsonl", ws.root / "release", free_port()
    cfg = ws.config({"command": [sys.executable, str(script), str(ws.ckpt), str(journal), "40",
                                 "20", "25", str(release)],
                     "resume_args": [],
                     "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}"}},
                    policy={"max_restarts": 1}, metrics={"address": "127.0.0.1", "port": port})
    proc = ws.run(cfg)
    rollbacks = ("trainwatch_job_rollbacks_total", frozenset({("job", "job"), ("skip", "exact")}))
    got = wait_for(lambda: (m := _scrape(port)).get(rollbacks) == 3 and m, timeout=90,
                   what="three exact rollbacks counted")
    release.touch()
    code, out = finish(proc, timeout=120)
    incs = ws.incidents()
    summary = [(i["kind"], i["action"], i["onset_step"], i["decision"], i["evidence"])
               for i in incs]
    assert got[("trainwatch_job_rollback_skipped_steps_total",
                frozenset({("job", "job")}))] == 13, (summary, out[-3000:])
    assert all(got[("trainwatch_job_rollbacks_total", frozenset({("job", "job"), ("skip", k)}))]
               == 0 for k in ("approximate", "unverified"))
    assert code == 0, (summary, out[-3000:])
    rbs = [json.loads(i["evidence"])["rollback"] for i in incs]
    assert [(i["kind"], i["action"], i["onset_step"]) for i in incs] == [
        ("nan_loss", "rollback", 20), ("nan_loss", "rollback", 21),
        ("nan_loss", "rollback", 23)], summary
    assert [(rb["window"], rb["previous_window"], rb["widening"]) for rb in rbs] == [
        ([20, 20], None, 0), ([19, 22], [20, 20], 1), ([15, 27], [19, 22], 2)]
    assert "restart 1 of 1" in incs[0]["decision"]
    assert all("not charged" in i["decision"] for i in incs[1:]), summary
    assert [rb["budget"] for rb in rbs] == ["charged"] + ["not charged: a widening"] * 2
    assert [rb["resume_step"] for rb in rbs] == [18, 17, 13]
    assert all(rb["skip"] == "exact" and rb["skip_why"] == "batch k is drawn from k"
               for rb in rbs), rbs
    # Attempt 0 checkpointed step 19 and whatever it reached before it was killed.
    assert rbs[0]["quarantined"][0] == 19, rbs[0]
    assert all(rb["quarantined"] and min(rb["quarantined"]) > rb["resume_step"] for rb in rbs)
    assert all((ws.ckpt / f"step_{s}").exists() for rb in rbs for s in rb["quarantined"])
    runs = [json.loads(x) for x in journal.read_text().splitlines()]
    assert [(r["start"], r["skip"]) for r in runs] == [
        (0, None), (18, [20, 20]), (17, [19, 22]), (13, [15, 27])], runs
    assert ("rollback for nan_loss from step 21: skip window 19-22 (widening 1 of 3, was "
            "20-20); resuming from step 17;") in out, out[-3000:]
    series = json.loads((ws.state / "jobs" / "job" / "incidents" / str(incs[1]["id"])
                         / "series.json").read_text())
    # The steps the lead rank beat up to the detection, each once (its first beat and
    # its NaN came both as a datagram and in its ring): a ring read on a busy machine
    # may bring the next steps' NaNs in the same batch as the onset's (kept too).
    steps = series["steps"]
    assert steps == sorted(set(steps)), series
    assert series["onset_step"] == 21 and 21 in steps, series
    assert series["loss"][steps.index(21)] == "nan" and steps[0] == 18 + 1, series


# Checkpoints every 5 steps until the loss goes NaN at step NAN (attempt 0), then
# none; on SIGTERM it saves the step it is at, as trainers that save on preemption
# do, and journals which.
_SAVES_ON_SIGTERM = textwrap.dedent(
    """
    import json, math, os, signal, sys, time
    from trainwatch import client
    ckpt, journal, steps, nan = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    attempt = int(os.environ["TRAINWATCH_ATTEMPT"])
    start = int(open(client.resume_from()).read()) if client.resume_from() else 0
    step = start

    def save(s):
        path = os.path.join(ckpt, f"step_{s}")
        with open(path + ".tmp", "w") as f:
            f.write(str(s))
        os.replace(path + ".tmp", path)
        hb.checkpoint(s, path)

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # trainwatch may send it twice
        save(step)
        with open(journal, "a") as f:
            f.write(json.dumps({"attempt": attempt, "saved_on_sigterm": step}) + "\\n")
        os._exit(143)

    signal.signal(signal.SIGTERM, on_term)
    hb = client.connect()
    hb.data_order("step", "batch k is drawn from k", step=start)
    skip = client.skip_steps()
    for step in range(start + 1, steps + 1):
        if skip and skip[0] <= step <= skip[1]:
            continue
        bad = attempt == 0 and step >= nan
        hb.beat(step, loss=math.nan if bad else 1.0 / step)
        if not bad and step % 5 == 0:
            save(step)
        time.sleep(0.05)
    """
)


def test_a_checkpoint_the_stopped_attempt_saves_late_is_listed_as_quarantined(
        ws: Workspace) -> None:
    """The attempt a rollback stops saves a checkpoint on SIGTERM, after the rollback
    decided what to quarantine: it is quarantined as it appears, and the incident's
    rollback lists it (the count matches), with one log line saying so."""
    script = ws.root / "trainer.py"
    script.write_text(_SAVES_ON_SIGTERM)
    journal = ws.root / "journal.jsonl"
    cfg = ws.config({"command": [sys.executable, str(script), str(ws.ckpt), str(journal), "40",
                                 "23"],
                     "resume_args": [],
                     "checkpoints": {"dir": str(ws.ckpt), "pattern": "step_{step}"}})
    code, out = finish(ws.run(cfg), timeout=120)
    assert code == 0, out[-3000:]
    [saved] = [r["saved_on_sigterm"] for r in map(json.loads, journal.read_text().splitlines())
               if "saved_on_sigterm" in r]
    assert saved >= 23, saved
    [inc] = ws.incidents()
    rb = json.loads(inc["evidence"])["rollback"]
    assert rb["resume_step"] == 20, rb
    assert saved in rb["quarantined"], (saved, rb, out[-3000:])
    assert rb["quarantined_count"] == len(rb["quarantined"]), rb
    assert "saved after the rollback was decided were quarantined too" in out, out[-3000:]


def _fault(onset: int, noticed: int | None = None) -> Fault:
    return Fault(FaultKind.NAN_LOSS, "job", onset=0.0, onset_step=onset,
                 evidence={"noticed_step": noticed if noticed is not None else onset})


def test_the_window_widens_for_the_same_anomaly_and_gives_up_after_max_widenings() -> None:
    """Bad steps 100-105: windows 100-100, 99-102, 95-107 (widenings 0, 1, 2); with
    max_widenings 2 a fourth comeback stops the job; an anomaly far away starts afresh."""
    rb = Rollback(max_widenings=2)
    skip: tuple[int, int, int] | None = None
    seen = []
    for onset in (100, 101, 103):
        p = rollback.plan(rb, skip, _fault(onset), None)
        assert p.gave_up is None
        seen.append((p.window, p.widening))
        skip = (p.window[0], p.window[1], p.widening + 1)
    assert seen == [((100, 100), 0), ((99, 102), 1), ((95, 107), 2)]
    again = rollback.plan(rb, skip, _fault(108), None)
    assert again.widening == 3 and again.gave_up is not None
    assert "after 2 widenings" in again.gave_up and "95-107" in again.gave_up
    far = rollback.plan(rb, skip, _fault(500), None)
    assert (far.window, far.widening, far.gave_up) == ((500, 500), 0, None)


def test_a_policy_may_start_with_a_palm_like_window() -> None:
    """skip_before/skip_after widen the first window around the onset and the steps after
    it that were seen anomalous (PaLM: ~100 steps back, 200-500 batches skipped)."""
    p = rollback.plan(Rollback(before=100, skip_before=100, skip_after=200), None,
                      _fault(1000, noticed=1009), None)
    assert (p.window, p.widening) == ((900, 1209), 0)


def test_a_widening_spends_no_restart_of_the_budget() -> None:
    """decide(charged=False) grants a relaunch with backoff but records no restart, even
    with the budget spent; a charged one is refused then."""
    policy = Policy(max_restarts=1, backoff=Backoff(initial=1.0, jitter=0.0))
    history, rng = RestartHistory(), random.Random(1)
    nan = _fault(10)
    first = decide(policy, nan, history, now=1.0, attempt_ran_for=1.0, rng=rng)
    assert not first.fatal and list(history.restarts) == [1.0]
    wider = decide(policy, nan, history, now=2.0, attempt_ran_for=1.0, rng=rng, charged=False)
    assert not wider.fatal and wider.delay == 2.0 and "not charged" in wider.reason
    assert list(history.restarts) == [1.0]
    assert decide(policy, nan, history, now=3.0, attempt_ran_for=1.0, rng=rng).fatal


@pytest.mark.parametrize(("order", "resumed", "verdict"), [
    (None, 6, "unverified"),
    (("step", None), 7, "exact"),
    (("epoch-seeded", 3), 6, "exact"),
    (("epoch-seeded", 3), 7, "approximate"),
    (("epoch-seeded", None), 7, "approximate"),
    (("epoch-seeded", 3), None, "exact"),
    (("unknown", None), 6, "approximate"),
])
def test_the_skip_is_exact_only_where_the_data_order_follows_the_step(
    order: tuple[str, int | None] | None, resumed: int | None, verdict: str
) -> None:
    """'step' is exact wherever the run resumes; 'epoch-seeded' only from an epoch's end
    (or from scratch); 'unknown' is approximate; a job that said nothing is unverified."""
    said = None if order is None else DataOrder(order[0], "why", order[1], 0, 0, 0.0)
    got, why = rollback.exactness(said, resumed)
    assert got == verdict, why


def test_a_data_order_report_reaches_the_daemon_and_a_bad_one_is_refused(
    tmp_path: Path
) -> None:
    """client.data_order() sends one datagram the heartbeat source turns into a DataOrder
    (reason bounded); an order outside step/epoch-seeded/unknown is malformed."""
    path = str(tmp_path / "hb.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        hb = client.Heartbeat(path, rank=0)
        assert hb.data_order("epoch-seeded", "x" * 5000, epoch_steps=8, step=24)
        got = parse(s.recv(65536), pid=1, at=0.0)
        hb.close()
    assert isinstance(got, DataOrder)
    assert (got.order, got.epoch_steps, got.step, len(got.why)) == ("epoch-seeded", 8, 24, 300)
    with pytest.raises(ValueError):
        parse(b'{"v":1,"k":"data","rank":0,"step":1,"order":"sideways"}', pid=1, at=0.0)
