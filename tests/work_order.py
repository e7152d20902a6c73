"""The order in which `make test` hands its worker groups to the xdist workers: the longest first.

xdist gives a free worker the next group in collection order (its own reordering counts tests, not seconds), so
a group of one long test — a run that starts its own vLLM server — collected late starts late and ends the suite
alone. tests/durations.json holds each group's seconds from a profiled `make test` (the sum of its tests'
setup, call and teardown); tests_in_longest_first sorts the collected tests by their group's seconds, keeping each
group's tests in their order. A group missing from the file counts half a second a test. Stale figures cost
balance only, never a result. To refresh the file after the suite has changed:

    RLPIPE_RECORD_DURATIONS=tests/durations.json make test
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Callable

DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_TEST_S = 0.5
"""Seconds assumed for a test of a group the file does not list (most unit tests take less)."""
RECORD_ENV = "RLPIPE_RECORD_DURATIONS"


def expected_seconds() -> dict[str, float]:
    """Group → seconds from tests/durations.json ({} when it is missing or unreadable: collection order then)."""
    try:
        table = json.loads(DURATIONS.read_text(encoding="utf-8"))
        return {str(k): float(v) for k, v in table["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def longest_first(items: list, group_of: Callable[[str], str]) -> list:
    """``items`` (pytest items) with whole groups ordered by expected seconds, longest first; stable inside."""
    known = expected_seconds()
    groups: dict[str, list] = collections.defaultdict(list)
    for item in items:
        groups[group_of(item.nodeid.split("::", 1)[0])].append(item)
    seconds = {g: known.get(g, UNKNOWN_TEST_S * len(members)) for g, members in groups.items()}
    ordered = sorted(groups, key=lambda g: -seconds[g])  # dicts keep first-seen order: ties stay in that order
    return [item for g in ordered for item in groups[g]]


class DurationRecorder:
    """Sums each group's test seconds on the xdist controller and writes them (RLPIPE_RECORD_DURATIONS=path)."""

    def __init__(self, path: str, group_of: Callable[[str], str]):
        self.path, self.group_of = Path(path), group_of
        self.seconds: dict[str, float] = collections.defaultdict(float)

    def add(self, report) -> None:
        self.seconds[self.group_of(report.nodeid.split("::", 1)[0])] += report.duration

    def write(self) -> None:
        kept = {g: round(s, 1) for g, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]) if s >= 5}
        self.path.write_text(json.dumps({"about": "seconds per worker group of one `make test` (tests/work_order.py)",
                                         "seconds": kept}, indent=1) + "\n", encoding="utf-8")


def recorder(group_of: Callable[[str], str]) -> DurationRecorder | None:
    """A recorder when RLPIPE_RECORD_DURATIONS names a file, else None."""
    path = os.environ.get(RECORD_ENV)
    return DurationRecorder(path, group_of) if path else None
