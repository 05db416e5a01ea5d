"""The incident page's checkpoint table shows the job's checkpoints as the catalog
judged them at the incident, reported or not: a job without the client reports
none, and its page said "0 of 0 checkpoints" with every one of them good on disk."""

from __future__ import annotations

import re
from pathlib import Path

from trainwatch.config import Checkpoints
from trainwatch.evidence import sections
from trainwatch.evidence.show import CATALOG
from trainwatch.state.catalog import Catalog


def test_a_jobs_unreported_checkpoints_are_in_its_incidents_table(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    for step in (10, 20, 30):
        (ckpt / f"step_{step}").mkdir(parents=True)
        (ckpt / f"step_{step}" / "done").touch()
    (ckpt / "step_40").mkdir()  # being written: no marker yet
    cat = Catalog(Checkpoints(dir=str(ckpt), marker="done"), tmp_path / "catalog.json")
    where = tmp_path / "incident"
    where.mkdir()
    cat.keep(where / CATALOG)
    html = sections.checkpoints({"onset_step": 35}, tmp_path, where)
    assert "4 of 4 checkpoints" in html, html
    verdicts = re.findall(r"<td[^>]*>(\d+)</td><td[^>]*>(\w+)</td>", html)
    assert verdicts == [("10", "good"), ("20", "good"), ("30", "good"), ("40", "incomplete")], html
    assert str(ckpt / "step_30") in html
