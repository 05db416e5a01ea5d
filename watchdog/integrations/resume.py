"""Where a launched rank resumes from, as trainwatch told it: the checkpoint and
the steps whose data to skip after a rollback, from its environment or, in a
multi-host job, from the group's newest decision (trainwatch.multihost). The
client's resume_from() and skip_steps() load it when asked: standard library
only, like the client."""

from __future__ import annotations

import os


def _group_decision() -> dict[str, object] | None:
    """A multi-host job's newest group restart, decided since this process's
    launcher started (its launcher restarts it with the environment it had):
    the one every rank of the group resumes from (trainwatch.multihost)."""
    base = os.environ.get("TRAINWATCH_GROUP_DIR")
    if not base:
        return None
    try:
        after = int(os.environ.get("TRAINWATCH_GROUP_GEN") or 0)
    except ValueError:
        after = 0
    from trainwatch.multihost import records  # stdlib only; only multi-host jobs load it

    return records.decision_after(base, after)


def resume_from() -> str | None:
    """The checkpoint to resume from (TRAINWATCH_RESUME_FROM; in a multi-host job,
    the newest group restart's), or None on a fresh start."""
    d = _group_decision()
    if d is not None:
        path = d.get("resume_path")
        return path if isinstance(path, str) and path else None
    return os.environ.get("TRAINWATCH_RESUME_FROM") or None


def skip_steps() -> tuple[int, int] | None:
    """(start, end) steps whose data to skip after a rollback, or None."""
    d = _group_decision()
    if d is not None:
        skip = d.get("skip")
        if isinstance(skip, list) and len(skip) == 2 and all(isinstance(x, int) for x in skip):
            return int(skip[0]), int(skip[1])
        return None
    raw = os.environ.get("TRAINWATCH_SKIP_STEPS")
    if not raw:
        return None
    try:
        a, b = raw.split(":")
        return int(a), int(b)
    except ValueError:
        return None
