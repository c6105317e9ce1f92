"""A llama.cpp server (a fake serving llama-server's own shapes, tests/engine_shapes.py) watched by the
adapter over a real socket: no bytes declared, its processes attributed, its KV usage where its build
serves one, its lifecycle and values beyond bounds."""
from __future__ import annotations

import pytest
from engine_shapes import LLAMACPP_LOADING, LLAMACPP_OK, llamacpp_metrics, llamacpp_props
from fake_engines import FakeEngine, of_engine, owned
from fake_pynvml import FakeGpu, GiB, proc
from test_exporter_host import spawn  # noqa: F401
from test_exporter_nvml import exporter, scrape

from vramledger.exporter.engines import read_one
from vramledger.exporter.engines.base import Status
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.engines.llamacpp import KIND
from vramledger.exporter.errors import ErrorLog


def llamacpp(spawn, tmp_path, metrics=None, health=LLAMACPP_OK, **props) -> FakeEngine:  # noqa: F811
    routes = {"/health": health, "/props": llamacpp_props(**props)}
    if metrics is not None:
        routes["/metrics"] = metrics
    return FakeEngine(spawn, tmp_path, routes)


def adapter(url: str, errors: ErrorLog | None = None, client: HttpClient | None = None):
    return KIND.adapter(url, client or HttpClient(5), errors or ErrorLog(), None)


def test_attributed_with_no_declaration_so_no_unaccounted_series(monkeypatch, spawn, tmp_path):  # noqa: F811
    fake = llamacpp(spawn, tmp_path)
    gpu = FakeGpu("GPU-0", allocated=7 * GiB, processes=[proc(fake.pid, "llama-server", 6.5), proc(999, "x", 0.25)])
    client = HttpClient(5)
    registry, _ = exporter(monkeypatch, [gpu], {}, engines=[lambda errors: adapter(fake.url, errors, client)])
    values, errors = scrape(registry)
    series = of_engine(values, fake.url)
    assert series[("observed_memory_bytes", (("device", "0"),))] == 6.5 * GiB
    assert owned(values, fake.url) == {fake.pid: 6.5 * GiB}
    assert {name for name, _ in series} == {"up", "state", "observed_memory_bytes"}  # nothing declared
    assert errors["llamacpp"] == 0
    client.close()


def test_identity_and_kv_usage_where_its_build_serves_it(spawn, tmp_path):  # noqa: F811
    fake = llamacpp(spawn, tmp_path, metrics=llamacpp_metrics(kv_cache_usage_ratio=0.375))
    state = read_one(adapter(fake.url)).state
    assert (state.info.kind, state.info.version, state.info.model) == (
        "llamacpp", "b6712-4f8d3b2e", "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf")
    assert state.kv_usage == 0.375 and state.pids == fake.tree
    assert state.declared_total([]) is None and state.token_capacity is None
    newer = llamacpp(spawn, tmp_path, metrics=llamacpp_metrics())  # a unified KV cache: no usage served
    assert read_one(adapter(newer.url)).state.kv_usage is None


def test_without_metrics_nothing_counted(spawn, tmp_path):  # noqa: F811
    fake = llamacpp(spawn, tmp_path)
    errors = ErrorLog()
    engine = adapter(fake.url, errors)
    assert [read_one(engine).status for _ in range(2)] == [Status.SERVING] * 2 and errors.counts() == {}


def test_loading_then_serving_then_down(spawn, tmp_path):  # noqa: F811
    fake = llamacpp(spawn, tmp_path, health=LLAMACPP_LOADING)
    engine = adapter(fake.url)
    reading = read_one(engine)
    assert reading.status is Status.LOADING and not reading.counted
    fake.serve({"/health": LLAMACPP_OK, "/props": llamacpp_props(build_info="b6713-0a1b2c3d")})
    assert read_one(engine).state.info.version == "b6713-0a1b2c3d"
    fake.proc.kill()
    fake.proc.wait(timeout=10)
    assert read_one(engine).status is Status.UNREACHABLE


@pytest.mark.parametrize("routes, why", [
    ({"/health": LLAMACPP_OK, "/props": {"status": "ok"}}, "total_slots"),
    ({"/health": LLAMACPP_OK, "/props": llamacpp_props(build_info="b" * 300)}, "no label value"),
    ({"/health": LLAMACPP_OK, "/props": llamacpp_props(), "/metrics": llamacpp_metrics(2.5)}, "KV cache usage"),
    ({"/health": LLAMACPP_OK, "/props": llamacpp_props(), "/metrics": "llamacpp:kv_cache_usage_ratio{ oops\n"},
     "/metrics"),
])
def test_another_shape_or_a_value_beyond_bounds_is_wrong(spawn, tmp_path, routes, why):  # noqa: F811
    fake = FakeEngine(spawn, tmp_path, routes)
    reading = read_one(adapter(fake.url))
    assert reading.status is Status.WRONG and reading.counted and why in reading.reason, reading.reason
    assert "exporter fault" not in reading.reason
