"""Who may read and reach trainwatch's files: private folders it can trust,
and modes and owners set without ever following a symlink.

A folder is trusted when it is owned by us (or root) and nobody else may
write to it: then no other user can plant or swap a file or a symlink inside
it. Modes and owners are set through an ``O_PATH | O_NOFOLLOW`` descriptor
(``/proc/self/fd/N``), so a path that is a symlink is refused, not followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat


class UnsafeDir(OSError):
    """A folder another user controls (or could): refused, one line."""


def set_mode(path: str | os.PathLike[str], mode: int, uid: int = -1, gid: int = -1) -> None:
    """chmod (and chown when uid/gid are not -1) ``path`` itself, never a
    symlink's target. Raises OSError (ELOOP for a symlink)."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            raise OSError(errno.ELOOP, "is a symlink; refusing to follow it", os.fspath(path))
        via = f"/proc/self/fd/{fd}"
        if uid != -1 or gid != -1:
            os.chown(via, uid, gid)
        os.chmod(via, mode)
    finally:
        os.close(fd)


def _check(path: str, st: os.stat_result, me: int) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDir(errno.ELOOP, f"{path}: is a symlink (refused: expected a folder "
                                     "trainwatch owns)", path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDir(errno.ENOTDIR, f"{path}: not a folder", path)
    if st.st_uid not in (me, 0):
        raise UnsafeDir(errno.EPERM, f"{path}: owned by uid {st.st_uid}, not by uid {me} "
                                     "(refused: another user could swap its files)", path)
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDir(errno.EPERM, f"{path}: writable by every user (mode "
                                     f"{stat.S_IMODE(st.st_mode):04o}; refused)", path)
    _check_group(path, st)


def _check_group(path: str, st: os.stat_result, below: str | None = None) -> None:
    """Group write is another user's write unless the group is ours (root's, for
    root), whoever owns the folder; the sticky bit still keeps entries in place."""
    if st.st_mode & stat.S_IWGRP and not st.st_mode & stat.S_ISVTX \
            and st.st_gid != os.getegid():
        what = f" (refused for {below})" if below else " (refused)"
        raise UnsafeDir(errno.EPERM, f"{path}: writable by group {st.st_gid}, mode "
                                     f"{stat.S_IMODE(st.st_mode):04o}{what}", path)


_MAX_LINKS = 40  # as the kernel's (ELOOP)


def _refuse_owner(at: str, st: os.stat_result, me: int, path: str) -> None:
    if st.st_uid not in (me, 0):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "a folder"
        raise UnsafeDir(errno.EPERM, f"{at}: {what} owned by uid {st.st_uid}, not by uid {me} "
                                     f"(refused for {path}: another user could swap it)", at)


def _check_ancestors(path: str, me: int) -> None:
    """Every folder above ``path``, walked from / as systemd's chase() with CHASE_SAFE
    walks it, whatever fs.protected_symlinks says: each component must be ours or
    root's, a folder not open to others' renames (world-writable only with the
    sticky bit, as /tmp is); a symlink of ours or root's is followed and what it
    names walked in turn, another user's is refused. A component not there yet ends
    the walk (we make it). Resolved first and judged after, a user's link planted
    in /tmp above the path led root into a folder of root's own, and wrote there."""
    todo = [c for c in os.path.dirname(os.path.abspath(path)).split("/") if c]
    at, links = "/", 0
    st = os.lstat(at)
    while True:
        _refuse_owner(at, st, me, path)
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise UnsafeDir(errno.EPERM, f"{at}: writable by every user (refused for {path})", at)
        _check_group(at, st, path)
        while todo and todo[0] in (".", ".."):
            at = os.path.dirname(at) if todo.pop(0) == ".." else at
        if not todo:
            return
        nxt = os.path.join(at, todo.pop(0))
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            _refuse_owner(nxt, st, me, path)
            links += 1
            if links > _MAX_LINKS:
                raise UnsafeDir(errno.ELOOP, f"{nxt}: too many symlinks (refused for {path})",
                                nxt)
            target = os.readlink(nxt)
            todo = [c for c in target.split("/") if c] + todo
            if target.startswith("/"):
                at, st = "/", os.lstat("/")
            else:
                st = os.lstat(at)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeDir(errno.ENOTDIR, f"{nxt}: not a folder (refused for {path})", nxt)
        at = nxt


def private_dir(path: str | os.PathLike[str], mode: int = 0o700) -> None:
    """Create ``path`` (and missing parents, 0755) with ``mode``, or check that
    the existing folder is one only we (or root) control; so must be every
    folder above it. A folder we create gets exactly ``mode``; an existing one
    is never loosened or tightened, only judged. Raises UnsafeDir (one line)
    or OSError."""
    p = os.path.abspath(os.fspath(path))
    me = os.geteuid()
    parent = os.path.dirname(p)
    _check_ancestors(p, me)  # before anything is created in them
    if parent != p and not os.path.isdir(parent):
        with contextlib.suppress(FileExistsError):
            os.makedirs(parent, mode=0o755)
        _check_ancestors(p, me)  # one planted while they were made is refused too
    try:
        os.mkdir(p, mode)
    except FileExistsError:
        _check(p, os.lstat(p), me)
    else:
        set_mode(p, mode)  # mkdir's mode passes through the umask
