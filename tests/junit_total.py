"""`make test`'s last line: the totals of its pytest runs (the main suite and the parity suites), from their
JUnit XML reports. Usage: ``python tests/junit_total.py NAME=report.xml ...``; exit 1 when a report is missing
(that run did not happen) or a test failed."""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

KEYS = ("tests", "failures", "errors", "skipped")


def counts(path: str) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in KEYS}


def main(argv: list[str]) -> int:
    total = dict.fromkeys(KEYS, 0)
    parts, missing = [], []
    for arg in argv:
        name, _, path = arg.partition("=")
        try:
            c = counts(path)
        except (OSError, ET.ParseError):
            missing.append(name)
            continue
        for k in KEYS:
            total[k] += c[k]
        parts.append(f"{name} {c['tests'] - c['failures'] - c['errors'] - c['skipped']} passed, "
                     f"{c['failures'] + c['errors']} failed, {c['skipped']} skipped")
    failed = total["failures"] + total["errors"]
    passed = total["tests"] - failed - total["skipped"]
    print("; ".join(parts) + (f"; no report from: {', '.join(missing)}" if missing else ""))
    print(f"total: {passed} passed, {failed} failed, {total['skipped']} skipped")
    return 1 if missing or failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
