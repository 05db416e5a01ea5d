"""Stacks judged across hosts (multihost/stackshare.py): a table of what every
host shared of its ranks, and whom the verdict names, host:rank."""

from __future__ import annotations

from typing import Any

import pytest
from trainwatch.multihost import stackshare


def _line(rank: int, sig: str | None, coll: bool = True, state: str = "S") -> dict[str, Any]:
    d: dict[str, Any] = {"rank": rank, "state": state}
    if sig is not None:
        d.update(sig=sig, top=f"{sig} (x.py)", collective=coll)
    return d


@pytest.mark.parametrize(("shared", "decided_by", "suspects"), [
    # Three ranks on two hosts wait in one all-reduce; hB's rank 3 is elsewhere.
    ([("hA", _line(0, "ar")), ("hA", _line(1, "ar")), ("hB", _line(2, "ar")),
      ("hB", _line(3, "load", coll=False))], "majority", ["hB:3"]),
    # Two ranks, no majority: the one outside any collective.
    ([("hA", _line(0, "ar")), ("hB", _line(1, "sleep", coll=False))],
     "outside_collective", ["hB:1"]),
    # Both inside a collective: the stopped process names it.
    ([("hA", _line(0, "ar")), ("hB", _line(1, "ar2", state="T"))], "process_state", ["hB:1"]),
    # A stopped rank without a stack, beside one that waits.
    ([("hA", _line(0, "ar")), ("hB", _line(1, None, state="T"))], "process_state", ["hB:1"]),
    # Everyone alike: no odd one out.
    ([("hA", _line(0, "ar")), ("hB", _line(1, "ar")), ("hC", _line(2, "ar"))], "none", []),
])
def test_the_odd_rank_out_is_named_across_hosts(
        shared: list[tuple[str, dict[str, Any]]], decided_by: str, suspects: list[str]) -> None:
    """The dominant group against the odd ones out, over every host's ranks."""
    v = stackshare.judge(shared)
    assert v is not None
    assert (v["decided_by"], v["suspects"]) == (decided_by, suspects), v
    assert v["hosts"] == len({h for h, _ in shared})


def test_one_rank_or_a_repeated_rank_is_not_judged() -> None:
    """Fewer than two distinct ranks: nothing to compare; a rank shared twice counts once."""
    assert stackshare.judge([("hA", _line(0, "ar"))]) is None
    assert stackshare.judge([("hA", _line(0, "ar")), ("hB", _line(0, "x"))]) is None
    assert stackshare.judge([("hA", {"rank": "0"}), ("hB", {"rank": None})]) is None
