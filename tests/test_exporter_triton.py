"""TensorRT-LLM behind Triton (a fake serving the shapes of Triton's metrics endpoint, tests/engine_shapes.py)
watched by the adapter over a real socket: no bytes declared, its processes attributed, its KV usage and
token capacity from KV cache blocks, its runtime memory published, its lifecycle and values beyond bounds."""
from __future__ import annotations

import pytest
from engine_shapes import triton_metrics
from fake_engines import FakeEngine, of_engine, owned
from fake_pynvml import FakeGpu, GiB, proc
from test_exporter_host import spawn  # noqa: F401
from test_exporter_nvml import exporter, scrape

from vramledger.exporter.engines import read_one
from vramledger.exporter.engines.base import Status
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.engines.triton import KIND
from vramledger.exporter.errors import ErrorLog


def triton(spawn, tmp_path, metrics, children=0) -> FakeEngine:  # noqa: F811
    return FakeEngine(spawn, tmp_path, {"/metrics": metrics}, children=children)


def adapter(url: str, errors: ErrorLog | None = None, client: HttpClient | None = None):
    return KIND.adapter(url, client or HttpClient(5), errors or ErrorLog(), None)


def test_blocks_give_usage_and_capacity_runtime_memory_is_published(monkeypatch, spawn, tmp_path):  # noqa: F811
    fake = triton(spawn, tmp_path, triton_metrics(used=1560, free=4680, tokens_per=64, gpu_bytes=1_610_236),
                  children=1)
    [instance] = fake.children  # a model instance TensorRT-LLM runs in its own process
    gpu = FakeGpu("GPU-0", allocated=76 * GiB, processes=[proc(fake.pid, "tritonserver", 1),
                                                          proc(instance, "trtllmExecutorWorker", 74)])
    client = HttpClient(5)
    registry, _ = exporter(monkeypatch, [gpu], {}, engines=[lambda errors: adapter(fake.url, errors, client)])
    values, errors = scrape(registry)
    series = of_engine(values, fake.url)
    assert series[("kv_cache_usage_ratio", ())] == 1560 / (1560 + 4680)
    assert series[("token_capacity", ())] == (1560 + 4680) * 64
    assert series[("runtime_memory_bytes", (("memory_type", "gpu"),))] == 1_610_236
    assert series[("runtime_memory_bytes", (("memory_type", "pinned"),))] == 0
    assert series[("observed_memory_bytes", (("device", "0"),))] == 75 * GiB
    assert owned(values, fake.url) == {fake.pid: GiB, instance: 74 * GiB}
    # Its runtime memory is part of what it holds, not a declaration: nothing is unaccounted.
    assert not {"declared_memory_bytes", "unaccounted_memory_bytes"} & {name for name, _ in series}
    assert errors["triton"] == 0
    client.close()


def test_identity_is_its_model(spawn, tmp_path):  # noqa: F811
    state = read_one(adapter(triton(spawn, tmp_path, triton_metrics()).url)).state
    assert (state.info.kind, state.info.version, state.info.model) == ("triton", "", "tensorrt_llm")


def test_loading_until_its_model_serves_then_down(spawn, tmp_path):  # noqa: F811
    fake = triton(spawn, tmp_path, triton_metrics(trt_llm=False))
    engine = adapter(fake.url)
    reading = read_one(engine)
    assert reading.status is Status.LOADING and "no TensorRT-LLM model" in reading.reason and not reading.counted
    fake.serve({"/metrics": triton_metrics()})
    assert read_one(engine).status is Status.SERVING
    fake.proc.kill()
    fake.proc.wait(timeout=10)
    assert read_one(engine).status is Status.UNREACHABLE


@pytest.mark.parametrize("metrics, why", [
    ("vllm:num_requests_running 1\n", "not a Triton server"),
    (triton_metrics(used=7000, free=-10), "KV cache blocks"),
    (triton_metrics(tokens_per=0), "KV cache blocks"),
    (triton_metrics(gpu_bytes=1 << 60), "beyond"),
    (triton_metrics().replace(" 1610236", " 1.5"), "no number of bytes"),
    (triton_metrics().replace(" 1610236", " NaN"), "no finite number"),
])
def test_another_shape_or_a_value_beyond_bounds_is_wrong(spawn, tmp_path, metrics, why):  # noqa: F811
    reading = read_one(adapter(triton(spawn, tmp_path, metrics).url))
    assert reading.status is Status.WRONG and reading.counted and why in reading.reason, reading.reason
    assert "exporter fault" not in reading.reason
