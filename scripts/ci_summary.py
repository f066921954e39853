"""The closing line of a ``nox -t ci`` run: each session's time and tests, passed and skipped (the skip reasons
counted), and the CPU with its SIMD level, so that a green run that skipped what it should have run, or ran
slower than before, says so in one place.

The noxfile's sessions leave, under one folder per nox run, ``<session>.json`` (the run's start, the session's
end and outcome: a session's time is from the previous one's end, so its virtualenv's creation counts) and
one JUnit XML file per pytest run (``<session>.<package>.<n>.xml``); `summarize` reads them. Standard library
only (it runs in nox's own interpreter).
"""

from __future__ import annotations

import collections
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def pytest_counts(path: Path) -> tuple[collections.Counter, collections.Counter]:
    """({passed, failed, skipped}: n, {skip reason: n}) of one JUnit XML file."""
    counts: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
                # a skip's reason, without the file:line pytest may put first (the same reason, counted once)
                reason = re.sub(r"^[^:\s]+\.py:\d+: ", "", child.get("message", "").strip()) or "(no reason given)"
                reasons[reason[:120]] += 1
        counts[outcome] += 1
    return counts, reasons


BUDGET_S = 25 * 60  # the test command's time budget on 2 cores (the hard limit is 90 minutes)


def summarize(results: Path, cpu: str, budget_s: float = BUDGET_S) -> list[str]:
    """The summary line, one line per skip reason (most frequent first), and a warning when the run took longer
    than ``budget_s`` (so a slow suite is seen before it meets the hard limit)."""
    records = sorted((json.loads(p.read_text()) for p in results.glob("*.json")), key=lambda r: r["end"])
    if not records:
        return [f"ci summary: no session of this run left results in {results}"]
    start = previous = records[0]["run_start"]
    total: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    parts = []
    for record in records:
        counts: collections.Counter = collections.Counter()
        for xml in sorted(results.glob(f"{record['session']}.*.xml")):
            c, r = pytest_counts(xml)
            counts += c
            reasons += r
        total += counts
        tests = f" {counts['passed']}p/{counts['skipped']}s" + (f"/{counts['failed']}F" if counts["failed"] else "") \
            if counts else ""
        state = "" if record["ok"] else " FAILED"
        parts.append(f"{record['session']} {_minutes(record['end'] - previous)}{tests}{state}")
        previous = record["end"]
    failed_sessions = sum(not r["ok"] for r in records)
    line = (f"ci summary: {len(records)} sessions in {_minutes(records[-1]['end'] - start)}"
            f"{f' ({failed_sessions} failed)' if failed_sessions else ''}; tests {total['passed']} passed, "
            f"{total['failed']} failed, {total['skipped']} skipped ({len(reasons)} reasons); {cpu} | "
            + "; ".join(parts))
    over = records[-1]["end"] - start - budget_s
    warning = [f"ci summary: WARNING: {_minutes(over)} over the {_minutes(budget_s)} budget: find what grew "
               "(pytest's --durations in each session's log)"] if over > 0 else []
    return [line] + [f"  skipped {n:>3}x: {reason}" for reason, n in reasons.most_common()] + warning
