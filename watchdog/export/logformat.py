"""trainwatch's log lines on stderr: text (the default) or, with ``--log-format
json``, one JSON object per line, for hosts without journald (a container, runit,
a log shipper reading stderr).

Text: ``2026-11-23T21:30:00.123+00:00 trainwatch: ...``, one line per record. A
message carries text a job's user wrote (a reported path, a host name in a group
record, a matched output line), so its control characters are shown as escapes
(``\n``, ``\x1b``, as systemd's ``cescape()``): no user's text ever starts a line
of root's own. A traceback, root's, follows its line as it is.

JSON: each line holds ``time`` (ISO 8601 in UTC with milliseconds, the text format's
timestamp), ``level`` (``info``, ``warning``, ...), ``logger``, ``job`` (the job the
message is about, else null), ``event`` (the message) and ``fields`` (the record's
structured extras, ``{}`` when none); ``exc`` and ``stack`` only when the record
carries them. A message about a job reads ``job NAME: ...`` in the text format:
here NAME is ``job`` and the rest is ``event``. An explicit ``extra={"job": NAME}``
(or journald's ``TRAINWATCH_JOB``) names the job too, and wins.

Standard library only (json, logging). A line never raises: values JSON cannot
hold are written as their ``str()``, and NaN or infinity as ``"nan"``, ``"inf"``,
so that strict parsers (jq) read every line.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
from datetime import datetime, timezone

FORMATS = ("text", "json")

# A LogRecord's own attributes; whatever else it has came from ``extra=``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "taskName"}
# "job NAME: ..." as the text format's messages about a job start (NAME as config's).
_ABOUT_JOB = re.compile(r"job ([A-Za-z0-9][A-Za-z0-9_.-]{0,62}): ")
_JOB_KEYS = ("job", "TRAINWATCH_JOB")


def _plain(value: object, depth: int = 0) -> object:
    """``value`` as JSON can hold it: containers walked (to a depth), floats finite,
    anything else its str()."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth < 8:
        if isinstance(value, dict):
            return {str(k): _plain(v, depth + 1) for k, v in value.items()}
        if isinstance(value, (list, tuple, set, frozenset)):
            return [_plain(v, depth + 1) for v in value]
    return str(value)


def utc_time(created: float) -> str:
    """``2026-11-23T21:30:00.123+00:00``: the text format's timestamp, in UTC."""
    return datetime.fromtimestamp(created, tz=timezone.utc).isoformat(timespec="milliseconds")


# C0 and C1 controls, DEL, and what a reader may take for a line break.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def cescape(text: str) -> str:
    """``text`` on one line: each control character as its escape."""
    return _CONTROL.sub(_escape, text)


class IsoFormatter(logging.Formatter):
    """Timestamps in ISO 8601 with milliseconds and the UTC offset, as journald,
    Loki and a reader in another time zone can all place without guessing; the
    message on one line (``cescape``)."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        when = datetime.fromtimestamp(record.created).astimezone()
        return when.isoformat(timespec="milliseconds")

    def formatMessage(self, record: logging.LogRecord) -> str:
        one = copy.copy(record)  # the record is shared with any other handler
        one.message = cescape(record.message)
        return super().formatMessage(one)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a newline in a message is escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        event = record.getMessage()
        fields = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        job: object = None
        for key in _JOB_KEYS:
            if key in fields:
                job = fields.pop(key)
                break
        about = _ABOUT_JOB.match(event)
        if about is not None and (job is None or str(job) == about.group(1)):
            job = about.group(1)
            event = event[about.end():]
        line: dict[str, object] = {
            "time": utc_time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "job": None if job is None else str(job),
            "event": event,
            "fields": _plain(fields),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, allow_nan=False, separators=(",", ":"))

