"""The start-up phase timer: a phase that fails is logged as failed and not published; repeated phases
add up, and the server's and the engine's timers merge by name. The garbage collector's pause around
the imports: off inside, and what was made inside frozen after."""
from __future__ import annotations

import gc
import logging
import weakref

import pytest

from vramledger.worker.engine.startup import StartupPhases, collector_paused, merged


def test_a_failed_phase_is_logged_and_not_kept(caplog):
    phases = StartupPhases()
    caplog.set_level(logging.INFO, logger="vramledger.worker.engine.startup")
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


class Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_the_collector_stays_off_while_paused_and_what_was_made_inside_is_frozen_after():
    gc.collect()
    collections: list[int] = []

    def count(phase, info):
        if phase == "stop":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        frozen_before = gc.get_freeze_count()
        with collector_paused():
            cycles = [Cycle() for _ in range(5 * gc.get_threshold()[0])]  # would trigger several collections
            last = weakref.ref(cycles[-1])
            del cycles
            assert not gc.isenabled()
        assert gc.isenabled()
        assert collections == [] and last() is not None
        assert gc.get_freeze_count() >= frozen_before + 5 * gc.get_threshold()[0]
        gc.collect()
        assert last() is not None  # frozen: full collections skip it
        gc.unfreeze()  # as the engine's load does at its end (collecting_only_new_objects)
        gc.collect()
        assert last() is None
    finally:
        gc.callbacks.remove(count)
        gc.unfreeze()


def test_a_collector_turned_off_by_its_caller_stays_off():
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
