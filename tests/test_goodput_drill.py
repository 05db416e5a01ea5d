"""The goodput drill (benchmarks/goodput.py) counts what a run was worth from what really
happened: real systems, real rank processes, real faults, the weights compared bit for bit."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import goodput  # noqa: E402
from goodput_drill import accounting, runner, schedule  # noqa: E402

STEP = 0.1
EVERY = 30


def test_each_trial_draws_its_own_schedule_of_the_same_kinds_the_first_from_the_seed() -> None:
    plans = schedule.per_trial(25, 3, 600, 2, STEP)
    assert plans[0] == schedule.draw(25, 600, 2, STEP)
    assert len({tuple(p) for p in plans}) == 3
    assert all(sorted(f.kind for f in p) == sorted(schedule.KINDS) for p in plans)
    assert plans == schedule.per_trial(25, 3, 600, 2, STEP)


def test_every_system_meets_the_same_faults_at_the_same_times() -> None:
    a = schedule.draw(25, 600, 2, STEP)
    assert a == schedule.draw(25, 600, 2, STEP)
    assert a != schedule.draw(26, 600, 2, STEP)
    assert sorted(f.kind for f in a) == sorted(schedule.KINDS)
    assert a[-1].kind == "xid"  # a lost GPU goes last
    ats = [f.at for f in a]
    assert ats == sorted(ats) and ats[0] > 0 and ats[-1] < 600
    nan = schedule.nan_window(a)
    assert nan is not None and nan[1] - nan[0] == 5


def test_the_default_schedule_of_seed_25_is_the_one_the_published_figures_met() -> None:
    """Naming other kinds (--kinds) must not move the default draw: docs/figures.md
    quotes trials of seeds 25-28 by their seconds."""
    got = [(f.kind, round(f.at), f.rank, f.steps) for f in schedule.draw(25, 600, 2, STEP)]
    assert got == [("stall", 92, 0, None), ("hang", 187, 1, None),
                   ("nan", 237, 1, (2372, 2377)), ("crash", 326, 0, None),
                   ("corrupt", 432, 0, None), ("xid", 515, 1, None)]


@pytest.mark.parametrize(("text", "kinds"), [
    ("crash", ("crash",)),
    ("crash:3,hang:2", ("crash",) * 3 + ("hang",) * 2),
    (" hang:1 , xid ", ("hang", "xid")),
    (",".join(schedule.KINDS), schedule.KINDS),
])
def test_kinds_name_each_fault_of_a_schedule_in_order(text: str, kinds: tuple[str, ...]) -> None:
    assert schedule.parse_kinds(text) == kinds


@pytest.mark.parametrize(("text", "why"), [
    ("crash:x", "whole number"), ("crash:0", "between 1 and 100"), ("crash:101", "between"),
    ("oom", "unknown fault kind"), ("", "no fault kinds"), ("nan:2", "nan at most once"),
    ("xid,crash,xid", "xid at most once"),
])
def test_kinds_that_cannot_be_played_are_refused_saying_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        schedule.parse_kinds(text)


def test_many_faults_of_a_few_kinds_keep_their_slots_and_the_xid_last() -> None:
    plan = schedule.draw(25, 300, 2, STEP, schedule.parse_kinds("crash:5,hang:5,xid"))
    assert sorted(f.kind for f in plan) == ["crash"] * 5 + ["hang"] * 5 + ["xid"]
    assert plan[-1].kind == "xid"
    ats = [f.at for f in plan]
    slot = 300 / 12
    assert all(b - a >= slot / 2 for a, b in itertools.pairwise(ats)), ats


class Drill(NamedTuple):
    result: runner.Result
    worth: accounting.Worth
    reference: str | None  # the fault-free run's digest at the final checkpoint


@pytest.fixture(scope="module")
def drills(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Drill]:
    """The three short drills below, run at once, then the fault-free references of the
    two that need one, at once: each is mostly a paced trainer waiting (about 60 s in all
    instead of 2 minutes one after the other). Each run is long enough for a slow start
    on a loaded machine: the faults come after the first step."""
    d = tmp_path_factory.mktemp("drills")
    runs: dict[str, Callable[[], runner.Result]] = {
        # Mid-interval (step ~75 of checkpoints every 30): some steps are redone.
        "trainwatch": lambda: runner.run("trainwatch", d / "tw", 1,
                                         [schedule.Fault("crash", 7.5, 0)], 45.0, EVERY,
                                         STEP, None),
        "torchrun": lambda: runner.run("torchrun", d / "tr", 1, [], 30.0, EVERY, STEP,
                                       (20, 22)),
        "nvrx": lambda: runner.run("nvrx", d / "nv", 1, [schedule.Fault("hang", 8.0, 0)],
                                   50.0, EVERY, STEP, None),
    }
    skips = {"trainwatch": None, "torchrun": (20, 22)}
    with ThreadPoolExecutor(len(runs)) as ex:
        futures = {name: ex.submit(run) for name, run in runs.items()}
        results = {name: f.result() for name, f in futures.items()}
        worths = {name: accounting.worth(res) for name, res in results.items()}
        refs = {name: ex.submit(goodput.reference, d / name, 1, worths[name].final_ckpt, skip,
                                skip, {})
                for name, skip in skips.items() if worths[name].final_ckpt is not None}
        return {name: Drill(results[name], worths[name],
                            refs[name].result() if name in refs else None)
                for name in runs}


def test_a_crash_under_trainwatch_is_recovered_and_the_final_weights_are_the_fault_free_ones(
        drills: dict[str, Drill]) -> None:
    res, worth, ref = drills["trainwatch"]
    [h] = accounting.handling(res, [])
    assert h.kind == "crash" and h.recovered_s is not None, (h, res.log.read_text()[-3000:])
    assert h.steps_lost is not None and 0 <= h.steps_lost <= EVERY + 10
    assert worth.final_ckpt is not None and worth.final_ckpt > EVERY
    # Work redone after the restart counts once: fewer effective steps than steps logged.
    logged = sum(1 for r in res.progress if "step" in r)
    assert worth.effective == worth.final_step < logged
    assert ref == worth.final_digest


def test_a_nan_window_under_torchrun_poisons_the_weights_and_is_never_handled(
        drills: dict[str, Drill]) -> None:
    res, worth, ref = drills["torchrun"]
    assert worth.poisoned_at == 20
    assert worth.effective == 19  # steps 1-19; nothing after the bad batch counts
    [h] = accounting.handling(res, [])
    assert h.kind == "nan" and h.detected_s is None and h.recovered_s is None
    assert worth.final_ckpt is not None and worth.final_ckpt >= EVERY
    assert ref is not None and ref != worth.final_digest


def test_a_stopped_rank_under_nvidias_launcher_is_found_by_its_heartbeats_and_restarted(
        drills: dict[str, Drill]) -> None:
    """The drill's NVRx side works: the rank monitor's timeouts, set from the beats seen
    (nvrx.CALIBRATE_AFTER steps in), find the SIGSTOPped rank and ft_launcher restarts it."""
    res = drills["nvrx"].result
    [h] = accounting.handling(res, [])
    assert h.kind == "hang" and h.detected_s is not None and h.recovered_s is not None, \
        (h, res.log.read_text()[-3000:])
    # At least the first attempt and the one after the hang (NVRx's timeouts, computed from
    # 0.1 s steps, are ~0.5 s: on a loaded machine it may also kill a slow rank).
    assert len(accounting.attempts(res.progress)) >= 2


@pytest.mark.parametrize("args", [["--systems", "nope"], ["--minutes", "0"],
                                  ["--trials", "0"], ["--trainer", "three"],
                                  ["--kinds", "nan:2"], ["--kinds", "crash:many"]])
def test_bad_arguments_get_one_clear_line_and_exit_2(args: list[str]) -> None:
    p = subprocess.run([sys.executable, str(BENCH / "goodput.py"), *args],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2, p
    assert "Traceback" not in p.stderr, p.stderr
    # argparse's usage may come first; the last line says what was wrong.
    assert p.stderr.strip().splitlines()[-1].startswith("goodput"), p.stderr


def test_the_table_lines_up_each_fault_by_kind_when_a_system_never_met_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A system that never reached the NaN steps has one event fewer: its crash is still
    its crash (seen in the first 10-minute run: torchrun's crash read 'never handled')."""
    def h(kind: str, det: float | None, rec: float | None, lost: int | None) -> dict[str, object]:
        return {"kind": kind, "detected_s": det, "recovered_s": rec, "steps_lost": lost}
    row = {"ratio": 0.5, "of_limit": 0.6, "weights": "= fault-free"}
    rows = {"a": [{**row, "faults": [h("nan", 0.1, 9.0, 2), h("crash", 0.2, 8.0, 30)]}],
            "b": [{**row, "faults": [h("crash", 30.1, 36.4, 16)]}]}
    goodput.table(rows, 0.8, ["nan", "crash"])
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.strip()}
    assert "never met" in lines["nan"]
    assert "36.40" in lines["crash"] and "never handled" not in lines["crash"]


def test_the_table_takes_the_median_of_every_fault_of_a_kind_in_every_trial(
        capsys: pytest.CaptureFixture[str]) -> None:
    """With --kinds crash:3 over two trials, a crash cell is the median of six, and the
    note says how many of each were met and recovered."""
    def crash(rec: float | None) -> dict[str, object]:
        return {"kind": "crash", "detected_s": 0.1, "recovered_s": rec, "steps_lost": 5}
    row = {"ratio": 0.5, "of_limit": 0.6, "weights": "= fault-free"}
    rows = {"a": [{**row, "faults": [crash(1.0), crash(2.0), crash(9.0)]},
                  {**row, "faults": [crash(3.0), crash(4.0), crash(None)]}]}
    goodput.table(rows, 0.8, ["crash"])
    out = capsys.readouterr().out
    crash_line = next(ln for ln in out.splitlines() if ln.startswith("crash"))
    assert "3.00," in crash_line, out  # the median of 1, 2, 3, 4, 9: not trial 1's first
    assert "a crash 5/6" in out, out


def test_bad_data_counts_as_recovered_only_by_the_attempt_that_trains_clear_of_it(
        tmp_path: Path) -> None:
    """A rollback whose first window is too narrow meets the NaN again: the recovery is
    the relaunch after the wider window, not the first one (which met it again)."""
    def start(pid: int, t: float, frm: int) -> dict[str, object]:
        return {"t": t, "pid": pid, "start": True, "from": frm, "skip": None}

    def step(pid: int, t: float, s: int, loss: float) -> dict[str, object]:
        return {"t": t, "pid": pid, "step": s, "loss": loss, "skip": False}

    nan = float("nan")
    progress = [start(1, 0.0, 0), step(1, 1.0, 1, 1.0), step(1, 2.0, 2, nan),
                start(2, 5.0, 1), step(2, 6.0, 2, 1.0), step(2, 7.0, 3, nan),  # met again
                start(3, 10.0, 1), step(3, 11.0, 2, 1.0), step(3, 12.0, 5, 1.0)]
    res = runner.Result("trainwatch", 0.0, 20.0, 1.0, [], {1: 3.0, 2: 8.0}, progress,
                        tmp_path / "log")
    [h] = accounting.handling(res, [])
    assert h.kind == "nan" and h.at == 2.0
    assert h.detected_s == 1.0
    assert h.recovered_s == 11.0 - 2.0, h
