"""An Ollama server (a fake serving Ollama's own shapes, tests/engine_shapes.py; its runners are children
of the process on its port, as Ollama's are) watched by the adapter over a real socket: what it declares
per loaded model, following models as they load and unload, its processes, its lifecycle and values
beyond bounds."""
from __future__ import annotations

import pytest
from engine_shapes import ollama_model, ollama_ps, ollama_version
from fake_engines import FakeEngine, of_engine, owned
from fake_pynvml import FakeGpu, GiB, proc
from test_exporter_host import spawn  # noqa: F401
from test_exporter_nvml import exporter, scrape

from vramledger.exporter.engines import read_one
from vramledger.exporter.engines.base import EngineInfo, EngineState, ModelMemory, Status
from vramledger.exporter.engines.fetch import HttpClient
from vramledger.exporter.engines.ollama import KIND, parse_ps
from vramledger.exporter.errors import ErrorLog
from vramledger.exporter.sources import HOST, DeviceMemory

GPU = DeviceMemory("0", "GPU-0", "gpu", 24 * GiB, 0, 24 * GiB, None, ())
HOST_MEMORY = DeviceMemory(HOST, "", "host", 64 * GiB, 0, 64 * GiB, None, ())
FITS = ollama_model("llama3.2:3b", size=3 * GiB)  # all of it on its GPU
SPLIT = ollama_model("llama3.1:70b", size=40 * GiB, size_vram=22 * GiB)  # 18 GiB offloaded to the CPU


def ollama(spawn, tmp_path, *models, children=1, version="0.12.3") -> FakeEngine:  # noqa: F811
    return FakeEngine(spawn, tmp_path, {"/api/ps": ollama_ps(*models), "/api/version": ollama_version(version)},
                      children=children)


def adapter(url: str, errors: ErrorLog | None = None, client: HttpClient | None = None):
    return KIND.adapter(url, client or HttpClient(5), errors or ErrorLog(), None)


def test_each_model_declares_its_vram_on_its_gpus_and_the_rest_on_the_host():
    assert parse_ps(ollama_ps(FITS, SPLIT)) == (ModelMemory("llama3.2:3b", 3 * GiB, 0),
                                                ModelMemory("llama3.1:70b", 22 * GiB, 18 * GiB))
    state = EngineState(frozenset([1]), EngineInfo("ollama"), models=parse_ps(ollama_ps(FITS, SPLIT)))
    assert state.declared_on(GPU) == 25 * GiB  # which GPU holds which model Ollama does not say
    assert state.declared_on(HOST_MEMORY) == 18 * GiB
    assert state.declared_total([GPU]) == 25 * GiB  # the host not read: its part not in the total
    assert state.declared_total([GPU, HOST_MEMORY]) == 43 * GiB


def test_nothing_loaded_serves_and_declares_nothing():
    assert parse_ps(ollama_ps()) == ()
    state = EngineState(frozenset([1]), EngineInfo("ollama"), models=())
    assert state.declared_on(GPU) is None and state.declared_total([GPU]) is None


def test_the_server_over_a_socket(spawn, tmp_path):  # noqa: F811
    fake = ollama(spawn, tmp_path, SPLIT, children=1)
    errors = ErrorLog()
    reading = read_one(adapter(fake.url, errors))
    assert reading.status is Status.SERVING, reading.reason
    state = reading.state
    assert state.pids == fake.tree  # `ollama serve` and its runner
    assert (state.info.kind, state.info.version, state.info.model) == ("ollama", "0.12.3", "llama3.1:70b")
    assert state.models == (ModelMemory("llama3.1:70b", 22 * GiB, 18 * GiB),) and state.kv_usage is None
    assert errors.counts() == {}


def test_models_load_and_unload_under_a_running_exporter(monkeypatch, spawn, tmp_path):  # noqa: F811
    fake = ollama(spawn, tmp_path, children=2)
    runner1, runner2 = fake.children
    gpu = FakeGpu("GPU-0", total=24 * GiB, allocated=GiB, processes=[])
    client = HttpClient(5)
    registry, _ = exporter(monkeypatch, [gpu], {}, engines=[lambda errors: adapter(fake.url, errors, client)])
    values, errors = scrape(registry)
    series = of_engine(values, fake.url)
    assert series[("up", ())] == 1 and "declared_memory_bytes" not in {name for name, _ in series}

    # A request loads a model: its runner holds it, and a little more than Ollama counts.
    fake.serve({"/api/ps": ollama_ps(FITS), "/api/version": ollama_version()})
    gpu.allocated, gpu.processes = 5 * GiB, [proc(runner1, "ollama", 3.25)]
    values, errors = scrape(registry)
    series = of_engine(values, fake.url)
    assert series[("model_declared_bytes", (("memory", "gpu"), ("model", "llama3.2:3b")))] == 3 * GiB
    assert series[("model_declared_bytes", (("memory", "host"), ("model", "llama3.2:3b")))] == 0
    assert series[("declared_memory_bytes", ())] == 3 * GiB
    assert series[("unaccounted_memory_bytes", (("device", "0"),))] == GiB // 4
    assert owned(values, fake.url) == {runner1: int(3.25 * GiB)}

    # A second model loads beside it, split with the host; then the first unloads.
    fake.serve({"/api/ps": ollama_ps(FITS, SPLIT), "/api/version": ollama_version()})
    gpu.allocated, gpu.processes = 24 * GiB, [proc(runner1, "ollama", 3), proc(runner2, "ollama", 20)]
    series = of_engine(scrape(registry)[0], fake.url)
    assert series[("model_declared_bytes", (("memory", "host"), ("model", "llama3.1:70b")))] == 18 * GiB
    assert series[("unaccounted_memory_bytes", (("device", "0"),))] == 0  # 23 GiB seen, 25 declared
    fake.serve({"/api/ps": ollama_ps(SPLIT), "/api/version": ollama_version()})
    gpu.processes = [proc(runner2, "ollama", 20)]
    series = of_engine(scrape(registry)[0], fake.url)
    assert {labels for name, labels in series if name == "model_declared_bytes"} == {
        (("memory", "gpu"), ("model", "llama3.1:70b")), (("memory", "host"), ("model", "llama3.1:70b"))}
    assert series[("declared_memory_bytes", ())] == 22 * GiB and errors["ollama"] == 0
    client.close()


def test_a_restart_is_not_an_error_and_reads_its_version_again(spawn, tmp_path):  # noqa: F811
    fake = ollama(spawn, tmp_path, FITS, children=0, version="0.12.3")
    engine = adapter(fake.url)
    assert read_one(engine).state.info.version == "0.12.3"
    fake.serve({"/api/ps": (503, {"error": "server busy"}), "/api/version": ollama_version("0.12.4")})
    reading = read_one(engine)
    assert reading.status is Status.LOADING and not reading.counted
    fake.serve({"/api/ps": ollama_ps(FITS), "/api/version": ollama_version("0.12.4")})
    assert read_one(engine).state.info.version == "0.12.4"
    fake.proc.kill()
    fake.proc.wait(timeout=10)
    reading = read_one(engine)
    assert reading.status is Status.UNREACHABLE and not reading.counted


@pytest.mark.parametrize("ps, why", [
    ({"status": "ok"}, "no list of models"),
    (ollama_ps(ollama_model(size_vram=4 * GiB, size=3 * GiB)), "not within"),
    (ollama_ps(ollama_model(size_vram=-1)), "not within"),
    (ollama_ps(ollama_model(size=1 << 60)), "beyond"),
    (ollama_ps(ollama_model(name="m" * 300)), "no label value"),
    (ollama_ps(FITS, FITS), "listed twice"),
    (ollama_ps(ollama_model() | {"size": "3.6 GB"}), "no int"),
    (ollama_ps(ollama_model() | {"size": True}), "no int"),
])
def test_another_shape_or_a_value_beyond_bounds_is_wrong(spawn, tmp_path, ps, why):  # noqa: F811
    fake = FakeEngine(spawn, tmp_path, {"/api/ps": ps, "/api/version": ollama_version()})
    reading = read_one(adapter(fake.url))
    assert reading.status is Status.WRONG and reading.counted and why in reading.reason, reading.reason
    assert "exporter fault" not in reading.reason


def test_no_version_loses_only_the_label(spawn, tmp_path):  # noqa: F811
    fake = FakeEngine(spawn, tmp_path, {"/api/ps": ollama_ps(FITS)})
    errors = ErrorLog()
    reading = read_one(adapter(fake.url, errors))
    assert reading.status is Status.SERVING and reading.state.info.version == ""
    assert errors.counts() == {}  # noted once, not counted


def test_a_hidden_process_is_counted_and_its_hint_names_this_kinds_flag(spawn, tmp_path, caplog):  # noqa: F811
    from vramledger.exporter.processes import PortLocator
    fake = ollama(spawn, tmp_path, FITS, children=0)
    errors = ErrorLog()
    # Where a container's server would be: reachable, its socket not visible (TEST-NET-1 is no address here).
    engine = KIND.adapter(fake.url, HttpClient(5), errors, PortLocator(f"http://192.0.2.1:{fake.port}"))
    with caplog.at_level("WARNING"):
        state = read_one(engine).state
    assert state.pids == frozenset() and errors.counts() == {"ollama": 1}
    [warning] = [r.getMessage() for r in caplog.records if r.name == "vramledger.exporter.errors"]
    assert "--ollama URL=PID" in warning and "--vllm" not in warning
