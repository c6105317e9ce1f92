"""The engine's published snapshot: frozen, taken after each change the engine makes, and the only
engine state /metrics and /v1/memory report."""
import dataclasses

import pytest
from fastapi.testclient import TestClient
from server_fixtures import metric_value
from test_server_app import small_config, wait_healthy

from vramledger.worker.engine.block_manager import BlockManager
from vramledger.worker.engine.llm_engine import LLMEngine
from vramledger.worker.engine.outputs import EngineStats
from vramledger.worker.engine.sampling_params import SamplingParams
from vramledger.worker.engine.scheduler import Scheduler
from vramledger.worker.engine.sequence import Sequence
from vramledger.worker.engine.snapshot import EngineSnapshot
from vramledger.worker.http.server import create_app

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def hold_blocks(blocks: BlockManager, n: int) -> Sequence:
    """A sequence outside every queue holding n fresh blocks: the pool changes, no step runs."""
    held = Sequence("held", [1] * (n * blocks.block_size), SamplingParams())
    blocks.allocate(held, n * blocks.block_size)
    return held


def test_a_snapshot_is_frozen_and_keeps_its_counts_when_the_engine_moves_on():
    blocks = BlockManager(num_blocks=8, block_size=16)
    stats = EngineStats(num_speculative_tokens=3, current_speculative_tokens=3)
    stats.record_verification([2, 0], 3)
    snapshot = EngineSnapshot.of(Scheduler(blocks, 2, 64, 3), blocks, stats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.blocks_used = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.extra = 1  # type: ignore[attr-defined]
    stats.record_verification([3], 3)  # the engine's list grows in place; the snapshot's copy does not
    hold_blocks(blocks, 2)
    assert snapshot.accepted_per_position == (1, 1, 0) and snapshot.accepted_tokens == 2
    assert snapshot.blocks_used == 0 and snapshot.blocks_free == 8
    assert EngineSnapshot.of(Scheduler(blocks, 2, 64, 3), blocks, stats).accepted_per_position == (2, 2, 1)


def test_changes_made_without_a_step_are_published_only_by_the_next_step(checkpoints):
    engine = LLMEngine(small_config(checkpoints["llama"]))
    started = engine.snapshot
    assert (started.requests_waiting, started.blocks_used, started.blocks_total) == (0, 0, engine.num_blocks)
    request_id = engine.add_request([5, 6, 7], PARAMS)
    added = engine.snapshot
    assert (added.requests_waiting, added.requests_running) == (1, 0)

    waiting = engine.scheduler.waiting.popleft()  # the queue and the pool change, with no step
    held = hold_blocks(engine.blocks, 3)
    assert engine.snapshot is added and added.requests_waiting == 1 and added.blocks_used == 0
    assert engine.memory_report()["kv_cache"]["blocks_used"] == 0

    engine.scheduler.waiting.append(waiting)
    engine.step()
    stepped = engine.snapshot
    assert (stepped.requests_waiting, stepped.requests_running) == (0, 1)
    assert stepped.blocks_used == 3 + len(waiting.block_table) == engine.blocks.num_used
    assert (stepped.prompt_tokens, stepped.generation_tokens) == (3, 1)
    assert stepped == EngineSnapshot.of(engine.scheduler, engine.blocks, engine.stats)
    assert engine.memory_report()["kv_cache"]["blocks_used"] == stepped.blocks_used

    engine.abort_request(request_id)  # an abort frees blocks with no step after it: it publishes too
    assert (engine.snapshot.requests_running, engine.snapshot.blocks_used) == (0, len(held.block_table))


def test_metrics_and_v1_memory_report_the_published_snapshot(checkpoints):
    app = create_app(small_config(checkpoints["llama"]))
    with TestClient(app) as client:
        wait_healthy(client)
        engine = app.state.server.engine_loop.engine
        held = hold_blocks(engine.blocks, 3)  # the engine thread sleeps: no request, no step

        def published() -> tuple[float | None, int]:
            return (metric_value(client.get("/metrics").text, "vramledger_kv_cache_blocks_used"),
                    client.get("/v1/memory").json()["kv_cache"]["blocks_used"])

        assert engine.blocks.num_used == 3 and published() == (0, 0)
        stray = Sequence("stray", [1, 2], SamplingParams())
        engine.scheduler.waiting.append(stray)  # the queue changes too: admission and /metrics see none
        waiting = metric_value(client.get("/metrics").text, "vramledger_requests_waiting")
        assert (app.state.server.engine_loop.num_waiting(), waiting) == (0, 0)
        engine.scheduler.waiting.remove(stray)  # before a step would run it: the engine never added it
        done = client.post("/v1/completions", json={"model": "llama", "prompt": "hi", "max_tokens": 3})
        assert done.status_code == 200
        # The request's steps published the pool: its own blocks went back, the held ones stay.
        assert published() == (3, 3) == (len(held.block_table),) * 2


def test_a_served_worker_reports_one_snapshot_on_both_routes(checkpoints):
    """/metrics and /v1/memory, read between steps, give the figures of the snapshot published last."""
    app = create_app(small_config(checkpoints["llama"]))
    with TestClient(app) as client:
        wait_healthy(client)
        done = client.post("/v1/completions", json={"model": "llama", "prompt": "hello world " * 3,
                                                    "max_tokens": 2})
        assert done.status_code == 200
        snapshot = app.state.server.engine_loop.snapshot()
        kv = client.get("/v1/memory").json()["kv_cache"]
        text = client.get("/metrics").text
        assert (kv["blocks_used"], kv["blocks_cached"], kv["blocks_free"]) == (
            snapshot.blocks_used, snapshot.blocks_cached, snapshot.blocks_free)
        for name, value in (("vramledger_kv_cache_blocks_cached", snapshot.blocks_cached),
                            ("vramledger_prompt_tokens_total", snapshot.prompt_tokens),
                            ("vramledger_generation_tokens_total", snapshot.generation_tokens)):
            assert metric_value(text, name) == value, name
        usage = done.json()["usage"]
        assert (snapshot.prompt_tokens, snapshot.generation_tokens) == (usage["prompt_tokens"],
                                                                         usage["completion_tokens"])
