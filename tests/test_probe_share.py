"""A silent job's stacks shared between hosts (multihost/probeshare.py): each
host's read written beside the group's records, the others' read back, and only
a fresh, well-formed one believed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from trainwatch.multihost import probeshare, records


def test_each_host_writes_its_read_and_gets_the_others_back(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert probeshare.exchange_in_hand(root, "hA", {"0": True}) == []
    got = probeshare.exchange_in_hand(root, "hB", {"1": False})
    assert [(b["host"], b["ranks"]) for b in got] == [("hA", {"0": True})]
    assert probeshare.peers(got, time.time(), {1: False}) == {0: True}


@pytest.mark.parametrize(("body", "believed"), [
    ({"host": "hA", "at": 100.0, "ranks": {"0": True, "3": False}}, {0: True, 3: False}),
    ({"host": "hA", "at": 90.0, "ranks": {"0": True}}, {}),  # stale: 10 s old
    ({"host": "hA", "at": 200.0, "ranks": {"0": True}}, {}),  # from the future
    ({"host": "hA", "at": True, "ranks": {"0": True}}, {}),
    ({"host": "h\nA", "at": 100.0, "ranks": {"0": True}}, {}),  # not a host's name
    ({"host": "hA", "at": 100.0, "ranks": {"-1": True, "x": True, "0": "yes"}}, {}),
    ({"host": "hA", "at": 100.0, "ranks": {"1": True}}, {}),  # this host's own rank
    ({"host": "hA", "at": 100.0, "ranks": ["0"]}, {}),
    ("not a read", {}),
])
def test_only_a_fresh_well_formed_read_of_other_ranks_is_believed(
        body: object, believed: dict[int, bool]) -> None:
    assert probeshare.peers([body], 101.0, {1: False}) == believed


def test_a_link_planted_for_a_peers_read_is_not_followed(tmp_path: Path) -> None:
    root = str(tmp_path)
    base = records.folder(root)
    os.makedirs(base)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"host": "hA", "at": time.time(), "ranks": {"0": True}}))
    os.symlink(secret, os.path.join(base, "probe-hA.json"))
    assert probeshare.exchange_in_hand(root, "hB", {"1": False}) == []
