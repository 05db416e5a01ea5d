"""The keeper's wire: its JSON (the spec it reads, the records it writes), its
exit files, and a process's start time; on the keeper's diet (keeper.py): os
and the C half of json only, as the keeper is run by path, isolated."""

from __future__ import annotations

import os

try:  # the C half of json, without json's import of re (10 ms)
    from _json import encode_basestring_ascii as _quote
    from _json import make_scanner as _make_scanner
except ImportError:  # another Python implementation
    from json.encoder import encode_basestring_ascii as _quote
    from json.scanner import make_scanner as _make_scanner


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


class _Context:
    """What json's C scanner reads from its decoder (strict JSON, plain types)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_constant)
    memo: dict[str, str] = {}  # noqa: RUF012  (the scanner's own cache of keys)


def loads(text: str) -> object:
    """Parse one JSON document (ValueError when it is not one)."""
    scan = _make_scanner(_Context())  # type: ignore[arg-type]  # duck-typed context
    i = len(text) - len(text.lstrip())
    try:
        obj, end = scan(text, i)
    except (StopIteration, SystemError):
        # The C scanner reports its errors through json.decoder, which we did
        # not import; on this path only, let json say what is wrong.
        import json

        json.loads(text)
        raise ValueError("not JSON") from None
    if text[end:].strip():
        raise ValueError(f"extra data at character {end}")
    return obj


def dumps(obj: dict[str, object]) -> str:
    """One flat JSON object (str, int, float, bool, None values), ASCII, one line."""
    items = []
    for key, v in obj.items():
        if v is None or isinstance(v, bool):
            s = "null" if v is None else ("true" if v else "false")
        elif isinstance(v, (int, float)):
            s = repr(v)
        else:
            s = _quote(str(v))
        items.append(f"{_quote(key)}: {s}")
    return "{" + ", ".join(items) + "}\n"


def start_ticks(pid: int | str) -> int:
    """Field 22 of /proc/<pid>/stat (after the command name, which may hold ")")."""
    fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    return int(data[data.rfind(b")") + 2:].split()[19])


def write_file(path: str, text: str) -> None:
    """Atomically: a temp file beside it, fsync, rename, fsync of the folder."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o640)
    try:
        data = text.encode()
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)
    dfd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
