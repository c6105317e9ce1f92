"""What selfcheck found: checks grouped by scenario, printed as a table or JSON, and the exit code."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

PASS, FAIL, SKIP = "pass", "fail", "skip"
INFO = "info"  # a figure shown beside the checks that judges nothing (a scenario of only these is not passed)
# Exit codes: every scenario passed / one failed / none failed but one could not run.
EXIT_PASSED, EXIT_FAILED, EXIT_INCOMPLETE = 0, 1, 3


class CannotRun(Exception):
    """A scenario cannot run on this device; the message says why, and the scenario is skipped."""


@dataclass
class Check:
    """One measured figure against what it should be."""

    name: str
    measured: str
    expected: str
    status: str
    values: dict = field(default_factory=dict)  # the raw numbers, for --json

    @classmethod
    def compare(cls, name: str, ok: bool, measured: str, expected: str, **values) -> Check:
        return cls(name, measured, expected, PASS if ok else FAIL, values)

    @classmethod
    def shown(cls, name: str, measured: str, expected: str, **values) -> Check:
        return cls(name, measured, expected, INFO, values)


@dataclass
class ScenarioResult:
    """A scenario's checks; skipped (with the reason) when it could not run here."""

    number: int
    title: str
    checks: list[Check] = field(default_factory=list)
    skipped: str | None = None  # why it did not run
    error: str | None = None  # why it stopped before its checks were done (a failure)
    seconds: float = 0.0

    @property
    def status(self) -> str:
        if self.error is not None or any(c.status == FAIL for c in self.checks):
            return FAIL
        if self.skipped is not None or all(c.status == INFO for c in self.checks):
            return SKIP
        return PASS

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check


def exit_code(results: list[ScenarioResult]) -> int:
    statuses = {r.status for r in results}
    if FAIL in statuses:
        return EXIT_FAILED
    return EXIT_INCOMPLETE if SKIP in statuses or not results else EXIT_PASSED


def summary(results: list[ScenarioResult]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    return f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped"


def format_table(results: list[ScenarioResult], header: str = "") -> str:
    """scenario | check | measured | expected | result, one row per check, a summary line last."""
    rows = [("scenario", "check", "measured", "expected", "result")]
    for r in results:
        label = f"{r.number} {r.title}"
        for c in r.checks:
            rows.append((label, c.name, c.measured, c.expected, c.status.upper()))
            label = ""
        if r.error is not None:
            rows.append((label, "stopped", r.error, "", FAIL.upper()))
        elif r.skipped is not None:
            rows.append((label, "skipped", r.skipped, "", SKIP.upper()))
        elif all(c.status == INFO for c in r.checks):
            rows.append((label, "no checks ran", "", "", SKIP.upper()))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    widths[2] = min(widths[2], 60)  # long reasons wrap past the column instead of widening it
    lines = [header] if header else []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(f"selfcheck: {summary(results)} (scenarios)")
    return "\n".join(lines)


def to_json(results: list[ScenarioResult], meta: dict) -> str:
    doc = {**meta, "passed": exit_code(results) == EXIT_PASSED, "summary": summary(results),
           "exit_code": exit_code(results),
           "scenarios": [{**asdict(r), "status": r.status} for r in results]}
    return json.dumps(doc, indent=2)
