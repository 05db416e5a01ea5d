"""`make install DESTDIR=... PREFIX=/usr/local` (one real install per session: pip
is slow), then the installed tree is checked where it will live: a private mount
namespace lays DESTDIR over /usr/local and /etc (read-only overlays), so the unit's
ExecStart, the entry script's shebang and the venv resolve at their final paths."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trainwatch
from conftest import missing, need_root

REPO = Path(__file__).resolve().parent.parent
PREFIX = "/usr/local"
UNIT = "/etc/systemd/system/trainwatch.service"  # where a PREFIX other than /usr puts it
VENV_PYTHON = f"{PREFIX}/lib/trainwatch/bin/python"


def clean_env() -> dict[str, str]:
    """Our environment without what would point Python or make at this checkout."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def need_tool(name: str) -> None:
    if shutil.which(name) is None:
        missing(f"{name} is not installed (.ci/run installs it)")


@pytest.fixture(scope="module")
def destdir() -> Iterator[Path]:
    """The tree `make install` wrote into a fresh DESTDIR."""
    need_tool("make")
    root = Path(tempfile.mkdtemp(prefix="twinst", dir="/tmp"))
    try:
        p = subprocess.run(
            ["make", "-s", "-C", str(REPO), "install", f"DESTDIR={root}", f"PREFIX={PREFIX}"],
            capture_output=True, text=True, timeout=1200, check=False, env=clean_env(),
        )
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "warning: systemd-python did not build" not in p.stderr, p.stderr[-3000:]
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def installed(root: Path, *cmd: str) -> subprocess.CompletedProcess[str]:
    """Run cmd with DESTDIR's usr/local and etc laid over the real ones (a private mount
    namespace: nothing outside this one command sees them)."""
    need_root("mounting overlays in a private mount namespace")
    need_tool("unshare")
    script = (
        "set -e; mount --make-rprivate /;"
        f' mount -t overlay overlay -o "lowerdir=$0{PREFIX}:{PREFIX}" {PREFIX};'
        ' mount -t overlay overlay -o "lowerdir=$0/etc:/etc" /etc;'
        ' exec "$@"'
    )
    return subprocess.run(["unshare", "--mount", "sh", "-c", script, str(root), *cmd],
                          capture_output=True, text=True, timeout=120, check=False,
                          env=clean_env())


def test_install_leaves_no_destdir_path_behind(destdir: Path) -> None:
    """The venv is relocated: no file mentions DESTDIR, the shebang is the final path."""
    p = subprocess.run(["grep", "-rlF", str(destdir), str(destdir)],
                       capture_output=True, text=True, check=False)
    assert p.stdout == "", p.stdout[:2000]
    script = destdir / f"{PREFIX[1:]}/lib/trainwatch/bin/trainwatch"
    assert script.read_text().splitlines()[0] == f"#!{VENV_PYTHON}"
    for name in ("trainwatch", "faultinject"):
        link = destdir / f"{PREFIX[1:]}/bin/{name}"
        assert os.readlink(link) == f"../lib/trainwatch/bin/{name}"


def test_installed_unit_passes_systemd_analyze_verify(destdir: Path) -> None:
    """The unit, with @PREFIX@ replaced, verifies where installed (ExecStart exists)."""
    need_tool("systemd-analyze")
    text = (destdir / UNIT[1:]).read_text()
    assert "@PREFIX@" not in text
    assert re.search(rf"^ExecStart={PREFIX}/bin/trainwatch daemon --config "
                     r"/etc/trainwatch/trainwatch.yaml$", text, re.M)
    p = installed(destdir, "systemd-analyze", "verify", UNIT)
    assert p.returncode == 0 and "trainwatch" not in p.stdout + p.stderr, p.stdout + p.stderr


def test_installed_cli_runs_from_its_own_venv(destdir: Path) -> None:
    """/usr/local/bin/trainwatch runs, from the installed venv, with the systemd extra."""
    p = installed(destdir, f"{PREFIX}/bin/trainwatch", "--version")
    assert (p.returncode, p.stdout.strip()) == (0, f"trainwatch {trainwatch.__version__}"), \
        p.stderr
    p = installed(destdir, f"{PREFIX}/bin/faultinject", "--help")
    assert p.returncode == 0, p.stderr
    p = installed(destdir, VENV_PYTHON, "-c",
                  "import sys, systemd.daemon, trainwatch.host.service;"
                  " print(sys.prefix, trainwatch.host.service.__file__)")
    assert p.returncode == 0, p.stderr
    prefix, module = p.stdout.split()
    assert prefix == f"{PREFIX}/lib/trainwatch"
    assert module.startswith(f"{PREFIX}/lib/trainwatch/lib/")  # not this checkout


def test_installed_default_config_validates(destdir: Path) -> None:
    """The installed /etc/trainwatch/trainwatch.yaml (no jobs yet) passes check-config."""
    p = installed(destdir, f"{PREFIX}/bin/trainwatch", "check-config",
                  "/etc/trainwatch/trainwatch.yaml")
    assert p.returncode == 0, p.stdout + p.stderr


def test_install_keeps_an_operators_config(destdir: Path) -> None:
    """Installing again never overwrites /etc/trainwatch/trainwatch.yaml."""
    config = destdir / "etc/trainwatch/trainwatch.yaml"
    assert config.read_text() == (REPO / "config/default.yaml").read_text()
    config.write_text("# the operator's own\n")
    try:
        p = subprocess.run(["make", "-s", "-C", str(REPO), "install-files",
                            f"DESTDIR={destdir}", f"PREFIX={PREFIX}"],
                           capture_output=True, text=True, timeout=60, check=False,
                           env=clean_env())
        assert p.returncode == 0, p.stderr
        assert config.read_text() == "# the operator's own\n"
        assert "kept the existing" in p.stdout
    finally:
        shutil.copyfile(REPO / "config/default.yaml", config)


def test_sysusers_and_tmpfiles_apply_from_where_installed(destdir: Path) -> None:
    """systemd-sysusers and systemd-tmpfiles find trainwatch.conf by name where installed
    and create the group and the two directories (in a copy of the tree)."""
    need_root("systemd-tmpfiles creating root-owned directories")
    need_tool("systemd-sysusers")
    need_tool("systemd-tmpfiles")
    root = Path(tempfile.mkdtemp(prefix="twsys", dir="/tmp"))
    try:
        shutil.copytree(destdir / "etc", root / "etc", symlinks=True)
        p = subprocess.run(["systemd-sysusers", f"--root={root}", "trainwatch.conf"],
                           capture_output=True, text=True, timeout=60, check=False)
        assert p.returncode == 0, p.stderr
        groups = [line.split(":")[0] for line in (root / "etc/group").read_text().splitlines()]
        assert "trainwatch" in groups
        p = subprocess.run(["systemd-tmpfiles", f"--root={root}", "--create", "trainwatch.conf"],
                           capture_output=True, text=True, timeout=60, check=False)
        assert p.returncode == 0, p.stderr
        for d in ("run/trainwatch", "var/lib/trainwatch"):
            st = (root / d).stat()
            assert (oct(st.st_mode & 0o7777), st.st_uid, st.st_gid) == ("0o755", 0, 0)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_default_config_example_job_validates(tmp_path: Path) -> None:
    """The commented example job in config/default.yaml is valid once uncommented."""
    lines = (REPO / "config/default.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("jobs:"))
    out = [*lines[:start], "jobs:"]
    for line in lines[start + 1:]:
        out.append(line[1:] if line.startswith("#  ") else line)
    (tmp_path / "example.yaml").write_text("\n".join(out) + "\n")
    p = subprocess.run([sys.executable, "-m", "trainwatch.cli", "check-config",
                        str(tmp_path / "example.yaml")],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0 and "1 job(s): llama-pretrain" in p.stdout, p.stdout + p.stderr


def test_install_without_libsystemd_says_so_plainly_and_still_notifies(tmp_path: Path) -> None:
    """`make install-venv` where systemd-python cannot build (a pkg-config that finds no
    libsystemd, no cached wheel): exit 0 with one warning naming the fallback, and the
    installed trainwatch, without systemd-python, sends READY=1 to NOTIFY_SOCKET."""
    need_tool("make")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "pkg-config").write_text(
        "#!/bin/sh\necho 'Package libsystemd was not found in the pkg-config search path.' >&2"
        "\nexit 1\n")
    (fake / "pkg-config").chmod(0o755)
    prefix = tmp_path / "prefix"
    env = {**clean_env(), "PATH": f"{fake}:{os.environ['PATH']}",
           "PIP_CACHE_DIR": str(tmp_path / "pip-cache")}  # no systemd-python wheel built before
    p = subprocess.run(["make", "-s", "-C", str(REPO), "install-venv", f"PREFIX={prefix}"],
                       capture_output=True, text=True, timeout=1200, check=False, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    warnings = [x for x in p.stderr.splitlines() if "systemd-python" in x]
    assert len(warnings) == 1, p.stderr[-3000:]
    assert warnings[0].startswith("warning: systemd-python did not build")
    assert "READY=1 through its own minimal sd_notify sender" in warnings[0]
    log = re.search(r"pip said why in (\S+)\)", warnings[0])
    assert log is not None
    try:
        assert "libsystemd" in Path(log.group(1)).read_text()
    finally:
        Path(log.group(1)).unlink(missing_ok=True)
    python = prefix / "lib/trainwatch/bin/python"
    root = Path(tempfile.mkdtemp(prefix="twin", dir="/tmp"))  # a short sun_path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
            manager.bind(str(root / "notify"))
            q = subprocess.run(
                [str(python), "-c", "import importlib.util, sys\n"
                 "assert importlib.util.find_spec('systemd') is None\n"
                 "from trainwatch.host.service import Service\n"
                 "Service().ready('up')\nprint(sys.modules['trainwatch'].__file__)"],
                env={**clean_env(), "NOTIFY_SOCKET": str(root / "notify")},
                capture_output=True, text=True, timeout=60, check=False, cwd=root)
            assert q.returncode == 0, q.stderr
            assert q.stdout.startswith(str(prefix))  # the installed copy, not this checkout
            manager.settimeout(10)
            assert manager.recv(4096) == b"READY=1\nSTATUS=up"
    finally:
        shutil.rmtree(root, ignore_errors=True)
