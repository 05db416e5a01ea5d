"""The users and groups the tests make: names of this run's own, made fresh, removed
at the end (conftest.py re-exports these, its hooks and its fixture)."""

from __future__ import annotations

import atexit
import contextlib
import grp
import hashlib
import os
import pwd
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest


def missing(why: str) -> None:
    """What this machine lacks skips a test here; in CI (CI=true) it fails instead."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must have this: {why}")
    pytest.skip(why)


def need_root(what: str) -> None:
    """Acting as other users, mounting, cgroups: root, as in CI (where a lack fails)."""
    if os.geteuid() != 0:
        missing(f"needs root: {what}")


@contextlib.contextmanager
def accounts() -> Iterator[None]:
    """Held while a test adds or removes a user or a group: the suite runs in several
    processes (pytest-xdist), and useradd fails outright when another holds
    /etc/passwd's lock."""
    import fcntl

    with open("/tmp/trainwatch-tests-accounts.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# --- users and groups of this run ----------------------------------------------------
#
# Every user and group the tests make has a name of this run's own, tw<run><worker><role>
# (run: 6 hex digits, shared by the xdist workers of one run; worker: w0, w1, ... or
# none without xdist), is made fresh by the process that uses it (a name that exists
# already is an error, never adopted: it is not ours) and is removed when that process's
# session ends, even when tests fail (a session fixture; pytest_sessionfinish and atexit
# for a run cut short; the xdist controller sweeps what a crashed worker left). So two
# suites, or a suite and a person, never meet in one account. A test names its accounts
# by role: ALICE = run_name("alice"), then local_user(ALICE).

_NAME_MAX = 32  # useradd's longest name
_ROLE = re.compile(r"[a-z][a-z0-9]*")
_prefix: str | None = None  # tw<run><worker>, set by pytest_configure
_sweep: str | None = None  # the xdist controller's: its workers' tw<run>w


@dataclass
class _Made:
    """The accounts this process made, in the order made, with their ids."""

    pid: int = field(default_factory=os.getpid)
    users: dict[str, int | None] = field(default_factory=dict)
    groups: dict[str, int | None] = field(default_factory=dict)


_made = _Made()


def _run_token(run: str) -> str:
    """6 hex digits of a run's id (xdist's testrunuid may be any text, --testrunuid)."""
    return hashlib.sha256(run.encode()).hexdigest()[:6]


def pytest_configure(config: pytest.Config) -> None:
    """This process's prefix for account names. An xdist worker takes the run's id
    from its controller, which chooses it here (xdist hands config.option.testrunuid
    to every worker it starts); a run without xdist draws its own."""
    global _prefix, _sweep
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        worker = "".join(c for c in str(workerinput["workerid"]) if c.isdigit())
        _prefix = f"tw{_run_token(str(workerinput['testrunuid']))}w{worker}"
        return
    run = getattr(config.option, "testrunuid", None) or uuid.uuid4().hex
    if hasattr(config.option, "testrunuid"):  # xdist is loaded: its workers get this run
        config.option.testrunuid = run
        _sweep = f"tw{_run_token(run)}w"
    _prefix = f"tw{_run_token(run)}"


def run_name(role: str) -> str:
    """This run's name for the user or group a test calls ``role`` (lowercase letters
    and digits): tw<run><worker><role>, made by local_user() or local_group()."""
    global _prefix
    if _prefix is None:  # imported outside a pytest session: a run of its own
        _prefix = f"tw{_run_token(uuid.uuid4().hex)}"
    name = _prefix + role
    if not _ROLE.fullmatch(role) or len(name) > _NAME_MAX:
        raise ValueError(f"{role!r}: a role is lowercase letters and digits, at most "
                         f"{_NAME_MAX - len(_prefix)} of them")
    return name


def _ours(name: str) -> None:
    if _prefix is None or not name.startswith(_prefix) or not _ROLE.fullmatch(
            name[len(_prefix):]):
        raise ValueError(f"{name!r} is not a name of this run: use run_name(role)")


def _absent(name: str) -> None:
    """The tests never adopt an account: one that holds this run's name is not theirs."""
    for kind, look in (("user", pwd.getpwnam), ("group", grp.getgrnam)):
        with contextlib.suppress(KeyError):
            look(name)
            pytest.fail(f"a {kind} {name} exists already, not made by this test process: "
                        "the tests use accounts of their own only (remove it if a killed "
                        "run left it)")


def _tool(*argv: str) -> subprocess.CompletedProcess[str]:
    """useradd, usermod, userdel, groupadd, groupdel: again while another program (a
    person's useradd, say) holds the lock of /etc/passwd or /etc/group."""
    for _ in range(100):
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if p.returncode == 0 or "cannot lock" not in p.stderr:
            break
        time.sleep(0.1)
    return p


def _check(p: subprocess.CompletedProcess[str]) -> None:
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, p.args))}: exit {p.returncode}: "
                             f"{p.stderr.strip()}")


def local_user(name: str) -> pwd.struct_passwd:
    """The local system user ``name`` (a run_name()) and its own group, made by this
    process at the first call and removed at the end of its session."""
    _ours(name)
    if name in _made.users:
        return pwd.getpwnam(name)
    need_root(f"create the test user {name}")
    with accounts():
        _absent(name)
        p = _tool("useradd", "--system", "--no-create-home", "--user-group", "--shell",
                  "/usr/sbin/nologin", name)
        _check(p)
        _remember(name, "users")
        pw = pwd.getpwnam(name)
        _made.users[name] = pw.pw_uid
        own = grp.getgrgid(pw.pw_gid)
        if own.gr_name == name:  # --user-group's: userdel removes it, or we do
            _made.groups[name] = own.gr_gid
        return pw


def local_group(name: str, members: tuple[str, ...] = ()) -> grp.struct_group:
    """The local system group ``name`` (a run_name()), made by this process at the
    first call and removed at the end of its session, with ``members`` (users of
    local_user()) in it as a supplementary group."""
    _ours(name)
    for user in members:
        if user not in _made.users:
            raise ValueError(f"{user!r}: only a user of local_user() joins a test group")
    need_root(f"create the test group {name}")
    with accounts():
        if name not in _made.groups:
            _absent(name)
            _check(_tool("groupadd", "--system", name))
            _remember(name, "groups")
            _made.groups[name] = grp.getgrnam(name).gr_gid
        for user in members:
            if user not in grp.getgrnam(name).gr_mem:
                _check(_tool("usermod", "-aG", name, user))
        return grp.getgrnam(name)


def _remember(name: str, kind: str) -> None:
    """Note an account made, before anything else can fail; atexit once."""
    if not _made.users and not _made.groups:
        atexit.register(_remove_at_exit)
    getattr(_made, kind)[name] = None


def _remove_user(name: str, uid: int | None) -> str | None:
    """Remove a user of this run; what went wrong, or None."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return None
    if uid is not None and pw.pw_uid != uid:
        return f"user {name}: uid {pw.pw_uid}, not the {uid} made: left alone"
    # A process still running as the user (a job or helper a failed test left behind)
    # makes userdel refuse ("currently used by process", exit 8). The uid is this
    # run's alone, so killing what runs as it (real or effective) ends only the tests'
    # own processes.
    for by in ("-U", "-u"):
        subprocess.run(["pkill", "-KILL", by, str(pw.pw_uid)], capture_output=True,
                       timeout=30, check=False)
    p = _tool("userdel", name)
    if p.returncode == 8:
        # A killed process stays the user's until its parent reaps it (a zombie keeps
        # its uid in /proc): -f removes the account anyway. Without -r it touches no
        # home (there is none: --no-create-home) and the group it removes with the
        # user is the user's own, this run's.
        time.sleep(0.5)
        p = _tool("userdel", "-f", name)
    return None if p.returncode == 0 else f"userdel {name}: {p.stderr.strip()}"


def _remove_group(name: str, gid: int | None) -> str | None:
    try:
        g = grp.getgrnam(name)
    except KeyError:
        return None  # a user's own group, gone with it
    if gid is not None and g.gr_gid != gid:
        return f"group {name}: gid {g.gr_gid}, not the {gid} made: left alone"
    p = _tool("groupdel", name)
    return None if p.returncode == 0 else f"groupdel {name}: {p.stderr.strip()}"


def remove_accounts() -> list[str]:
    """Remove every user, then every group, this process made (a group cannot go
    while it is a user's primary group); what could not be removed, one line each."""
    if _made.pid != os.getpid() or not (_made.users or _made.groups):
        return []  # none, or a forked child's copy: the parent's to remove
    problems: list[str] = []
    with accounts():
        for name, uid in reversed(list(_made.users.items())):
            if (why := _remove_user(name, uid)) is None:
                del _made.users[name]
            else:
                problems.append(why)
        for name, gid in reversed(list(_made.groups.items())):
            if (why := _remove_group(name, gid)) is None:
                del _made.groups[name]
            else:
                problems.append(why)
    return problems


def _remove_at_exit() -> None:
    for why in remove_accounts():
        print(f"conftest: left behind: {why}", file=sys.stderr)


@pytest.fixture(scope="session", autouse=True)
def _accounts_removed() -> Iterator[None]:
    """Set up first and torn down last: every other fixture (a daemon with jobs as
    these users) is done by then. A failure to remove is this session's error."""
    yield
    problems = remove_accounts()
    if problems:
        pytest.fail("test accounts left behind: " + "; ".join(problems))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session cut short (^C, -x) skips fixture teardown: remove the accounts here.
    The xdist controller removes those of its run that a crashed worker left."""
    problems = remove_accounts()
    if _sweep is not None and os.geteuid() == 0:
        workers = re.compile(re.escape(_sweep) + r"[0-9]+[a-z][a-z0-9]*")
        with accounts():
            problems += [why for pw in pwd.getpwall() if workers.fullmatch(pw.pw_name)
                         if (why := _remove_user(pw.pw_name, None)) is not None]
            problems += [why for g in grp.getgrall() if workers.fullmatch(g.gr_name)
                         if (why := _remove_group(g.gr_name, None)) is not None]
    for why in problems:
        print(f"conftest: left behind: {why}", file=sys.stderr)
