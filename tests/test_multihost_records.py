"""A group restart's records in the shared checkpoint folder (multihost/records.py),
on real files: one host wins each restart number, every host's claim is kept,
where the restart began is the earliest claim, and what root believes of a
record is checked and bounded like anything a user wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from trainwatch.multihost import records


def _decision(step: int | None = 30) -> dict[str, object]:
    return {"resume_step": step, "resume_path": None if step is None else f"/ck/step_{step}",
            "skip": None, "kind": "crash", "at": 100.0}


def test_the_first_host_wins_a_restart_and_the_earliest_claim_names_where_it_began(
        tmp_path: Path) -> None:
    """Two hosts act on one fault: the first one's decision stands, both claims are
    kept, and the restart began where the earliest claim says, not at the quickest."""
    root = str(tmp_path)
    first = records.begin_in_hand(root, 1, "hA", _decision(30),
                                  {"kind": "crash", "rank": 0, "at": 100.07})
    second = records.begin_in_hand(root, 1, "hB", _decision(31),
                                   {"kind": "crash", "rank": 1, "at": 100.0})
    assert (first["won"], second["won"]) == (True, False)
    rec = records.parse(second)
    assert rec is not None
    assert (rec.gen, rec.host, rec.resume_step, rec.began) == (1, "hA", 30, "hB rank 1")
    assert records.current_in_hand(root) == 1
    assert records.newest_in_hand(root, 1) is None
    assert records.decision_after(records.folder(root), 0)["resume_step"] == 30  # type: ignore[index]
    assert records.decision_after(records.folder(root), 1) is None


def test_the_newest_restart_is_the_one_read(tmp_path: Path) -> None:
    """Restarts 1 and 2: a host at 0 reads 2, the client's decision too."""
    root = str(tmp_path)
    records.begin_in_hand(root, 1, "hA", _decision(10), None)
    records.begin_in_hand(root, 2, "hB", _decision(20), None)
    rec = records.parse(records.newest_in_hand(root, 0))
    assert rec is not None and (rec.gen, rec.resume_step, rec.began) == (2, 20, "hB")


@pytest.mark.parametrize(("decision", "believed"), [
    ({"resume_step": -1, "resume_path": 5, "skip": [1], "kind": 7}, (None, None, None, "?")),
    ({"resume_step": True, "resume_path": "x" * 5000, "skip": [3, "4"]}, (None, None, None, "?")),
    ({"resume_step": 12, "resume_path": "/a", "skip": [3, 4], "kind": "nan_loss"},
     (12, 2, (3, 4), "nan_loss")),
])
def test_what_root_believes_of_a_record_is_checked(
        tmp_path: Path, decision: dict[str, object],
        believed: tuple[object, object, object, str]) -> None:
    """Wrong types, negative steps and long strings are not believed as they stand."""
    d = tmp_path / records.FOLDER / "restart-00000001"
    d.mkdir(parents=True)
    (d / "decision.json").write_text(json.dumps(decision))
    rec = records.parse(records.newest_in_hand(str(tmp_path), 0))
    assert rec is not None
    path = rec.resume_path
    assert (rec.resume_step, len(path) if path is not None else None, rec.skip,
            rec.kind) == believed


def test_a_record_that_is_a_link_or_too_large_or_not_json_is_not_read(tmp_path: Path) -> None:
    """A decision that is a symlink, over 16 KiB, or not JSON: no restart believed."""
    base = tmp_path / records.FOLDER
    for gen, make in ((1, "link"), (2, "large"), (3, "junk")):
        d = base / f"restart-{gen:08d}"
        d.mkdir(parents=True)
        target = d / "decision.json"
        if make == "link":
            (tmp_path / "elsewhere.json").write_text(json.dumps(_decision()))
            os.symlink(tmp_path / "elsewhere.json", target)
        elif make == "large":
            target.write_text(json.dumps({**_decision(), "pad": "x" * 20000}))
        else:
            target.write_text("{not json")
        assert records.parse(records.newest_in_hand(str(tmp_path), gen - 1)) is None, make


def test_a_victims_earlier_claim_does_not_name_where_a_restart_began(tmp_path: Path) -> None:
    """A host whose rank failed because a peer did (its daemon saw that first on a
    busy machine) claims earlier than the host of the cause: the cause is named."""
    root = str(tmp_path)
    records.begin_in_hand(root, 1, "hC", _decision(30),
                          {"kind": "crash", "rank": 2, "at": 99.9, "victim": True})
    got = records.begin_in_hand(root, 1, "hB", _decision(30),
                                {"kind": "crash", "rank": 0, "at": 100.0, "victim": False})
    rec = records.parse(got)
    assert rec is not None and rec.began == "hB rank 0"


def test_a_rank_that_says_its_peer_failed_is_blamed_on_the_peer(tmp_path: Path) -> None:
    """gloo's and NCCL's lines of a rank whose peer died, in this round's output only."""
    from trainwatch.multihost import group

    log = tmp_path / "attempt.log"
    old = "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:1 (an earlier round)\n"
    log.write_text(old + "[rank0]: step 12\n[rank1]: RuntimeError: [pair.cc:553] Connection "
                   "closed by peer [127.0.0.1]:18073. This is typically caused by a remote "
                   "worker crashing.\n[rank2]: torch.distributed.DistBackendError: "
                   "ncclRemoteError: A call failed possibly due to a network error or a "
                   "remote process exiting prematurely.\n")
    assert "remote worker crashing" in (group.peer_blamed(log, len(old), 1) or "")
    assert "ncclRemoteError" in (group.peer_blamed(log, len(old), 2) or "")
    assert group.peer_blamed(log, len(old), 0) is None  # its own line says no such thing
    assert group.peer_blamed(log, log.stat().st_size, 1) is None  # before this round
    assert group.peer_blamed(tmp_path / "gone.log", 0, 1) is None
