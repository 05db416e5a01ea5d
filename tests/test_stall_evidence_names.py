"""A job's processes in a stall's evidence are named for what they are: a rank by its
rank, the launcher (torchrun's agent, a shell) by its pid, never as a rank of its own."""

from __future__ import annotations

import json

from trainwatch.detectors.stall import Proc, SilentView, StallSettings, detect_silent
from trainwatch.evidence import ranks


def _silent_stall() -> dict[str, object]:
    procs = {0: Proc(101, "S", 0.0), 1: Proc(102, "T", 0.0), -29047: Proc(29047, "S", 0.0)}
    v = SilentView(now=1000.0, silent_for=400.0, procs=procs, attempt_age=900.0,
                   quiet_for=400.0)
    f = detect_silent("job", v, StallSettings())
    assert f is not None and f.rank == 1
    return f.evidence


def test_the_launcher_is_listed_by_its_pid_not_as_a_negative_rank() -> None:
    procs = _silent_stall()["processes"]
    assert isinstance(procs, dict)
    assert set(procs) == {"0", "1", "pid 29047"}, procs
    assert procs["pid 29047"]["pid"] == 29047


def test_the_incident_pages_rank_table_lists_ranks_only() -> None:
    row = {"evidence": json.dumps(_silent_stall())}
    assert sorted(ranks._ranks(ranks.evidence(row), None)) == [0, 1]
    old = {"evidence": json.dumps({"processes": {"0": {"pid": 1}, "-29047": {"pid": 29047}}})}
    assert sorted(ranks._ranks(ranks.evidence(old), None)) == [0]
