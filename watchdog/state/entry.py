"""A checkpoint as the catalog (catalog.py) judges it, and the summary of them
that the exporter shows."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Entry:
    step: int
    path: str
    complete: bool
    bad: bool
    why: str  # how completeness was established, or why it is not usable

    @property
    def good(self) -> bool:
        return self.complete and not self.bad


@dataclass(frozen=True)
class Summary:
    """What the exporter shows of the catalog."""

    last_good: Entry | None = None
    last_good_mtime: float | None = None  # Unix seconds
    counts: dict[str, int] = field(default_factory=dict)  # good / incomplete / bad
