"""Selfcheck reads a worker's ledger through the one reader: a document it refuses fails the scenario
with a line naming the worker and the field, not a traceback."""
from __future__ import annotations

import sys

import pytest
from selfcheck_helpers import HERE, cpu_context

from vramledger.worker.selfcheck import run as selfcheck_run
from vramledger.worker.selfcheck import scenario_draft, scenario_ledger
from vramledger.worker.selfcheck.report import FAIL, ScenarioResult
from vramledger.worker.selfcheck.workers import Launcher


class RefusedLedgerLauncher(Launcher):
    def __init__(self, how: str):
        super().__init__()
        self.command = (sys.executable, str(HERE / "serve_refused_ledger.py"), how)


@pytest.mark.parametrize("scenario, how, said", [
    (scenario_ledger, "negative-budget", "s1-worker's GET /v1/memory is no ledger: budget.bytes -1 is not"),
    (scenario_draft, "no-budget", "the worker's ledger gives no budget.bytes"),  # null: a check needs it
])
def test_a_ledger_the_reader_refuses_fails_the_scenario_saying_why(tmp_path, scenario, how, said):
    ctx = cpu_context(tmp_path, RefusedLedgerLauncher(how))
    result = ScenarioResult(1, scenario.TITLE)
    with ctx.procs:
        selfcheck_run.attempt(ctx, result, lambda: scenario.run(ctx, result))
    assert result.status == FAIL and result.error is not None
    assert result.error.startswith("LedgerError: ") and said in result.error, result.error
    assert "Traceback" not in result.error and "\n" not in result.error
