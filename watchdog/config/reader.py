"""The config reader's walker: each field checked, each mistake one line
naming the source and the field's path (``jobs.train.command[3]``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainwatch.config import fields
from trainwatch.config.fields import Refused, Said, show
from trainwatch.config.schema import ConfigError
from trainwatch.types import IMPLEMENTED_ACTIONS, Action


class Reader:
    """Walks a mapping, checking each field and naming its path on error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, expected: str, got: object) -> ConfigError:
        shown = "nothing" if got is MISSING else show(got)
        return ConfigError(f"{self.source}: {path}: expected {expected}, got {shown}")

    def mapping(self, value: object, path: str, keys: set[str],
                expected: str | None = None) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path or "top level", "a mapping", value)
        for k in value:
            if k not in keys:
                where = f"{path}.{fields.key(k)}" if path else fields.key(k)
                raise self.fail(where, expected or "one of " + ", ".join(sorted(keys)),
                                Said("an unknown key"))
        return value

    def get(self, m: Mapping[str, Any], key: str, path: str, kind: str, default: Any) -> Any:
        value = m.get(key, MISSING)
        where = f"{path}.{key}" if path else key
        if value is MISSING:
            if default is MISSING:
                raise self.fail(where, kind, value)
            return default
        try:
            return fields.CHECKS[kind](value)
        except Refused as e:
            raise self.fail(where, e.expected, e.got) from None
        except (TypeError, ValueError, OverflowError):
            raise self.fail(where, kind, value) from None

    def arguments(self, value: object, path: str, expected: str) -> tuple[str, ...]:
        """A list of command-line arguments, each mistake named by its index."""
        if not isinstance(value, list):
            raise self.fail(path, expected, value)
        out = []
        for n, x in enumerate(value):
            try:
                out.append(fields.argument(x))
            except Refused as e:
                raise self.fail(f"{path}[{n}]", e.expected, e.got) from None
        return tuple(out)


MISSING: Any = object()
STR, DUR, OPT_DUR = fields.STR, fields.DUR, fields.OPT_DUR


def action(r: Reader, where: str, act: object) -> Action:
    """An action by its name, refused unless this version carries it out."""
    try:
        parsed = Action(act)
    except ValueError:
        raise r.fail(where, "one of " + ", ".join(a.value for a in Action), act) from None
    if parsed not in IMPLEMENTED_ACTIONS:
        ok = ", ".join(sorted(a.value for a in IMPLEMENTED_ACTIONS))
        raise r.fail(where, f"an action this version carries out ({ok})", act)
    return parsed
