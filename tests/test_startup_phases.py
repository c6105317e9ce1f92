"""The start-up phase timer: a phase that fails is logged as failed and not published; repeated phases
add up, and the server's and the engine's timers merge by name."""
from __future__ import annotations

import logging

import pytest

from worker.engine.startup import StartupPhases, merged


def test_a_failed_phase_is_logged_and_not_kept(caplog):
    phases = StartupPhases()
    caplog.set_level(logging.INFO, logger="worker.engine.startup")
    with pytest.raises(ValueError), phases.phase("weights_target"):
        raise ValueError("no such checkpoint")
    assert phases.seconds == {}
    assert [r.getMessage().split(" after ")[0] for r in caplog.records] == [
        "start-up: weights_target ...", "start-up: weights_target failed"]


def test_repeated_phases_add_up_and_timers_merge():
    server, engine = StartupPhases(), StartupPhases()
    for timer in (server, engine, engine):
        with timer.phase("tokenizer"):
            pass
    with engine.phase("kv_cache"):
        pass
    server.end("server")  # never begun: nothing kept
    total = merged([server, engine])
    assert list(total) == ["tokenizer", "kv_cache"]
    assert total["tokenizer"] == pytest.approx(server.seconds["tokenizer"] + engine.seconds["tokenizer"])
    assert len(engine.seconds) == 2
