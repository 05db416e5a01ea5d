"""After `make test` failed in its tests (not its lint or types): each failed test
once more, alone and verbose, as CPython's `regrtest --rerun` does. CI passes only
if every one passes then; each that failed and then passed is printed at the end as
`FLAKY: <test id>: <its first failure's last line>`, a race to fix next, never hidden.

Run: .venv/bin/python .ci/rerun.py build/unit.xml  (the suite's --junitxml report)
Exit 0: every failed test passed alone. 1: one failed twice, or the report is not
one to rerun from (a collection error, too many failures, no report at all)."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# More failures than this in one run is no race: something is broken. Fail at once.
MOST = 25


def node_id(case: ET.Element) -> str | None:
    """The pytest node id junitxml mangled into classname and name (its
    mangle_test_address: the file's path dotted, then the classes, then the name with
    its parameters); None when no test file under this checkout matches."""
    parts, name = (case.get("classname") or "").split("."), case.get("name") or ""
    for k in range(len(parts), 0, -1):
        path = "/".join(parts[:k]) + ".py"
        if Path(path).is_file():
            return "::".join([path, *parts[k:], name])
    return None


def failures(report: Path) -> list[tuple[str | None, str]]:
    """(node id, the failure's last line) of each failed or erroring test case."""
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            text = (bad.text or "").rstrip().splitlines()
            first = (bad.get("message") or "").strip().splitlines()
            line = text[-1].strip() if text else ""  # "path:line: AssertionError"
            where, _, kind = line.rpartition(": ")
            if first and first[0].startswith(kind) and where:
                line = f"{where}: {first[0]}"  # the type with its message
            elif first and first[0] not in line:
                line = f"{line} - {first[0]}" if line else first[0]
            out.append((node_id(case), line[:300]))
    return out


def passed(report: Path) -> set[str]:
    """The node ids that passed (not failed, erred or skipped) in ``report``."""
    out = set()
    for case in ET.parse(report).getroot().iter("testcase"):
        if not any(case.find(t) is not None for t in ("failure", "error", "skipped")):
            nid = node_id(case)
            if nid is not None:
                out.add(nid)
    return out


def main() -> int:
    report = Path(sys.argv[1])
    if not report.is_file():
        print(f"rerun: no test report at {report}: the tests did not finish; not rerun")
        return 1
    failed = failures(report)
    if not failed:
        print("rerun: the report holds no failed test; the failure was elsewhere")
        return 1
    unnamed = [line for nid, line in failed if nid is None]
    if unnamed:
        print(f"rerun: {len(unnamed)} failure(s) outside any test (a collection error?): "
              f"{unnamed[0]}; not rerun")
        return 1
    first: dict[str, str] = {}
    for nid, line in failed:
        first.setdefault(str(nid), line)
    if len(first) > MOST:
        print(f"rerun: {len(first)} tests failed (more than {MOST}): not a race; not rerun")
        return 1
    print(f"\nrerun: {len(first)} failed test(s), once more each, alone and verbose:", flush=True)
    again = report.with_name("rerun.xml")
    again.unlink(missing_ok=True)
    subprocess.run([str(Path(".venv/bin/pytest")), "-v", "-n", "0", "-p", "no:cacheprovider",
                    f"--junitxml={again}", *first], check=False)
    ok = passed(again) if again.is_file() else set()
    twice = [nid for nid in first if nid not in ok]
    print()
    for nid, line in first.items():
        print(f"{'FLAKY' if nid in ok else 'FAILED TWICE'}: {nid}: {line}")
    if twice:
        print(f"rerun: {len(twice)} test(s) failed twice: CI fails")
        return 1
    print(f"rerun: all {len(first)} passed alone: CI passes, each FLAKY line above a race "
          f"to fix next")
    return 0


if __name__ == "__main__":
    sys.exit(main())
