"""Reading one YAML document from a file that may be hostile, within bounds.

A config file is read by a root daemon, so its size, its nesting and what its
aliases expand to are capped before anything looks at the values: a
billion-laughs document, a few aliases of one long string, a 100,000-deep
nesting or a gigabyte file is one line
and a refusal, never a hang or a traceback. Duplicate keys are refused too
(PyYAML silently keeps the last).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1 << 20  # 1 MiB: a config of a thousand jobs is a tenth of it
MAX_DEPTH = 64  # a config nests six or seven levels
MAX_VALUES = 100_000  # scalars, lists and mappings, counted with aliases expanded
MAX_TEXT = 4 << 20  # 4 MiB: bytes of scalars with aliases expanded (the file holds 1 MiB)
MAX_INT_DIGITS = 4300  # CPython's own limit on converting text to int


class DocumentError(ValueError):
    """The file is not a document we read: one line, without the file's name."""


# Where a path pattern's "*" stands for any list index or mapping key.
Pattern = Sequence[str]


def read(path: str | os.PathLike[str], as_text: Sequence[Pattern] = ()) -> object:
    """The file's one YAML document as Python values. Plain scalars at a path
    matching one of ``as_text`` (e.g. ``("jobs", "*", "command", "*")``) are
    kept as the text the user wrote: ``3`` is ``"3"``, ``0x10`` is ``"0x10"``."""
    text = _text(Path(path))
    try:
        # The loader's constructor already reads the whole text and refuses a NUL or
        # another control character (ReaderError): that too is one line, not a traceback.
        loader = _Loader(text)
    except yaml.YAMLError as e:
        raise DocumentError(_said(e, text)) from None
    try:
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_size(node)
            for pattern in as_text:
                _mark_text(node, tuple(pattern))
            return loader.construct_document(node)
        except yaml.YAMLError as e:
            raise DocumentError(_said(e, text)) from None
        except RecursionError:  # a guard above missed a way to nest: still one line
            raise DocumentError(f"expected nesting at most {MAX_DEPTH} deep, got deeper") from None
    finally:
        loader.dispose()


def _text(p: Path) -> str:
    # O_NONBLOCK: opening a FIFO waits for a writer otherwise; nothing but a regular
    # file is read (a FIFO, a device such as /dev/zero, a folder), and its size is
    # judged before a byte of it is read.
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise DocumentError(f"cannot read: {e.strerror or e}") from None
    except ValueError as e:  # a NUL byte in the path
        raise DocumentError(f"cannot read: {e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DocumentError(f"expected a regular file, got {_kind(st.st_mode)}")
        if st.st_size > MAX_BYTES:
            raise DocumentError(_TOO_BIG)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise DocumentError(f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:  # it grew since fstat
        raise DocumentError(_TOO_BIG)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DocumentError(
            f"byte {e.start}: expected UTF-8 text, got {e.object[e.start : e.start + 1]!r}"
        ) from None


_TOO_BIG = f"expected a config file of at most 1 MiB ({MAX_BYTES} bytes), got a larger one"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def _said(e: yaml.YAMLError, text: str) -> str:
    if isinstance(e, yaml.reader.ReaderError):  # a character YAML does not allow
        at = min(max(e.position, 0), len(text))
        line = text.count("\n", 0, at) + 1
        column = at - (text.rfind("\n", 0, at) + 1) + 1
        what = "a NUL byte" if e.character == 0 else f"the character {chr(e.character)!r}"
        return (f"line {line}, column {column}: expected text without control characters"
                f" (YAML allows none), got {what}")
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "top level"
    if isinstance(e, _Refused):
        return f"{where}: expected {e.expected}, got {e.got}"
    said = [getattr(e, "context", None), getattr(e, "problem", None)]
    problem = ", ".join(x for x in said if x) or str(e)
    return f"{where}: expected valid YAML, got an error: {problem}"


class _Refused(yaml.constructor.ConstructorError):
    """A document that parses but is beyond a bound (or repeats a key)."""

    def __init__(self, expected: str, got: str, mark: yaml.Mark | None) -> None:
        super().__init__(None, None, got, mark)
        self.expected, self.got = expected, got


class _Loader(yaml.SafeLoader):
    """SafeLoader with a nesting bound, unique keys and bounded integers."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        # The composer recurses once per level: bound it before Python's stack does.
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]  # untyped in PyYAML
                raise _Refused(f"nesting at most {MAX_DEPTH} deep", "deeper", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, KeyError, TypeError, OverflowError) as e:
            # A timestamp of month 13, "!!bool x", ...: PyYAML lets these escape raw.
            kind = str(node.tag).rsplit(":", 1)[-1]
            text = node.value[:40] if isinstance(node, yaml.ScalarNode) else kind
            raise _Refused(f"a valid {kind}", f"{text!r} ({str(e)[:80]})",
                           node.start_mark) from None


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key; construct_mapping reports it
            continue
        if duplicate:
            shown = repr(key) if len(repr(key)) <= 60 else repr(key)[:57] + "..."
            raise _Refused("each key once", f"{shown} again", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


def _bounded_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(node.value)
    if len(text) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of at most {MAX_INT_DIGITS} digits",
                       f"one of {len(text)} characters", node.start_mark)
    try:
        return int(yaml.constructor.SafeConstructor.construct_yaml_int(loader, node))
    except ValueError as e:
        raise _Refused("an integer", str(e), node.start_mark) from None


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)
_Loader.add_constructor("tag:yaml.org,2002:int", _bounded_int)


def _children(node: yaml.Node) -> Iterator[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        yield from node.value
    elif isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            yield k
            yield v


def _check_size(root: yaml.Node) -> None:
    """Refuse a document whose values, with every alias expanded, exceed MAX_VALUES,
    or whose scalars then hold more than MAX_TEXT bytes.

    An alias is a reference to a node composed once, so the node graph stays
    small however far it expands; counting each node's expanded size once
    (memoized, iterative) costs the size of the file, not of the expansion."""
    size: dict[int, tuple[int, int]] = {}  # id -> (values, bytes), each capped past its bound
    open_: set[int] = set()  # nodes begun and not finished: the current path
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finishing = stack.pop()
        key = id(node)
        if finishing:
            open_.discard(key)
            values, text = 1, _scalar_bytes(node)
            for c in _children(node):
                values, text = values + size[id(c)][0], text + size[id(c)][1]
            size[key] = (min(values, MAX_VALUES + 1), min(text, MAX_TEXT + 1))
            continue
        if key in size:
            continue
        if key in open_:
            raise _Refused(f"at most {MAX_VALUES} values with aliases expanded",
                           "an alias inside its own anchor (endless)", node.start_mark)
        open_.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)
    values, text = size[id(root)]
    if values > MAX_VALUES:
        raise _Refused(f"at most {MAX_VALUES} values with aliases expanded", "more",
                       root.start_mark)
    if text > MAX_TEXT:
        raise _Refused(f"at most {MAX_TEXT >> 20} MiB ({MAX_TEXT} bytes) of text with aliases"
                       " expanded", "more", root.start_mark)


def _scalar_bytes(node: yaml.Node) -> int:
    if not isinstance(node, yaml.ScalarNode):
        return 0
    return len(str(node.value).encode("utf-8", "surrogatepass"))


_TEXT_TAGS = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool"}


def _mark_text(node: yaml.Node, pattern: tuple[str, ...]) -> None:
    """Make plain numbers and booleans at ``pattern`` strings, as written."""
    if not pattern:
        if isinstance(node, yaml.ScalarNode) and node.style is None and node.tag in _TEXT_TAGS:
            node.tag = "tag:yaml.org,2002:str"
        return
    head, rest = pattern[0], pattern[1:]
    if isinstance(node, yaml.SequenceNode) and head == "*":
        for child in node.value:
            _mark_text(child, rest)
    elif isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if k.tag == "tag:yaml.org,2002:merge":  # "<<: *base": base's keys are ours
                for merged in v.value if isinstance(v, yaml.SequenceNode) else [v]:
                    _mark_text(merged, pattern)
            elif isinstance(k, yaml.ScalarNode) and head in ("*", k.value):
                _mark_text(v, rest)
