"""Who may read and act on which jobs over the control socket: the rule Slurm
applies to ``scontrol``, decided per request from the sender's credentials.

The kernel vouches for each request's pid, uid and gid (SO_PASSCRED on the
control socket); the group database adds the sender's supplementary groups (a
datagram carries only the primary gid). An *admin* is root, the daemon's own
user, or a member of the admin group (the config's ``admin_group``, by default
``trainwatch``: ``GROUP``): admins read and act on
every job and alone make host-wide requests (``reload``, GPU drills). Any
other local user reads and acts only on the jobs that run as that user (the
job's ``user:``; a job without one runs as the daemon's user, so under a root
daemon only admins may touch it).

Lookups in the user and group databases may be slow (LDAP, sssd) and anyone
may now send requests, so a sender's verdict and a job's owner are cached for
``TTL`` seconds: a user added to or removed from the admin group is seen within
that time. Standard library only.
"""

from __future__ import annotations

import grp
import os
import pwd
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

GROUP = "trainwatch"  # the admin group, unless the config's admin_group names another
TTL = 30.0  # seconds a sender's verdict or a job's owner is cached
_CACHE_MAX = 1024  # cached senders or owners; the cache is emptied when full

__all__ = ["GROUP", "TTL", "Peer", "Peers", "Refused", "admin_only", "check", "may", "mine",
           "owner_of"]


class Refused(Exception):
    """A request this sender may not make: one line, counted as refused."""


@dataclass(frozen=True)
class Peer:
    """The sender of one request, as the kernel and the group database say."""

    pid: int
    uid: int
    gid: int
    name: str | None  # the user's name; None without a passwd entry
    admin: bool  # root, the daemon's user or the admin group: every job

    def __str__(self) -> str:
        return f"uid {self.uid} ({self.name})" if self.name else f"uid {self.uid}"


class Peers:
    """Credentials -> Peer, cached per (uid, gid) for TTL seconds."""

    def __init__(self, group: str = GROUP, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.group = group
        self.gid: int | None
        if group.isascii() and group.isdigit():  # a gid, as config.fields.numeric_id reads it
            self.gid = int(group)
        else:
            try:
                self.gid = grp.getgrnam(group).gr_gid
            except KeyError:
                self.gid = None  # no such group: root and the daemon's user are the admins
        self.daemon_uid = os.geteuid()
        self.clock = clock
        self._cache: dict[tuple[int, int], tuple[float, str | None, bool]] = {}

    def peer(self, pid: int, uid: int, gid: int) -> Peer:
        now = self.clock()
        hit = self._cache.get((uid, gid))
        if hit is None or hit[0] <= now:
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()  # many uids at once: drop them all, not one per call
            name, admin = self._look_up(uid, gid)
            hit = (now + TTL, name, admin)
            self._cache[(uid, gid)] = hit
        return Peer(pid, uid, gid, hit[1], hit[2])

    def _look_up(self, uid: int, gid: int) -> tuple[str | None, bool]:
        try:
            name: str | None = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = None
        if uid in (0, self.daemon_uid):
            return name, True
        if self.gid is None:
            return name, False
        if gid == self.gid:
            return name, True
        if name is None:  # a uid with no passwd entry has no supplementary groups
            return name, False
        try:
            return name, self.gid in os.getgrouplist(name, gid)
        except OSError:
            return name, False


# --- a job's owner -----------------------------------------------------------------

_owners: dict[str | None, tuple[float, int | None, str]] = {}


def owner_of(user: str | None, clock: Callable[[], float] = time.monotonic
             ) -> tuple[int | None, str]:
    """The uid a job with this ``user:`` runs as, and a name for it; uid None when
    the user is no longer in the passwd database (then only admins may touch it)."""
    now = clock()
    hit = _owners.get(user)
    if hit is None or hit[0] <= now:
        if len(_owners) >= _CACHE_MAX:
            _owners.clear()
        uid, name = _look_up_owner(user)
        hit = (now + TTL, uid, name)
        _owners[user] = hit
    return hit[1], hit[2]


def _look_up_owner(user: str | None) -> tuple[int | None, str]:
    try:
        if user is None:  # the job runs as the daemon does
            uid = os.geteuid()
            return uid, pwd.getpwuid(uid).pw_name
        if user.isascii() and user.isdigit():  # a uid, as config.fields.numeric_id reads it
            uid = int(user)
            return uid, pwd.getpwuid(uid).pw_name
        return pwd.getpwnam(user).pw_uid, user
    except (KeyError, ValueError, OverflowError):
        return (os.geteuid() if user is None else None), user or f"uid {os.geteuid()}"


def may(peer: Peer, user: str | None) -> bool:
    """May this sender read and act on a job with this ``user:``?"""
    if peer.admin:
        return True
    uid, _ = owner_of(user)
    return uid is not None and uid == peer.uid


def check(peer: Peer, job: str, user: str | None, act: bool = True) -> None:
    """Raise Refused, one line, unless this sender may act on (or read) the job."""
    if may(peer, user):
        return
    _, name = owner_of(user)
    verb = "act on" if act else "read"
    raise Refused(f"job {job} runs as {name}; {peer} may {verb} only its own jobs")


def admin_only(peer: Peer, what: str, group: str = GROUP) -> None:
    """Raise Refused, one line, unless the sender is an admin (a host-wide request)."""
    if not peer.admin:
        raise Refused(f"{what} is for root and the {group} group only; {peer} may act "
                      "only on its own jobs")


def mine(peer: Peer, jobs: Iterable[tuple[str, str | None]]) -> list[str]:
    """The names of the jobs (name, user) this sender may see."""
    return [name for name, user in jobs if may(peer, user)]
