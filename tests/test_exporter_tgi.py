"""A Hugging Face TGI server (a fake serving TGI's own shapes, tests/engine_shapes.py, started as TGI is:
by a text-generation-launcher process beside its shards) watched by the adapter over a real socket: no
bytes declared, every process of the launcher attributed, its token budget and KV usage, its lifecycle
and values beyond bounds."""
from __future__ import annotations

import pytest
from engine_shapes import tgi_info, tgi_metrics
from fake_engines import FakeEngine, of_engine, owned
from fake_pynvml import FakeGpu, GiB, proc
from test_exporter_host import spawn  # noqa: F401
from test_exporter_nvml import exporter, scrape

from vramledger.exporter.engines import read_one
from vramledger.exporter.engines.base import Status
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.engines.tgi import KIND, LAUNCHER
from vramledger.exporter.errors import ErrorLog


def tgi(spawn, tmp_path, metrics=None, info=None, **kwargs) -> FakeEngine:  # noqa: F811
    return FakeEngine(spawn, tmp_path, {"/info": tgi_info() if info is None else info,
                                        "/metrics": tgi_metrics() if metrics is None else metrics}, **kwargs)


def adapter(url: str, errors: ErrorLog | None = None, client: HttpClient | None = None):
    return KIND.adapter(url, client or HttpClient(5), errors or ErrorLog(), None)


def test_the_launchers_shards_are_the_servers(monkeypatch, spawn, tmp_path):  # noqa: F811
    fake = tgi(spawn, tmp_path, metrics=tgi_metrics(batch_tokens=40_960), launcher=LAUNCHER, shards=2)
    shard0, shard1 = fake.shards
    assert fake.launcher not in (fake.pid, None)
    gpus = [FakeGpu("GPU-0", allocated=70 * GiB, processes=[proc(shard0, "python", 69)]),
            FakeGpu("GPU-1", allocated=72 * GiB, processes=[proc(shard1, "python", 69), proc(999, "trainer", 2)])]
    client = HttpClient(5)
    registry, _ = exporter(monkeypatch, gpus, {}, engines=[lambda errors: adapter(fake.url, errors, client)])
    values, errors = scrape(registry)
    series = of_engine(values, fake.url)
    assert owned(values, fake.url) == {shard0: 69 * GiB, shard1: 69 * GiB}  # the trainer is not TGI's
    assert series[("token_capacity", ())] == 163_840
    assert series[("kv_cache_usage_ratio", ())] == 40_960 / 163_840
    assert "declared_memory_bytes" not in {name for name, _ in series}  # TGI gives no bytes
    assert not any(name == "unaccounted_memory_bytes" for name, _ in series)
    assert errors["tgi"] == 0
    client.close()


def test_a_router_without_a_launcher_is_its_own_tree(spawn, tmp_path):  # noqa: F811
    fake = tgi(spawn, tmp_path, children=1)
    state = read_one(adapter(fake.url)).state
    assert state.pids == fake.tree == {fake.pid, *fake.children}
    assert (state.info.kind, state.info.version, state.info.model) == (
        "tgi", "3.3.4", "meta-llama/Llama-3.1-8B-Instruct")
    assert state.kv_usage is None  # no batch has run yet: no tgi_batch_current_max_tokens
    assert state.token_capacity == 163_840


def test_a_backend_without_a_token_budget_gives_no_usage(spawn, tmp_path):  # noqa: F811
    fake = tgi(spawn, tmp_path, info=tgi_info(max_batch_total_tokens=None), metrics=tgi_metrics(512))
    state = read_one(adapter(fake.url)).state
    assert (state.kv_usage, state.token_capacity) == (None, None)


def test_a_restart_reads_its_info_again(spawn, tmp_path):  # noqa: F811
    fake = tgi(spawn, tmp_path)
    engine = adapter(fake.url)
    assert read_one(engine).state.info.version == "3.3.4"
    fake.serve({"/metrics": (503, "")})  # a proxy's answer while TGI restarts behind it
    assert read_one(engine).status is Status.LOADING
    fake.serve({"/info": tgi_info(version="3.3.5"), "/metrics": tgi_metrics()})
    assert read_one(engine).state.info.version == "3.3.5"
    fake.proc.kill()
    fake.proc.wait(timeout=10)
    reading = read_one(engine)
    assert reading.status is Status.UNREACHABLE and not reading.counted


@pytest.mark.parametrize("info, metrics, why", [
    ({"model_id": "m"}, tgi_metrics(), "version"),
    (tgi_info(max_batch_total_tokens=0), tgi_metrics(), "holds no token"),
    (tgi_info(max_batch_total_tokens=1 << 50), tgi_metrics(), "token capacity"),
    (tgi_info(), tgi_metrics(batch_tokens=200_000), "KV cache usage"),
    (tgi_info(version="v" * 300), tgi_metrics(), "no label value"),
])
def test_another_shape_or_a_value_beyond_bounds_is_wrong(spawn, tmp_path, info, metrics, why):  # noqa: F811
    fake = tgi(spawn, tmp_path, info=info, metrics=metrics)
    reading = read_one(adapter(fake.url))
    assert reading.status is Status.WRONG and reading.counted and why in reading.reason, reading.reason
    assert "exporter fault" not in reading.reason
