"""The package's layout, read from its source: the root grouped by role, and the
job (lifecycle/job.py) at the top of its own import graph: what it imports
depends on the job's protocols (lifecycle/runner.py), never on JobRunner, so
no module it imports imports it back, not even for types."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "watchdog"  # imported as trainwatch
JOB = "trainwatch.lifecycle.job"


def _modules() -> dict[str, Path]:
    """Every module of the package by its import name."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(["trainwatch", *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source:
    ``if TYPE_CHECKING:`` and function bodies included, and the packages an
    import runs the ``__init__`` of."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package[:len(package) - node.level + 1]
                base = ".".join([*above, *([base] if base else [])])
            # ``from pkg import x``: x is a module of pkg, or a name in pkg's __init__.
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            found.update(m for i in range(1, len(parts) + 1)
                         if (m := ".".join(parts[:i])) in modules)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _path(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The import chain from ``start`` to ``goal`` (breadth first), None without one."""
    came: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        now = todo.pop(0)
        for nxt in sorted(graph[now]):
            if nxt in came:
                continue
            came[nxt] = now
            if nxt == goal:
                chain: list[str] = []
                at: str | None = nxt
                while at is not None:
                    chain.append(at)
                    at = came[at]
                return chain[::-1]
            todo.append(nxt)
    return None


def test_no_module_the_job_imports_imports_the_job_back() -> None:
    """No module lifecycle/job.py imports (directly or not) imports it back, types included."""
    graph = _graph()
    assert graph[JOB], "the graph found none of job.py's imports"
    reached = _path(graph, JOB, "trainwatch.actions.launch")
    assert reached is not None, "job.py's imports are not followed"
    circles = []
    for name in sorted(graph):
        if name == JOB or _path(graph, JOB, name) is None:
            continue
        back = _path(graph, name, JOB)
        if back is not None:
            circles.append(" -> ".join(back))
    assert not circles, "imported by job.py, yet imports it back:\n" + "\n".join(circles)


def test_package_root_holds_only_the_client_the_vocabulary_and_folders() -> None:
    """The package root: __init__.py, the client (client.py, and slurmattach.py, its
    side in a Slurm step), types.py (and py.typed); the rest in folders."""
    files = sorted(p.name for p in PACKAGE.iterdir() if not p.is_dir())
    assert files == ["__init__.py", "client.py", "py.typed", "slurmattach.py", "types.py"]
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir()}
    assert {"actions", "host", "lifecycle", "watch", "cli"} <= folders
