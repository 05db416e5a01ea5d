"""trainwatch.snapshot: async, atomic, incremental snapshots of a training
job's state, which trainwatch's catalog knows as the layout ``trainwatch``.

    from trainwatch.snapshot import Snapshotter
    snap = Snapshotter("ckpt", every_steps=100, keep=3, compress="zstd")
    restored = snap.restore()            # (step, state) or None
    for step in ...:
        snap.maybe_save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    snap.close()

Importing this package (or ``trainwatch.snapshot.format``, as the daemon does)
loads nothing heavy: torch, numpy, zstandard and fsspec are imported only by
the code that needs them. ``Snapshotter`` is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainwatch.snapshot.snapshotter import Snapshotter

__all__ = ["Snapshotter"]


def __getattr__(name: str) -> Any:
    if name == "Snapshotter":
        from trainwatch.snapshot.snapshotter import Snapshotter

        return Snapshotter
    raise AttributeError(f"module 'trainwatch.snapshot' has no attribute {name!r}")
