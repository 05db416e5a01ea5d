"""Who a job runs as, and what its first process does between fork and exec.

A job with ``user:`` runs with that user's uid, primary group and
supplementary groups (what ``runuser`` and ``setpriv --init-groups`` give),
or with ``group:`` as its primary group instead; never with ours.

Order matters in the child: it first joins its cgroup (only we, root, may
write there), then drops privileges (groups, gid, uid), then asks for a
parent-death signal (a credential change clears it) and checks that its
parent did not die before it asked. CPython's ``user=``/``group=`` would
drop privileges before ``preexec_fn`` runs, too early to join a root-owned
cgroup, so the drop is done here. The child is a fork of a process with
threads: the function does no imports, no logging, no allocation of locks.
"""

from __future__ import annotations

import ctypes
import errno
import grp
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass

from trainwatch.config.fields import numeric_id

_PR_SET_PDEATHSIG = 1
_SIGKILL = 9


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    groups: tuple[int, ...]
    name: str | None  # the user's name, when a user was named
    home: str | None


def resolve(user: str | None, group: str | None) -> Identity | None:
    """The credentials for a job's user/group; None: run as we do. A string of ASCII
    digits is a uid or gid. Raises KeyError (no such user) or OSError (no such
    group, or not ours to give)."""
    if user is None and group is None:
        return None
    pw = None
    if user is not None:
        try:
            uid = numeric_id(user)
            pw = pwd.getpwuid(uid) if uid is not None else pwd.getpwnam(user)
        except (ValueError, OverflowError):  # beyond uid_t, or a NUL: nobody's
            raise KeyError(user) from None
    if group is not None:
        try:
            gid_ = numeric_id(group)
            gid = (grp.getgrgid(gid_) if gid_ is not None else grp.getgrnam(group)).gr_gid
        except (KeyError, ValueError, OverflowError):
            raise OSError(errno.EINVAL, f"no such group {group!r}") from None
    else:
        assert pw is not None
        gid = pw.pw_gid
    if pw is not None:
        ident = Identity(pw.pw_uid, gid, tuple(os.getgrouplist(pw.pw_name, gid)), pw.pw_name,
                         pw.pw_dir)
    else:
        ident = Identity(os.geteuid(), gid, (gid,), None, None)
    if os.geteuid() != 0 and not _is_ours(ident):
        who = ident.name or f"group {group}"
        raise PermissionError(errno.EPERM, f"cannot run the job as {who}: only root can "
                                           "start a job as another user or group")
    return ident


def _is_ours(ident: Identity) -> bool:
    return ident.uid == os.geteuid() and ident.gid == os.getegid()


_prctl: Callable[..., int] | None = None


def _libc_prctl() -> Callable[..., int] | None:
    global _prctl
    if _prctl is None:
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            return None
    return _prctl


def child_setup(cgroup_fd: int | None, ident: Identity | None,
                die_with_parent: bool) -> Callable[[], None]:
    """The ``preexec_fn`` for a job's leader. Everything it needs is computed
    here, in the parent."""
    drop = ident is not None and os.geteuid() == 0
    uid, gid = (ident.uid, ident.gid) if ident is not None else (-1, -1)
    groups = list(ident.groups) if ident is not None else []
    prctl = _libc_prctl() if die_with_parent else None
    parent = os.getpid()
    write, setgroups, setresgid, setresuid = os.write, os.setgroups, os.setresgid, os.setresuid
    getppid, exit_ = os.getppid, os._exit

    def setup() -> None:
        if cgroup_fd is not None:
            write(cgroup_fd, b"0")  # "0": the writing process itself
        if drop:
            setgroups(groups)
            setresgid(gid, gid, gid)
            setresuid(uid, uid, uid)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
            if getppid() != parent:
                exit_(1)  # the parent died before we asked to die with it

    return setup
