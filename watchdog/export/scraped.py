"""What the exporter reads of the supervisor (host/supervisor.py) at a scrape,
under the loop's lock: a protocol, so that the exporter depends on what it
reads and not on the supervisor, which starts it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import threading

    from trainwatch.config import Config
    from trainwatch.lifecycle.runner import Runner
    from trainwatch.state.ledger import Ledger
    from trainwatch.watch.gpuwatch import GpuWatch


class ControlCounts(Protocol):
    """The control socket's counters (host/control.py)."""

    @property
    def requests(self) -> int: ...
    @property
    def refused(self) -> int: ...
    @property
    def throttled(self) -> int: ...
    @property
    def malformed(self) -> int: ...
    @property
    def failed(self) -> int: ...


class Control(Protocol):
    @property
    def counters(self) -> ControlCounts: ...


class Scraped(Protocol):
    @property
    def lock(self) -> threading.Lock: ...  # the loop's: held while it handles an event
    @property
    def config(self) -> Config: ...
    @property
    def runners(self) -> Sequence[Runner]: ...
    @property
    def gpus(self) -> GpuWatch | None: ...
    @property
    def control(self) -> Control | None: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def loop_errors(self) -> int: ...
