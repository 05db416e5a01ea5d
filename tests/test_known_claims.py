"""Another host's checkpoint claims (multihost/known.py) are the job user's
bytes: read bounded, never through a link, and each claim well formed or dropped."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from trainwatch.multihost import known, records

_CASES = [
    ("one host, newest first",
     [{"host": "hA", "reported": {"10": "/c/step_10", "20": "/c/step_20"}}],
     [(20, "/c/step_20", "hA"), (10, "/c/step_10", "hA")]),
    ("two hosts merged by step", [{"host": "hA", "reported": {"10": "/c/step_10"}},
                                  {"host": "hB", "reported": {"30": "/c/step_30"}}],
     [(30, "/c/step_30", "hB"), (10, "/c/step_10", "hA")]),
    ("a host name with a newline", [{"host": "h\nA", "reported": {"10": "/c/step_10"}}], []),
    ("no host", [{"reported": {"10": "/c/step_10"}}], []),
    ("reported not a mapping", [{"host": "hA", "reported": ["/c/step_10"]}], []),
    ("a step that is no number", [{"host": "hA", "reported": {"-1": "/c/x", "1e3": "/c/y",
                                                             "10": "/c/step_10"}}],
     [(10, "/c/step_10", "hA")]),
    ("a path that is no string", [{"host": "hA", "reported": {"10": 7, "20": None}}], []),
    ("a path too long", [{"host": "hA", "reported": {"10": "/" + "x" * 5000}}], []),
    ("not a list", {"host": "hA", "reported": {"10": "/c/step_10"}}, []),
    ("an entry not a mapping", ["hA", 3, None], []),
]


@pytest.mark.parametrize(("raw", "want"), [c[1:] for c in _CASES], ids=[c[0] for c in _CASES])
def test_a_peers_claims_are_taken_only_when_well_formed(raw: object,
                                                        want: list[tuple[int, str, str]]) -> None:
    assert known.claims(raw) == want


def test_a_host_reads_every_other_hosts_claims_and_not_its_own(tmp_path: Path) -> None:
    known.share_in_hand(str(tmp_path), "hA", {"10": "/c/step_10"})
    known.share_in_hand(str(tmp_path), "hB", {"20": "/c/step_20"})
    got = known.others_in_hand(str(tmp_path), "hA")
    assert got == [{"host": "hB", "reported": {"20": "/c/step_20"}}]
    assert known.claims(got) == [(20, "/c/step_20", "hB")]


def test_a_claim_through_a_link_or_past_its_size_is_not_read(tmp_path: Path) -> None:
    base = Path(records.folder(str(tmp_path)))
    base.mkdir()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"host": "hL", "reported": {"90": "/c/step_90"}}))
    os.symlink(elsewhere, base / "known-hL.json")
    big = {"host": "hZ", "reported": {str(i): "/c/" + "x" * 100 for i in range(400)}}
    (base / "known-hZ.json").write_text(json.dumps(big))
    (base / "known-hB.json").write_text(json.dumps({"host": "hB", "reported": {"5": "/c/s"}}))
    assert known.others_in_hand(str(tmp_path), "hA") == [{"host": "hB",
                                                           "reported": {"5": "/c/s"}}]
