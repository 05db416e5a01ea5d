"""The watcher that takes an attempt down if trainwatch is SIGKILLed (attempt.py
starts one per attempt under ``die_with_parent``, as `trainwatch run` does): a
``/bin/sh`` in a session of its own reading a pipe only we hold; a line from us
stands it down, end of file without one means we are gone."""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger("trainwatch")
# The watcher that takes the attempt down if `trainwatch run` is SIGKILLed
# (see start): it reads its stdin, a pipe only we hold; a line from us stands
# it down, end of file without one means we are gone.
# With a cgroup ($0): kill every process in it and remove it once empty.
CGROUP = ('read -r x || { echo 1 > "$0/cgroup.kill"; for i in 1 2 3 4 5 6 7 8 9 10; do '
                 'rmdir "$0" 2>/dev/null && break; sleep 1; done; }')
# Without one ($0: the leader's pid, its process group and session id): one
# snapshot of /proc ("pid ppid pgrp sid" of each live process), the members are
# those in that session or group and, to a fixed point, the children of a
# member; then SIGKILL to the group and to each member. Again (up to 5 passes)
# for what was forked meanwhile.
SESSION = r"""read -r x && exit 0
n=$0
case $n in ''|*[!0-9]*|0|1) exit 2;; esac
for i in 1 2 3 4 5; do
  s=
  for d in /proc/[0-9]*; do
    { read -r l < "$d/stat"; } 2>/dev/null || continue
    set -f; set -- ${l##*") "}; set +f
    [ "$1" = Z ] || s="$s${d#/proc/} $2 $3 $4
"
  done
  m=" "
  while read -r p pp g sid; do
    [ "$g" = "$n" ] || [ "$sid" = "$n" ] && m="$m$p "
  done <<E
$s
E
  k=
  while [ "$k" != "$m" ]; do
    k=$m
    while read -r p pp g sid; do
      case $m in *" $p "*) ;; *" $pp "*) m="$m$p ";; esac
    done <<E
$s
E
  done
  [ "$i" = 1 ] && kill -s KILL -- "-$n" 2>/dev/null
  [ "$m" = " " ] && exit 0
  kill -s KILL $m 2>/dev/null
  [ "$i" = 1 ] || sleep 1
done
"""
# pidfds of watchers stood down but not yet reaped (see reap).
_stood_down: list[int] = []




def start(script: str, target: str) -> tuple[int, int, int | None] | None:
    """Start the watcher that ends the attempt if we die without closing it
    (SIGKILL): ``target`` is its cgroup, else the leader's pid. Returns (pid,
    fd to stand it down, pidfd to reap it by) or None when it cannot start.

    Without a cgroup it reaches the leader's process group and session and
    what descends from a member still alive then: a process that left both
    session and group (setsid) and whose parent is gone too (the leader dies
    with us: PR_SET_PDEATHSIG) is out of reach, as is what was forked between
    its last pass and its kill. Strangers: a process group or session id is
    the leader's pid, and a pid is not reused while any process still has it as
    its group or session id, so the group and session it kills are the job's.
    The residual risk: the leader is reaped by init and every member is gone
    before the watcher runs, and the pid counter wraps round to the leader's
    pid for a new group or session leader in that moment. A member's pid read
    from /proc may likewise be freed and reused before the kill (the usual
    race of kill(2), milliseconds wide, after pid_max forks)."""
    reap()  # those stood down by earlier attempts
    try:
        r, w = os.pipe2(os.O_CLOEXEC)
    except OSError:
        return None
    try:
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            # posix_spawn, not Popen: no Popen bookkeeping may ever wait on this
            # pid after it was reaped (by us, or the supervisor's stray reaper).
            pid = os.posix_spawn("/bin/sh", ["/bin/sh", "-c", script, target], {},
                                 file_actions=[(os.POSIX_SPAWN_DUP2, r, 0),
                                               (os.POSIX_SPAWN_DUP2, null, 1),
                                               (os.POSIX_SPAWN_DUP2, null, 2)],
                                 setsid=True)
        finally:
            os.close(null)
    except OSError as e:
        os.close(w)
        log.warning("cannot start the watcher that ends the job with trainwatch: %s",
                    e.strerror or e)
        return None
    finally:
        os.close(r)
    pidfd: int | None = None
    # Our unreaped child: the pid is its own. Reaping through the pidfd can never
    # take the status of another child (a new leader) given the pid after it.
    with contextlib.suppress(OSError, AttributeError):
        pidfd = os.pidfd_open(pid)
    return pid, w, pidfd


def stand_down(pid: int, w: int, pidfd: int | None) -> None:
    """Tell the watcher we closed the attempt: it exits at once, killing nothing."""
    with contextlib.suppress(OSError):
        os.write(w, b"exit\n")
    os.close(w)
    if pidfd is not None:
        _stood_down.append(pidfd)
    reap()


def reap() -> None:
    """Reap the stood-down watchers that have exited (WNOHANG); one still
    exiting is tried again at the next close() or start. Without a pidfd (an
    old kernel) the supervisor's stray reaper reaps it."""
    for fd in list(_stood_down):
        try:
            if os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG) is None:
                continue  # not yet exited
        except ChildProcessError:
            pass  # reaped already (the supervisor's stray reaper)
        except OSError:
            pass  # cannot wait on it: leave it to the stray reaper
        _stood_down.remove(fd)
        os.close(fd)
