"""A drill across hosts is recorded as one: ``faultinject crash --rank`` on host B's
rank of a 2-host torchrun job is an incident marked injected there (its onset the
drill's notice), with the backoff the restart applied, and the group restarts once
from one checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import wait_for
from test_multihost_group import _fault_free, _hosts, _journal, _one_restart, _stop


def test_faultinject_crash_of_one_rank_across_hosts_is_recorded_injected(
        tmp_path: Path) -> None:
    hosts, journal, _ = _hosts(tmp_path)
    b = hosts[1]
    try:
        wait_for(lambda: (b.status().get("step") or 0) >= 12, timeout=120,
                 what="host B's rank to reach step 12")
        rank = next(e["rank"] for e in _journal(journal) if e["host"] == "hB")
        done = b.faultinject("crash", "--rank", str(rank))
        assert done.returncode == 0, done.stdout + done.stderr
        wait_for(lambda: len(_journal(journal)) >= 4, timeout=120,
                 what="every rank to start again")
        wait_for(lambda: (tmp_path / "final.json").exists(), timeout=180,
                 what="the run to finish")
    finally:
        outs = _stop(hosts)
    [inc] = b.incidents()
    assert inc["kind"] == "crash" and inc["injected"], (inc, outs[-1][-3000:])
    assert json.loads(inc["evidence"]).get("source") == "drill", inc
    for ws in hosts:  # the backoff applied: the agents start the new round at once
        assert [i["backoff_s"] for i in ws.incidents()] == [0.0], ws.incidents()
    for ws in hosts:
        _one_restart(ws, outs)
    final = json.loads((tmp_path / "final.json").read_text())["w"]
    assert final == _fault_free(), (final, _fault_free())
