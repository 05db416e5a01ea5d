"""What each local user may see of the incident pages served on the metrics
port (pageserve.py): the control socket's rule (privsep/access.py). Root, the
daemon's user and the admin group see every job's incidents; any other local
user only those of the jobs that run as them; a job no longer in the config
(removed, or an attached Slurm job forgotten) is the admins' alone; a client
on another host sees nothing (there is no local user to vouch for it).
"""

from __future__ import annotations

import html
import pwd
from collections.abc import Callable
from typing import Any

from trainwatch.privsep.access import Peers, may
from trainwatch.state.ledger import Ledger

MAX_ROWS = 2000  # newest incidents an index lists


def _plain(text: str) -> bytes:
    return f"<!doctype html><meta charset=utf-8><p>{html.escape(text)}".encode()


def _gid(uid: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return -1


class IncidentPages:
    """(path, uid) -> (HTTP status, page), for pageserve.PageWorker. ``owners``
    gives each job's ``user:`` now (called in the page thread: a copy)."""

    def __init__(self, state_dir: str, owners: Callable[[], dict[str, str | None]],
                 grafana: str | None = None, peers: Peers | None = None) -> None:
        self.state_dir, self.owners, self.grafana = state_dir, owners, grafana
        self.peers = peers or Peers()

    def __call__(self, path: str, uid: int | None) -> tuple[int, bytes]:
        from trainwatch.evidence import page  # the renderer, loaded on the first page

        if uid is None:
            return 403, _plain("incident pages are served to the users of this host only")
        parts = [p for p in path.split("/") if p]
        if parts[:1] != ["incidents"] or len(parts) > 2 \
                or (len(parts) == 2 and not parts[1].isdigit()):
            return 404, _plain("no such page: /incidents/ or /incidents/N")
        rows = self._rows(uid)
        if len(parts) == 1:
            return 200, page.index_page(self.state_dir, rows, self.grafana,
                                        link_to="/incidents/{id}").encode()
        row = next((r for r in rows if r.get("id") == int(parts[1])), None)
        if row is None:  # none, or not this user's: the same answer
            return 404, _plain(f"no incident {parts[1]} of yours")
        return 200, page.incident_page(self.state_dir, row, self.grafana).encode()

    def _rows(self, uid: int) -> list[dict[str, Any]]:
        peer = self.peers.peer(0, uid, _gid(uid))
        owners = self.owners()
        ledger = Ledger(self.state_dir, readonly=True)
        try:
            rows = ledger.incidents()[-MAX_ROWS:]
        finally:
            ledger.close()
        return [r for r in rows
                if peer.admin or (r.get("job") in owners and may(peer, owners[r["job"]]))]
