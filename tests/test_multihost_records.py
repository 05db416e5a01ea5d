"""A group restart's records in the shared checkpoint folder (multihost/records.py),
on real files: one host wins each restart number, every host's claim is kept,
where the restart began is the earliest claim, and what root believes of a
record is checked and bounded like anything a user wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from trainwatch.multihost import records
from trainwatch.state.ledger import steps_lost


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


def _race(root: str, gen: int, host: str, go: Any, out: Any) -> None:
    go.wait()
    got = records.begin_in_hand(root, gen, host, _decision(gen), None)
    rec = records.parse(got)
    out.put((host, got["won"], None if rec is None else (rec.host, rec.resume_step)))


def test_a_host_that_loses_the_race_for_a_restart_reads_the_winners_decision(
        tmp_path: Path) -> None:
    """Hosts acting on one fault at once: one makes the restart, and each other one
    reads its decision at once. The folder was made first and its decision written
    after: a host between the two found no decision and restarted with no record (its
    incident not the group's; FLAKY in a three-host drill on a loaded machine)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    n, gens = 6, 30
    for gen in range(1, gens + 1):
        go, out = ctx.Barrier(n), ctx.Queue()
        procs = [ctx.Process(target=_race, args=(str(tmp_path), gen, f"h{i}", go, out))
                 for i in range(n)]
        for p in procs:
            p.start()
        got = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        winners = [h for h, won, _ in got if won]
        assert len(winners) == 1, (gen, got)
        assert all(rec == (winners[0], gen) for _, _, rec in got), (gen, got)
    names = sorted(p.name for p in (tmp_path / records.FOLDER).iterdir())
    assert names == [f"restart-{g:08d}" for g in range(1, gens + 1)] + [records.TRACKER], names


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


def test_a_host_or_kind_in_a_record_is_believed_only_as_config_would_take_it(
        tmp_path: Path) -> None:
    """A host name with a newline (and a forged log line after it) in a decision or a
    claim, or a kind that is no fault's name: '?' in root's view, never its text."""
    forged = "hB\n2026-12-02T01:00:00.000+00:00 trainwatch: job v: FORGED"
    d = tmp_path / records.FOLDER / "restart-00000001"
    d.mkdir(parents=True)
    (d / "decision.json").write_text(json.dumps({**_decision(), "host": forged,
                                                 "leaves": forged, "kind": "crash\nX"}))
    (d / "claim-hB.json").write_text(json.dumps({"host": forged, "kind": "hang\nY",
                                                 "rank": 1, "at": 99.0}))
    rec = records.parse(records.newest_in_hand(str(tmp_path), 0))
    assert rec is not None
    assert (rec.host, rec.began, rec.leaves, rec.kind) == ("?", "? rank 1", None, "?")
    assert rec.claims == (("?", "?", 1, 99.0),)


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


@pytest.mark.parametrize(("said", "reached"), [
    ((None, None), None),  # no host told a step: unknown, not 0
    ((40, None), 40),
    ((40, 57), 57),  # the newest any host reached
    ((40, "57"), 40),  # text, a bool, a negative step: not believed
    ((True, -3), None),
])
def test_a_restart_reached_the_newest_step_any_claiming_host_was_told(
        tmp_path: Path, said: tuple[object, object], reached: int | None) -> None:
    root = str(tmp_path)
    for host, step in zip(("hA", "hB"), said, strict=True):
        got = records.begin_in_hand(root, 1, host, _decision(30),
                                    {"kind": "crash", "rank": 0, "at": 100.0, "reached": step})
    rec = records.parse(got)
    assert rec is not None and rec.reached == reached


@pytest.mark.parametrize(("resumed", "reached", "lost"), [
    (30, (None, None), None),
    (30, (35, None), 5),
    (30, (None, 47), 17),  # this host knew no step; the group's claims did
    (30, (35, 47), 17),
    (None, (12,), 12),  # from scratch
    (50, (40,), 0),  # never negative
])
def test_steps_lost_count_from_the_newest_step_known(
        resumed: int | None, reached: tuple[int | None, ...], lost: int | None) -> None:
    assert steps_lost(resumed, *reached) == lost


def test_a_rank_that_says_its_peer_failed_is_blamed_on_the_peer(tmp_path: Path) -> None:
    """gloo's and NCCL's lines of a rank whose peer died, in this round's output only."""
    from trainwatch.multihost import victim

    log = tmp_path / "attempt.log"
    old = "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:1 (an earlier round)\n"
    log.write_text(old + "[rank0]: step 12\n[rank1]: RuntimeError: [pair.cc:553] Connection "
                   "closed by peer [127.0.0.1]:18073. This is typically caused by a remote "
                   "worker crashing.\n[rank2]: torch.distributed.DistBackendError: "
                   "ncclRemoteError: A call failed possibly due to a network error or a "
                   "remote process exiting prematurely.\n")
    assert "remote worker crashing" in (victim.peer_blamed(log, len(old), 1) or "")
    assert "ncclRemoteError" in (victim.peer_blamed(log, len(old), 2) or "")
    assert victim.peer_blamed(log, len(old), 0) is None  # its own line says no such thing
    assert victim.peer_blamed(log, log.stat().st_size, 1) is None  # before this round
    assert victim.peer_blamed(tmp_path / "gone.log", 0, 1) is None


def test_the_workers_torchruns_agent_says_failed_are_read_from_this_round_only(
        tmp_path: Path) -> None:
    """torchrun 2.13's own line for a worker it reaped that failed (seen by default, at
    level E), with its exit code: a rank reaped before trainwatch read it is judged by it
    at once; a worker that ended well gets no line, and an earlier round's do not count."""
    from trainwatch.multihost import victim

    log = tmp_path / "attempt.log"
    old = ("E1203 14:28:01.000000 1 torch/distributed/elastic/multiprocessing/api.py:1002] "
           "failed (exitcode: 1) local_rank: 1 (pid: 111) of binary: /usr/bin/python\n")
    log.write_text(old + "W1203 14:28:07.336000 18338 torch/distributed/elastic/multiprocessing"
                   "/api.py:1028] Sending process 18344 closing signal SIGTERM\nE1203 14:28:07"
                   ".369000 18338 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
                   "(exitcode: -9) local_rank: 0 (pid: 18343) of binary: /venv/bin/python\n")
    assert victim.agent_failed(log, len(old)) == {18343: -9}
    assert victim.agent_failed(log, 0) == {111: 1, 18343: -9}
    assert victim.agent_failed(tmp_path / "gone.log", 0) == {}


# --- scopes (a Slurm job's records: .trainwatch/slurm-<job id>/) ---


def test_no_scope_keeps_the_layout_and_a_scope_has_a_folder_of_its_own(
        tmp_path: Path) -> None:
    """Without a scope, restart-N is in <root>/.trainwatch as before; with one, in
    <root>/.trainwatch/<scope>/, with the same files. The resume-from tracker is
    <root>/.trainwatch/resume-from either way: the newest decision's, any scope."""
    root = str(tmp_path)
    base = tmp_path / records.FOLDER
    assert records.folder(root) == str(base)
    assert records.folder(root, "slurm-7") == str(base / "slurm-7")
    records.begin_in_hand(root, 1, "hA", _decision(10), {"kind": "crash", "rank": 0, "at": 1.0})
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        ".trainwatch", ".trainwatch/restart-00000001",
        ".trainwatch/restart-00000001/claim-hA.json",
        ".trainwatch/restart-00000001/decision.json", ".trainwatch/resume-from"]
    assert (base / "resume-from").read_text() == "/ck/step_10\n"
    got = records.begin_in_hand(root, 1, "hA", _decision(20),
                                {"kind": "hang", "rank": 1, "at": 2.0}, "slurm-7")
    assert got["won"] is True
    scoped = base / "slurm-7" / "restart-00000001"
    assert sorted(p.name for p in scoped.iterdir()) == ["claim-hA.json", "decision.json"]
    assert json.loads((scoped / "decision.json").read_text())["resume_step"] == 20
    assert (base / "resume-from").read_text() == "/ck/step_20\n"
    assert not (base / "slurm-7" / "resume-from").exists()
    assert json.loads((base / "restart-00000001" / "decision.json").read_text())[
        "resume_step"] == 10
    assert records.decision_after(records.folder(root, "slurm-7"), 0)["resume_step"] == 20  # type: ignore[index]


def test_two_scopes_and_the_default_never_see_each_others_records(tmp_path: Path) -> None:
    """slurm-7 and slurm-8 (a new sbatch, restarts from 0 again) and the unscoped
    records each make their own restart 1 (each wins it), read only their own
    restarts, claims and stacks, and count only their own."""
    root = str(tmp_path)
    scopes: list[str | None] = [None, "slurm-7", "slurm-8"]
    for i, scope in enumerate(scopes):
        got = records.begin_in_hand(root, 1, f"h{i}", _decision(10 * (i + 1)), None, scope)
        assert got["won"] is True, scope
        records.claim_in_hand(root, 1, f"c{i}", {"kind": "crash", "rank": i, "at": 5.0 + i},
                              scope)
        records.stacks_in_hand(root, 1, f"c{i}", [{"rank": i}], scope)
    records.begin_in_hand(root, 2, "h7", _decision(70), None, "slurm-7")
    assert [records.current_in_hand(root, s) for s in scopes] == [1, 2, 1]
    assert records.newest_in_hand(root, 1, None) is None
    assert records.newest_in_hand(root, 1, "slurm-8") is None
    for i, scope in enumerate(scopes):
        rec = records.parse(records.newest_in_hand(root, 0, scope))
        assert rec is not None
        newest = (2, "h7", 70) if scope == "slurm-7" else (1, f"h{i}", 10 * (i + 1))
        assert (rec.gen, rec.host, rec.resume_step) == newest, scope
        first = records.parse(records.begin_in_hand(root, 1, "late", _decision(99), None, scope))
        assert first is not None
        assert (first.host, first.resume_step) == (f"h{i}", 10 * (i + 1)), scope
        assert first.claims == ((f"c{i}", "crash", i, 5.0 + i),), scope
        assert first.stacks == ((f"c{i}", {"rank": i}),), scope


@pytest.mark.parametrize("scope", [
    "", ".", "..", "../x", "a/b", "/abs", "slurm-7/..", "a..b", ".hidden", "a b", "a\nb",
    "slurm-7\x00", "é", "x" * 65, "restart-00000001", "resume-from", 7, b"slurm-7",
])
def test_a_scope_that_is_not_one_plain_name_is_refused_and_nothing_is_made(
        tmp_path: Path, scope: Any) -> None:
    """A scope with a separator, a dot first, `..`, an odd character, too long, a
    name of the default layout (restart-N, resume-from) or not a str: every records
    function raises ValueError before it touches the folder."""
    root = tmp_path / "ck"
    root.mkdir()
    assert records.bad_scope(scope) is not None
    calls = [
        lambda: records.folder(str(root), scope),
        lambda: records.begin_in_hand(str(root), 1, "hA", _decision(), {"at": 1.0}, scope),
        lambda: records.claim_in_hand(str(root), 1, "hA", {"at": 1.0}, scope),
        lambda: records.stacks_in_hand(str(root), 1, "hA", [], scope),
        lambda: records.newest_in_hand(str(root), 0, scope),
        lambda: records.current_in_hand(str(root), scope),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="a records scope is one name"):
            call()
    assert list(tmp_path.rglob("*")) == [root]


@pytest.mark.parametrize("scope", ["slurm-7", "slurm-4294967293", "a", "A.b_c-9", "x" * 64])
def test_a_plain_name_is_a_scope(scope: str) -> None:
    """Letters, digits, '.', '_', '-', one to 64, not a dot first."""
    assert records.bad_scope(scope) is None
    assert records.folder("/ck", scope) == f"/ck/{records.FOLDER}/{scope}"


def test_a_temporary_name_another_host_holds_neither_fails_nor_clobbers_a_write(
        tmp_path: Path) -> None:
    """The folder is shared by every host, and two hosts' hands may have the same pid:
    a temporary file another host is writing under the name ours would have had (here
    a folder, so that a write into it would fail) is left alone, and the record and the
    tracker are written whole."""
    root = str(tmp_path)
    base = tmp_path / records.FOLDER
    base.mkdir()
    theirs = base / f".{records.TRACKER}.{os.getpid()}.tmp"
    theirs.mkdir()
    got = records.begin_in_hand(root, 1, "hA", _decision(30), None)
    assert got["won"] is True
    assert (base / records.TRACKER).read_text() == "/ck/step_30\n"
    assert theirs.is_dir() and not any(theirs.iterdir())
    assert [p.name for p in base.iterdir() if p.name.endswith(".tmp")] == [theirs.name]


def test_a_rank_reads_its_groups_decision_without_loading_the_daemons_modules(
        tmp_path: Path) -> None:
    """Every rank of a group job reads the decision as it starts, while the new round
    waits for it: the client's path loads the standard library only, not the config,
    YAML or the hands (they were 0.11 s of each rank's start)."""
    import subprocess
    import sys

    root = str(tmp_path)
    records.begin_in_hand(root, 1, "h1", _decision(30), None)
    probe = ("import sys\nfrom trainwatch import client\n"
             "print(client.resume_from(), client.skip_steps())\n"
             "print(sorted(m for m in sys.modules if m == 'yaml' or m.startswith("
             "('trainwatch.config', 'trainwatch.privsep', 'trainwatch.actions'))))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True,
                         env={**os.environ, "TRAINWATCH_GROUP_DIR": records.folder(root),
                              "TRAINWATCH_GROUP_GEN": "0"}).stdout.splitlines()
    assert out == ["/ck/step_30 None", "[]"], out
